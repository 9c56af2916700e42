"""The FastAPI application that speaks the Tinker wire protocol (routes under ``/api/v1``).

Operation routes answer ``{"request_id", ...}`` at once; results come from ``retrieve_future``
(long-poll, then HTTP 408 so the SDK polls again; 410 for a future lost in a restart, on which
the SDK resubmits the request). Failed operations answer ``{"error", "category"}`` with status
200; malformed direct requests answer 4xx with a JSON body (the SDK retries a 400 without a body
as a proxy error). A request body of the wrong shape (a string where an object or a number
belongs, a missing field) is such a 4xx, never a 500.

Users: every request under ``/api/v1`` and ``/skylift`` (but healthz) carries ``X-API-Key``; the
key's user (`skylift.tinker.auth`) owns what it creates, and another user's ids and paths are
answered exactly like unknown ones (`skylift.tinker.ownership`): 404 on direct routes, a future
failing with the same "unknown ..." user error on operation routes.

Errors (`skylift.tinker.http_common`): an internal failure on an operation route becomes a failed
future of category "server" (the SDK raises it at once instead of retrying the POST for
minutes); on a direct route a 500 with the message.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from skylift.tinker import checkpoint_routes, ownership, runs, training_ops
from skylift.tinker.auth import KeyRing
from skylift.tinker.errors import UserError
from skylift.tinker.futures import FutureHub
from skylift.tinker.http_common import (
    add_owned_route,
    add_page_route,
    install_auth,
    install_error_handlers,
    reading_request,
)
from skylift.tinker.http_common import caller as who
from skylift.tinker.http_common import error_response as _error
from skylift.tinker.http_common import read_json as _json
from skylift.tinker.limits import RequestLimits, read_payload
from skylift.tinker.openapi import install_sdk_bodies
from skylift.tinker.ownership import Owners
from skylift.tinker.service import ServerConfig, TinkerService
from skylift.tinker.wire import WireLimits, decode_forward_backward

logger = logging.getLogger(__name__)

CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "use_pyqwest_transport": False,
    "parallel_fwdbwd_chunks": True,
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,
    "sample_join_sampling_session": False,
    "custom_loss_server_side": False,
}


def create_app(config: ServerConfig) -> FastAPI:
    """The Tinker-compatible app; the service starts with the app's lifespan."""
    service = TinkerService(config)
    keyring = KeyRing(config.api_key, config.api_keys_file)
    owners = Owners(service.store)

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
    app.state.service = service
    app.state.keyring = keyring
    app.state.limits = limits = RequestLimits.from_config(config)
    wire_limits = WireLimits(
        max_tokens=max(b.max_model_len for b in service.base_models), max_cells=limits.max_cells
    )
    api = "/api/v1"

    install_auth(app, keyring, api)
    install_error_handlers(app)
    install_sdk_bodies(app, api)

    def idem(request: Request) -> str | None:
        return request.headers.get("x-idempotency-key")

    def hub() -> FutureHub:
        return service.hub  # raises until the service started

    def failed_future(kind: str, exc: Exception) -> str:
        """A new future that fails with `exc` (a refused or broken operation)."""
        request_id, _ = hub().submit(kind, None)
        hub().fail(request_id, exc)
        return request_id

    async def operation(
        request: Request,
        kind: str,
        refuse: Callable[[str], Exception | None],
        run: Callable[[], Awaitable[dict[str, Any]]],
    ) -> dict[str, Any]:
        """Submit an operation for the calling user: `refuse(user)` (run in a thread) names the
        error when the user may not (an unknown-id error); an internal failure while submitting
        becomes a failed future of category "server"."""
        refusal = await asyncio.to_thread(refuse, who(request))
        if refusal is not None:
            return {"request_id": failed_future(kind, refusal)}
        try:
            return await run()
        except UserError:
            raise
        except Exception as exc:
            if reading_request(exc):
                raise
            logger.error("%s: submitting failed: %s", kind, exc, exc_info=exc)
            return {"request_id": failed_future(kind, exc)}

    # ---------------------------------------------------------------- client and sessions
    @app.post(f"{api}/client/config")
    async def client_config() -> dict[str, Any]:
        return CLIENT_CONFIG

    @app.post(f"{api}/client/dynamic_config")
    async def client_dynamic_config() -> dict[str, Any]:
        return {}

    @app.post(f"{api}/telemetry")
    async def telemetry() -> dict[str, Any]:
        return {"status": "accepted"}

    @app.get(f"{api}/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok"}

    @app.get(f"{api}/get_server_capabilities")
    async def capabilities() -> dict[str, Any]:
        models = [
            {
                "model_name": b.name,
                "max_context_length": b.max_model_len,
                "trainable": True,
                "sampleable": True,
            }
            for b in service.base_models
        ]
        return {"supported_models": models}

    @app.post(f"{api}/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        body = await _json(request)

        def create() -> str:
            session_id = service.create_session(body)
            service.store.set_session_owner(session_id, who(request))
            return session_id

        return {"type": "create_session", "session_id": await asyncio.to_thread(create)}

    @app.post(f"{api}/session_heartbeat")
    async def session_heartbeat(request: Request) -> Response:
        body = await _json(request)
        session_id = str(body.get("session_id"))

        def beat() -> bool:
            owners.session(who(request), session_id)
            return service.heartbeat(session_id)

        if not await asyncio.to_thread(beat):
            return _error(410, f"session {body.get('session_id')} is finished")
        return JSONResponse({"type": "session_heartbeat"})

    @app.post(f"{api}/sessions/{{session_id}}/finish")
    async def finish_session(session_id: str, request: Request) -> dict[str, Any]:
        body = await _json(request)
        reason = body.get("reason") or {}
        if not isinstance(reason, dict):
            raise UserError(f"{request.url.path}: reason must be an object like {{'type': 'success'}}")
        await asyncio.to_thread(owners.session, who(request), session_id)
        await service.finish_session(session_id, str(reason.get("type", "success")))
        return {}

    # ---------------------------------------------------------------- training
    def model_refusal(model_id: object) -> Callable[[str], Exception | None]:
        return lambda user: None if owners.owns_model(user, model_id) else ownership.unknown_model(model_id)

    def session_refusal(session_id: object) -> Callable[[str], Exception | None]:
        return lambda user: (
            None if owners.owns_session(user, session_id) else ownership.unknown_session(session_id)
        )

    @app.post(f"{api}/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        body = await _json(request)

        async def run() -> dict[str, Any]:
            request_id, model_id = await service.create_model(body)
            return {"request_id": request_id, "model_id": model_id}

        return await operation(request, "create_model", session_refusal(body.get("session_id")), run)

    @app.post(f"{api}/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        model_id = str((await _json(request)).get("model_id"))

        def info() -> dict[str, Any]:
            owners.model(who(request), model_id)
            return service.get_info(model_id)

        return await asyncio.to_thread(info)

    async def decoded_call(request: Request) -> Any:
        """The protobuf body (size-limited, zstd allowed), decoded in a worker thread with the
        server's shape limits."""
        raw = await read_payload(request)
        return await asyncio.to_thread(decode_forward_backward, raw, wire_limits)

    @app.post(f"{api}/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        return await forward_call(request, await decoded_call(request), "forward_backward")

    @app.post(f"{api}/forward")
    async def forward(request: Request) -> dict[str, Any]:
        call = await decoded_call(request)
        call.forward_only = True
        return await forward_call(request, call, "forward")

    async def forward_call(request: Request, call: Any, kind: str) -> dict[str, Any]:
        async def run() -> dict[str, Any]:
            request_id = await training_ops.forward_backward(service, call, idem(request))
            return {"request_id": request_id, "model_id": call.model_id}

        result = await operation(request, kind, model_refusal(call.model_id), run)
        return {"model_id": call.model_id, **result}

    async def model_operation(
        request: Request,
        kind: str,
        submit: Callable[[TinkerService, dict[str, Any], str | None], Awaitable[str]],
    ) -> dict[str, Any]:
        body = await _json(request)

        async def run() -> dict[str, Any]:
            return {"request_id": await submit(service, body, idem(request))}

        result = await operation(request, kind, model_refusal(body.get("model_id")), run)
        return {"model_id": body.get("model_id"), **result}

    @app.post(f"{api}/optim_step")
    async def optim_step(request: Request) -> dict[str, Any]:
        return await model_operation(request, "optim_step", training_ops.optim_step)

    @app.post(f"{api}/save_weights")
    async def save_weights(request: Request) -> dict[str, Any]:
        return await model_operation(request, "save_weights", training_ops.save_weights)

    @app.post(f"{api}/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> dict[str, Any]:
        return await model_operation(
            request, "save_weights_for_sampler", training_ops.save_weights_for_sampler
        )

    @app.post(f"{api}/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        body = await _json(request)
        path = body.get("path")

        def refuse(user: str) -> Exception | None:
            if body.get("session_id") is None:
                if not owners.owns_model(user, body.get("model_id")):
                    return ownership.unknown_model(body.get("model_id"))
            elif not owners.owns_session(user, body.get("session_id")):
                return ownership.unknown_session(body.get("session_id"))
            if not owners.may_read_path(user, path):
                return ownership.missing_checkpoint(path)
            return None

        async def run() -> dict[str, Any]:
            request_id, model_id = await training_ops.load_weights(service, body, idem(request))
            return {"request_id": request_id, "model_id": model_id}

        return await operation(request, "load_weights", refuse, run)

    # ---------------------------------------------------------------- sampling
    @app.post(f"{api}/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        body = await _json(request)

        def create() -> str:
            user = who(request)
            owners.session(user, str(body.get("session_id")))
            if body.get("model_path") and not owners.may_read_path(user, body["model_path"]):
                raise ownership.missing_checkpoint(body["model_path"], sampler=True)
            return service.sampling.create_sampling_session(body)

        sampling_id = await asyncio.to_thread(create)
        return {"type": "create_sampling_session", "sampling_session_id": sampling_id}

    @app.get(f"{api}/samplers/{{sampler_id}}")
    async def get_sampler(sampler_id: str, request: Request) -> dict[str, Any]:
        def get() -> dict[str, Any]:
            owners.sampler(who(request), sampler_id)
            return service.sampling.get_sampler(sampler_id)

        return await asyncio.to_thread(get)

    @app.post(f"{api}/asample")
    async def asample(request: Request) -> dict[str, Any]:
        body = await _json(request)

        def refuse(user: str) -> Exception | None:
            sampling_id = body.get("sampling_session_id")
            if sampling_id and not owners.may_use_sampler(user, sampling_id):
                return ownership.unknown_sampling_session(sampling_id)
            if (
                not sampling_id
                and body.get("model_path")
                and not owners.may_read_path(user, body["model_path"])
            ):
                return ownership.missing_checkpoint(body["model_path"], sampler=True)
            return None

        async def run() -> dict[str, Any]:
            request_id, sequence_ids = await service.asample(body, idem(request))
            return {"request_id": request_id, "sample_sequence_ids": sequence_ids}

        result = await operation(request, "sample", refuse, run)
        result.setdefault("sample_sequence_ids", [])
        return result

    # ---------------------------------------------------------------- futures
    @app.post(f"{api}/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        request_id = str((await _json(request)).get("request_id"))
        try:
            outcome = await hub().wait(request_id, config.long_poll_s, user=who(request))
        except KeyError:  # unknown, pruned or another user's
            return _error(404, f"unknown request id {request_id!r}")
        if outcome is None:
            return JSONResponse(
                {"type": "try_again", "request_id": request_id, "queue_state": "active"}, status_code=408
            )
        if outcome.status == "lost":  # the SDK resubmits the original request on 410
            message = f"request {request_id} was lost in a server restart; send it again"
            return _error(410, message, "server")
        if outcome.status == "failed":
            return JSONResponse({"error": outcome.error, "category": outcome.category or "unknown"})
        return Response(
            content=outcome.result or b"{}", media_type=outcome.content_type or "application/json"
        )

    @app.post(f"{api}/cancel_future")
    async def cancel_future() -> dict[str, Any]:
        return {}

    # ---------------------------------------------------------------- checkpoints out and in
    checkpoint_routes.add_routes(app, api, service, owners, who, idem, operation, model_refusal)

    # ---------------------------------------------------------------- REST: runs and checkpoints
    add_page_route(app, f"{api}/training_runs", partial(runs.list_training_runs, service))
    add_owned_route(app, f"{api}/training_runs/{{key}}", owners.run, partial(runs.training_run, service))
    add_owned_route(
        app, f"{api}/training_runs/{{key}}/checkpoints", owners.run, partial(runs.list_checkpoints, service)
    )

    @app.delete(f"{api}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}")
    async def delete_checkpoint(run_id: str, checkpoint_id: str, request: Request) -> dict[str, Any]:
        def delete() -> None:
            segment, _, name = checkpoint_id.partition("/")
            valid = segment in ("weights", "sampler_weights", "external_weights") and bool(name)
            if valid and not owners.owns_model(who(request), run_id):
                raise ownership.missing_checkpoint(f"tinker://{run_id}/{segment}/{name}")
            runs.delete_checkpoint(service, run_id, checkpoint_id)

        await asyncio.to_thread(delete)
        return {}

    add_page_route(app, f"{api}/checkpoints", partial(runs.list_user_checkpoints, service), default_limit=100)

    # ---------------------------------------------------------------- skylift extras
    @app.get("/skylift/status")
    async def status(request: Request) -> dict[str, Any]:
        """Which engines and render servers started (tests check that training never starts an
        engine, and text-only training no render server) and the caller's loaded models."""
        loaded = list(service.models)
        mine = await asyncio.to_thread(
            lambda: sorted(m for m in loaded if owners.owns_model(who(request), m))
        )
        return {
            "engines": [
                {
                    "base_model": h.base_model,
                    "started": h.started,
                    "start_attempts": h.start_attempts,
                    "last_error": h.last_error,
                }
                for h in service.sampling.engines.values()
            ],
            "engine_start_attempts": sum(h.start_attempts for h in service.sampling.engines.values()),
            "loaded_models": mine,
            "renderers": [r.status() for r in service.render_hosts.hosts.values()],
            "snapshots": service.snapshots.stats(),
        }

    return app
