"""The FastAPI application that speaks the Tinker wire protocol (routes under ``/api/v1``).

The routes live in routers (`router` of each feature folder: `skylift.tinker.sessions.router`,
`skylift.tinker.training.router`, ...) that
take their feature (`skylift.tinker.core.deps.app_part`: the service's part of that name, set on
the app's state here), the caller and a typed body (`skylift.tinker.core.bodies`) as dependencies;
this module assembles them with the service's parts, the API keys and the error handlers.

Operation routes answer ``{"request_id", ...}`` at once; results come from ``retrieve_future``
(long-poll, then HTTP 408 so the SDK polls again; 410 for a future lost in a restart, on which
the SDK resubmits the request). Failed operations answer ``{"error", "category"}`` with status
200; malformed direct requests answer 4xx with a JSON body (the SDK retries a 400 without a body
as a proxy error). A request body of the wrong shape (a string where an object or a number
belongs, a missing field, a value past a declared limit) is such a 4xx naming the field, never
a 500.

Users: every request under ``/api/v1`` and ``/skylift`` (but healthz) carries ``X-API-Key``; the
key's user (`skylift.tinker.core.auth`) owns what it creates, and another user's ids and paths are
answered exactly like unknown ones (`skylift.tinker.core.ownership`): 404 on direct routes, a future
failing with the same "unknown ..." user error on operation routes.

Errors (`skylift.tinker.core.http_common`): an internal failure on an operation route becomes a failed
future of category "server" (the SDK raises it at once instead of retrying the POST for
minutes); on a direct route a 500 with the message.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from skylift.tinker.checkpoints import router as checkpoint_routes
from skylift.tinker.core.auth import KeyRing
from skylift.tinker.core.deps import RefusedOperation
from skylift.tinker.core.fairness import QuotaError
from skylift.tinker.core.http_common import error_response, install_auth, install_error_handlers
from skylift.tinker.core.limits import RequestLimits
from skylift.tinker.core.ownership import Owners
from skylift.tinker.openapi import install_typed_bodies
from skylift.tinker.sampling import router as sampling
from skylift.tinker.service import ServerConfig, TinkerService
from skylift.tinker.sessions import router as sessions
from skylift.tinker.sessions import runs_router as runs
from skylift.tinker.training import router as training

logger = logging.getLogger(__name__)
API = "/api/v1"
CLIENT_CONFIG = sessions.CLIENT_CONFIG


def create_app(config: ServerConfig) -> FastAPI:
    """The Tinker-compatible app; the service starts with the app's lifespan."""
    service = TinkerService(config)
    keyring = KeyRing(config.api_key, config.api_keys_file)
    service.admission.caps_of = keyring.caps_of  # the users file's caps (reloaded with it)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGHUP, keyring.reload)
        except (RuntimeError, ValueError, NotImplementedError):  # not the main thread (in-process tests)
            logger.info("SIGHUP does not reload the API keys in this process")
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="skylift Tinker-compatible service", lifespan=lifespan)
    app.state.service, app.state.keyring = service, keyring
    for part in (
        "requests",
        "base_models",
        "training",
        "sampling",
        "checkpoints",
        "sessions",
        "runs",
        "stats",
    ):
        setattr(app.state, part, getattr(service, part))
    app.state.owners = Owners(service.store)
    app.state.limits = RequestLimits.from_config(config)
    install_auth(app, keyring, API)
    install_error_handlers(app)

    @app.exception_handler(RefusedOperation)
    async def refused(request: Request, exc: RefusedOperation) -> JSONResponse:
        try:
            return JSONResponse({"request_id": service.requests.fail_now(exc.kind, exc.error)})
        except QuotaError as quota:
            return error_response(429, str(quota))

    for router in (sessions.router, training.router, sampling.router, checkpoint_routes.router, runs.router):
        app.include_router(router, prefix=API)
    app.include_router(checkpoint_routes.signed)
    app.include_router(runs.extras, prefix="/skylift")
    install_typed_bodies(app)
    return app
