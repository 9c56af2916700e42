"""The server's checkpoint-delta weight sync routes (``weight_sync_backend=delta``; see
`skylift.weight_sync.delta.engine`; shims onto its `weight_call`). Bodies: `{"version",
"sync_dir", "local_checkpoint_dir"?}`.

- POST `/skylift/delta/fetch`: bring this host's store to `version` (the server keeps generating);
- POST `/skylift/delta/load`: the same, then load the tensors that changed since the version the
  engine holds and reset the prefix cache (the driver pauses generation around it when requests
  are in flight: `/skylift/pause`, `/skylift/resume`).

``sync_dir`` and ``local_checkpoint_dir`` must lie under a root the server was started with
(``--delta-sync-root``, `skylift.inference.allowed_paths`): 403 otherwise, naming the roots, before
anything is opened. 400: a body that is not one of these, a path no file system could hold, a
sync_dir that is neither a directory on this host nor a gs:// or s3:// URI, a corrupt payload
(named); 404: a version never published; 409: a store that
cannot reach the version (a bucket this host cannot read among the reasons). The engine keeps
serving with the weights it had.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI, HTTPException, Request

from skylift.inference.allowed_paths import PathNotAllowed
from skylift.inference.bodies import DeltaSyncBody
from skylift.inference.engine_http import engine_call
from skylift.inference.routes import SkyliftState
from skylift.weight_sync.protocol import DeltaSyncRequest

router = APIRouter()


def _state(request: Request) -> SkyliftState:
    return request.app.state.skylift


def _request(body: DeltaSyncBody, request: Request) -> DeltaSyncRequest:
    """The engine's request, its paths checked against the server's roots (403/400 otherwise)."""
    roots = _state(request).delta_roots
    try:
        sync_dir = roots.check("sync_dir", body.sync_dir)
        store = body.local_checkpoint_dir
        store = roots.check("local_checkpoint_dir", store) if store is not None else None
    except PathNotAllowed as exc:
        raise HTTPException(status_code=exc.status, detail=str(exc)) from exc
    return DeltaSyncRequest(body.version, sync_dir, store, body.download_workers)


@router.post("/skylift/delta/fetch")
async def fetch_delta(body: DeltaSyncBody, request: Request) -> dict[str, Any]:
    """Apply published versions up to `version` to this host's store."""
    return await engine_call(
        _state(request).engine.weight_call("delta", "fetch", _request(body, request).to_dict())
    )


@router.post("/skylift/delta/load")
async def load_delta(body: DeltaSyncBody, request: Request) -> dict[str, Any]:
    """Apply, then load what changed into the engine and reset its prefix cache."""
    return await engine_call(
        _state(request).engine.weight_call("delta", "load", _request(body, request).to_dict())
    )


def install(app: FastAPI) -> None:
    """Attach these routes ahead of vLLM's own (the API-key check covers them: it wraps the app)."""
    before = len(app.router.routes)
    app.include_router(router)
    ours = app.router.routes[before:]
    del app.router.routes[before:]
    app.router.routes[0:0] = ours
