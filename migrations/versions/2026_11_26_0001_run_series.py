"""Schema for the agent's step series, heartbeats and run liveness (issue: the whole run).

Revision ID: 2026_11_26_0001
Revises: 2026_11_22_1800
Create Date: 2026-11-26 11:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

revision: str = "2026_11_26_0001"
down_revision: str | None = "2026_11_22_1800"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
