"""advert seal: a joined job's origin key and the origin's signature of its advert

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-06 00:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("origin_key", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("origin_signature", sa.String(length=128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("origin_signature")
        batch.drop_column("origin_key")
