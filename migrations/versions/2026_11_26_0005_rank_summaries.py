"""Schema for each trace's compact per-rank record, folded into its run's aggregate.

``rank_summaries``: one row per analysis (``stepdoctor_analysis.run.trace_summary.TraceSummary`` as
msgspec JSON; NULL when the report does not decode), so a run's verdict reads these, not every report.

Revision ID: 2026_11_26_0005
Revises: 2026_11_26_0004
Create Date: 2026-11-26 11:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "2026_11_26_0005"
down_revision: str | None = "2026_11_26_0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "rank_summaries",
        sa.Column("analysis_id", sa.Integer(), nullable=False),
        sa.Column("trace_id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("summary", sa.LargeBinary(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["analysis_id"],
            ["analyses.id"],
            name=op.f("fk_rank_summaries_analysis_id_analyses"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["trace_id"], ["traces.id"], name=op.f("fk_rank_summaries_trace_id_traces"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_rank_summaries_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("analysis_id", name=op.f("pk_rank_summaries")),
    )
    op.create_index("ix_rank_summaries_trace_id", "rank_summaries", ["trace_id"], unique=False)
    op.create_index("ix_rank_summaries_run_id", "rank_summaries", ["run_id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_rank_summaries_run_id", table_name="rank_summaries")
    op.drop_index("ix_rank_summaries_trace_id", table_name="rank_summaries")
    op.drop_table("rank_summaries")
