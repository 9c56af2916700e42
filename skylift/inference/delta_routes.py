"""The server's checkpoint-delta weight sync routes (``weight_sync_backend=delta``; see
`skylift.inference.delta_engine`). Bodies: `{"version", "sync_dir", "local_checkpoint_dir"?}`.

- POST `/skylift/delta/fetch`: bring this host's store to `version` (the server keeps generating);
- POST `/skylift/delta/load`: the same, then load the tensors that changed since the version the
  engine holds and reset the prefix cache (the driver pauses generation around it when requests
  are in flight: `/skylift/pause`, `/skylift/resume`).

400: a body that is not one of these, a sync_dir that is neither a directory on this host nor a
gs:// or s3:// URI, a corrupt payload (named); 404: a version never published; 409: a store that
cannot reach the version (a bucket this host cannot read among the reasons). The engine keeps
serving with the weights it had.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI, Request

from skylift.inference.bodies import DeltaSyncBody
from skylift.inference.engine_http import engine_call
from skylift.inference.routes import SkyliftState
from skylift.weight_sync.protocol import DeltaSyncRequest

router = APIRouter()


def _state(request: Request) -> SkyliftState:
    return request.app.state.skylift


def _request(body: DeltaSyncBody) -> DeltaSyncRequest:
    return DeltaSyncRequest(body.version, body.sync_dir, body.local_checkpoint_dir, body.download_workers)


@router.post("/skylift/delta/fetch")
async def fetch_delta(body: DeltaSyncBody, request: Request) -> dict[str, Any]:
    """Apply published versions up to `version` to this host's store."""
    return await engine_call(_state(request).engine.fetch_delta(_request(body)))


@router.post("/skylift/delta/load")
async def load_delta(body: DeltaSyncBody, request: Request) -> dict[str, Any]:
    """Apply, then load what changed into the engine and reset its prefix cache."""
    return await engine_call(_state(request).engine.load_delta(_request(body)))


def install(app: FastAPI) -> None:
    """Attach these routes ahead of vLLM's own (the API-key check covers them: it wraps the app)."""
    before = len(app.router.routes)
    app.include_router(router)
    ours = app.router.routes[before:]
    del app.router.routes[before:]
    app.router.routes[0:0] = ours
