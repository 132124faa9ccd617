"""SQLAlchemy models of atomd's records: one row type per table, timestamps in UTC.

Only ``atomd.db.repo`` and the migrations use these; everything else sees ``atomd.db.schemas``.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar, get_args

from sqlalchemy import (
    JSON,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from atomd.db.schemas import Direction, JobScope, JobState, PeerState

# Named constraints: SQLite batch migrations recreate tables and can only drop or alter
# constraints that have names.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

JOB_STATES: tuple[str, ...] = get_args(JobState)
JOB_SCOPES: tuple[str, ...] = get_args(JobScope)
PEER_STATES: tuple[str, ...] = get_args(PeerState)
DIRECTIONS: tuple[str, ...] = get_args(Direction)


def utcnow() -> datetime:
    return datetime.now(UTC)


def _one_of(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime. SQLite drops the offset, so it is stored as naive UTC
    and given back its ``tzinfo`` on read; naive datetimes are refused on write."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value.isoformat()}: give a timezone-aware one")
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    """Declarative base: ``datetime`` maps to ``UTCDateTime``, ``dict[str, Any]`` to JSON."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        datetime: UTCDateTime(),
        dict[str, Any]: JSON(),
    }


class Node(Base):
    """This node's identity: exactly one row, ``id == 1``."""

    __tablename__ = "node"
    __table_args__ = (CheckConstraint("id = 1", name="single_row"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    peer_id: Mapped[str] = mapped_column(String(128))
    public_key: Mapped[str] = mapped_column(String(128))  # hex
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Peer(Base):
    """A peer this node has heard of, with its SWIM membership state."""

    __tablename__ = "peers"
    __table_args__ = (CheckConstraint(_one_of("state", PEER_STATES), name="state"),)

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    url: Mapped[str] = mapped_column(Text)
    public_key: Mapped[str | None] = mapped_column(String(128))  # hex
    state: Mapped[str] = mapped_column(String(16))
    incarnation: Mapped[int] = mapped_column(default=0, server_default="0")
    first_seen_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_seen_at: Mapped[datetime] = mapped_column(default=utcnow)
    rtt_ms: Mapped[float | None] = mapped_column(Float)


class Job(Base):
    """A training job; ``step``..``val_loss`` mirror its newest progress point."""

    __tablename__ = "jobs"
    __table_args__ = (
        CheckConstraint(_one_of("state", JOB_STATES), name="state"),
        CheckConstraint(_one_of("scope", JOB_SCOPES), name="scope"),
    )

    # 32 hex: a random head, then its origin's tag (``p2p.messages.job_id_for``)
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    spec: Mapped[dict[str, Any]]
    state: Mapped[str] = mapped_column(String(16), index=True)
    reason: Mapped[str | None] = mapped_column(Text)
    out_dir: Mapped[str] = mapped_column(Text)
    step: Mapped[int] = mapped_column(default=0, server_default="0")
    tokens: Mapped[int] = mapped_column(default=0, server_default="0")
    loss: Mapped[float | None] = mapped_column(Float)
    val_loss: Mapped[float | None] = mapped_column(Float)
    plan: Mapped[dict[str, Any] | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    # "swarm": announced to the peers, who join it; "local": this daemon's alone (0002).
    scope: Mapped[str] = mapped_column(String(8), default="local", server_default="local")
    origin: Mapped[str | None] = mapped_column(String(128))  # peer id that started it
    # A joined job: the origin's public key and its signature of the job's advert (0006).
    origin_key: Mapped[str | None] = mapped_column(String(64))
    origin_signature: Mapped[str | None] = mapped_column(String(128))
    # How many times the origin resumed it by request; a joined job's, that of the advert (0008).
    run: Mapped[int] = mapped_column(default=0, server_default="0")
    # The newest progress point's sync figures: cadence in force, time in sync (0003).
    sync: Mapped[dict[str, Any] | None]


class Progress(Base):
    """One logged training step of a job."""

    __tablename__ = "progress"
    # SQLite backs the UNIQUE constraint with an index on (job_id, step); a second index on
    # the same columns would only slow inserts.
    __table_args__ = (UniqueConstraint("job_id", "step"),)

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int]
    tokens: Mapped[int]
    loss: Mapped[float] = mapped_column(Float)
    val_loss: Mapped[float | None] = mapped_column(Float)
    tokens_per_s: Mapped[float] = mapped_column(Float)
    lr: Mapped[float | None] = mapped_column(Float)
    at: Mapped[datetime] = mapped_column(default=utcnow)
    # Swarm jobs: cadence in force and the trainer's time in sync (SyncPlugin.stats, 0003).
    sync: Mapped[dict[str, Any] | None]


class SyncRound(Base):
    """One delta sent to or received from a peer, applied or not (and why not)."""

    __tablename__ = "sync_rounds"
    __table_args__ = (
        CheckConstraint(_one_of("direction", DIRECTIONS), name="direction"),
        Index("ix_sync_rounds_job_id_round", "job_id", "round"),
        # A job's rounds newest first without a sort: list_rounds and their retention (0007).
        Index("ix_sync_rounds_job_id_id", "job_id", "id"),
    )

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    round: Mapped[int]
    direction: Mapped[str] = mapped_column(String(8))
    peer_id: Mapped[str] = mapped_column(String(128))
    bytes: Mapped[int]  # on the wire
    codec: Mapped[str] = mapped_column(String(64))
    compression_ratio: Mapped[float] = mapped_column(Float)
    staleness: Mapped[int | None]  # rounds behind the receiver's base version
    applied: Mapped[bool]
    reason: Mapped[str | None] = mapped_column(Text)
    at: Mapped[datetime] = mapped_column(default=utcnow)
    every: Mapped[int | None]  # steps the sender's round lasted: the cadence it used (0003)


class Checkpoint(Base):
    """A checkpoint written to disk for a job."""

    __tablename__ = "checkpoints"
    __table_args__ = (Index("ix_checkpoints_job_id_step", "job_id", "step"),)

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int]
    path: Mapped[str] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(64))
    at: Mapped[datetime] = mapped_column(default=utcnow)


class Event(Base):
    """The audit log. ``job_id`` is not a foreign key: events outlive the jobs they mention."""

    __tablename__ = "events"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    kind: Mapped[str] = mapped_column(String(64), index=True)
    job_id: Mapped[str | None] = mapped_column(String(32))
    peer_id: Mapped[str | None] = mapped_column(String(128))
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any] | None]


class PeerBan(Base):
    """A key the operator banned: refused on the peer plane, out of every merge and transfer."""

    __tablename__ = "peer_bans"

    public_key: Mapped[str] = mapped_column(String(64), primary_key=True)  # hex
    reason: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class PeerQuarantine(Base):
    """A member quarantined for repeated refused contributions, until ``until`` (a restart of
    the daemon does not lift it; ``atomd unban`` does)."""

    __tablename__ = "peer_quarantines"

    peer_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    public_key: Mapped[str | None] = mapped_column(String(64), index=True)  # hex, when known
    reason: Mapped[str] = mapped_column(Text)
    until: Mapped[datetime]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
