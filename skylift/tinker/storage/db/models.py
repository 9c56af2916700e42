"""Tables of the Tinker service (SQLAlchemy ORM; any SQLAlchemy URL: SQLite, PostgreSQL, ...).

The schema is versioned by the Alembic scripts in `migrations/versions/`: change a table here
AND add a migration there (tests compare the two). Ownership is stored once per user-facing
root: a session has an `owner` (the user whose key created it) and every model, sampler and
checkpoint belongs to the owner of its session (models and samplers carry their session id,
checkpoints their model id); a future carries its own `owner`. Times are naive UTC.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import JSON, BigInteger, DateTime, Integer, LargeBinary, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


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
    owner: Mapped[str | None] = mapped_column(String(128), nullable=True, index=True)


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
    """One operation's future. status: pending | done | failed | lost (pending when the server stopped)."""

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
    owner: Mapped[str | None] = mapped_column(String(128), nullable=True)
    retrieved_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True, index=True)


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
    size_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    expires_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)
    user_metadata: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
