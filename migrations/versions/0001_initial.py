"""initial schema: node, peers, jobs, progress, sync_rounds, checkpoints, events

Revision ID: 0001
Revises:
Create Date: 2025-01-01 00:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies of the model's types and choices: a migration must not change when the
# models do. SQLite stores datetimes as naive UTC; atomd.db.models.UTCDateTime adds the zone.
UTC_DATETIME = sa.DateTime(timezone=True)
JOB_STATES = "'pending', 'running', 'stopping', 'stopped', 'finished', 'failed'"
PEER_STATES = "'alive', 'suspect', 'dead', 'left'"


def upgrade() -> None:
    op.create_table(
        "node",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("peer_id", sa.String(128), nullable=False),
        sa.Column("public_key", sa.String(128), nullable=False),
        sa.Column("created_at", UTC_DATETIME, nullable=False),
        sa.CheckConstraint("id = 1", name=op.f("ck_node_single_row")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_node")),
    )
    op.create_table(
        "peers",
        sa.Column("id", sa.String(128), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("public_key", sa.String(128), nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("incarnation", sa.Integer(), server_default="0", nullable=False),
        sa.Column("first_seen_at", UTC_DATETIME, nullable=False),
        sa.Column("last_seen_at", UTC_DATETIME, nullable=False),
        sa.Column("rtt_ms", sa.Float(), nullable=True),
        sa.CheckConstraint(f"state IN ({PEER_STATES})", name=op.f("ck_peers_state")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_peers")),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("out_dir", sa.Text(), nullable=False),
        sa.Column("step", sa.Integer(), server_default="0", nullable=False),
        sa.Column("tokens", sa.Integer(), server_default="0", nullable=False),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("val_loss", sa.Float(), nullable=True),
        sa.Column("plan", sa.JSON(), nullable=True),
        sa.Column("created_at", UTC_DATETIME, nullable=False),
        sa.Column("started_at", UTC_DATETIME, nullable=True),
        sa.Column("finished_at", UTC_DATETIME, nullable=True),
        sa.Column("updated_at", UTC_DATETIME, nullable=False),
        sa.CheckConstraint(f"state IN ({JOB_STATES})", name=op.f("ck_jobs_state")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
    )
    op.create_index(op.f("ix_jobs_state"), "jobs", ["state"])
    op.create_index(op.f("ix_jobs_created_at"), "jobs", ["created_at"])

    op.create_table(
        "progress",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(32), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("tokens", sa.Integer(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=False),
        sa.Column("val_loss", sa.Float(), nullable=True),
        sa.Column("tokens_per_s", sa.Float(), nullable=False),
        sa.Column("lr", sa.Float(), nullable=True),
        sa.Column("at", UTC_DATETIME, nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_progress_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_progress")),
        # Also the index for per-job reads by step.
        sa.UniqueConstraint("job_id", "step", name=op.f("uq_progress_job_id_step")),
    )
    op.create_table(
        "sync_rounds",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(32), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("direction", sa.String(8), nullable=False),
        sa.Column("peer_id", sa.String(128), nullable=False),
        sa.Column("bytes", sa.Integer(), nullable=False),
        sa.Column("codec", sa.String(64), nullable=False),
        sa.Column("compression_ratio", sa.Float(), nullable=False),
        sa.Column("staleness", sa.Integer(), nullable=True),
        sa.Column("applied", sa.Boolean(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("at", UTC_DATETIME, nullable=False),
        sa.CheckConstraint(
            "direction IN ('sent', 'received')", name=op.f("ck_sync_rounds_direction")
        ),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_sync_rounds_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sync_rounds")),
    )
    op.create_index("ix_sync_rounds_job_id_round", "sync_rounds", ["job_id", "round"])

    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(32), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("at", UTC_DATETIME, nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_checkpoints_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoints")),
    )
    op.create_index("ix_checkpoints_job_id_step", "checkpoints", ["job_id", "step"])

    op.create_table(
        "events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("at", UTC_DATETIME, nullable=False),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("job_id", sa.String(32), nullable=True),
        sa.Column("peer_id", sa.String(128), nullable=True),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("data", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
    )
    op.create_index(op.f("ix_events_at"), "events", ["at"])
    op.create_index(op.f("ix_events_kind"), "events", ["kind"])


def downgrade() -> None:
    # Children before the jobs they reference; SQLite drops a table's indexes with it.
    for table in ("events", "checkpoints", "sync_rounds", "progress", "jobs", "peers", "node"):
        op.drop_table(table)
