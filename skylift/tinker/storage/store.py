"""Durable records of the Tinker service (SQLAlchemy; SQLite by default, any SQLAlchemy URL works).

Sessions, training models, futures (with their results), sampling sessions and checkpoints live
here, so a restarted server on the same database and data directory still knows every model and
checkpoint. The tables are in `skylift.tinker.storage.db.models` (re-exported here); opening a `Store`
upgrades the schema with the Alembic migrations (`skylift.tinker.storage.db.migrate`). Ownership: a
session's `owner` owns its models, samplers and checkpoints (`*_owner` look-ups below). Every
method is blocking; the service calls them off the event loop (`asyncio.to_thread`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from sqlalchemy import create_engine, delete, event, func, select, update
from sqlalchemy.orm import Session, sessionmaker

from skylift.tinker.errors import missing_checkpoint, unknown
from skylift.tinker.storage.db.migrate import upgrade
from skylift.tinker.storage.db.models import (
    Base,
    CheckpointRow,
    FutureRow,
    ModelRow,
    SamplingSessionRow,
    SessionRow,
    utcnow,
)

__all__ = [
    "Base",
    "CheckpointRow",
    "FutureRow",
    "ModelRow",
    "SamplingSessionRow",
    "SessionRow",
    "Store",
    "utcnow",
]

R = TypeVar("R")


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")  # readers never wait for the writer
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


class Store:
    """Typed access to the tables; every method is one short transaction."""

    def __init__(self, url: str) -> None:
        kwargs: dict[str, Any] = {"pool_pre_ping": True}
        sqlite = url.startswith("sqlite")
        if sqlite:
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
        else:
            kwargs.update(pool_size=10, max_overflow=20)
        self.url = url
        self.engine = create_engine(url, **kwargs)
        if sqlite and ":memory:" not in url:
            event.listen(self.engine, "connect", _sqlite_pragmas)
        self.revision = upgrade(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @contextmanager
    def tx(self) -> Iterator[Session]:
        with self._sessions() as s, s.begin():
            yield s

    def close(self) -> None:
        self.engine.dispose()

    # ---------------------------------------------------------------- generic
    def add(self, row: Base) -> None:
        with self.tx() as s:
            s.add(row)

    def get(self, cls: type, key: Any) -> Any:
        with self.tx() as s:
            return s.get(cls, key)

    def require(self, cls: type[R], key: Any, what: str) -> R:
        """The row of `cls` with primary key `key`; `NotFoundError` "unknown <what> <key>" if none."""
        row = self.get(cls, key)
        if row is None:
            raise unknown(what, key)
        return row  # type: ignore[no-any-return]

    def update(self, cls: type, key: Any, **values: Any) -> None:
        with self.tx() as s:
            row = s.get(cls, key)
            if row is not None:
                for k, v in values.items():
                    setattr(row, k, v)

    # ---------------------------------------------------------------- sessions
    def stale_sessions(self, older_than: dt.datetime) -> list[SessionRow]:
        with self.tx() as s:
            q = select(SessionRow).where(
                SessionRow.finished_at.is_(None), SessionRow.last_heartbeat < older_than
            )
            return list(s.scalars(q))

    # ---------------------------------------------------------------- owners
    def set_session_owner(self, session_id: str, owner: str) -> None:
        with self.tx() as s:
            s.execute(update(SessionRow).where(SessionRow.id == session_id).values(owner=owner))

    def session_owner(self, session_id: str) -> str | None:
        with self.tx() as s:
            return s.scalar(select(SessionRow.owner).where(SessionRow.id == session_id))

    def model_owner(self, model_id: str) -> str | None:
        """The owner of a training model (its session's owner); None for an unknown model."""
        with self.tx() as s:
            q = select(SessionRow.owner).join(ModelRow, ModelRow.session_id == SessionRow.id)
            return s.scalar(q.where(ModelRow.model_id == model_id))

    def sampler_owner(self, sampler_id: str) -> str | None:
        with self.tx() as s:
            q = select(SessionRow.owner).join(
                SamplingSessionRow, SamplingSessionRow.session_id == SessionRow.id
            )
            return s.scalar(q.where(SamplingSessionRow.id == sampler_id))

    # ---------------------------------------------------------------- models
    def list_models(self, limit: int, offset: int, owner: str | None = None) -> tuple[list[ModelRow], int]:
        """A page of training models, newest first (only `owner`'s when given) and their total."""
        with self.tx() as s:
            mine = select(ModelRow)
            if owner is not None:
                mine = mine.join(SessionRow, ModelRow.session_id == SessionRow.id).where(
                    SessionRow.owner == owner
                )
            total = s.scalar(select(func.count()).select_from(mine.subquery())) or 0
            q = mine.order_by(ModelRow.created_at.desc()).limit(limit).offset(offset)
            return list(s.scalars(q)), int(total)

    def models_of_session(self, session_id: str) -> list[ModelRow]:
        with self.tx() as s:
            return list(s.scalars(select(ModelRow).where(ModelRow.session_id == session_id)))

    def mark_loaded_models_unloaded(self) -> None:
        with self.tx() as s:
            for row in s.scalars(select(ModelRow).where(ModelRow.status.in_(["ready", "creating"]))):
                row.status = "unloaded"

    # ---------------------------------------------------------------- futures
    def finish_future(
        self,
        request_id: str,
        *,
        content_type: str | None = None,
        result: bytes | None = None,
        error: str | None = None,
        category: str | None = None,
    ) -> None:
        self.update(
            FutureRow,
            request_id,
            status="failed" if error is not None else "done",
            content_type=content_type,
            result=result,
            error=error,
            category=category,
            finished_at=utcnow(),
        )

    def mark_pending_lost(self) -> int:
        """At start-up: futures still pending belonged to a previous process; they are lost."""
        with self.tx() as s:
            done = s.execute(
                update(FutureRow)
                .where(FutureRow.status == "pending")
                .values(status="lost", dedup_key=None, finished_at=utcnow())
            )
            return int(done.rowcount or 0)

    def mark_retrieved(self, request_id: str) -> None:
        with self.tx() as s:
            s.execute(
                update(FutureRow)
                .where(FutureRow.request_id == request_id, FutureRow.retrieved_at.is_(None))
                .values(retrieved_at=utcnow())
            )

    def prune_retrieved(self, retrieved_before: dt.datetime) -> int:
        """Delete futures (and their results) retrieved before `retrieved_before`."""
        with self.tx() as s:
            done = s.execute(delete(FutureRow).where(FutureRow.retrieved_at < retrieved_before))
            return int(done.rowcount or 0)

    def prune_unretrieved(self, finished_before: dt.datetime) -> int:
        """Delete final futures nobody retrieved that finished before `finished_before`."""
        with self.tx() as s:
            done = s.execute(
                delete(FutureRow).where(
                    FutureRow.retrieved_at.is_(None),
                    FutureRow.status.in_(("done", "failed", "lost")),
                    FutureRow.finished_at < finished_before,
                )
            )
            return int(done.rowcount or 0)

    # ---------------------------------------------------------------- checkpoints
    def checkpoint(self, tinker_path: str) -> CheckpointRow | None:
        with self.tx() as s:
            return s.scalars(select(CheckpointRow).where(CheckpointRow.tinker_path == tinker_path)).first()

    def require_checkpoint(self, tinker_path: str, what: str = "checkpoint") -> CheckpointRow:
        """The checkpoint at `tinker_path`; `NotFoundError` "<what> <path> does not exist" if none."""
        row = self.checkpoint(tinker_path)
        if row is None:
            raise missing_checkpoint(tinker_path, what)
        return row

    def put_checkpoint(self, row: CheckpointRow) -> None:
        with self.tx() as s:
            old = s.scalars(select(CheckpointRow).where(CheckpointRow.tinker_path == row.tinker_path)).first()
            if old is not None:
                s.delete(old)
                s.flush()
            s.add(row)

    def checkpoints(self, model_id: str | None = None, owner: str | None = None) -> list[CheckpointRow]:
        """Checkpoints, newest first: of one model and/or of the models `owner` owns."""
        with self.tx() as s:
            q = select(CheckpointRow).order_by(CheckpointRow.created_at.desc(), CheckpointRow.id.desc())
            if model_id is not None:
                q = q.where(CheckpointRow.model_id == model_id)
            if owner is not None:
                q = (
                    q.join(ModelRow, ModelRow.model_id == CheckpointRow.model_id)
                    .join(SessionRow, SessionRow.id == ModelRow.session_id)
                    .where(SessionRow.owner == owner)
                )
            return list(s.scalars(q))

    def delete_checkpoint(self, tinker_path: str) -> CheckpointRow | None:
        with self.tx() as s:
            row = s.scalars(select(CheckpointRow).where(CheckpointRow.tinker_path == tinker_path)).first()
            if row is not None:
                s.delete(row)
            return row
