"""The schema skylift created with `create_all` before migrations existed (frozen here).

Revision ID: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tinker_sessions",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("last_heartbeat", sa.DateTime, nullable=False),
        sa.Column("finished_at", sa.DateTime, nullable=True),
        sa.Column("finish_reason", sa.String(64), nullable=True),
        sa.Column("tags", sa.JSON, nullable=False),
        sa.Column("user_metadata", sa.JSON, nullable=False),
        sa.Column("sdk_version", sa.String(64), nullable=True),
    )
    op.create_table(
        "tinker_models",
        sa.Column("model_id", sa.String(256), primary_key=True),
        sa.Column("session_id", sa.String(128), nullable=False, index=True),
        sa.Column("base_model", sa.Text, nullable=False),
        sa.Column("config", sa.JSON, nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("last_request_time", sa.DateTime, nullable=False),
        sa.Column("user_metadata", sa.JSON, nullable=True),
    )
    op.create_table(
        "tinker_futures",
        sa.Column("request_id", sa.String(64), primary_key=True),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("model_id", sa.String(256), nullable=True, index=True),
        sa.Column("dedup_key", sa.String(512), nullable=True, unique=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("content_type", sa.String(64), nullable=True),
        sa.Column("result", sa.LargeBinary, nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("category", sa.String(16), nullable=True),
        sa.Column("extra", sa.JSON, nullable=True),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("finished_at", sa.DateTime, nullable=True),
    )
    op.create_table(
        "tinker_sampling_sessions",
        sa.Column("id", sa.String(256), primary_key=True),
        sa.Column("session_id", sa.String(128), nullable=False, index=True),
        sa.Column("base_model", sa.Text, nullable=False),
        sa.Column("model_path", sa.Text, nullable=True),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("model_id", sa.String(256), nullable=True),
        sa.Column("created_at", sa.DateTime, nullable=False),
    )
    op.create_table(
        "tinker_checkpoints",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("tinker_path", sa.String(768), nullable=False, unique=True),
        sa.Column("model_id", sa.String(256), nullable=False, index=True),
        sa.Column("checkpoint_id", sa.String(512), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("directory", sa.Text, nullable=False),
        sa.Column("size_bytes", sa.Integer, nullable=True),
        sa.Column("created_at", sa.DateTime, nullable=False),
        sa.Column("expires_at", sa.DateTime, nullable=True),
        sa.Column("user_metadata", sa.JSON, nullable=True),
    )


def downgrade() -> None:
    for table in (
        "tinker_checkpoints",
        "tinker_sampling_sessions",
        "tinker_futures",
        "tinker_models",
        "tinker_sessions",
    ):
        op.drop_table(table)
