"""Engine errors as HTTP answers: the status of each `EngineError` and an engine call that raises it."""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from http import HTTPStatus
from typing import TypeVar

from fastapi import HTTPException

from skylift.utils import engine_errors as errors

logger = logging.getLogger("skylift.inference.engine_http")

T = TypeVar("T")


def status_of(exc: errors.EngineError) -> HTTPStatus:
    """The HTTP status of an engine error: 404 something named that the engine does not have,
    400 bad request, 409 wrong state, 501 unsupported by the backend, 503 engine gone or silent,
    500 otherwise."""
    for cls, status in (
        (errors.EngineNotFoundError, HTTPStatus.NOT_FOUND),
        (errors.EngineRequestError, HTTPStatus.BAD_REQUEST),
        (errors.EngineStateError, HTTPStatus.CONFLICT),
        (errors.EngineCapabilityError, HTTPStatus.NOT_IMPLEMENTED),
        (errors.EngineUnavailableError, HTTPStatus.SERVICE_UNAVAILABLE),
    ):
        if isinstance(exc, cls):
            return status
    return HTTPStatus.INTERNAL_SERVER_ERROR


async def engine_call(awaitable: Awaitable[T]) -> T:
    """Await an engine call; its `EngineError` becomes the HTTP error `status_of` says (logged when 5xx)."""
    try:
        return await awaitable
    except errors.EngineError as exc:
        status = status_of(exc)
        if status >= 500:
            logger.error("%s", exc)
        raise HTTPException(status_code=int(status), detail=str(exc)) from exc
