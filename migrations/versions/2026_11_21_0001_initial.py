"""Initial schema: teams, tokens, projects, runs, traces (also the job queue), analyses.

Revision ID: 2026_11_21_0001
Revises:
Create Date: 2026-11-21 20:00:36
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "2026_11_21_0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _timestamp(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "teams",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        _timestamp("created_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_teams")),
        sa.UniqueConstraint("name", name=op.f("uq_teams_name")),
    )
    op.create_table(
        "projects",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("team_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        _timestamp("created_at"),
        sa.ForeignKeyConstraint(
            ["team_id"], ["teams.id"], name=op.f("fk_projects_team_id_teams"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_projects")),
        sa.UniqueConstraint("team_id", "name", name=op.f("uq_projects_team_id_name")),
    )
    op.create_table(
        "tokens",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("team_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("scope", sa.String(length=16), nullable=False),
        sa.Column("hash", sa.String(length=64), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        _timestamp("created_at"),
        _timestamp("last_used_at", nullable=True),
        _timestamp("revoked_at", nullable=True),
        sa.CheckConstraint("scope IN ('upload', 'read', 'admin')", name=op.f("ck_tokens_scope")),
        sa.ForeignKeyConstraint(
            ["team_id"], ["teams.id"], name=op.f("fk_tokens_team_id_teams"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tokens")),
        sa.UniqueConstraint("hash", name=op.f("uq_tokens_hash")),
    )
    op.create_index(op.f("ix_tokens_team_id"), "tokens", ["team_id"], unique=False)
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("tags", sa.JSON(), nullable=False),
        _timestamp("created_at"),
        _timestamp("updated_at"),
        sa.Column("primary_kind", sa.String(length=32), nullable=True),
        sa.Column("diagnosis", sa.JSON(), nullable=True),
        sa.Column("diagnosis_engine_version", sa.String(length=32), nullable=True),
        sa.ForeignKeyConstraint(
            ["project_id"], ["projects.id"], name=op.f("fk_runs_project_id_projects"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
        sa.UniqueConstraint("project_id", "name", name=op.f("uq_runs_project_id_name")),
    )
    op.create_index("ix_runs_created_at", "runs", ["created_at"], unique=False)
    op.create_index("ix_runs_primary_kind", "runs", ["primary_kind"], unique=False)
    op.create_index("ix_runs_project_id_created_at", "runs", ["project_id", "created_at"], unique=False)
    op.create_table(
        "traces",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("team_id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("window_index", sa.Integer(), nullable=True),
        sa.Column("first_step", sa.Integer(), nullable=True),
        sa.Column("last_step", sa.Integer(), nullable=True),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("storage_key", sa.String(length=255), nullable=False),
        sa.Column("filename", sa.String(length=255), nullable=False),
        sa.Column("idempotency_key", sa.String(length=128), nullable=True),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("status_reason", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("claimed_by", sa.String(length=255), nullable=True),
        _timestamp("claimed_at", nullable=True),
        _timestamp("created_at"),
        _timestamp("updated_at"),
        sa.CheckConstraint(
            "status IN ('pending', 'running', 'done', 'failed')", name=op.f("ck_traces_status")
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_traces_run_id_runs"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["team_id"], ["teams.id"], name=op.f("fk_traces_team_id_teams"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_traces")),
        sa.UniqueConstraint("storage_key", name=op.f("uq_traces_storage_key")),
        sa.UniqueConstraint("team_id", "idempotency_key", name=op.f("uq_traces_team_id_idempotency_key")),
    )
    op.create_index(op.f("ix_traces_run_id"), "traces", ["run_id"], unique=False)
    op.create_index("ix_traces_status_created_at", "traces", ["status", "created_at"], unique=False)
    op.create_table(
        "analyses",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("trace_id", sa.Integer(), nullable=False),
        sa.Column("engine_version", sa.String(length=32), nullable=False),
        sa.Column("schema_version", sa.Integer(), nullable=False),
        sa.Column("primary_kind", sa.String(length=32), nullable=True),
        sa.Column("primary_share", sa.Float(), nullable=True),
        sa.Column("report", sa.JSON(), nullable=False),
        sa.Column("duration_ms", sa.Integer(), nullable=True),
        _timestamp("created_at"),
        sa.ForeignKeyConstraint(
            ["trace_id"], ["traces.id"], name=op.f("fk_analyses_trace_id_traces"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_analyses")),
        sa.UniqueConstraint("trace_id", name=op.f("uq_analyses_trace_id")),
    )


def downgrade() -> None:
    op.drop_table("analyses")
    op.drop_index("ix_traces_status_created_at", table_name="traces")
    op.drop_index(op.f("ix_traces_run_id"), table_name="traces")
    op.drop_table("traces")
    op.drop_index("ix_runs_project_id_created_at", table_name="runs")
    op.drop_index("ix_runs_primary_kind", table_name="runs")
    op.drop_index("ix_runs_created_at", table_name="runs")
    op.drop_table("runs")
    op.drop_index(op.f("ix_tokens_team_id"), table_name="tokens")
    op.drop_table("tokens")
    op.drop_table("projects")
    op.drop_table("teams")
