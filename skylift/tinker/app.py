"""The FastAPI application that speaks the Tinker wire protocol (routes under ``/api/v1``).

Operation routes answer ``{"request_id", ...}`` at once; results come from ``retrieve_future``
(long-poll, then HTTP 408 so the SDK polls again). Failed operations answer
``{"error", "category"}`` with status 200; malformed direct requests answer 4xx with a JSON body
(the SDK retries a 400 without a body as a proxy error). A request body of the wrong shape
(a string where an object or a number belongs, a missing field) is such a 4xx, never a 500.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from skylift.tinker import checkpoints, runs, training_ops
from skylift.tinker.errors import NotFoundError, UserError
from skylift.tinker.service import ServerConfig, TinkerService
from skylift.tinker.wire import decode_forward_backward

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


def _error(status: int, message: str, category: str = "user") -> JSONResponse:
    return JSONResponse({"error": message, "detail": message, "category": category}, status_code=status)


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except Exception as exc:
        raise UserError(f"{request.url.path}: the body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise UserError(f"{request.url.path}: expected a JSON object")
    return body


def create_app(config: ServerConfig) -> FastAPI:
    """The Tinker-compatible app; the service starts with the app's lifespan."""
    service = TinkerService(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="skylift Tinker-compatible service", lifespan=lifespan)
    app.state.service = service
    api = "/api/v1"

    @app.middleware("http")
    async def check_api_key(request: Request, call_next: Any) -> Response:
        path = request.url.path
        if config.api_key and path.startswith((api, "/skylift/")) and path != f"{api}/healthz":
            sent = request.headers.get("x-api-key", "").encode()
            if not secrets.compare_digest(sent, config.api_key.encode()):
                return _error(401, "invalid or missing API key (header X-API-Key)")
        return await call_next(request)

    @app.exception_handler(NotFoundError)
    async def not_found(request: Request, exc: NotFoundError) -> Response:
        return _error(404, str(exc))

    @app.exception_handler(UserError)
    async def user_error(request: Request, exc: UserError) -> Response:
        return _error(400, str(exc))

    async def malformed(request: Request, exc: Exception) -> Response:
        """Route handlers only read the request before queueing work: these errors mean its shape is wrong."""
        what = f"missing field {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
        logger.info("%s: malformed request: %s", request.url.path, what)
        return _error(400, f"{request.url.path}: malformed request ({what})")

    for kind in (ValueError, TypeError, KeyError, AttributeError):
        app.add_exception_handler(kind, malformed)

    @app.exception_handler(RequestValidationError)
    async def invalid_parameters(request: Request, exc: RequestValidationError) -> Response:
        problems = "; ".join(f"{'.'.join(str(part) for part in e['loc'])}: {e['msg']}" for e in exc.errors())
        return _error(400, f"{request.url.path}: {problems}")

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> Response:
        logger.error("%s failed: %s", request.url.path, exc, exc_info=exc)
        return _error(500, f"{type(exc).__name__}: {exc}", "server")

    def idem(request: Request) -> str | None:
        return request.headers.get("x-idempotency-key")

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
        return {"type": "create_session", "session_id": service.create_session(await _json(request))}

    @app.post(f"{api}/session_heartbeat")
    async def session_heartbeat(request: Request) -> Response:
        body = await _json(request)
        if not service.heartbeat(str(body.get("session_id"))):
            return _error(410, f"session {body.get('session_id')} is finished")
        return JSONResponse({"type": "session_heartbeat"})

    @app.post(f"{api}/sessions/{{session_id}}/finish")
    async def finish_session(session_id: str, request: Request) -> dict[str, Any]:
        body = await _json(request)
        reason = body.get("reason") or {}
        if not isinstance(reason, dict):
            raise UserError(f"{request.url.path}: reason must be an object like {{'type': 'success'}}")
        service.finish_session(session_id, str(reason.get("type", "success")))
        return {}

    # ---------------------------------------------------------------- training
    @app.post(f"{api}/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        request_id, model_id = service.create_model(await _json(request))
        return {"request_id": request_id, "model_id": model_id}

    @app.post(f"{api}/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        return service.get_info(str((await _json(request)).get("model_id")))

    @app.post(f"{api}/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        raw = await request.body()
        if request.headers.get("content-encoding", "").lower() == "zstd":
            import zstandard

            try:
                raw = zstandard.ZstdDecompressor().decompress(raw)
            except zstandard.ZstdError as exc:
                raise UserError(f"forward_backward: the body is not valid zstd: {exc}") from exc
        call = decode_forward_backward(raw)
        request_id = training_ops.forward_backward(service, call, idem(request))
        return {"request_id": request_id, "model_id": call.model_id}

    @app.post(f"{api}/forward")
    async def forward(request: Request) -> dict[str, Any]:
        call = decode_forward_backward(await request.body())
        call.forward_only = True
        return {
            "request_id": training_ops.forward_backward(service, call, idem(request)),
            "model_id": call.model_id,
        }

    @app.post(f"{api}/optim_step")
    async def optim_step(request: Request) -> dict[str, Any]:
        body = await _json(request)
        return {
            "request_id": training_ops.optim_step(service, body, idem(request)),
            "model_id": body.get("model_id"),
        }

    @app.post(f"{api}/save_weights")
    async def save_weights(request: Request) -> dict[str, Any]:
        body = await _json(request)
        return {
            "request_id": training_ops.save_weights(service, body, idem(request)),
            "model_id": body.get("model_id"),
        }

    @app.post(f"{api}/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> dict[str, Any]:
        body = await _json(request)
        request_id = training_ops.save_weights_for_sampler(service, body, idem(request))
        return {"request_id": request_id, "model_id": body.get("model_id")}

    @app.post(f"{api}/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        request_id, model_id = training_ops.load_weights(service, await _json(request), idem(request))
        return {"request_id": request_id, "model_id": model_id}

    # ---------------------------------------------------------------- sampling
    @app.post(f"{api}/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        sampling_id = service.sampling.create_sampling_session(await _json(request))
        return {"type": "create_sampling_session", "sampling_session_id": sampling_id}

    @app.get(f"{api}/samplers/{{sampler_id}}")
    async def get_sampler(sampler_id: str) -> dict[str, Any]:
        return service.sampling.get_sampler(sampler_id)

    @app.post(f"{api}/asample")
    async def asample(request: Request) -> dict[str, Any]:
        request_id, sequence_ids = service.asample(await _json(request), idem(request))
        return {"request_id": request_id, "sample_sequence_ids": sequence_ids}

    # ---------------------------------------------------------------- futures
    @app.post(f"{api}/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        request_id = str((await _json(request)).get("request_id"))
        try:
            row = await service.hub.wait(request_id, config.long_poll_s)
        except KeyError:
            return _error(404, f"unknown request id {request_id!r}")
        if row is None:
            return JSONResponse(
                {"type": "try_again", "request_id": request_id, "queue_state": "active"}, status_code=408
            )
        if row.status == "pending":
            return JSONResponse(
                {"error": "request lost in a server restart; send it again", "category": "server"}
            )
        if row.status == "failed":
            return JSONResponse({"error": row.error, "category": row.category or "unknown"})
        return Response(content=row.result or b"{}", media_type=row.content_type or "application/json")

    @app.post(f"{api}/cancel_future")
    async def cancel_future() -> dict[str, Any]:
        return {}

    # ---------------------------------------------------------------- checkpoints out and in
    @app.post(f"{api}/save_weights_external")
    async def save_weights_external(request: Request) -> dict[str, Any]:
        body = await _json(request)
        request_id = checkpoints.save_weights_external(service, body, idem(request))
        return {"request_id": request_id, "model_id": body.get("model_id")}

    ckpt = f"{api}/training_runs/{{run_id}}/checkpoints/{{segment}}/{{name}}"

    @app.get(f"{ckpt}/external_weights_urls")
    async def external_weights_urls(run_id: str, segment: str, name: str, request: Request) -> dict[str, Any]:
        return checkpoints.external_weights_urls(service, run_id, f"{segment}/{name}", str(request.base_url))

    @app.get(checkpoints.SIGNED_PREFIX + "/{rest:path}")
    async def signed_download(
        rest: str, request: Request, expires: int = Query(...), sig: str = Query(...)
    ) -> Response:
        from fastapi.responses import FileResponse

        try:
            target = checkpoints.signed_file(service, request.url.path, expires, sig)
        except PermissionError as exc:
            return _error(403, str(exc))
        return FileResponse(target)

    @app.post(f"{ckpt}/publish")
    async def publish(run_id: str, segment: str, name: str) -> Response:
        checkpoints.set_public(service, run_id, f"{segment}/{name}", True)
        return Response(status_code=204)

    @app.delete(f"{ckpt}/publish")
    async def unpublish(run_id: str, segment: str, name: str) -> Response:
        checkpoints.set_public(service, run_id, f"{segment}/{name}", False)
        return Response(status_code=204)

    @app.put(f"{ckpt}/ttl")
    async def set_ttl(run_id: str, segment: str, name: str, request: Request) -> Response:
        checkpoints.set_ttl(service, run_id, f"{segment}/{name}", await _json(request))
        return Response(status_code=204)

    @app.post(f"{api}/weights_info")
    async def weights_info(request: Request) -> dict[str, Any]:
        return checkpoints.weights_info(service, str((await _json(request)).get("tinker_path")))

    @app.post(f"{api}/copy_weights")
    async def copy_weights(request: Request) -> dict[str, Any]:
        return checkpoints.copy_weights(service, await _json(request))

    @app.get(f"{api}/sessions")
    async def list_sessions(limit: int = Query(20, ge=1), offset: int = Query(0, ge=0)) -> dict[str, Any]:
        return checkpoints.list_sessions(service, limit, offset)

    @app.get(f"{api}/sessions/{{session_id}}")
    async def get_session(session_id: str) -> dict[str, Any]:
        return checkpoints.get_session(service, session_id)

    # ---------------------------------------------------------------- REST: runs and checkpoints
    @app.get(f"{api}/training_runs")
    async def list_training_runs(
        limit: int = Query(20, ge=1), offset: int = Query(0, ge=0)
    ) -> dict[str, Any]:
        return runs.list_training_runs(service, limit, offset)

    @app.get(f"{api}/training_runs/{{run_id}}")
    async def training_run(run_id: str) -> dict[str, Any]:
        return runs.training_run(service, run_id)

    @app.get(f"{api}/training_runs/{{run_id}}/checkpoints")
    async def list_checkpoints(run_id: str) -> dict[str, Any]:
        return runs.list_checkpoints(service, run_id)

    @app.delete(f"{api}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}")
    async def delete_checkpoint(run_id: str, checkpoint_id: str) -> dict[str, Any]:
        runs.delete_checkpoint(service, run_id, checkpoint_id)
        return {}

    @app.get(f"{api}/checkpoints")
    async def user_checkpoints(limit: int = Query(100, ge=1), offset: int = Query(0, ge=0)) -> dict[str, Any]:
        return runs.list_user_checkpoints(service, limit, offset)

    # ---------------------------------------------------------------- skylift extras
    @app.get("/skylift/status")
    async def status() -> dict[str, Any]:
        """Which engines and render servers started (tests check that training never starts an
        engine, and text-only training no render server) and loaded models."""
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
            "loaded_models": sorted(service.models),
            "renderers": [r.status() for r in service.render_hosts.hosts.values()],
            "snapshots": service.snapshots.stats(),
        }

    return app
