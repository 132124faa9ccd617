"""job runs: how many times a job's origin resumed it, signed into its adverts and stops

A member that kept the origin's signed stop of a job could otherwise pass it to the peers of a
later run, once the origin resumed the job, and end their copies (``StopNotice.run``).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07 16:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("run", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("run")
