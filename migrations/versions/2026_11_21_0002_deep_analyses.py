"""Deep (HTA) analyses: a second job table, same status/claim columns as ``traces``.

Revision ID: 2026_11_21_0002
Revises: 2026_11_21_0001
Create Date: 2026-11-21 20:35:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "2026_11_21_0002"
down_revision: str | None = "2026_11_21_0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _timestamp(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "deep_analyses",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("trace_id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("params_key", sa.String(length=255), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("status_reason", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("claimed_by", sa.String(length=255), nullable=True),
        _timestamp("claimed_at", nullable=True),
        sa.Column("result", sa.JSON(), nullable=True),
        _timestamp("created_at"),
        _timestamp("updated_at"),
        sa.CheckConstraint("kind IN ('critical_path')", name=op.f("ck_deep_analyses_kind")),
        sa.CheckConstraint(
            "status IN ('pending', 'running', 'done', 'failed')", name=op.f("ck_deep_analyses_status")
        ),
        sa.ForeignKeyConstraint(
            ["trace_id"], ["traces.id"], name=op.f("fk_deep_analyses_trace_id_traces"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_deep_analyses")),
        sa.UniqueConstraint(
            "trace_id", "kind", "params_key", name=op.f("uq_deep_analyses_trace_id_kind_params_key")
        ),
    )
    op.create_index(
        "ix_deep_analyses_status_created_at", "deep_analyses", ["status", "created_at"], unique=False
    )


def downgrade() -> None:
    op.drop_index("ix_deep_analyses_status_created_at", table_name="deep_analyses")
    op.drop_table("deep_analyses")
