"""sync cadence: the cadence of each round, and the sync figures of each progress point

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 00:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("sync_rounds") as batch:
        batch.add_column(sa.Column("every", sa.Integer(), nullable=True))
    with op.batch_alter_table("progress") as batch:
        batch.add_column(sa.Column("sync", sa.JSON(), nullable=True))
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("sync", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("sync")
    with op.batch_alter_table("progress") as batch:
        batch.drop_column("sync")
    with op.batch_alter_table("sync_rounds") as batch:
        batch.drop_column("every")
