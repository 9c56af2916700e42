"""REST views of training runs and checkpoints, and skylift's own status route."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter

from skylift.tinker.core import ownership
from skylift.tinker.core.deps import Caller, OwnersDep, Service
from skylift.tinker.core.http_common import add_owned_route, add_page_route
from skylift.tinker.core.ownership import Owners
from skylift.tinker.sessions import runs

router = APIRouter()
extras = APIRouter()  # under /skylift

add_page_route(router, "/training_runs", runs.list_training_runs)
add_owned_route(router, "/training_runs/{key}", Owners.run, runs.training_run)
add_owned_route(router, "/training_runs/{key}/checkpoints", Owners.run, runs.list_checkpoints)
add_page_route(router, "/checkpoints", runs.list_user_checkpoints, default_limit=100)


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
async def delete_checkpoint(
    run_id: str, checkpoint_id: str, service: Service, owners: OwnersDep, user: Caller
) -> dict[str, Any]:
    def delete() -> None:
        segment, _, name = checkpoint_id.partition("/")
        valid = segment in ("weights", "sampler_weights", "external_weights") and bool(name)
        if valid and not owners.owns_model(user, run_id):
            raise ownership.missing_checkpoint(f"tinker://{run_id}/{segment}/{name}")
        runs.delete_checkpoint(service, run_id, checkpoint_id)

    await asyncio.to_thread(delete)
    return {}


@extras.get("/status")
async def status(service: Service, owners: OwnersDep, user: Caller) -> dict[str, Any]:
    """Which engines and render servers started (tests check that training never starts an
    engine, and text-only training no render server) and the caller's loaded models."""
    loaded = list(service.models)
    mine = await asyncio.to_thread(lambda: sorted(m for m in loaded if owners.owns_model(user, m)))
    engines = service.sampling.engines.values()
    return {
        "engines": [
            {
                "base_model": h.base_model,
                "started": h.started,
                "start_attempts": h.start_attempts,
                "last_error": h.last_error,
            }
            for h in engines
        ],
        "engine_start_attempts": sum(h.start_attempts for h in engines),
        "loaded_models": mine,
        "renderers": [r.status() for r in service.render_hosts.hosts.values()],
        "snapshots": service.snapshots.stats(),
    }
