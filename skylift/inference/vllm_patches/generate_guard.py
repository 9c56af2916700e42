"""Patch: vLLM's ``/inference/v1/generate`` gets only bodies it can serve.

`GenerateGuard` is a pure ASGI middleware in front of that route: it reads the body (at most
`max_body_bytes`, refused at once from its Content-Length, else while it arrives: 413), parses it
(off the event loop when large) and checks it with
`skylift.inference.vllm_patches.generate_body.check_generate_body`. A malformed body gets a 400 in vLLM's
error shape whose message names each bad field; a well-formed one reaches vLLM byte for byte, and
vLLM still hears of a client that disconnects. Other routes pass untouched.

Upstream: vLLM 0.32's ``GenerateRequest`` leaves fields unbounded that its engine then fails on
(a 500 under fuzzing, tests/reliability/test_fuzz_server.py); no issue filed. Removable when
vLLM's own request model bounds them (the guard's unit tests' bodies get vLLM's 400 without it);
until then the models in `generate_body` follow vLLM's ``SamplingParams`` of the pinned release.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from skylift.inference.generate_compat import GENERATE_PATH
from skylift.inference.vllm_patches.generate_body import (
    GenerateLimits,
    Problem,
    check_generate_body,
    problems_message,
)
from skylift.inference.vllm_patches.versions import guard

NAME = "generate_guard"
WRITTEN_FOR = "==0.32.*"

#: Bodies larger than this are parsed and checked in a worker thread.
OFF_LOOP_BYTES = 64 << 10


class BodyTooLarge(Exception):
    pass


def error_response(status: int, message: str, param: str | None, kind: str) -> JSONResponse:
    """vLLM's error shape."""
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status
    )


def check_raw_body(raw: bytes, limits: GenerateLimits) -> list[Problem]:
    """`check_generate_body` of the JSON in `raw` (a body that is no JSON is one problem)."""
    try:
        payload = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        return [Problem("body", f"not valid JSON ({exc})")]
    return check_generate_body(payload, limits)


class GenerateGuard:
    """Pure ASGI middleware: see the module docstring."""

    def __init__(self, app: ASGIApp, limits: GenerateLimits, max_body_bytes: int) -> None:
        self.app = app
        self.limits = limits
        self.max_body_bytes = max_body_bytes

    def _too_large(self) -> JSONResponse:
        return error_response(
            413,
            f"the body of {GENERATE_PATH} exceeds {self.max_body_bytes} bytes (the server's "
            "SKYLIFT_MAX_GENERATE_BODY_MB)",
            None,
            "RequestEntityTooLarge",
        )

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        for name, value in scope.get("headers", []):
            if name.lower() == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_body_bytes:
                    raise BodyTooLarge
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ConnectionResetError
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = (
            scope.get("path", "").removeprefix(scope.get("root_path", "")) if scope["type"] == "http" else ""
        )
        if path != GENERATE_PATH or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        try:
            raw = await self._read_body(scope, receive)
        except BodyTooLarge:
            await self._too_large()(scope, receive, send)
            return
        except ConnectionResetError:
            return  # the client left before its body arrived: nobody to answer
        if len(raw) > OFF_LOOP_BYTES:
            problems = await asyncio.to_thread(check_raw_body, raw, self.limits)
        else:
            problems = check_raw_body(raw, self.limits)
        if problems:
            response = error_response(400, problems_message(problems), problems[0].field, "BadRequestError")
            await response(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()  # disconnects reach vLLM's cancellation

        await self.app(scope, replay, send)


def install(app: Any, limits: GenerateLimits, max_body_bytes: int) -> None:
    """Put `GenerateGuard` innermost of `app`'s user middleware (the caller rebuilds the stack);
    `VllmPatchVersionError` on a vLLM whose generate body it was not written for."""
    guard(NAME, WRITTEN_FOR)
    app.user_middleware.insert(0, Middleware(GenerateGuard, limits=limits, max_body_bytes=max_body_bytes))
