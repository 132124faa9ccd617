"""Response models of the control API (never ORM rows)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

JobState = Literal["pending", "running", "stopping", "stopped", "finished", "failed"]


class ErrorBody(BaseModel):
    """Every error: a machine-readable kind and a sentence for people."""

    error: str = Field(
        description="not_found, conflict, unauthorized, forbidden, invalid, too_large, rate_limited"
    )
    detail: str


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class Readiness(BaseModel):
    ready: bool
    checks: dict[str, bool]
    reasons: dict[str, str] = Field(
        default_factory=dict, description="Why each failing check fails, where known"
    )


class JobPublic(BaseModel):
    id: str
    state: JobState
    scope: Literal["local", "swarm"] = "local"
    origin: str | None = Field(None, description="Peer id of the daemon that started it")
    run: int = Field(
        0,
        description="Swarm jobs: how many times its origin resumed it. A swarm-wide stop ends "
        "the run it names and those before, no later one",
    )
    reason: str | None = None
    spec: dict[str, Any]
    out_dir: str
    step: int
    tokens: int
    loss: float | None = None
    val_loss: float | None = None
    plan: dict[str, Any] | None = None
    sync: dict[str, Any] | None = Field(
        None,
        description="Swarm jobs, as of the newest step: the cadence in force (every: steps per "
        "round, period_s: the swarm's round period, auto) and the trainer's time in sync "
        "(busy_s: merging and sending, wait_s: blocked waiting for deltas), rounds closed, "
        "fraction: the share of entries a sparse codec sends now (it follows the link), "
        "and once the job has ended final_model: 'swarm' (it ended on the swarm's model), "
        "'own' (on this peer's replica) or 'average' (on the average of the peers' models), "
        "whichever the guard's probe preferred, with average_shares (the other peers' shares "
        "in that average) and average_s (its time) when there was one",
    )
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    updated_at: datetime


class ProgressPublic(BaseModel):
    step: int
    tokens: int
    loss: float
    val_loss: float | None = None
    tokens_per_s: float
    lr: float | None = None
    at: datetime
    sync: dict[str, Any] | None = Field(None, description="As the job's sync, at this step")


class RoundPublic(BaseModel):
    round: int
    direction: Literal["sent", "received"]
    peer_id: str
    bytes: int
    codec: str
    compression_ratio: float
    staleness: int | None = None
    applied: bool
    reason: str | None = None
    at: datetime
    every: int | None = Field(None, description="Steps the sender's round lasted (its cadence)")


class PeerPublic(BaseModel):
    id: str
    url: str
    state: Literal["alive", "suspect", "dead", "left"]
    incarnation: int
    first_seen_at: datetime
    last_seen_at: datetime
    rtt_ms: float | None = Field(None, description="Round-trip time of the last direct ping")
    is_self: bool = Field(False, description="This daemon")
    public_key: str | None = Field(None, description="Its Ed25519 key (hex): what a ban names")
    excluded: Literal["banned", "quarantined"] | None = Field(
        None, description="Deltas and state not taken from it: banned by the operator, or "
        "quarantined after repeated refused contributions",
    )  # fmt: skip
    excluded_reason: str | None = None


class BanPublic(BaseModel):
    public_key: str = Field(pattern=r"^[0-9a-f]{64}$")
    reason: str
    created_at: datetime


class BanIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    public_key: str = Field(
        pattern=r"^[0-9a-f]{64}$", description="The peer's Ed25519 key, 64 lowercase hex"
    )
    reason: str = Field("banned by the operator", max_length=500)


class StatusPublic(BaseModel):
    version: str
    peer_id: str
    public_key: str
    uptime_s: float
    data_dir: str
    control: str
    listen: str
    advertise: str
    swarm: str
    peers_alive: int
    device: str
    job: JobPublic | None = None


class EventPublic(BaseModel):
    """One entry of the daemon's audit log (``job.created``, ``peer.dead``, ``auth.rejected``)."""

    id: int
    at: datetime
    kind: str
    job_id: str | None = None
    peer_id: str | None = None
    message: str


class CurvePointPublic(BaseModel):
    step: int
    loss: float | None = None
    val_loss: float | None = None
    tokens_per_s: float
    at: datetime


class PeerCurvePublic(BaseModel):
    peer_id: str
    is_self: bool = False
    points: list[CurvePointPublic] = Field(
        description="Logged steps spread over the whole run, ascending (at most 402), every "
        "step with a validation loss among them"
    )
    error: str | None = Field(None, description="Why this peer's curve is missing")


class CurvesPublic(BaseModel):
    job_id: str
    peers: list[PeerCurvePublic] = Field(
        description="This daemon first, then each live peer heard training the job (the "
        "first 32 heard)"
    )
    left_out: int = Field(0, description="Further peers heard training the job, not asked")
