"""Indexes for every sort and filter of the dashboard's run lists (home, project, runs pages).

Without them the home page sorted on an unindexed column (7 → 58 ms at 10k runs); each list is now
an index range scan, within a project or over a team's runs.

Revision ID: 2026_11_22_1800
Revises: 2026_11_22_1330
Create Date: 2026-11-22 18:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "2026_11_22_1800"
down_revision: str | None = "2026_11_22_1330"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEXES = {
    "ix_runs_updated_at": ["updated_at"],
    "ix_runs_name": ["name"],
    "ix_runs_project_id_updated_at": ["project_id", "updated_at"],
    "ix_runs_project_id_primary_kind_updated_at": ["project_id", "primary_kind", "updated_at"],
}


def upgrade() -> None:
    for name, columns in INDEXES.items():
        op.create_index(name, "runs", columns, unique=False)


def downgrade() -> None:
    for name in INDEXES:
        op.drop_index(name, table_name="runs")
