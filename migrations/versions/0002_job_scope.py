"""jobs: scope (local or swarm) and origin (the peer that started it)

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 00:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("scope", sa.String(8), server_default="local", nullable=False))
        batch.add_column(sa.Column("origin", sa.String(128), nullable=True))
        batch.create_check_constraint(op.f("ck_jobs_scope"), "scope IN ('local', 'swarm')")


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_constraint(op.f("ck_jobs_scope"), type_="check")
        batch.drop_column("origin")
        batch.drop_column("scope")
