"""peer quarantines: members quarantined until a time, kept across restarts (issue #15)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 11:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "peer_quarantines",
        sa.Column("peer_id", sa.String(128), nullable=False),
        sa.Column("public_key", sa.String(64), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("until", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("peer_id", name=op.f("pk_peer_quarantines")),
    )
    op.create_index(
        op.f("ix_peer_quarantines_public_key"), "peer_quarantines", ["public_key"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_peer_quarantines_public_key"), table_name="peer_quarantines")
    op.drop_table("peer_quarantines")
