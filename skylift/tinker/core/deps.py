"""What the Tinker routers take from FastAPI's dependency injection: a feature of the app
(`app_part`: the object the app's state holds under that name), the ownership checks, the caller,
the idempotency key and the typed body of a request; and how an operation is submitted for the
caller (`operation`).

A typed body (`typed(Model)`) is read once (size-limited, zstd allowed, NaN refused: see
`skylift.tinker.core.limits`), parsed in a worker thread when large, and validated into `Model` with
its declared limits, before anything else happens: a violation is a 400 naming the field. The
one exception is an operation on a model (`model_op(Model)`): the caller's ownership of the
named model is decided first, so another user's model id gets the same failed future as an
unknown one, whatever the rest of the body holds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request
from pydantic import BaseModel, ValidationError

from skylift.tinker.core import ownership
from skylift.tinker.core.bodies import ModelBody, parse_body
from skylift.tinker.core.http_common import caller, read_json, reading_request
from skylift.tinker.core.ownership import Owners
from skylift.tinker.core.requests import Requests
from skylift.tinker.errors import UserError

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
_PARSE_ON_LOOP_BYTES = 64 * 1024
Refusal = Callable[[str], Exception | None]


class RefusedOperation(Exception):
    """An operation the caller may not submit: answered with a failed future (status 200)."""

    def __init__(self, kind: str, error: Exception) -> None:
        super().__init__(str(error))
        self.kind, self.error = kind, error


def app_part(name: str) -> Any:
    """A dependency: the app's `name` (`request.app.state.<name>`: a feature's operations)."""

    def part(request: Request) -> Any:
        return getattr(request.app.state, name)

    return Depends(part)


def requests_of(request: Request) -> Requests:
    return request.app.state.requests  # type: ignore[no-any-return]


def owners_of(request: Request) -> Owners:
    return request.app.state.owners  # type: ignore[no-any-return]


def idem(request: Request) -> str | None:
    return request.headers.get("x-idempotency-key")


RequestsDep = Annotated[Requests, Depends(requests_of)]
OwnersDep = Annotated[Owners, Depends(owners_of)]
Caller = Annotated[str, Depends(caller)]
IdemKey = Annotated[str | None, Depends(idem)]


async def _validated(model: type[M], request: Request, raw: dict[str, Any]) -> M:
    where = request.url.path
    if int(request.headers.get("content-length") or 0) > _PARSE_ON_LOOP_BYTES:
        return await asyncio.to_thread(parse_body, model, raw, where)
    return parse_body(model, raw, where)


def typed(model: type[M]) -> Any:
    """A dependency: the request's body as `model` (its schema is the route's OpenAPI body)."""

    async def read(request: Request) -> M:
        return await _validated(model, request, await read_json(request))

    read.body_model = model  # type: ignore[attr-defined]  (see skylift.tinker.openapi)
    return Depends(read)


def model_op(model: type[M], kind: str) -> Any:
    """Like `typed`, for a body naming a `model_id`: a body the caller may not act on (another
    user's or an unknown model) is refused as a failed future before its shape is judged."""

    async def read(request: Request) -> M:
        raw = await read_json(request)
        try:
            return await _validated(model, request, raw)
        except UserError as exc:
            if not isinstance(exc.__cause__, ValidationError):
                raise
            try:
                named = ModelBody.model_validate(raw)
            except ValidationError:
                raise exc from None
            user, owners = caller(request), owners_of(request)
            if not await asyncio.to_thread(owners.owns_model, user, named.model_id):
                raise RefusedOperation(kind, ownership.unknown_model(named.model_id)) from None
            raise

    read.body_model = model  # type: ignore[attr-defined]
    return Depends(read)


async def operation(
    request: Request, kind: str, refuse: Refusal, run: Callable[[], Awaitable[dict[str, Any]]]
) -> dict[str, Any]:
    """Submit an operation for the calling user: `refuse(user)` (run in a thread) names the error
    when the user may not (an unknown-id error); an internal failure while submitting becomes a
    failed future of category "server"."""
    requests = requests_of(request)
    refusal = await asyncio.to_thread(refuse, caller(request))
    if refusal is not None:
        return {"request_id": requests.fail_now(kind, refusal)}
    try:
        return await run()
    except UserError:
        raise
    except Exception as exc:
        if reading_request(exc):
            raise
        logger.error("%s: submitting failed: %s", kind, exc, exc_info=exc)
        return {"request_id": requests.fail_now(kind, exc)}


def model_refusal(owners: Owners, model_id: object) -> Refusal:
    return lambda user: None if owners.owns_model(user, model_id) else ownership.unknown_model(model_id)


def session_refusal(owners: Owners, session_id: object) -> Refusal:
    return lambda user: (
        None if owners.owns_session(user, session_id) else ownership.unknown_session(session_id)
    )
