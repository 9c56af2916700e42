"""Bring a database to the newest schema with the Alembic scripts in `migrations/`.

A database written before migrations existed (skylift's tables, no `alembic_version`) is
stamped as revision 0001 first, then upgraded like any other, so every record is kept.
"""

from __future__ import annotations

import logging
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, inspect

logger = logging.getLogger(__name__)

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
#: The revision of the schema skylift created before it had migrations.
LEGACY_REVISION = "0001"


def alembic_config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return config


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> str:
    """Upgrade the database behind `engine` to `revision` (the newest by default); returns it."""
    config = alembic_config()
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        tables = set(inspect(conn).get_table_names())
        if "alembic_version" not in tables and "tinker_sessions" in tables:
            logger.info("database from before migrations: stamping revision %s", LEGACY_REVISION)
            command.stamp(config, LEGACY_REVISION)
        before = MigrationContext.configure(conn).get_current_revision()
        command.upgrade(config, revision)
        after = MigrationContext.configure(conn).get_current_revision()
    if before != after:
        logger.info("database schema upgraded from %s to %s", before, after)
    assert after is not None
    return after
