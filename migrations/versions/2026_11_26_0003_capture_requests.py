"""Schema for capture-now requests a live run's agent polls for.

Revision ID: 2026_11_26_0003
Revises: 2026_11_26_0002
Create Date: 2026-11-26 11:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "2026_11_26_0003"
down_revision: str | None = "2026_11_26_0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "capture_requests",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("pending_run_id", sa.Integer(), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("requested_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("requested_by", sa.Integer(), nullable=True),
        sa.Column("acknowledged_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("trace_key", sa.String(length=128), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.CheckConstraint(
            "status IN ('pending', 'captured', 'failed')", name=op.f("ck_capture_requests_status")
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_capture_requests_run_id_runs"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["requested_by"],
            ["tokens.id"],
            name=op.f("fk_capture_requests_requested_by_tokens"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_capture_requests")),
        sa.UniqueConstraint("pending_run_id", name=op.f("uq_capture_requests_pending_run_id")),
    )
    op.create_index(op.f("ix_capture_requests_run_id"), "capture_requests", ["run_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_capture_requests_run_id"), table_name="capture_requests")
    op.drop_table("capture_requests")
