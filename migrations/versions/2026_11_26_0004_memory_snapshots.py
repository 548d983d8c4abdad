"""Schema for CUDA allocator snapshots stored beside their traces.

Revision ID: 2026_11_26_0004
Revises: 2026_11_26_0003
Create Date: 2026-11-26 11:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "2026_11_26_0004"
down_revision: str | None = "2026_11_26_0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "memory_snapshots",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("trace_id", sa.Integer(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("protocol", sa.Integer(), nullable=False),
        sa.Column("storage_key", sa.String(length=255), nullable=False),
        sa.Column("filename", sa.String(length=255), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["trace_id"], ["traces.id"], name=op.f("fk_memory_snapshots_trace_id_traces"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_memory_snapshots")),
        sa.UniqueConstraint("storage_key", name=op.f("uq_memory_snapshots_storage_key")),
        sa.UniqueConstraint("trace_id", name=op.f("uq_memory_snapshots_trace_id")),
    )


def downgrade() -> None:
    op.drop_table("memory_snapshots")
