"""Users: sessions and futures get an owner (records from before belong to user "default");
futures get `retrieved_at` (results are pruned a retention time after it); checkpoint sizes
become 64-bit.

Revision ID: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

#: The user that owns records written before users existed (the single-user server's user).
LEGACY_OWNER = "default"


def upgrade() -> None:
    with op.batch_alter_table("tinker_sessions") as batch:
        batch.add_column(sa.Column("owner", sa.String(128), nullable=True))
        batch.create_index("ix_tinker_sessions_owner", ["owner"])
    with op.batch_alter_table("tinker_futures") as batch:
        batch.add_column(sa.Column("owner", sa.String(128), nullable=True))
        batch.add_column(sa.Column("retrieved_at", sa.DateTime, nullable=True))
        batch.create_index("ix_tinker_futures_retrieved_at", ["retrieved_at"])
    with op.batch_alter_table("tinker_checkpoints") as batch:
        batch.alter_column(
            "size_bytes", type_=sa.BigInteger, existing_type=sa.Integer, existing_nullable=True
        )
    for table in ("tinker_sessions", "tinker_futures"):
        op.execute(
            sa.text(f"UPDATE {table} SET owner = :owner WHERE owner IS NULL").bindparams(owner=LEGACY_OWNER)
        )


def downgrade() -> None:
    with op.batch_alter_table("tinker_checkpoints") as batch:
        batch.alter_column(
            "size_bytes", type_=sa.Integer, existing_type=sa.BigInteger, existing_nullable=True
        )
    with op.batch_alter_table("tinker_futures") as batch:
        batch.drop_index("ix_tinker_futures_retrieved_at")
        batch.drop_column("retrieved_at")
        batch.drop_column("owner")
    with op.batch_alter_table("tinker_sessions") as batch:
        batch.drop_index("ix_tinker_sessions_owner")
        batch.drop_column("owner")
