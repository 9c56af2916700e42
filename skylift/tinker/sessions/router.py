"""Client configuration, health, capabilities and sessions."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from skylift.tinker.core.base_models import BaseModels
from skylift.tinker.core.deps import Caller, OwnersDep, app_part, typed
from skylift.tinker.core.http_common import error_response
from skylift.tinker.sessions.bodies import CreateSessionBody, FinishSessionBody, HeartbeatBody
from skylift.tinker.sessions.operations import SessionOperations
from skylift.tinker.sessions.stats import ServerStats

router = APIRouter()
Sessions = Annotated[SessionOperations, app_part("sessions")]
Stats = Annotated[ServerStats, app_part("stats")]
Bases = Annotated[BaseModels, app_part("base_models")]

CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "use_pyqwest_transport": False,
    "parallel_fwdbwd_chunks": True,
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,
    "sample_join_sampling_session": False,
    "custom_loss_server_side": False,
}


@router.post("/client/config")
async def client_config() -> dict[str, Any]:
    return CLIENT_CONFIG


@router.post("/client/dynamic_config")
async def client_dynamic_config() -> dict[str, Any]:
    return {}


@router.post("/telemetry")
async def telemetry() -> dict[str, Any]:
    return {"status": "accepted"}


@router.get("/healthz")
async def healthz() -> dict[str, Any]:
    return {"status": "ok"}


@router.get("/get_server_capabilities")
async def capabilities(base_models: Bases) -> dict[str, Any]:
    models = [
        {"model_name": b.name, "max_context_length": b.max_model_len, "trainable": True, "sampleable": True}
        for b in base_models
    ]
    return {"supported_models": models}


@router.get("/server_stats")
async def stats(stats: Stats, user: Caller) -> dict[str, Any]:
    """Resident base models, training clients and adapters (totals; the caller's own under
    "you"), memory budget and use, slots in use, loads, evictions, refusals."""
    return stats.server_stats(user)


@router.post("/create_session")
async def create_session(
    sessions: Sessions, user: Caller, body: Annotated[CreateSessionBody, typed(CreateSessionBody)]
) -> dict[str, Any]:
    return {
        "type": "create_session",
        "session_id": await asyncio.to_thread(sessions.create_session, body, user),
    }


@router.post("/session_heartbeat")
async def session_heartbeat(
    sessions: Sessions, owners: OwnersDep, user: Caller, body: Annotated[HeartbeatBody, typed(HeartbeatBody)]
) -> Response:
    def beat() -> bool:
        owners.session(user, body.session_id)
        return sessions.heartbeat(body.session_id)

    if not await asyncio.to_thread(beat):
        return error_response(410, f"session {body.session_id} is finished")
    return JSONResponse({"type": "session_heartbeat"})


@router.post("/sessions/{session_id}/finish")
async def finish_session(
    session_id: str,
    sessions: Sessions,
    owners: OwnersDep,
    user: Caller,
    body: Annotated[FinishSessionBody, typed(FinishSessionBody)],
) -> dict[str, Any]:
    await asyncio.to_thread(owners.session, user, session_id)
    await sessions.finish_session(session_id, body.reason.type if body.reason else "success")
    return {}
