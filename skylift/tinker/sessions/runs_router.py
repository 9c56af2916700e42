"""REST views of training runs and checkpoints, and skylift's own status route."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter

from skylift.tinker.core import ownership
from skylift.tinker.core.deps import Caller, OwnersDep, app_part
from skylift.tinker.core.http_common import add_owned_route, add_page_route
from skylift.tinker.core.ownership import Owners
from skylift.tinker.sessions.runs import RunViews
from skylift.tinker.sessions.stats import ServerStats

router = APIRouter()
extras = APIRouter()  # under /skylift

Runs = Annotated[RunViews, app_part("runs")]
Stats = Annotated[ServerStats, app_part("stats")]

add_page_route(router, "/sessions", "runs", RunViews.list_sessions)
add_owned_route(router, "/sessions/{key}", Owners.session, "runs", RunViews.get_session)
add_page_route(router, "/training_runs", "runs", RunViews.list_training_runs)
add_owned_route(router, "/training_runs/{key}", Owners.run, "runs", RunViews.training_run)
add_owned_route(router, "/training_runs/{key}/checkpoints", Owners.run, "runs", RunViews.list_checkpoints)
add_page_route(router, "/checkpoints", "runs", RunViews.list_user_checkpoints, default_limit=100)


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
async def delete_checkpoint(
    run_id: str, checkpoint_id: str, runs: Runs, owners: OwnersDep, user: Caller
) -> dict[str, Any]:
    def delete() -> None:
        segment, _, name = checkpoint_id.partition("/")
        valid = segment in ("weights", "sampler_weights", "external_weights") and bool(name)
        if valid and not owners.owns_model(user, run_id):
            raise ownership.missing_checkpoint(f"tinker://{run_id}/{segment}/{name}")
        runs.delete_checkpoint(run_id, checkpoint_id)

    await asyncio.to_thread(delete)
    return {}


@extras.get("/status")
async def status(stats: Stats, owners: OwnersDep, user: Caller) -> dict[str, Any]:
    """Which engines and render servers started and the caller's loaded models (`ServerStats.status`)."""
    return await asyncio.to_thread(
        stats.status, lambda ids: sorted(m for m in ids if owners.owns_model(user, m))
    )
