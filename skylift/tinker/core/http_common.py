"""What every route of the Tinker app shares: the JSON error shape, reading a JSON body, the
API-key middleware (which user is calling), the mapping of exceptions to responses and the two
shapes of the REST views (a page of the caller's records; one record the caller owns).

Errors: `UserError` is a 400 (`NotFoundError` a 404, `TooLargeError` a 413, `QuotaError` a 429). Any other exception is a server error
with its message: a 500 on a direct route (operation routes turn it into a failed future of
category "server" themselves, see `skylift.tinker.app`). The one exception: a ValueError /
TypeError / KeyError / AttributeError raised while reading the request body (the innermost
skylift frame of the traceback holds the body) is the body's wrong shape, a 400.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

import skylift
from skylift.tinker.core.auth import DEFAULT_USER, KeyRing, current_user
from skylift.tinker.core.fairness import QuotaError
from skylift.tinker.core.limits import parse_json, read_payload
from skylift.tinker.errors import NotFoundError, TooLargeError, UserError

logger = logging.getLogger(__name__)

_SKYLIFT_DIR = str(Path(skylift.__file__).resolve().parent)
_SHAPE_ERRORS = (ValueError, TypeError, KeyError, AttributeError, OverflowError)
_PARSE_ON_LOOP_BYTES = 64 * 1024
_REQUEST_LOCALS = ("body", "raw")


def error_response(status: int, message: str, category: str = "user") -> JSONResponse:
    return JSONResponse({"error": message, "detail": message, "category": category}, status_code=status)


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object: size-limited (413), zstd allowed, NaN/Infinity refused (400);
    a large body is parsed in a worker thread."""
    raw = await read_payload(request)
    if len(raw) > _PARSE_ON_LOOP_BYTES:
        return await asyncio.to_thread(parse_json, raw, request.url.path)
    return parse_json(raw, request.url.path)


def caller(request: Request) -> str:
    """The user the request's API key belongs to (set by the middleware of `install_auth`)."""
    return str(request.state.user)


#: Most records one page lists, and the largest offset (the database's integers are 64-bit).
MAX_PAGE, MAX_OFFSET = 1000, 2**31 - 1


def add_page_route(
    router: APIRouter,
    path: str,
    part: str,
    page: Callable[[Any, int, int, str], dict[str, Any]],
    default_limit: int = 20,
) -> None:
    """GET `path?limit=&offset=`: `page(views, limit, offset, user)` of the caller's records (a
    thread; `views` is the app's `part`, `request.app.state.<part>`)."""

    async def route(
        request: Request,
        limit: int = Query(default_limit, ge=1, le=MAX_PAGE),
        offset: int = Query(0, ge=0, le=MAX_OFFSET),
    ) -> dict[str, Any]:
        views = getattr(request.app.state, part)
        return await asyncio.to_thread(page, views, limit, offset, caller(request))

    router.get(path)(route)


def add_owned_route(
    router: APIRouter,
    path: str,
    check: Callable[[Any, str, str], None],
    part: str,
    view: Callable[[Any, str], dict[str, Any]],
) -> None:
    """GET `path` (one parameter, `{key}`): `check(owners, user, key)` (raises for another user's
    key), then `view(views, key)` with the app's `part` as `views`, both in a thread."""

    async def route(key: str, request: Request) -> dict[str, Any]:
        def get() -> dict[str, Any]:
            check(request.app.state.owners, caller(request), key)
            return view(getattr(request.app.state, part), key)

        return await asyncio.to_thread(get)

    router.get(path)(route)


def reading_request(exc: BaseException) -> bool:
    """True for a shape error raised while reading the request: the innermost skylift frame of
    its traceback holds the request body (`body` / `raw`)."""
    if not isinstance(exc, _SHAPE_ERRORS) or isinstance(exc, UserError):
        return False
    tb, last = exc.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.startswith(_SKYLIFT_DIR):
            last = tb.tb_frame
        tb = tb.tb_next
    return last is not None and any(name in last.f_locals for name in _REQUEST_LOCALS)


def malformed_response(request: Request, exc: Exception) -> JSONResponse:
    what = f"missing field {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
    logger.info("%s: malformed request: %s", request.url.path, what)
    return error_response(400, f"{request.url.path}: malformed request ({what})")


class _Authenticate:
    """Pure ASGI middleware (no extra task per request): the caller's user from X-API-Key."""

    def __init__(self, app: ASGIApp, keyring: KeyRing, api: str) -> None:
        self.app, self.keyring, self.api = app, keyring, api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        user: str | None = DEFAULT_USER
        if path.startswith((self.api, "/skylift/")) and path != f"{self.api}/healthz":
            sent = Headers(scope=scope).get("x-api-key")
            user = self.keyring.user_of(sent)
            if user is None:
                await error_response(401, "invalid or missing API key (header X-API-Key)")(
                    scope, receive, send
                )
                return
        scope.setdefault("state", {})["user"] = user
        token = current_user.set(user)
        try:
            await self.app(scope, receive, send)
        finally:
            current_user.reset(token)


def install_auth(app: FastAPI, keyring: KeyRing, api: str) -> None:
    """Every request under `api` and /skylift/ (but healthz) needs a key `keyring` knows; its user
    is `request.state.user` and `skylift.tinker.core.auth.current_user` while the request is served."""
    app.add_middleware(_Authenticate, keyring=keyring, api=api)


#: The user errors and the status each answers with, its message the detail (the most specific class
#: of an error that is several decides).
_USER_ERROR_STATUS: tuple[tuple[type[Exception], int], ...] = (
    (NotFoundError, 404),
    (QuotaError, 429),
    (TooLargeError, 413),
    (UserError, 400),
)


def _answer_with(status: int) -> Callable[[Request, Exception], Awaitable[Response]]:
    async def answer(request: Request, exc: Exception) -> Response:
        return error_response(status, str(exc))

    return answer


def install_error_handlers(app: FastAPI) -> None:
    for error, status in _USER_ERROR_STATUS:
        app.add_exception_handler(error, _answer_with(status))

    @app.exception_handler(RequestValidationError)
    async def invalid_parameters(request: Request, exc: RequestValidationError) -> Response:
        problems = "; ".join(f"{'.'.join(str(part) for part in e['loc'])}: {e['msg']}" for e in exc.errors())
        return error_response(400, f"{request.url.path}: {problems}")

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> Response:
        if reading_request(exc):
            return malformed_response(request, exc)
        logger.error("%s failed: %s", request.url.path, exc, exc_info=exc)
        response = error_response(500, f"{type(exc).__name__}: {exc}", "server")
        response.headers["x-should-retry"] = "false"
        return response
