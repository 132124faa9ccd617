"""What the repository functions take and return: frozen pydantic models, never ORM rows."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict

JobState = Literal["pending", "running", "stopping", "stopped", "finished", "failed"]
PeerState = Literal["alive", "suspect", "dead", "left"]
Direction = Literal["sent", "received"]
JobScope = Literal["local", "swarm"]

# Jobs in these states are resumed after a crash or restart.
ACTIVE_JOB_STATES: frozenset[JobState] = frozenset({"pending", "running", "stopping"})
TERMINAL_JOB_STATES: frozenset[JobState] = frozenset({"stopped", "finished", "failed"})


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, from_attributes=True)


class NodeRecord(_Record):
    """This node's identity."""

    peer_id: str
    public_key: str
    created_at: AwareDatetime


class PeerRecord(_Record):
    """A peer and its membership state."""

    id: str
    url: str
    public_key: str | None
    state: PeerState
    incarnation: int
    first_seen_at: AwareDatetime
    last_seen_at: AwareDatetime
    rtt_ms: float | None


class BanRecord(_Record):
    """A key banned by the operator."""

    public_key: str
    reason: str
    created_at: AwareDatetime


class QuarantineRecord(_Record):
    """A member quarantined until ``until``, and why."""

    peer_id: str
    public_key: str | None
    reason: str
    until: AwareDatetime
    created_at: AwareDatetime


class JobRecord(_Record):
    """A job; ``step``, ``tokens``, ``loss`` and ``val_loss`` are from its newest progress."""

    id: str
    spec: dict[str, Any]
    state: JobState
    reason: str | None
    out_dir: str
    step: int
    tokens: int
    loss: float | None
    val_loss: float | None
    plan: dict[str, Any] | None
    created_at: AwareDatetime
    started_at: AwareDatetime | None
    finished_at: AwareDatetime | None
    updated_at: AwareDatetime
    scope: JobScope = "local"
    origin: str | None = None
    origin_key: str | None = None
    origin_signature: str | None = None
    run: int = 0
    sync: dict[str, Any] | None = None


class ProgressPoint(_Record):
    """One logged training step; ``at`` must be timezone-aware (stored as UTC)."""

    step: int
    tokens: int
    loss: float
    val_loss: float | None = None
    tokens_per_s: float
    lr: float | None = None
    at: AwareDatetime
    sync: dict[str, Any] | None = None


class RoundRecord(_Record):
    """One delta sent or received; ``reason`` says why it was not applied."""

    id: int
    job_id: str
    round: int
    direction: Direction
    peer_id: str
    bytes: int
    codec: str
    compression_ratio: float
    staleness: int | None
    applied: bool
    reason: str | None
    at: AwareDatetime
    every: int | None = None


class CheckpointRecord(_Record):
    """A checkpoint on disk."""

    id: int
    job_id: str
    step: int
    path: str
    sha256: str
    at: AwareDatetime


class EventRecord(_Record):
    """One audit-log entry, e.g. ``job.started``, ``peer.dead``, ``auth.rejected``."""

    id: int
    at: AwareDatetime
    kind: str
    job_id: str | None
    peer_id: str | None
    message: str
    data: dict[str, Any] | None
