"""The job this daemon trains now (``ActiveJob``), and what its trainer thread tells the loop."""

from __future__ import annotations

import asyncio
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from atomd.db.schemas import JobRecord
from atomd.spec import JobSpec
from atomd.train.metrics import StepReport

if TYPE_CHECKING:  # torch loads when the first job trains, not when the daemon starts
    from atomd.train.trainer import RoundPlugin, SnapshotRequests

Scope = Literal["local", "swarm"]


@dataclass
class TrainerStarted:
    """The trainer is built and trains from ``start_step``."""

    start_step: int


@dataclass
class TrainerResumed:
    """The trainer resumed at ``start_step``; ``rows``: its run's ``metrics.jsonl``."""

    start_step: int
    rows: list[dict[str, Any]]


@dataclass
class CheckpointSaved:
    """The trainer wrote a checkpoint of ``step`` to ``path``."""

    path: Path
    step: int


TrainerMessage = StepReport | CheckpointSaved | TrainerResumed | TrainerStarted


@dataclass
class ActiveJob:
    id: str
    spec: JobSpec
    out_dir: Path
    resume: bool
    scope: Scope = "local"
    origin: str | None = None
    # A joined job's origin key and its signature of the advert (``messages.sign_advert``),
    # carried on in this daemon's adverts; None for a job started here (the swarm signs it).
    origin_key: str | None = None
    origin_signature: str | None = None
    run: int = 0  # the run of the job (``JobAdvert.run``): a stop of an earlier one is refused
    donors: list[str] = field(default_factory=list)
    stop_event: threading.Event = field(default_factory=threading.Event)  # the trainer's
    stopping: asyncio.Event = field(default_factory=asyncio.Event)  # the same, for the loop
    queue: asyncio.Queue[TrainerMessage] = field(default_factory=asyncio.Queue)
    stop_reason: str | None = None  # set when a person or the swarm asked it to stop
    tokens_seen: int = 0
    plugin: RoundPlugin | None = None  # the delta exchange (swarm jobs)
    adopt_step: int | None = None  # a checkpoint fetched from a peer, at this step
    claimed_val: float | None = None  # ... where the job's other members measured this loss
    adopt_from: str | None = None  # ... served by this peer (its id, as the transfer found it)
    logged_at: float = 0.0  # monotonic time of the last progress line in the log
    snapshots: SnapshotRequests | None = None  # live-state checkpoints asked for by peers
    step: int = 0  # the newest step reported by the trainer
    live_at: float = -math.inf  # monotonic time of its last live-state checkpoint
    tries: int = 0  # donors' states the trainer refused
    retakes: int = 0  # times it took the swarm's state again, far behind (``moved_on``)
    retaking: bool = False  # the next state taken is the swarm's whatever its step

    def stop(self) -> None:
        """Stop it: the trainer at its next step boundary (it checkpoints); a wait for donors
        or a state transfer before it trains, at once (``SwarmStateTaker.take``)."""
        self.stop_event.set()
        self.stopping.set()


def resumed_job(job: JobRecord, spec: JobSpec) -> ActiveJob:
    """``job`` of the database, to continue here from its newest checkpoint."""
    return ActiveJob(
        id=job.id, spec=spec, out_dir=Path(job.out_dir), resume=True, scope=job.scope,
        origin=job.origin, origin_key=job.origin_key, origin_signature=job.origin_signature,
        run=job.run,
    )  # fmt: skip
