"""API keys of the inference server: every route but the probes needs ``Authorization: Bearer``.

Keys are kept as SHA-256 digests and compared in constant time.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

#: Paths that stay open when the server has API keys: liveness and load probes, the version and
#: Prometheus metrics (open in vLLM too).
PUBLIC_PATHS = frozenset({"/health", "/ping", "/version", "/metrics", "/load"})


def hash_key(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def api_key_problem(key_hashes: Sequence[bytes], authorization: str) -> str | None:
    """Why a request with this Authorization header is refused; None when it may pass."""
    if not key_hashes:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return "missing API key: send 'Authorization: Bearer <key>'"
    digest = hash_key(token.strip())
    ok = False
    for known in key_hashes:
        ok |= secrets.compare_digest(digest, known)
    return None if ok else "invalid API key"


class ApiKeyMiddleware:
    """Pure ASGI middleware: every HTTP path but `PUBLIC_PATHS` (and CORS preflights) needs a key."""

    def __init__(self, app: ASGIApp, key_hashes: Sequence[bytes]) -> None:
        self.app = app
        self.key_hashes = list(key_hashes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") != "OPTIONS":
            path = scope["path"].removeprefix(scope.get("root_path", ""))
            if path not in PUBLIC_PATHS:
                problem = api_key_problem(self.key_hashes, Headers(scope=scope).get("authorization", ""))
                if problem is not None:
                    body = {"error": {"message": problem, "type": "Unauthorized", "param": None, "code": 401}}
                    await JSONResponse(body, status_code=401)(scope, receive, send)
                    return
        await self.app(scope, receive, send)
