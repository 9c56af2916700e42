"""Durable records of the Tinker service (SQLAlchemy; SQLite by default, any SQLAlchemy URL works).

Sessions, training models, futures (with their results), sampling sessions and checkpoints live
here, so a restarted server on the same database and data directory still knows every model and
checkpoint. Times are naive UTC.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import JSON, DateTime, Integer, LargeBinary, String, Text, create_engine, func, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(tzinfo=None)


class Base(DeclarativeBase):
    pass


class SessionRow(Base):
    __tablename__ = "tinker_sessions"
    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    last_heartbeat: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)
    finish_reason: Mapped[str | None] = mapped_column(String(64), nullable=True)
    tags: Mapped[list[str]] = mapped_column(JSON, default=list)
    user_metadata: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    sdk_version: Mapped[str | None] = mapped_column(String(64), nullable=True)


class ModelRow(Base):
    __tablename__ = "tinker_models"
    model_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    session_id: Mapped[str] = mapped_column(String(128), index=True)
    base_model: Mapped[str] = mapped_column(Text)
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(32), default="creating")
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    last_request_time: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    user_metadata: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class FutureRow(Base):
    __tablename__ = "tinker_futures"
    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(String(64))
    model_id: Mapped[str | None] = mapped_column(String(256), nullable=True, index=True)
    dedup_key: Mapped[str | None] = mapped_column(String(512), nullable=True, unique=True)
    status: Mapped[str] = mapped_column(String(16), default="pending")
    content_type: Mapped[str | None] = mapped_column(String(64), nullable=True)
    result: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    category: Mapped[str | None] = mapped_column(String(16), nullable=True)
    extra: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)


class SamplingSessionRow(Base):
    __tablename__ = "tinker_sampling_sessions"
    id: Mapped[str] = mapped_column(String(256), primary_key=True)
    session_id: Mapped[str] = mapped_column(String(128), index=True)
    base_model: Mapped[str] = mapped_column(Text)
    model_path: Mapped[str | None] = mapped_column(Text, nullable=True)
    source: Mapped[str] = mapped_column(String(16))  # base | path | ephemeral
    model_id: Mapped[str | None] = mapped_column(String(256), nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)


class CheckpointRow(Base):
    __tablename__ = "tinker_checkpoints"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tinker_path: Mapped[str] = mapped_column(String(768), unique=True)
    model_id: Mapped[str] = mapped_column(String(256), index=True)
    checkpoint_id: Mapped[str] = mapped_column(String(512))  # "weights/<name>" | "sampler_weights/<name>"
    kind: Mapped[str] = mapped_column(String(16))  # training | sampler
    directory: Mapped[str] = mapped_column(Text)
    size_bytes: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    expires_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)
    user_metadata: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class Store:
    """Typed access to the tables; every method is one short transaction."""

    def __init__(self, url: str) -> None:
        kwargs: dict[str, Any] = {}
        if url.startswith("sqlite"):
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
        self.engine = create_engine(url, **kwargs)
        Base.metadata.create_all(self.engine)
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

    # ---------------------------------------------------------------- models
    def list_models(self, limit: int, offset: int) -> tuple[list[ModelRow], int]:
        with self.tx() as s:
            total = s.scalar(select(func.count()).select_from(ModelRow)) or 0
            q = select(ModelRow).order_by(ModelRow.created_at.desc()).limit(limit).offset(offset)
            return list(s.scalars(q)), int(total)

    def models_of_session(self, session_id: str) -> list[ModelRow]:
        with self.tx() as s:
            return list(s.scalars(select(ModelRow).where(ModelRow.session_id == session_id)))

    def mark_loaded_models_unloaded(self) -> None:
        with self.tx() as s:
            for row in s.scalars(select(ModelRow).where(ModelRow.status.in_(["ready", "creating"]))):
                row.status = "unloaded"

    # ---------------------------------------------------------------- futures
    def future_by_dedup(self, key: str) -> FutureRow | None:
        with self.tx() as s:
            return s.scalars(select(FutureRow).where(FutureRow.dedup_key == key)).first()

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

    def fail_pending_futures(self, message: str) -> int:
        with self.tx() as s:
            rows = list(s.scalars(select(FutureRow).where(FutureRow.status == "pending")))
            for row in rows:
                row.status, row.error, row.category, row.finished_at = "failed", message, "server", utcnow()
            return len(rows)

    # ---------------------------------------------------------------- checkpoints
    def checkpoint(self, tinker_path: str) -> CheckpointRow | None:
        with self.tx() as s:
            return s.scalars(select(CheckpointRow).where(CheckpointRow.tinker_path == tinker_path)).first()

    def put_checkpoint(self, row: CheckpointRow) -> None:
        with self.tx() as s:
            old = s.scalars(select(CheckpointRow).where(CheckpointRow.tinker_path == row.tinker_path)).first()
            if old is not None:
                s.delete(old)
                s.flush()
            s.add(row)

    def checkpoints(self, model_id: str | None = None) -> list[CheckpointRow]:
        with self.tx() as s:
            q = select(CheckpointRow).order_by(CheckpointRow.created_at.desc(), CheckpointRow.id.desc())
            if model_id is not None:
                q = q.where(CheckpointRow.model_id == model_id)
            return list(s.scalars(q))

    def delete_checkpoint(self, tinker_path: str) -> CheckpointRow | None:
        with self.tx() as s:
            row = s.scalars(select(CheckpointRow).where(CheckpointRow.tinker_path == tinker_path)).first()
            if row is not None:
                s.delete(row)
            return row
