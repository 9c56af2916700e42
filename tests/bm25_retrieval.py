"""A retrieval server on 127.0.0.1 that answers SkyRL-Gym's ``search`` environment as SkyRL's own
retriever does (examples/train/search/retriever/retrieval_server.py): ``POST /retrieve`` with
``{"query": str, "topk": int | null, "return_scores": bool}`` returns ``{"result": [docs]}``, one list
for the one query, each doc ``{"document": {"id", "contents"}, "score": float}`` with scores, else the
bare ``{"id", "contents"}``. Behind it: a BM25 (Okapi) index of a corpus given as documents, built by
``rank_bm25`` over lower-cased word tokens; the best ``topk`` documents by score, ties by corpus
order.

Bad requests (not JSON, no string ``query``, a ``topk`` outside 1..`MAX_TOPK`, a body over
`MAX_BODY` bytes, another path) get a 4xx with a message; the server keeps serving. Each answered
query is recorded in `RetrievalServer.queries`.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rank_bm25 import BM25Okapi

MAX_BODY = 64 * 1024
MAX_TOPK = 100
DEFAULT_TOPK = 3
SOCKET_TIMEOUT_S = 10.0


def tokenize(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


class BM25Index:
    """The BM25 index of `documents` (``{"id", "contents"}`` dicts)."""

    def __init__(self, documents: Sequence[dict[str, str]]) -> None:
        if not documents:
            raise ValueError("the corpus is empty")
        self.documents = [dict(d) for d in documents]
        self.bm25 = BM25Okapi([tokenize(d["contents"]) for d in self.documents])

    def search(self, query: str, topk: int) -> list[tuple[dict[str, str], float]]:
        scores = self.bm25.get_scores(tokenize(query))
        order = sorted(range(len(self.documents)), key=lambda i: (-float(scores[i]), i))[:topk]
        return [(self.documents[i], float(scores[i])) for i in order]


class RetrievalServer:
    """`serve`'s running server: its ``url`` (``http://127.0.0.1:PORT/retrieve``), the queries it
    answered, and ``stop()``."""

    def __init__(self, index: BM25Index) -> None:
        self.index = index
        self.queries: list[str] = []
        self._lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            timeout = SOCKET_TIMEOUT_S

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                return

            def _answer(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                self._answer(405 if self.path == "/retrieve" else 404, {"error": "POST /retrieve"})

            def do_POST(self) -> None:  # noqa: N802
                if self.path != "/retrieve":
                    self._answer(404, {"error": f"no route {self.path}; POST /retrieve"})
                    return
                try:
                    length = int(self.headers.get("Content-Length", ""))
                except ValueError:
                    self._answer(411, {"error": "Content-Length is required"})
                    return
                if not 0 <= length <= MAX_BODY:
                    self._answer(413, {"error": f"body of {length} bytes; at most {MAX_BODY}"})
                    return
                status, body = owner.handle(self.rfile.read(length))
                self._answer(status, body)

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._http.daemon_threads = True
        port = self._http.server_address[1]
        self.url = f"http://127.0.0.1:{port}/retrieve"
        self._thread = threading.Thread(
            target=self._http.serve_forever, args=(0.05,), daemon=True, name="bm25-retrieval"
        )
        self._thread.start()

    def handle(self, raw: bytes) -> tuple[int, dict[str, Any]]:
        """The status and JSON body of one ``/retrieve`` request."""
        try:
            request = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return 400, {"error": f"the body is not JSON: {exc}"}
        if not isinstance(request, dict) or not isinstance(request.get("query"), str):
            return 400, {"error": "the body must be an object with a string 'query'"}
        topk = request.get("topk") or DEFAULT_TOPK
        if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= MAX_TOPK:
            return 400, {"error": f"'topk' must be an integer in [1, {MAX_TOPK}], got {topk!r}"}
        hits = self.index.search(request["query"], topk)
        with self._lock:
            self.queries.append(request["query"])
        if request.get("return_scores"):
            return 200, {"result": [[{"document": doc, "score": score} for doc, score in hits]]}
        return 200, {"result": [[doc for doc, _ in hits]]}

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=10.0)


def serve(documents: Sequence[dict[str, str]]) -> RetrievalServer:
    """A retrieval server over `documents` on an ephemeral port of 127.0.0.1 (stop it when done)."""
    return RetrievalServer(BM25Index(documents))
