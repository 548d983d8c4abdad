"""Hardening: jsonb for client JSON on PostgreSQL, token expiry, re-analysis priority, dashboard sessions.

- ``traces.metadata`` and ``runs.tags`` become ``jsonb`` on PostgreSQL (a NUL escape, which jsonb
  refuses, is dropped from rows stored before validation existed);
- ``tokens.expires_at`` (optional expiry);
- ``traces.priority`` (0 fresh upload, 1 re-analysis) and the index the claim order uses;
- ``dashboard_sessions``: the dashboard cookie holds a random id whose sha256 is stored here.

Revision ID: 2026_11_22_1200
Revises: 2026_11_21_0002
Create Date: 2026-11-22 12:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "2026_11_22_1200"
down_revision: str | None = "2026_11_21_0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_JSONB_COLUMNS = (("traces", "metadata"), ("runs", "tags"))


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for table, column in _JSONB_COLUMNS:
            op.execute(
                f'ALTER TABLE {table} ALTER COLUMN "{column}" TYPE jsonb '
                f"USING replace(\"{column}\"::text, '\\u0000', '')::jsonb"
            )
    with op.batch_alter_table("tokens") as batch:
        batch.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("traces") as batch:
        batch.add_column(sa.Column("priority", sa.Integer(), server_default="0", nullable=False))
    op.create_index(
        "ix_traces_status_priority_created_at", "traces", ["status", "priority", "created_at"], unique=False
    )
    op.create_table(
        "dashboard_sessions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("token_id", sa.Integer(), nullable=False),
        sa.Column("hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["token_id"],
            ["tokens.id"],
            name=op.f("fk_dashboard_sessions_token_id_tokens"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_dashboard_sessions")),
        sa.UniqueConstraint("hash", name=op.f("uq_dashboard_sessions_hash")),
    )
    op.create_index(op.f("ix_dashboard_sessions_token_id"), "dashboard_sessions", ["token_id"], unique=False)
    op.create_index(
        op.f("ix_dashboard_sessions_expires_at"), "dashboard_sessions", ["expires_at"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_dashboard_sessions_expires_at"), table_name="dashboard_sessions")
    op.drop_index(op.f("ix_dashboard_sessions_token_id"), table_name="dashboard_sessions")
    op.drop_table("dashboard_sessions")
    op.drop_index("ix_traces_status_priority_created_at", table_name="traces")
    with op.batch_alter_table("traces") as batch:
        batch.drop_column("priority")
    with op.batch_alter_table("tokens") as batch:
        batch.drop_column("expires_at")
    if op.get_bind().dialect.name == "postgresql":
        for table, column in _JSONB_COLUMNS:
            op.execute(f'ALTER TABLE {table} ALTER COLUMN "{column}" TYPE json USING "{column}"::json')
