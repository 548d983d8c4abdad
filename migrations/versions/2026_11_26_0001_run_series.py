"""Schema for the agent's step series, heartbeats and run liveness (issue: the whole run).

``series_streams``: one row per agent process in a run (its rank, latest heartbeat, whether it
exited cleanly); ``series_chunks``: the chunks' bytes as the agent wrote them; ``run_timelines``:
the last computed run timeline, so a long run's page does not decompress every chunk each time.

Revision ID: 2026_11_26_0001
Revises: 2026_11_22_1800
Create Date: 2026-11-26 11:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "2026_11_26_0001"
down_revision: str | None = "2026_11_22_1800"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _timestamp(name: str) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=False)


def upgrade() -> None:
    op.create_table(
        "series_streams",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("stream", sa.String(length=64), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("chunks", sa.Integer(), nullable=False),
        sa.Column("steps", sa.BigInteger(), nullable=False),
        _timestamp("heartbeat_at"),
        sa.Column("final", sa.Boolean(), nullable=False),
        sa.Column("clean_exit", sa.Boolean(), nullable=False),
        _timestamp("created_at"),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_series_streams_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_series_streams")),
        sa.UniqueConstraint("run_id", "stream", name=op.f("uq_series_streams_run_id_stream")),
    )
    op.create_index("ix_series_streams_run_id", "series_streams", ["run_id"], unique=False)
    op.create_table(
        "series_chunks",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("stream_id", sa.Integer(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("first_step", sa.BigInteger(), nullable=False),
        sa.Column("last_step", sa.BigInteger(), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("final", sa.Boolean(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("size_bytes", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        _timestamp("received_at"),
        sa.ForeignKeyConstraint(
            ["stream_id"],
            ["series_streams.id"],
            name=op.f("fk_series_chunks_stream_id_series_streams"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_series_chunks")),
        sa.UniqueConstraint("stream_id", "seq", name=op.f("uq_series_chunks_stream_id_seq")),
    )
    op.create_index(
        "ix_series_chunks_stream_id_first_step", "series_chunks", ["stream_id", "first_step"], unique=False
    )
    op.create_table(
        "run_timelines",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("basis", sa.String(length=64), nullable=False),
        sa.Column("engine_version", sa.String(length=32), nullable=False),
        sa.Column("timeline", sa.JSON(), nullable=False),
        _timestamp("updated_at"),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_run_timelines_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", name=op.f("pk_run_timelines")),
    )


def downgrade() -> None:
    op.drop_table("run_timelines")
    op.drop_index("ix_series_chunks_stream_id_first_step", table_name="series_chunks")
    op.drop_table("series_chunks")
    op.drop_index("ix_series_streams_run_id", table_name="series_streams")
    op.drop_table("series_streams")
