"""rounds by job and id: the index that finds a job's newest rounds without a sort

``list_rounds`` and the retention of rounds (``repo.prune_rounds``) both read a job's rounds
newest first; (job_id, round) could not give them that order.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06 19:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_sync_rounds_job_id_id", "sync_rounds", ["job_id", "id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_sync_rounds_job_id_id", table_name="sync_rounds")
