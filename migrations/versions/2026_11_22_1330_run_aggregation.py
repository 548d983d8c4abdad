"""Run aggregation as its own job: the inputs digest of the stored diagnosis and a counter.

Revision ID: 2026_11_22_1330
Revises: 2026_11_22_1200
Create Date: 2026-11-22 17:45:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "2026_11_22_1330"
down_revision: str | None = "2026_11_22_1200"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("diagnosis_basis", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("aggregations", sa.Integer(), server_default="0", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("aggregations")
        batch.drop_column("diagnosis_basis")
