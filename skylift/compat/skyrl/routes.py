"""vLLM's RL routes on `skylift serve`, as the newest SkyRL client (`skyrl` 0.4,
`RemoteInferenceClient` and `SkyrlWeightSyncClient`) drives them.

vLLM defines these in `vllm.entrypoints.rl.online` and `...serve.dev.sleep` but only mounts them
in its dev mode (`VLLM_SERVER_DEV_MODE=1`), which also opens `/collective_rpc` (any worker method,
any argument). skylift mounts the control routes alone, with vLLM's own handlers:
- POST `/pause` (`?mode=abort|wait|keep&clear_cache=...`), POST `/resume`, GET `/is_paused`;
- GET `/get_world_size` (`?include_dp=`), GET `/is_sleeping`.

vLLM's weight-transfer lifecycle (`/init_weight_transfer_engine`, `/start_weight_update`,
`/update_weights` with an `update_info` body, `/finish_weight_update`, ...) runs through the
transfer engines registered in vLLM's `WeightTransferEngineFactory`; all of them (nccl, ipc,
sparse_nccl, sharded_rdt, nccl_m2n) need a GPU. On a GPU these routes go to vLLM (start the
server with `--weight-transfer-config`); on CPU they answer 501 and name the path that works
there: skylift's (or SkyRL 0.3's) broadcast over a gloo group. `/update_weights` itself is
skylift's route (`routes.py`), which hands bodies with `update_info` to `weight_transfer_update`.

Also here: SkyRL's ``--worker-extension-cls skyrl_train....WorkerWrap`` (the seed's server command)
is replaced by skylift's receiver with one warning (`skyrl_worker_wrap`).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, FastAPI, HTTPException, Request

from skylift.inference.route_plugins import ROUTES, WEIGHT_TRANSFER, WORKER_EXTENSIONS

#: What a CPU server says instead of vLLM's GPU-only weight transfer.
GLOO_PATH = (
    "vLLM's weight-transfer engines (nccl, ipc, sparse_nccl, sharded_rdt, nccl_m2n) need a GPU; on "
    "CPU use the gloo broadcast path: POST /init_weight_update_communicator (backend 'gloo'; "
    "SkyRL's BroadcastInitInfo fields work) while the trainer joins the group, then "
    "POST /update_weights with names/dtypes/shapes while it broadcasts, and "
    "POST /destroy_weights_update_group (SkyRL 0.3's RemoteInferenceEngine speaks this protocol)"
)

router = APIRouter()


def _vllm_routes() -> dict[tuple[str, str], Any]:
    """vLLM's handlers for the control routes we mount: (method, path) -> endpoint."""
    from vllm.entrypoints.rl.online import api_router as rl
    from vllm.entrypoints.serve.dev.sleep import api_router as sleep

    return {
        ("POST", "/pause"): rl.pause_generation,
        ("POST", "/resume"): rl.resume_generation,
        ("GET", "/is_paused"): rl.is_paused,
        ("GET", "/get_world_size"): rl.get_world_size,
        ("GET", "/is_sleeping"): sleep.is_sleeping,
    }


def _on_cpu(request: Request) -> bool:
    state = getattr(request.app.state, "skylift", None)
    return getattr(state, "platform", "cpu") == "cpu"


def _refuse_on_cpu(request: Request, route: str) -> None:
    if _on_cpu(request):
        raise HTTPException(int(HTTPStatus.NOT_IMPLEMENTED), f"{route} is not available on CPU: {GLOO_PATH}")


async def json_object(request: Request, empty: dict[str, Any] | None = None) -> dict[str, Any]:
    """The request's JSON body, which must be an object (400 otherwise); an empty body is `empty`
    when given, else a 400."""
    raw = await request.body()
    if not raw.strip() and empty is not None:
        return empty
    try:
        data = json.loads(raw) if raw.strip() else None
    except ValueError as e:
        raise HTTPException(int(HTTPStatus.BAD_REQUEST), f"{request.url.path}: body is not JSON: {e}") from e
    if not isinstance(data, dict):
        raise HTTPException(
            int(HTTPStatus.BAD_REQUEST), f"{request.url.path}: the body must be a JSON object"
        )
    return data


def _engine(request: Request) -> Any:
    return request.app.state.engine_client


@router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(request: Request) -> dict[str, Any]:
    """vLLM's transfer-engine init (`{"init_info": {...}}`); 501 on CPU."""
    _refuse_on_cpu(request, "/init_weight_transfer_engine")
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

    body = await json_object(request, empty={})
    if not isinstance(body.get("init_info"), dict):
        raise HTTPException(int(HTTPStatus.BAD_REQUEST), "init_info (an object) is required")
    await _engine(request).init_weight_transfer_engine(WeightTransferInitRequest(init_info=body["init_info"]))
    return {"message": "Weight transfer initialized"}


@router.post("/finish_weight_update")
async def finish_weight_update(request: Request) -> dict[str, Any]:
    _refuse_on_cpu(request, "/finish_weight_update")
    version = (await json_object(request, empty={})).get("weight_version")
    if version is not None and not isinstance(version, str):
        raise HTTPException(int(HTTPStatus.BAD_REQUEST), "weight_version must be a string")
    await _engine(request).finish_weight_update(version)
    return {"message": "Weight update finished"}


def _engine_step_route(name: str, message: str) -> Callable[[Request], Awaitable[dict[str, Any]]]:
    """The route ``/name`` of vLLM's weight-transfer protocol that takes no body: the engine
    client's method of that name, answered with `message`; 501 on CPU."""

    async def route(request: Request) -> dict[str, Any]:
        _refuse_on_cpu(request, f"/{name}")
        await getattr(_engine(request), name)()
        return {"message": message}

    route.__name__ = route.__qualname__ = name
    return route


for _name, _message in (
    ("start_weight_update", "Weight update started"),
    ("start_draft_weight_update", "Draft weight update started"),
    ("shutdown_weight_transfer_engine", "Weight transfer shut down"),
):
    router.post(f"/{_name}")(_engine_step_route(_name, _message))


@WEIGHT_TRANSFER.register
async def weight_transfer_update(request: Request, body: dict[str, Any]) -> dict[str, Any]:
    """POST /update_weights with `{"update_info": {...}}`: vLLM's transfer engine; 501 on CPU."""
    _refuse_on_cpu(request, "/update_weights with update_info (vLLM's weight-transfer protocol)")
    from pydantic import TypeAdapter, ValidationError
    from vllm.distributed.weight_transfer.base import WeightTransferUpdatePayload, WeightTransferUpdateRequest

    try:
        info = TypeAdapter(WeightTransferUpdatePayload).validate_python(body["update_info"])
    except ValidationError as e:
        raise HTTPException(int(HTTPStatus.BAD_REQUEST), f"invalid update_info: {e}") from e
    await _engine(request).update_weights(request=WeightTransferUpdateRequest(update_info=info))
    return {"message": "Weights updated"}


@ROUTES.register
def install(app: FastAPI) -> None:
    """Mount vLLM's control routes (unless vLLM mounted them itself, in dev mode) and the
    weight-transfer routes above."""
    present = {(m, getattr(r, "path", "")) for r in app.router.routes for m in getattr(r, "methods", ())}
    control = APIRouter()
    for (method, path), endpoint in _vllm_routes().items():
        if (method, path) not in present:
            control.add_api_route(path, endpoint, methods=[method])
    app.include_router(control)
    app.include_router(router)


@WORKER_EXTENSIONS.register
def skyrl_worker_wrap(requested: str) -> str | None:
    """SkyRL's receiver (``skyrl_train....WorkerWrap``, which the seed's server command names) is
    replaced by skylift's: it speaks SkyRL's weight-update protocol."""
    if requested.split(".")[0] in ("skyrl_train", "skyrl"):
        return "skylift's weight receiver speaks SkyRL's weight-update protocol"
    return None
