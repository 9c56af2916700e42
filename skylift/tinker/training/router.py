"""Training operations: models, forward(/backward), optimizer steps, saving and loading weights.

Each answers ``{"request_id", "model_id"}`` at once; the result comes from ``retrieve_future``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Annotated, Any

from fastapi import APIRouter, Request

from skylift.tinker.core import ownership
from skylift.tinker.core.deps import (
    Caller,
    IdemKey,
    OwnersDep,
    app_part,
    model_op,
    model_refusal,
    operation,
    session_refusal,
    typed,
)
from skylift.tinker.core.limits import read_payload
from skylift.tinker.core.ownership import Owners
from skylift.tinker.core.wire import WireLimits, decode_forward_backward
from skylift.tinker.training.bodies import (
    CreateModelBody,
    GetInfoBody,
    LoadWeightsBody,
    OptimStepBody,
    SaveWeightsBody,
    SaveWeightsForSamplerBody,
)
from skylift.tinker.training.operations import TrainingOperations

router = APIRouter()
Training = Annotated[TrainingOperations, app_part("training")]


@router.post("/create_model")
async def create_model(
    request: Request,
    training: Training,
    owners: OwnersDep,
    body: Annotated[CreateModelBody, typed(CreateModelBody)],
) -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        request_id, model_id = await training.create_model(body)
        return {"request_id": request_id, "model_id": model_id}

    return await operation(request, "create_model", session_refusal(owners, body.session_id), run)


@router.post("/get_info")
async def get_info(
    training: Training, owners: OwnersDep, user: Caller, body: Annotated[GetInfoBody, typed(GetInfoBody)]
) -> dict[str, Any]:
    def info() -> dict[str, Any]:
        owners.model(user, body.model_id)
        return training.get_info(body.model_id)

    return await asyncio.to_thread(info)


async def _model_operation(
    request: Request, owners: Owners, kind: str, model_id: str, submit: Callable[[], Awaitable[str]]
) -> dict[str, Any]:
    """Submit operation `kind` on model `model_id` for the calling user, who must own it (else an
    unknown-model error as a failed future): ``{"model_id", "request_id"}``."""

    async def run() -> dict[str, Any]:
        return {"request_id": await submit()}

    result = await operation(request, kind, model_refusal(owners, model_id), run)
    return {"model_id": model_id, **result}


def wire_limits(request: Request, training: Training) -> WireLimits:
    cells = request.app.state.limits.max_cells
    return WireLimits(max_tokens=max(b.max_model_len for b in training.base_models), max_cells=cells)


async def _forward(
    request: Request, training: Training, owners: OwnersDep, kind: str, key: str | None
) -> Any:
    """Decode the protobuf body (size-limited, zstd allowed) in a worker thread with the server's
    shape limits, then submit it."""
    raw = await read_payload(request)
    call = await asyncio.to_thread(decode_forward_backward, raw, wire_limits(request, training))
    call.forward_only = kind == "forward"

    submit = partial(training.forward_backward, call, key)
    return await _model_operation(request, owners, kind, call.model_id, submit)


@router.post("/forward_backward")
async def forward_backward(request: Request, training: Training, owners: OwnersDep, key: IdemKey) -> Any:
    return await _forward(request, training, owners, "forward_backward", key)


@router.post("/forward")
async def forward(request: Request, training: Training, owners: OwnersDep, key: IdemKey) -> Any:
    return await _forward(request, training, owners, "forward", key)


def _body_model_route(kind: str, body_type: type[Any]) -> Callable[..., Awaitable[dict[str, Any]]]:
    """The route of the model operation `kind`: its body (a `body_type`) goes to the training
    operations' method of that name, with the idempotency key."""

    async def route(
        request: Request, training: Training, owners: OwnersDep, key: IdemKey, body: Any
    ) -> dict[str, Any]:
        submit = partial(getattr(training, kind), body, key)
        return await _model_operation(request, owners, kind, body.model_id, submit)

    route.__name__ = route.__qualname__ = kind
    # FastAPI reads the parameters' types off the annotations: the body's is this route's own
    route.__annotations__ = {
        "request": Request,
        "training": Training,
        "owners": OwnersDep,
        "key": IdemKey,
        "body": Annotated[body_type, model_op(body_type, kind)],
        "return": dict[str, Any],
    }
    return route


for _kind, _body_type in (
    ("optim_step", OptimStepBody),
    ("save_weights", SaveWeightsBody),
    ("save_weights_for_sampler", SaveWeightsForSamplerBody),
):
    router.post(f"/{_kind}")(_body_model_route(_kind, _body_type))


@router.post("/load_weights")
async def load_weights(
    request: Request,
    training: Training,
    owners: OwnersDep,
    key: IdemKey,
    body: Annotated[LoadWeightsBody, typed(LoadWeightsBody)],
) -> dict[str, Any]:
    def refuse(user: str) -> Exception | None:
        if body.session_id is None:
            if not owners.owns_model(user, body.model_id):
                return ownership.unknown_model(body.model_id)
        elif not owners.owns_session(user, body.session_id):
            return ownership.unknown_session(body.session_id)
        if not owners.may_read_path(user, body.path):
            return ownership.missing_checkpoint(body.path)
        return None

    async def run() -> dict[str, Any]:
        request_id, model_id = await training.load_weights(body, key)
        return {"request_id": request_id, "model_id": model_id}

    return await operation(request, "load_weights", refuse, run)
