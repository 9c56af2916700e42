"""REST views of training runs and checkpoints (what `tinker.RestClient` lists and deletes)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from skylift.tinker.core.errors import NotFoundError
from skylift.tinker.storage.store import ModelRow
from skylift.tinker.storage.views import SEGMENT_KIND, checkpoint_json, tinker_path, training_run_json

if TYPE_CHECKING:
    from skylift.tinker.service import TinkerService


def _model(svc: TinkerService, run_id: str) -> ModelRow:
    return svc.store.require(ModelRow, run_id, "training run")


def training_run(svc: TinkerService, run_id: str) -> dict[str, Any]:
    return training_run_json(_model(svc, run_id), svc.store.checkpoints(run_id))


def list_training_runs(
    svc: TinkerService, limit: int, offset: int, owner: str | None = None
) -> dict[str, Any]:
    """A page of training runs (`owner`'s only, when given)."""
    rows, total = svc.store.list_models(limit, offset, owner=owner)
    runs = [training_run_json(r, svc.store.checkpoints(r.model_id)) for r in rows]
    return {"training_runs": runs, "cursor": {"offset": offset, "limit": limit, "total_count": total}}


def list_checkpoints(svc: TinkerService, run_id: str) -> dict[str, Any]:
    _model(svc, run_id)
    rows = svc.store.checkpoints(run_id)
    return {"checkpoints": [checkpoint_json(r) for r in rows]}


def list_user_checkpoints(
    svc: TinkerService, limit: int, offset: int, owner: str | None = None
) -> dict[str, Any]:
    """A page of checkpoints (of `owner`'s training runs only, when given)."""
    rows = svc.store.checkpoints(owner=owner)
    page = rows[offset : offset + limit]
    return {
        "checkpoints": [checkpoint_json(r) for r in page],
        "cursor": {"offset": offset, "limit": limit, "total_count": len(rows)},
    }


def delete_checkpoint(svc: TinkerService, run_id: str, checkpoint_id: str) -> None:
    """Delete `weights/<name>`, `sampler_weights/<name>` or `external_weights/<name>` of a run."""
    kind_segment, _, name = checkpoint_id.partition("/")
    kind = SEGMENT_KIND.get(kind_segment)
    if kind is None or not name:
        raise NotFoundError(
            f"invalid checkpoint id {checkpoint_id!r}: expected weights/<name>, sampler_weights/<name> "
            "or external_weights/<name>"
        )
    path = tinker_path(run_id, kind, name)
    if svc.delete_checkpoint(path) is None:
        raise NotFoundError(f"checkpoint {path} does not exist")
