"""peer bans: keys the operator banned (issue #15)

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 03:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "peer_bans",
        sa.Column("public_key", sa.String(64), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("public_key", name=op.f("pk_peer_bans")),
    )


def downgrade() -> None:
    op.drop_table("peer_bans")
