"""vLLM's ``/inference/v1/generate`` answers as the clients that sample through it expect.

vLLM 0.32 labels each sampled token's logprob entry with its integer ``token_id``; the clients
of verifiers 0.4 (its ``train`` client, through ``renderers`` 0.1.12, the newest) check an
OpenAI-style ``"token": "token_id:N"`` label on every entry and refuse the answer without it (the
episode fails with a 502 from verifiers' interception). `GenerateTokenLabels` adds that label
(beside ``token_id``, which stays) to every entry of a non-streamed JSON answer of the route,
``top_logprobs`` included; other routes and streamed answers pass untouched.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

GENERATE_PATH = "/inference/v1/generate"


def label_tokens(payload: Any) -> Any:
    """`payload` (a generate answer) with ``token`` = ``"token_id:N"`` on each logprob entry that
    has a ``token_id`` and no ``token``."""
    if not isinstance(payload, dict):
        return payload
    for choice in payload.get("choices") or []:
        logprobs = choice.get("logprobs") if isinstance(choice, dict) else None
        content = logprobs.get("content") if isinstance(logprobs, dict) else None
        for entry in content or []:
            if not isinstance(entry, dict):
                continue
            for item in [entry, *(entry.get("top_logprobs") or [])]:
                if isinstance(item, dict) and "token" not in item and isinstance(item.get("token_id"), int):
                    item["token"] = f"token_id:{item['token_id']}"
    return payload


class GenerateTokenLabels:
    """Pure ASGI middleware: see the module docstring."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = (
            scope.get("path", "").removeprefix(scope.get("root_path", "")) if scope["type"] == "http" else ""
        )
        if path != GENERATE_PATH:
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []
        passthrough = False

        async def capture(message: Message) -> None:
            nonlocal start, passthrough
            if passthrough:
                await send(message)
                return
            if message["type"] == "http.response.start":
                headers = {k.lower(): v for k, v in message.get("headers", [])}
                if b"application/json" not in headers.get(b"content-type", b""):
                    passthrough = True  # a streamed (event-stream) answer
                    await send(message)
                    return
                start = message
                return
            if message["type"] != "http.response.body" or start is None:
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = b"".join(chunks)
            try:
                body = json.dumps(label_tokens(json.loads(body))).encode()
            except ValueError:
                pass  # not JSON after all: as it was
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, capture)
