"""Sampling sessions, samples and the futures every operation answers through.

``retrieve_future`` long-polls, then answers HTTP 408 so the SDK polls again; 410 for a future
lost in a restart (the SDK resubmits the request); a failed operation is ``{"error",
"category"}`` with status 200.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from skylift.tinker.core import ownership
from skylift.tinker.core.bodies import RetrieveBody
from skylift.tinker.core.deps import Caller, IdemKey, OwnersDep, RequestsDep, app_part, operation, typed
from skylift.tinker.core.http_common import error_response
from skylift.tinker.sampling.bodies import CreateSamplingSessionBody, SampleBody
from skylift.tinker.sampling.service import SamplingService

router = APIRouter()
Sampling = Annotated[SamplingService, app_part("sampling")]


@router.post("/create_sampling_session")
async def create_sampling_session(
    sampling: Sampling,
    owners: OwnersDep,
    user: Caller,
    body: Annotated[CreateSamplingSessionBody, typed(CreateSamplingSessionBody)],
) -> dict[str, Any]:
    def create() -> str:
        owners.session(user, body.session_id)
        if body.model_path and not owners.may_read_path(user, body.model_path):
            raise ownership.missing_checkpoint(body.model_path, sampler=True)
        return sampling.create_sampling_session(body)

    sampling_id = await asyncio.to_thread(create)
    return {"type": "create_sampling_session", "sampling_session_id": sampling_id}


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, sampling: Sampling, owners: OwnersDep, user: Caller) -> dict[str, Any]:
    def get() -> dict[str, Any]:
        owners.sampler(user, sampler_id)
        return sampling.get_sampler(sampler_id)

    return await asyncio.to_thread(get)


@router.post("/asample")
async def asample(
    request: Request,
    sampling: Sampling,
    owners: OwnersDep,
    key: IdemKey,
    body: Annotated[SampleBody, typed(SampleBody)],
) -> dict[str, Any]:
    def refuse(user: str) -> Exception | None:
        sampling_id = body.sampling_session_id
        if sampling_id and not owners.may_use_sampler(user, sampling_id):
            return ownership.unknown_sampling_session(sampling_id)
        if not sampling_id and body.model_path and not owners.may_read_path(user, body.model_path):
            return ownership.missing_checkpoint(body.model_path, sampler=True)
        return None

    async def run() -> dict[str, Any]:
        request_id, sequence_ids = await sampling.asample(body, key)
        return {"request_id": request_id, "sample_sequence_ids": sequence_ids}

    result = await operation(request, "sample", refuse, run)
    result.setdefault("sample_sequence_ids", [])
    return result


@router.post("/retrieve_future")
async def retrieve_future(
    requests: RequestsDep, user: Caller, body: Annotated[RetrieveBody, typed(RetrieveBody)]
) -> Response:
    request_id = body.request_id
    try:
        outcome = await requests.hub.wait(request_id, requests.config.long_poll_s, user=user)
    except KeyError:  # unknown, pruned or another user's
        return error_response(404, f"unknown request id {request_id!r}")
    if outcome is None:
        return JSONResponse(
            {"type": "try_again", "request_id": request_id, "queue_state": "active"}, status_code=408
        )
    if outcome.status == "lost":  # the SDK resubmits the original request on 410
        return error_response(
            410, f"request {request_id} was lost in a server restart; send it again", "server"
        )
    if outcome.status == "failed":
        return JSONResponse({"error": outcome.error, "category": outcome.category or "unknown"})
    return Response(content=outcome.result or b"{}", media_type=outcome.content_type or "application/json")


@router.post("/cancel_future")
async def cancel_future() -> dict[str, Any]:
    return {}
