"""REST views of sessions, training runs and checkpoints (what `tinker.RestClient` and the
`tinker` CLI list and delete): `RunViews`, over the store (blocking: the routes call it in a thread)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from skylift.tinker.checkpoints.operations import CheckpointOperations
from skylift.tinker.errors import NotFoundError
from skylift.tinker.storage.store import ModelRow, SamplingSessionRow, SessionRow, Store
from skylift.tinker.storage.views import SEGMENT_KIND, checkpoint_json, tinker_path, training_run_json


class RunViews:
    """Pages and records of sessions, training runs and checkpoints; checkpoint deletion."""

    def __init__(self, store: Store, checkpoints: CheckpointOperations) -> None:
        self.store, self.checkpoints = store, checkpoints

    # ---------------------------------------------------------------- sessions
    def list_sessions(self, limit: int, offset: int, owner: str | None = None) -> dict[str, Any]:
        """A page of session ids, newest first (`owner`'s only, when given)."""
        with self.store.tx() as s:
            q = select(SessionRow.id).order_by(SessionRow.created_at.desc())
            if owner is not None:
                q = q.where(SessionRow.owner == owner)
            return {"sessions": list(s.scalars(q.limit(limit).offset(offset)))}

    def get_session(self, session_id: str) -> dict[str, Any]:
        row = self.store.require(SessionRow, session_id, "session")
        with self.store.tx() as s:
            q = select(SamplingSessionRow.id).where(SamplingSessionRow.session_id == session_id)
            sampler_ids = list(s.scalars(q))
        return {
            "training_run_ids": [m.model_id for m in self.store.models_of_session(session_id)],
            "sampler_ids": sampler_ids,
            "user_metadata": {str(k): str(v) for k, v in (row.user_metadata or {}).items()} or None,
        }

    # ---------------------------------------------------------------- training runs
    def _model(self, run_id: str) -> ModelRow:
        return self.store.require(ModelRow, run_id, "training run")

    def training_run(self, run_id: str) -> dict[str, Any]:
        return training_run_json(self._model(run_id), self.store.checkpoints(run_id))

    def list_training_runs(self, limit: int, offset: int, owner: str | None = None) -> dict[str, Any]:
        """A page of training runs (`owner`'s only, when given)."""
        rows, total = self.store.list_models(limit, offset, owner=owner)
        runs = [training_run_json(r, self.store.checkpoints(r.model_id)) for r in rows]
        return {"training_runs": runs, "cursor": {"offset": offset, "limit": limit, "total_count": total}}

    # ---------------------------------------------------------------- checkpoints
    def list_checkpoints(self, run_id: str) -> dict[str, Any]:
        self._model(run_id)
        rows = self.store.checkpoints(run_id)
        return {"checkpoints": [checkpoint_json(r) for r in rows]}

    def list_user_checkpoints(self, limit: int, offset: int, owner: str | None = None) -> dict[str, Any]:
        """A page of checkpoints (of `owner`'s training runs only, when given)."""
        rows = self.store.checkpoints(owner=owner)
        page = rows[offset : offset + limit]
        return {
            "checkpoints": [checkpoint_json(r) for r in page],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(rows)},
        }

    def delete_checkpoint(self, run_id: str, checkpoint_id: str) -> None:
        """Delete `weights/<name>`, `sampler_weights/<name>` or `external_weights/<name>` of a run."""
        kind_segment, _, name = checkpoint_id.partition("/")
        kind = SEGMENT_KIND.get(kind_segment)
        if kind is None or not name:
            raise NotFoundError(
                f"invalid checkpoint id {checkpoint_id!r}: expected weights/<name>, sampler_weights/<name> "
                "or external_weights/<name>"
            )
        path = tinker_path(run_id, kind, name)
        if self.checkpoints.delete_checkpoint(path) is None:
            raise NotFoundError(f"checkpoint {path} does not exist")
