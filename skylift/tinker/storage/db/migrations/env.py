"""Alembic environment: upgrades run on the connection `skylift.tinker.storage.db.migrate` hands over."""

from __future__ import annotations

from alembic import context

from skylift.tinker.storage.db.models import Base

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    render_as_batch=True,  # SQLite alters tables by copying them
    compare_type=True,
)
with context.begin_transaction():
    context.run_migrations()
