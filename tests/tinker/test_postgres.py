"""The Tinker service's database: Alembic migrations build exactly the table models, and an upgrade
keeps every record of a database written before migrations existed, on SQLite and on a real
PostgreSQL (a throw-away cluster on loopback from Debian's `postgresql` package; in CI, CI=true, a
missing server fails these tests instead of skipping them). The server itself runs on PostgreSQL in
test_restart.py, and on an upgraded SQLite data directory in test_users.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from lab_helpers import T0, postgres_cluster, write_legacy
from sqlalchemy import create_engine

from skylift.tinker.storage.db.local_postgres import LocalPostgres
from skylift.tinker.storage.db.migrate import current_revision, head_revision
from skylift.tinker.storage.db.models import Base
from skylift.tinker.storage.store import (
    CheckpointRow,
    FutureRow,
    ModelRow,
    SamplingSessionRow,
    SessionRow,
    Store,
)


@pytest.fixture(scope="module")
def postgres() -> Iterator[LocalPostgres]:
    yield from postgres_cluster()


def _no_drift(url: str) -> list:
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return compare_metadata(
                MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata
            )
    finally:
        engine.dispose()


def _assert_upgraded_keeps_everything(store: Store) -> None:
    assert store.revision == head_revision() == current_revision(store.engine)
    session = store.get(SessionRow, "s-old")
    assert session.tags == ["x"] and session.sdk_version == "0.38.0" and session.owner == "default"
    model = store.get(ModelRow, "s-old:train:0")
    assert model.status == "ready" and model.config["lora_rank"] == 4
    assert store.model_owner("s-old:train:0") == "default"
    assert store.get(SamplingSessionRow, "s-old:sample:0").source == "base"
    assert store.get(FutureRow, "req-old").owner == "default"
    [ckpt] = store.checkpoints(owner="default")
    assert ckpt.tinker_path == "tinker://s-old:train:0/weights/w1" and ckpt.size_bytes == 123456789
    assert store.get(CheckpointRow, ckpt.id).created_at.isoformat(sep=" ") == T0
    store.update(CheckpointRow, ckpt.id, size_bytes=5_000_000_000)  # sizes are 64-bit from revision 0002 on
    assert store.get(CheckpointRow, ckpt.id).size_bytes == 5_000_000_000


def test_migrations_build_exactly_the_table_models(tmp_path: Path, postgres: LocalPostgres) -> None:
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    Store(url).close()
    assert _no_drift(url) == []
    fresh = postgres.create_database("fresh")
    Store(fresh).close()
    assert _no_drift(fresh) == []


def test_upgrade_keeps_every_record_of_a_database_from_before_migrations(
    tmp_path: Path, tiny_model_dir: Path, postgres: LocalPostgres
) -> None:
    model_path = os.path.realpath(tiny_model_dir)
    sqlite_file = tmp_path / "old.db"
    write_legacy(f"sqlite:///{sqlite_file}", model_path, sqlite_file)
    store = Store(f"sqlite:///{sqlite_file}")
    _assert_upgraded_keeps_everything(store)
    store.close()
    assert Store(f"sqlite:///{sqlite_file}").revision == head_revision()  # reopening changes nothing

    old = postgres.create_database("old")
    write_legacy(old, model_path)
    store = Store(old)
    _assert_upgraded_keeps_everything(store)
    store.close()
