"""The job manager: one training job at a time, run on a dedicated trainer thread.

The event loop never waits for training: the trainer thread hands step reports and checkpoint
notices to the loop through ``call_soon_threadsafe`` onto an asyncio queue, and the loop records
them in SQLite. States: pending -> running -> stopping -> stopped | finished | failed.

Swarm jobs (scope "swarm", the default) are announced to the peers through a ``SwarmLink``;
a peer that hears of one it has no record of joins it (auto-join), fetching the newest state
from a live peer first, and trains it with a plugin from the ``DeltaLink`` (the delta exchange).
A stop is local, or swarm-wide when asked.

Durability: ``metrics.jsonl`` and the checkpoints are written by the trainer thread itself, so
nothing depends on the loop keeping up. After a crash, a restarted daemon resumes every job that
was pending or running from its newest good checkpoint, and re-syncs the progress table with the
run's ``metrics.jsonl`` (truncated to that checkpoint).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib
import logging
import math
import os
import shutil
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from atomd.aio import unless_set
from atomd.config import PROGRESS_KEEP
from atomd.data.sources import (
    BUNDLED,
    check_source,
    check_tokenizer_name,
    exists,
    expand_path,
    shard_for_peer,
)
from atomd.data.sources import BYTES as BYTES_TOKENIZER
from atomd.data.sources import DEFAULT as DEFAULT_TOKENIZER
from atomd.db import repo
from atomd.db.health import is_locked, until_unlocked
from atomd.db.schemas import JobRecord, JobState, ProgressPoint
from atomd.devices import (
    TRAIN_BYTES_PER_PARAMETER,
    host_memory_available,
    host_step_bytes,
    trains_on_host,
)
from atomd.errors import (
    AtomdError,
    ConfigError,
    DataError,
    DonorStateError,
    JobConflictError,
    NotFoundError,
    SpecError,
    SwarmMovedOnError,
)
from atomd.logs import get_logger
from atomd.model.config import num_parameters
from atomd.p2p.messages import job_id_for, shared_spec
from atomd.spec import JobSpec
from atomd.telemetry import Telemetry
from atomd.train.checkpoint import (
    DONATED_FILE,
    checkpoint_dir,
    checkpoint_root,
    checkpoint_step,
    list_checkpoints,
    remove_checkpoints_after,
    remove_partial,
    sha256_file,
)
from atomd.train.metrics import StepReport, read_metrics

if TYPE_CHECKING:  # torch loads when the first job trains, not when the daemon starts
    from atomd.p2p.transfer import Fetched
    from atomd.train.trainer import RoundPlugin, SnapshotRequests, TrainSummary

log = get_logger(__name__)

Scope = Literal["local", "swarm"]
# Job progress goes to the daemon's log at most this often (and at every evaluation).
PROGRESS_LOG_INTERVAL_S = 30.0
SHUTDOWN_REASON = "interrupted by daemon shutdown; resumes when the daemon starts"
# How long a peer that asks for this daemon's live state waits for the trainer to checkpoint
# at its next step boundary, before it gets the newest checkpoint on disk instead.
LIVE_STATE_TIMEOUT_S = 30.0
# At most one live-state checkpoint per job this often (``live_state``); a peer asking sooner
# gets the one written last. Each costs ~6 model sizes of disk writes, and any member may ask.
LIVE_STATE_EVERY_S = 30.0
# A checkpoint holds about this many fp32 copies of the model: the weights, AdamW's two moments
# and the sync state (anchor, outer momentum, residuals).
CHECKPOINT_MODEL_SIZES = 6
# How long the trainer's reports wait for room on a full disk (``_record_when_room``).
RECORD_FULL_S = 30.0
SWARM_STOPS_KEPT = 100  # the newest swarm-wide stops a restarted daemon still tells stragglers
RECORD_RETRY_S = 0.5
# Donors whose state a joiner refuses (``DonorStateError``) before it gives up on the job.
DONOR_TRIES = 3
# Times a job here takes the swarm's state again after the swarm moved on past what it can
# merge (``SwarmMovedOnError``); beyond that it catches up by closing rounds early, as before.
RETAKES = 3
RESUMING_REASON = "resuming from the last good checkpoint"
SWARM_STOP_REASON = "stopped by the swarm"  # how a copy's reason begins once its origin stopped it


class SwarmLink(Protocol):
    """What the job manager needs from the swarm (``atomd.p2p.node.SwarmNode``)."""

    def announce(self, advert: dict[str, Any]) -> None: ...
    def broadcast_stop(self, job_id: str, run: int = 0) -> None: ...
    def latest_run(self, job_id: str) -> int: ...
    async def fetch_state(
        self,
        job_id: str,
        donors: list[str],
        root: Path,
        *,
        max_file_bytes: int | None = None,
        at_least: int = 0,
    ) -> Fetched | None: ...
    def distrust(self, donor: str) -> None: ...
    async def settled_donors(self, job_id: str, *, give_up: Callable[[], bool]) -> list[str]: ...


class DeltaLink(Protocol):
    """What the job manager needs from the delta exchange (``atomd.sync.exchange``)."""

    def expect(self, job_id: str, spec: JobSpec) -> None:
        """The job is about to train here: keep its frames until its plugin is attached."""
        ...

    def plugin(self, job_id: str, spec: JobSpec, *, may_retake: bool = False) -> RoundPlugin:
        """The trainer-thread side of the exchange for one swarm job."""
        ...

    def release(self, job_id: str) -> None:
        """The job no longer trains here."""
        ...


@dataclass
class _Started:
    start_step: int


@dataclass
class _Resumed:
    start_step: int
    rows: list[dict[str, Any]]


@dataclass
class _Saved:
    path: Path
    step: int


_Message = StepReport | _Saved | _Resumed | _Started


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
    queue: asyncio.Queue[_Message] = field(default_factory=asyncio.Queue)
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
    retakes: int = 0  # times it took the swarm's state again, far behind (``_moved_on``)
    retaking: bool = False  # the next state taken is the swarm's whatever its step

    def stop(self) -> None:
        """Stop it: the trainer at its next step boundary (it checkpoints); a wait for donors
        or a state transfer before it trains, at once (``JobManager._take_swarm_state``)."""
        self.stop_event.set()
        self.stopping.set()


def _resumed(job: JobRecord, spec: JobSpec) -> ActiveJob:
    """``job`` of the database, to continue here from its newest checkpoint."""
    return ActiveJob(
        id=job.id, spec=spec, out_dir=Path(job.out_dir), resume=True, scope=job.scope,
        origin=job.origin, origin_key=job.origin_key, origin_signature=job.origin_signature,
        run=job.run,
    )  # fmt: skip


def _point(r: StepReport | dict[str, Any], at: datetime | None = None) -> ProgressPoint:
    d = r.to_row() if isinstance(r, StepReport) else r
    return ProgressPoint(
        step=int(d["step"]),
        tokens=int(d["tokens"]),
        loss=float(d["loss"]),
        val_loss=d.get("val_loss"),
        tokens_per_s=float(d["tokens_per_s"]),
        lr=d.get("lr"),
        at=at or datetime.now(UTC),
        sync=d.get("sync"),
    )


def advert_data_problem(data: str, names: Mapping[str, str]) -> str | None:
    """Why a job another peer announced may not train on ``data`` here, or None: a swarm job
    names the bundled corpus or a dataset this daemon's operator registered by name
    (``ATOMD_DATA_NAMES``), never a path (a peer would otherwise make this daemon train on,
    and send deltas of, whatever local file the advert names)."""
    if data == BUNDLED or data in names:
        return None
    known = ", ".join(sorted([BUNDLED, *names]))
    return (
        f"its data {data[:200]!r} is neither the bundled corpus nor a dataset registered here "
        f"by name ({known}; ATOMD_DATA_NAMES): a job from the swarm may not name a local path"
    )


def advert_problem(spec: JobSpec, names: Mapping[str, str]) -> str | None:
    """Why this daemon may not join a job another peer announced, or None: no field of the
    advert may make it read a local file (its data, tokenizer, or initial weights)."""
    problem = advert_data_problem(spec.data, names)
    if problem is not None:
        return problem
    if spec.tokenizer not in (BYTES_TOKENIZER, DEFAULT_TOKENIZER):
        return (
            f"its tokenizer {spec.tokenizer[:200]!r} is a path: a job from the swarm may only "
            f"use {BYTES_TOKENIZER!r} or {DEFAULT_TOKENIZER!r}"
        )
    if spec.init_from is not None:
        return (
            f"it starts from init_from {spec.init_from[:200]!r}: a job from the swarm may not "
            f"name a local path (a joiner starts from the swarm's state)"
        )
    return None


def local_data(spec: JobSpec, names: Mapping[str, str]) -> JobSpec:
    """``spec`` with a registered dataset name replaced by its local path."""
    if spec.data in names:
        return spec.model_copy(update={"data": names[spec.data]})
    return spec


def state_file_bound(spec: JobSpec) -> int:
    """The most bytes a checkpoint file of ``spec``'s model can hold: fp32 weights, AdamW's two
    moments and the sync state (anchor, momentum, error feedback, pending rounds), with room
    to spare; a donor announcing more is lying (issue #15: a manifest claimed 10^12 bytes)."""
    return num_parameters(spec.model_shape) * 4 * 16 + (64 << 20)


def admit(spec: JobSpec, device: str = "auto") -> None:
    """Refuse, with the reason, a job that cannot start here (before anything is queued).

    Cheap on purpose (microseconds, no torch): it runs on the request path of ``POST
    /v1/jobs``. The parameter count and, where the job trains on the CPU (``device``, the
    daemon's setting: ``trains_on_host``), one micro-batch's activations follow from the spec
    in closed form (``host_step_bytes``); whatever else can fail (building the model, loading
    the data) fails on the trainer thread after the 201 and is recorded on the job."""
    try:
        check_source(spec.data)
    except DataError as e:
        raise SpecError(str(e), field="data") from None
    try:
        check_tokenizer_name(spec.tokenizer)
    except ConfigError as e:
        raise SpecError(str(e), field="tokenizer") from None
    if spec.init_from is not None and not exists(expand_path(spec.init_from)):
        raise SpecError(f"init_from {spec.init_from!r} does not exist", field="init_from")
    have = host_memory_available()
    if have is None:
        return
    state = num_parameters(spec.model_shape) * TRAIN_BYTES_PER_PARAMETER
    if state > have:
        raise SpecError(
            f"preset {spec.preset!r} needs about {state / 2**30:.1f} GiB of host memory for its "
            f"weights, gradients and AdamW state; this host has {have / 2**30:.1f} GiB available",
            field="preset",
        )
    if not trains_on_host(device):
        return  # the activations live in the GPU's memory
    acts = host_step_bytes(spec)
    if state + acts > have:
        fit = _sequences_that_fit(spec, have - state)
        if fit:
            plural = "s fit" if fit > 1 else " fits"
            hint, lower = f"{fit} sequence{plural}", "micro_batch_size"
        else:
            hint, lower = "not one sequence fits", "seq_len"
        raise SpecError(
            f"preset {spec.preset!r} with micro_batch_size {spec.micro_batch_size} and seq_len "
            f"{spec.effective_seq_len} needs about {(state + acts) / 2**30:.1f} GiB of host "
            f"memory, training on the CPU: {state / 2**30:.1f} GiB for its weights, gradients "
            f"and AdamW state and {acts / 2**30:.1f} GiB for one micro-batch's activations "
            f"(with the allocator's slack); "
            f"this host has {have / 2**30:.1f} GiB available ({hint}): lower {lower} "
            f"(grad_accum keeps the tokens per step)",
            field=lower,
        )


def _sequences_that_fit(spec: JobSpec, room: int) -> int:
    """The largest micro_batch_size below the spec's whose activations fit ``room`` bytes
    (0: none); the activations grow with it, so a bisection of a dozen estimates finds it."""
    lo, hi = 0, spec.micro_batch_size  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if host_step_bytes(spec.model_copy(update={"micro_batch_size": mid})) <= room:
            lo = mid
        else:
            hi = mid
    return lo


def _origin_only(job_id: str, origin: str, more: str = "") -> JobConflictError:
    """The refusal of a swarm-wide stop of ``job_id`` by a daemon other than its ``origin``."""
    return JobConflictError(
        f"job {job_id} was started by peer {origin}: only its origin stops it on every peer{more}"
    )


TRAINING_MODULES = ("atomd.train.trainer", "atomd.sync.runner")


def load_training_modules() -> None:
    """Import torch and the training code (blocking: call it off the event loop), and what
    torch loads lazily on first use: building the first AdamW imports torch._dynamo (3 s of
    a tiny job's 3.5 s start on 2 cores)."""
    for name in TRAINING_MODULES:
        importlib.import_module(name)
    import torch

    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])


def lower_thread_priority(nice: int) -> None:
    """Make the calling thread ``nice`` steps nicer (Linux, where niceness is per thread;
    elsewhere nothing). Threads it starts later, torch's workers included, inherit it. A
    thread may always lower its own priority; a failure to is logged and training goes on."""
    if nice <= 0 or sys.platform != "linux":
        return
    tid = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, now + nice))
    except OSError as e:
        log.warning("could not lower the training thread's priority: %s", e)


def data_seed(peer_id: str, seed: int) -> int:
    """This peer's sampling seed for a job: distinct per peer, stable across restarts."""
    digest = hashlib.sha256(f"{peer_id}:{seed}".encode()).digest()
    return int.from_bytes(digest[:6], "big")


class JobManager:
    """Starts, stops and records jobs. ``run()`` lives in the daemon's TaskGroup."""

    def __init__(
        self,
        *,
        jobs_dir: Path,
        sessions: async_sessionmaker[AsyncSession],
        telemetry: Telemetry,
        device: str,
        peer_id: str = "local",
        trainer_nice: int = 0,
        progress_keep: int = PROGRESS_KEEP,
    ) -> None:
        self.jobs_dir = jobs_dir
        # Points kept at full resolution (``atomd.db.retention``): a resume backfills those.
        self.progress_keep = progress_keep
        self.sessions = sessions
        self.telemetry = telemetry
        self.device = device
        self.peer_id = peer_id
        self.data_names: dict[str, str] = {}  # registered datasets: name -> local path
        self.swarm: SwarmLink | None = None
        self.exchange: DeltaLink | None = None
        self.active: ActiveJob | None = None
        self._executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="atomd-trainer",
            initializer=lower_thread_priority,
            initargs=(trainer_nice,),
        )
        self._tg: asyncio.TaskGroup | None = None
        self._closing = asyncio.Event()
        self._started = asyncio.Event()
        self._considering: set[str] = set()
        # Check free, record, launch: one job at a time (two POSTs at once both found the
        # daemon free across the record's await, and the second job orphaned the first).
        self._launching = asyncio.Lock()
        # A job's state changes commit in the order they were asked for: a stop's "stopping"
        # and the end a cancelled transfer writes at once could wait on another process's
        # lock side by side, and the later commit won ("stopping" for ever, nothing running).
        self._state_writes = asyncio.Lock()
        # Swarm jobs this daemon started and stopped swarm-wide, not resumed since: job id ->
        # the run the stop ended (``StopNotice.run``). A member that missed the stop (asleep,
        # cut off, restarted) and advertises one is told again (``SwarmNode``).
        self._swarm_stopped: dict[str, int] = {}

    async def run(self) -> None:
        """Own the per-job tasks until ``shutdown()``; resume interrupted jobs first."""
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                try:
                    await until_unlocked(
                        "taking up the jobs the last run left", self._resume_interrupted,
                        give_up=self._closing.is_set,
                    )  # fmt: skip
                except OperationalError as e:
                    if not (is_locked(e) and self._closing.is_set()):
                        raise
                    log.warning(
                        "shutting down before the jobs the last run left were taken up (the "
                        "database was locked); the next start takes them up"
                    )
                self._started.set()
                await self._closing.wait()
        finally:
            # On every way out, a failure too: the trainer has stopped (its checkpoint written)
            # before the daemon lets go of the data directory (``datadir.lock_data_dir``).
            if self.active is not None:
                self.active.stop()
            self._executor.shutdown(wait=True)

    async def wait_started(self) -> None:
        await self._started.wait()

    @property
    def started(self) -> bool:
        """Whether the jobs a crash or shutdown interrupted are taken up (their records say
        pending or stopped, no longer what they were when the daemon went down)."""
        return self._started.is_set()

    async def shutdown(self) -> None:
        """Stop the current job at a step boundary (it checkpoints) and end ``run()``."""
        if self.active is not None:
            self.active.stop()
        self._closing.set()

    # -- queries -----------------------------------------------------------------------------

    async def get(self, job_id: str) -> JobRecord:
        async with self.sessions() as s:
            job = await repo.get_job(s, job_id=job_id)
        if job is None:
            raise NotFoundError(f"no job {job_id!r}")
        return job

    async def list_jobs(self) -> list[JobRecord]:
        async with self.sessions() as s:
            return await repo.list_jobs(s)

    async def progress(
        self, job_id: str, after_step: int | None, limit: int, *, newest: bool = False
    ) -> list[ProgressPoint]:
        await self.get(job_id)
        async with self.sessions() as s:
            return await repo.list_progress(
                s, job_id=job_id, after_step=after_step, limit=limit, newest=newest
            )

    async def progress_curve(self, job_id: str, points: int) -> list[ProgressPoint]:
        """The job's loss curve here, at most ``2 * points + 2`` steps (``repo.progress_curve``)."""
        async with self.sessions() as s:
            return await repo.progress_curve(s, job_id=job_id, points=points)

    def advert(self) -> dict[str, Any] | None:
        """The swarm job this daemon trains, as told to peers (None if none)."""
        a = self.active
        if a is None or a.scope != "swarm" or a.stop_event.is_set() or self._hash_pending(a):
            return None
        return {
            "id": a.id, "spec": a.spec.model_dump(), "origin": a.origin,
            "origin_key": a.origin_key, "signature": a.origin_signature, "run": a.run,
        }  # fmt: skip

    async def _rejoin(self, had: JobRecord, advert: dict[str, Any]) -> None:
        """A copy of the swarm's job that its origin stopped here (``SWARM_STOP_REASON``) goes
        on in the later run ``advert`` names, from its newest checkpoint or the swarm's state
        (``resume``): the origin resumed the job, and its word is the job's. A copy stopped
        by this daemon's operator, finished or failed stays so."""
        if (
            had.scope != "swarm"
            or had.state != "stopped"
            or not (had.reason or "").startswith(SWARM_STOP_REASON)
        ):
            return
        spec = JobSpec.model_validate(had.spec)
        later = self._later_run(had.id, had.origin, had.run, spec, advert)
        if later is None:
            return
        log.info("job %s: its origin resumed it (run %d); this copy, stopped by the swarm in "
                 "run %d, goes on", had.id, later[0], had.run)  # fmt: skip
        await self.resume(had.id, later=later)

    async def newer_run(self, advert: dict[str, Any]) -> None:
        """The origin of the job trained here signed a later run of it in ``advert`` (the swarm
        node checked the seal): the copy goes on in that run, and carries that seal on. A stop
        of the run it trained before, which a member may have kept, then ends it no more. The
        spec must be the one trained here (an origin resumes a job as it was)."""
        a = self.active
        later = None if a is None else self._later_run(a.id, a.origin, a.run, a.spec, advert)
        if a is None or later is None:
            return
        run, signature = later
        log.info("job %s: its origin resumed it; this copy goes on in run %d (was %d)",
                 a.id, run, a.run)  # fmt: skip
        a.run, a.origin_signature = run, signature
        async with self.sessions() as s, s.begin():
            await repo.set_run(s, job_id=a.id, run=run, origin_signature=signature)
            await repo.add_event(s, kind="job.run", job_id=a.id, message=f"run {run}")

    def _later_run(
        self, job_id: str, origin: str | None, run: int, spec: JobSpec, advert: dict[str, Any]
    ) -> tuple[int, str] | None:
        """(run, the origin's signature) of ``advert`` if it names a later run than ``run`` of
        the joined job ``job_id`` of ``origin`` trained here as ``spec`` (the swarm node
        checked its seal; an origin resumes a job as it was, so another spec is refused),
        else None."""
        later, signature = int(advert.get("run") or 0), advert.get("signature")
        if (
            advert.get("id") != job_id
            or origin in (None, self.peer_id)
            or origin != advert.get("origin")
            or later <= run
            or not isinstance(signature, str)
        ):
            return None
        if shared_spec(JobSpec.model_validate(advert.get("spec", {}))) != shared_spec(spec):
            log.warning("job %s: its run %d has another spec; this copy stays in run %d",
                        job_id, later, run)  # fmt: skip
            return None
        return later, signature

    def run_of(self, job_id: str) -> int | None:
        """The run of swarm job ``job_id`` this daemon trains now (None: it does not)."""
        return self.active.run if self.trains(job_id) and self.active is not None else None

    async def had(self, job_id: str) -> bool:
        """Whether this daemon has a record of ``job_id`` (trains it, or trained it once)."""
        async with self.sessions() as s:
            return await repo.get_job(s, job_id=job_id) is not None

    def trains(self, job_id: str) -> bool:
        """Whether this daemon trains swarm job ``job_id`` now (and is not stopping it)."""
        a = self.active
        return a is not None and a.id == job_id and a.scope == "swarm" and not a.stop_event.is_set()

    async def live_state(self, job_id: str, at_least: int = 0) -> bool:
        """Checkpoint the live state of ``job_id`` at the trainer's next step boundary, for a
        peer joining the job (so it starts from the swarm's current model, not from the last
        checkpoint on disk). True once written; False when this daemon does not train the job
        or the trainer did not get there within ``LIVE_STATE_TIMEOUT_S``. ``NotFoundError``
        when the job trains here but is not yet at step ``at_least``, or its swarm has closed
        no round yet: the anchor is still the initial weights, and a joiner that starts from
        them at round 0 agrees with it (a state transfer costs ~6 model sizes: weights, AdamW
        moments, sync state)."""
        a = self.active
        if a is None or a.id != job_id or a.snapshots is None or a.stop_event.is_set():
            return False
        if a.step < at_least:
            raise NotFoundError(
                f"job {job_id} is at step {a.step} here; no state from step {at_least} on yet"
            )
        if a.plugin is not None and a.plugin.version == 0:
            raise NotFoundError(
                f"job {job_id} has closed no round here yet: start from its initial weights"
            )
        if time.monotonic() - a.live_at < LIVE_STATE_EVERY_S:
            # Written moments ago: that one (a member asking in a loop made the trainer write
            # ~6 model sizes at every step; a review of 2026-12-06).
            log.info("job %s: live state written %.0f s ago; serving it", job_id,
                     time.monotonic() - a.live_at)  # fmt: skip
            return False
        fut = a.snapshots.ask()
        try:
            step = await asyncio.wait_for(asyncio.wrap_future(fut), LIVE_STATE_TIMEOUT_S)
        except (TimeoutError, RuntimeError) as e:
            fut.cancel()
            log.info("job %s: no live state for a peer (%s); serving the newest checkpoint",
                     job_id, e or "timed out")  # fmt: skip
            return False
        a.live_at = time.monotonic()
        log.info("job %s: live state at step %d checkpointed for a peer", job_id, step)
        return True

    def job_dir(self, job_id: str) -> Path:
        return self.jobs_dir / job_id

    # -- commands ----------------------------------------------------------------------------

    def _hash_pending(self, a: ActiveJob) -> bool:
        """A swarm job started here whose spec has no data hash yet: its data is hashed off
        the loop before its trainer is built, and only then announced (``_pin_data``)."""
        return (
            self.swarm is not None and a.scope == "swarm" and a.origin == self.peer_id
            and a.spec.data_sha256 is None
        )  # fmt: skip

    def _check_started(self) -> None:
        """Refuse a command before the jobs the daemon's last run left are taken up: a job a
        SIGKILL interrupted still reads "running" then, and a job started meanwhile made it
        fail ("another job was resumed first"). ``GET /readyz`` says when."""
        if not self.started:
            raise JobConflictError(
                "the daemon is starting: it is taking up the jobs its last run left; "
                "retry once GET /readyz answers 200"
            )

    def _check_free(self) -> None:
        self._check_started()
        if self._closing.is_set():
            raise JobConflictError("the daemon is shutting down; no new jobs")
        if self.active is not None:
            raise JobConflictError(
                f"job {self.active.id} is active; "
                f"stop it first (POST /v1/jobs/{self.active.id}/stop)"
            )

    async def start(self, spec: JobSpec, scope: Scope = "swarm") -> JobRecord:
        async with self._launching:
            self._check_free()
            admit(local_data(spec, self.data_names), self.device)  # cheap: a stat() and arithmetic
            job_id = job_id_for(self.peer_id)
            out_dir = self.job_dir(job_id)
            async with self.sessions() as s, s.begin():
                job = await repo.create_job(
                    s,
                    job_id=job_id,
                    spec=spec.model_dump(),
                    out_dir=str(out_dir),
                    scope=scope,
                    origin=self.peer_id,
                )
                await repo.add_event(
                    s, kind="job.created", job_id=job_id, message=f"preset {spec.preset}, {scope}"
                )
            active = ActiveJob(
                id=job_id,
                spec=spec,
                out_dir=out_dir,
                resume=False,
                scope=scope,
                origin=self.peer_id,
            )
            self._launch(active)
        if scope == "swarm" and self.swarm is not None:
            advert = self.advert()
            if advert is not None:
                self.swarm.announce(advert)
        return job

    async def resume(self, job_id: str, later: tuple[int, str] | None = None) -> JobRecord:
        """Continue a stopped or failed job here from its newest good checkpoint (a job that
        stopped on a full disk, once there is space again). ``later``: a joined copy goes on
        in that later run of its origin's, sealed by that signature (``_rejoin``)."""
        async with self._launching:
            job = await self.get(job_id)
            self._check_free()
            if job.state not in ("stopped", "failed", "pending"):
                raise JobConflictError(
                    f"job {job_id} is {job.state}; only a stopped, failed or pending job resumes"
                )
            spec = JobSpec.model_validate(job.spec)
            admit(local_data(spec, self.data_names), self.device)
            run: Callable[[AsyncSession], Awaitable[int]] | None = None
            if later is not None:

                async def run(s: AsyncSession) -> int:
                    await repo.set_run(s, job_id=job_id, run=later[0], origin_signature=later[1])
                    return later[0]

            elif job.scope == "swarm" and job.origin in (None, self.peer_id):
                # A new run of the swarm's job: a stop of the runs before ends none of its
                # copies (``StopNotice.run``). A joined copy goes on in the run it joined.
                run = functools.partial(repo.next_run, job_id=job_id)
            job = await self._set_state(
                job_id, "pending", RESUMING_REASON, "job.resuming", "", run=run
            )
            self._swarm_stopped.pop(job_id, None)
            self._launch(_resumed(job, spec))
        return job

    async def stop(self, job_id: str, scope: Scope = "local") -> JobRecord:
        job = await self.get(job_id)
        swarm = self.swarm if scope == "swarm" else None
        if swarm is not None and job.origin not in (None, self.peer_id):
            # The others would not take it.
            raise _origin_only(
                job_id, job.origin, f"; POST /v1/jobs/{job_id}/stop stops this daemon's copy"
            )
        self._check_started()
        if swarm is not None:
            if job_id not in self._swarm_stopped:
                async with self.sessions() as s, s.begin():
                    await repo.add_event(s, kind="job.swarm_stopped", job_id=job_id,
                                         message=f"run {job.run}")  # fmt: skip
                self._swarm_stopped[job_id] = job.run  # once recorded: a failed write is retried
            swarm.broadcast_stop(job_id, job.run)
        active = self.active
        if active is None or active.id != job_id:
            if scope == "swarm":
                return job  # not training it here, but the swarm has been told
            raise JobConflictError(f"job {job_id} is {job.state}, not active; nothing to stop")
        return await self._request_stop(active, "stopped by request")

    async def stop_from_peer(
        self, job_id: str, peer_id: str, via: str | None = None, run: int | None = None
    ) -> None:
        """A peer stopped ``job_id`` swarm-wide: stop our copy (if we train it), if that peer
        started the job. ``JobConflictError`` from another: any member could otherwise end
        every peer's copy of every job with one message each, and a stopped job is not joined
        again (a review of 2026-12-06). ``via``: the member that passed on the origin's signed
        stop (``atomd.p2p.messages.StopNotice``), checked there; ``run``: the run it ends, and
        those before (None: the origin's own word, unsigned, from a daemon of before runs).
        ``JobConflictError`` for a stop of a run before ours: the origin resumed the job since,
        and a member that kept its old stop could otherwise end every copy of the new run."""
        active = self.active
        if active is None or active.id != job_id or active.stop_reason is not None:
            return
        if active.origin is not None and peer_id != active.origin:
            log.warning("job %s: a stop from peer %s refused; only its origin %s stops it on "
                        "every peer", job_id, peer_id, active.origin)  # fmt: skip
            raise _origin_only(job_id, active.origin)
        if run is not None and run < active.run:
            log.warning("job %s: a stop of its run %d refused (told by peer %s); this "
                        "daemon trains run %d", job_id, run, (via or peer_id)[:12],
                        active.run)  # fmt: skip
            raise JobConflictError(
                f"a stop of run {run} of job {job_id}; this daemon trains its run {active.run}, "
                "which its origin started after that stop"
            )
        told = "" if via is None else f", told by peer {via[:12]}"
        await self._request_stop(active, f"{SWARM_STOP_REASON} (peer {peer_id[:12]}{told})")

    async def _request_stop(self, active: ActiveJob, reason: str) -> JobRecord:
        active.stop_reason = reason
        active.stop()
        return await self._set_state(active.id, "stopping", reason, "job.stopping", reason)

    def offer(self, advert: dict[str, Any], donors: list[str]) -> None:
        """A peer trains ``advert``: join it if we are free and have never had it."""
        job_id = str(advert.get("id", ""))
        if (
            self._tg is None
            or self._closing.is_set()
            or self.active is not None
            or not job_id
            or job_id in self._considering
        ):
            return
        self._considering.add(job_id)
        self._tg.create_task(self._join(job_id, advert, donors), name=f"join-{job_id}")

    def _disk_problem(self, spec: JobSpec) -> str | None:
        """Why this daemon's disk cannot hold the checkpoints a swarm's job asks it to keep
        (``keep_checkpoints``, and one more while the next is written, each about
        CHECKPOINT_MODEL_SIZES fp32 models), or None. A member's advert chooses them: up to
        1,000 kept, which would fill the disk of every peer that joined (a review of
        2026-12-06)."""
        size = CHECKPOINT_MODEL_SIZES * 4 * num_parameters(spec.model_shape)
        need = (spec.keep_checkpoints + 1) * size
        where = self.jobs_dir
        while not where.exists() and where.parent != where:
            where = where.parent
        free = shutil.disk_usage(where).free
        if need <= free:
            return None
        return (
            f"keeping {spec.keep_checkpoints} checkpoints of this model takes up to "
            f"{need / 2**30:.1f} GiB, and {free / 2**30:.1f} GiB are free under {where}"
        )

    async def _refuse_join(self, job_id: str, problem: str) -> None:
        """Not joining the swarm's ``job_id``: say why in the log and a ``job.refused`` event."""
        log.warning("not joining the swarm's job %s: %s", job_id, problem)
        async with self.sessions() as s, s.begin():
            await repo.add_event(s, kind="job.refused", job_id=job_id,
                                 message=f"not joined: {problem}")  # fmt: skip

    async def _join(self, job_id: str, advert: dict[str, Any], donors: list[str]) -> None:
        try:
            run = int(advert.get("run") or 0)
            if self.swarm is not None and run < self.swarm.latest_run(job_id):
                return  # a later run was heard of since: its advert is offered in turn
            async with self.sessions() as s:
                had = await repo.get_job(s, job_id=job_id)
            if had is not None:  # stopped, finished or failed here: not joined again, but
                await self._rejoin(had, advert)  # a later run of a stop of the swarm's
                return
            spec = JobSpec.model_validate(advert.get("spec", {}))
            problem = advert_problem(spec, self.data_names)
            if problem is not None:
                await self._refuse_join(job_id, problem)
                return
            if spec.num_shards > 1:
                spec = spec.model_copy(
                    update={"shard_index": shard_for_peer(self.peer_id, spec.num_shards)}
                )
            try:
                admit(local_data(spec, self.data_names), self.device)
            except SpecError as e:  # e.g. an advert's micro-batch whose activations do not fit
                await self._refuse_join(job_id, str(e))
                return
            problem = self._disk_problem(spec)
            if problem is not None:
                await self._refuse_join(job_id, problem)
                return
            async with self._launching:
                if self.active is not None or self._closing.is_set():
                    return
                out_dir = self.job_dir(job_id)
                origin = str(advert.get("origin") or "") or None
                # The origin's seal of the advert (``SwarmNode`` checked it), carried on in ours.
                key, signature = advert.get("origin_key"), advert.get("signature")
                async with self.sessions() as s, s.begin():
                    await repo.create_job(
                        s,
                        job_id=job_id,
                        spec=spec.model_dump(),
                        out_dir=str(out_dir),
                        scope="swarm",
                        origin=origin,
                        origin_key=key,
                        origin_signature=signature,
                        run=run,
                    )
                    await repo.add_event(
                        s,
                        kind="job.joined",
                        job_id=job_id,
                        message=f"joined the swarm's job from {origin or 'a peer'}",
                    )
                self._launch(
                    ActiveJob(
                        id=job_id, spec=spec, out_dir=out_dir, resume=True, scope="swarm",
                        origin=origin, donors=donors, origin_key=key, origin_signature=signature,
                        run=run,
                    )
                )  # fmt: skip
        except (AtomdError, ValueError) as e:
            log.warning("not joining job %s: %s", job_id, e)
        finally:
            self._considering.discard(job_id)

    # -- internals ---------------------------------------------------------------------------

    def stopped_swarm_wide(self, job_id: str) -> int | None:
        """The run of ``job_id`` this daemon started and stopped on every peer (and has not
        resumed since), or None."""
        return self._swarm_stopped.get(job_id)

    async def _resume_interrupted(self) -> None:
        async with self.sessions() as s:
            jobs = await repo.active_jobs(s)
            # Whatever this copy's state (a SIGKILL may have left it "stopping"; it may have
            # finished or failed); a resume here since takes it out.
            self._swarm_stopped.update(await repo.swarm_stopped_jobs(s, limit=SWARM_STOPS_KEPT))
        for job in jobs:
            if self.active is not None and job.id == self.active.id:
                continue  # taken up by a try before that another process's lock cut short
            if job.state == "stopping":
                # Someone asked it to stop and the daemon died first: honour the stop (and say
                # who: a copy the swarm stopped rejoins a later run, ``_rejoin``).
                reason = job.reason or "stopped"
                await self._set_state(
                    job.id, "stopped", f"{reason} (daemon restarted)", "job.stopped", ""
                )
                continue
            if self.active is not None:
                await self._set_state(
                    job.id, "failed", "another job was resumed first", "job.failed", ""
                )
                continue
            log.info("resuming job %s from %s", job.id, job.out_dir)
            # Pending until the trainer has loaded the checkpoint and runs again.
            await self._set_state(job.id, "pending", RESUMING_REASON, "job.resuming", "")
            self._launch(_resumed(job, JobSpec.model_validate(job.spec)))

    def _launch(self, active: ActiveJob) -> None:
        assert self._tg is not None, "JobManager.run() is not running"
        assert self.active is None, f"job {self.active.id} is active"  # ``_launching``
        self.active = active
        self.telemetry.job_launched()
        if self._closing.is_set():  # shutdown came while it was recorded: stop as it would
            active.stop()
        if active.scope == "swarm" and self.swarm is not None and self.exchange is not None:
            # From now on its frames are kept until its plugin exists: a restarted daemon
            # loads torch for seconds while the others already send it their rounds.
            self.exchange.expect(active.id, active.spec)
        self._tg.create_task(self._drive(active), name=f"job-{active.id}")

    def _train_blocking(self, active: ActiveJob, loop: asyncio.AbstractEventLoop) -> TrainSummary:
        """Runs on the trainer thread."""
        from atomd.engines import build_engine
        from atomd.train.trainer import Trainer

        def send(item: _Message) -> None:
            loop.call_soon_threadsafe(active.queue.put_nowait, item)

        spec = local_data(active.spec, self.data_names)
        built = build_engine(spec, self.device)
        trainer = Trainer(
            spec,
            active.out_dir,
            built.engine,
            plan=built.plan,
            resume=active.resume,
            on_report=send,
            on_checkpoint=lambda path, step: send(_Saved(path, step)),
            stop_event=active.stop_event,
            data_seed=data_seed(self.peer_id, active.spec.seed),
            plugin=active.plugin,
            adopt_step=active.adopt_step,
            adopt_claim=active.claimed_val,
            adopt_from=active.adopt_from,
            snapshots=active.snapshots,
        )
        if active.resume:
            rows = read_metrics(trainer.metrics.path) if trainer.metrics.path.exists() else []
            send(_Resumed(trainer.start_step, rows))
        send(_Started(trainer.start_step))
        return trainer.run()

    async def _drive(self, active: ActiveJob) -> None:
        loop = asyncio.get_running_loop()
        try:
            # torch and the trainer load off the loop (seconds on a busy machine), before
            # anything below imports them on it.
            await asyncio.to_thread(load_training_modules)
            left = await asyncio.to_thread(remove_partial, checkpoint_root(active.out_dir))
            if left:
                log.info("job %s: removed %d half-written folder(s) a crash left: %s",
                         active.id, len(left), ", ".join(left))  # fmt: skip
            if self._hash_pending(active):
                await self._pin_data(active)
            while True:  # again with another donor while the trainer refuses a donor's state
                if active.scope == "swarm" and self.swarm is not None:
                    if self.exchange is not None and active.plugin is None:
                        # first: the kept frames wait for its state
                        active.plugin = self.exchange.plugin(
                            active.id, active.spec, may_retake=active.retakes < RETAKES
                        )
                    if not await self._take_swarm_state(active):
                        return
                    from atomd.train.trainer import SnapshotRequests

                    active.snapshots = SnapshotRequests()
                fut = loop.run_in_executor(self._executor, self._train_blocking, active, loop)
                await self._follow(active, fut)
                if await self._moved_on(active, fut):
                    continue
                if not await self._donor_refused(active, fut):
                    break
            await self._finish(active, fut)
        finally:
            self._release(active)
            if self.active is None and not self._closing.is_set():
                self.telemetry.job_state.state("none")

    async def _follow(self, active: ActiveJob, fut: asyncio.Future[TrainSummary]) -> None:
        """Record what the trainer reports until it has returned and said everything."""
        while not fut.done() or not active.queue.empty():
            getter = asyncio.ensure_future(active.queue.get())
            waiting: set[asyncio.Future[Any]] = {fut, getter}
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                continue
            items = [getter.result()]
            while not active.queue.empty():
                items.append(active.queue.get_nowait())
            await self._record_when_room(active, items)

    async def _record_when_room(self, active: ActiveJob, items: Sequence[_Message]) -> None:
        """``_record``, again while the database's disk is full, for up to RECORD_FULL_S, and
        while another process holds the database, for as long as it does (the reports wait in
        the queue meanwhile; ``until_unlocked``). The trainer's checkpoint can fill the disk
        for a moment before it fails and is removed (the job then fails with the reason): a
        progress commit in that moment raised out of the job's task and ended the daemon (CI,
        2026-12-06, the full-disk test). Past the bound the items are dropped, said in the log
        (the trainer's metrics.jsonl has them)."""
        deadline = time.monotonic() + RECORD_FULL_S
        while True:
            try:
                await until_unlocked(
                    f"recording job {active.id}'s progress", lambda: self._record(active, items),
                    give_up=self._closing.is_set,
                )  # fmt: skip
                return
            except OperationalError as e:
                if is_locked(e):  # only once the daemon shuts down
                    log.error("job %s: %d report(s) of the trainer not recorded: the database "
                              "is locked by another process", active.id, len(items))  # fmt: skip
                    return
                if "full" not in str(e):
                    raise
                if time.monotonic() >= deadline:
                    log.error("job %s: %d report(s) of the trainer not recorded: the database's "
                              "disk is full", active.id, len(items))  # fmt: skip
                    return
                await asyncio.sleep(RECORD_RETRY_S)

    async def _take_swarm_state(self, active: ActiveJob) -> bool:
        """Before a swarm job trains here: fetch the swarm's newest state from a peer that
        trains it, when that is newer than our own checkpoint (retaking, ``_moved_on``: at
        whatever step, our own checkpoints past it removed: they hold the rounds this peer
        closed alone, and a peer cut off trains faster alone). False if the job ended here:
        it failed, or a stop or a shutdown came while it waited for donors or a transfer
        (recorded as ``_finish`` would, at its newest checkpoint's step; the transfer is
        cancelled and its partial folder removed: a SIGTERM waited out its 15 minutes)."""
        assert self.swarm is not None
        retake, active.retaking = active.retaking, False
        donors = active.donors
        root = checkpoint_root(active.out_dir)
        own = await asyncio.to_thread(list_checkpoints, root)
        own_step = checkpoint_step(own[0]) if own else 0
        if not donors and active.resume:
            # Restarted: wait until the membership can tell who trains the job now.
            donors = await self.swarm.settled_donors(active.id, give_up=active.stopping.is_set)
        if active.stopping.is_set():
            await self._record_end(active, "stopped", own_step)
            return False
        if not donors:
            return True
        # A donor whose swarm has closed no round yet answers "no state": the initial weights
        # are the swarm's model then, and the joiner starts from them at round 0 like it.
        at_least = 1 if retake else own_step + 1
        try:
            fetched, got = await unless_set(
                active.stopping,
                self.swarm.fetch_state(
                    active.id, donors, root, max_file_bytes=state_file_bound(active.spec),
                    at_least=at_least,
                ),
            )  # fmt: skip
        except AtomdError as e:
            if own:  # our own checkpoint still serves: resume from it
                log.warning("job %s: %s; resuming from our own checkpoint", active.id, e)
                return True
            await self._set_state(
                active.id, "failed", str(e), "job.failed", str(e),
                functools.partial(self._release, active),
            )  # fmt: skip
            return False
        if not fetched:  # a stop or SIGTERM must not wait out a transfer (15 minutes)
            log.info("job %s: stopped; the state transfer is cancelled", active.id)
            await self._record_end(active, "stopped", own_step)
            return False
        if got is not None and retake:
            await asyncio.to_thread(remove_checkpoints_after, root, got.step)
        if got is not None and (retake or got.step >= own_step):
            active.adopt_step, active.claimed_val = got.step, got.claimed_val
            active.adopt_from = got.donor_id
            log.info("job %s continues from the swarm's state at step %d", active.id, got.step)
        return True

    async def _moved_on(self, active: ActiveJob, fut: asyncio.Future[TrainSummary]) -> bool:
        """Whether the trainer ended because the swarm has moved on past what it can merge
        (``SwarmMovedOnError``: it was stopped or cut off for a while) and the job should take
        the swarm's state again, as a restarted daemon does: from a peer that trains it now,
        if newer than the checkpoint the trainer wrote as it ended (``_take_swarm_state``),
        with a fresh plugin. Up to RETAKES times a job."""
        e = None if fut.cancelled() else fut.exception()
        if not isinstance(e, SwarmMovedOnError) or self.swarm is None:
            return False
        active.retakes += 1
        # A fresh plugin at once, before anything is awaited: the frames that come from now
        # on are kept for it until it holds the state (the old one's inbox has no trainer).
        active.plugin = None
        if self.exchange is not None:
            active.plugin = self.exchange.plugin(
                active.id, active.spec, may_retake=active.retakes < RETAKES
            )
        active.resume, active.donors, active.retaking = True, [], True
        active.adopt_step = active.claimed_val = active.adopt_from = None
        log.warning("job %s: step %d: %s (%d of %d)", active.id, e.step, e, active.retakes,
                    RETAKES)  # fmt: skip
        async with self.sessions() as s, s.begin():
            await repo.add_event(s, kind="job.retake", job_id=active.id,
                                 message=f"step {e.step}: {e}")  # fmt: skip
        return True

    async def _donor_refused(self, active: ActiveJob, fut: asyncio.Future[TrainSummary]) -> bool:
        """Whether the trainer refused a state another peer gave (``DonorStateError``) and the
        job should take another: its checkpoint is removed, its donor (the one the checkpoint's
        ``DONATED_FILE`` names: the fetch writes it, the trainer removes it once the state
        passed) is not asked again, up to DONOR_TRIES states."""
        e = None if fut.cancelled() else fut.exception()
        if not isinstance(e, DonorStateError) or self.swarm is None:
            return False
        where = checkpoint_dir(checkpoint_root(active.out_dir), e.step)
        named = where / DONATED_FILE
        donor = await asyncio.to_thread(named.read_text) if named.exists() else None
        active.tries += 1
        log.warning("job %s: %s; not asking %s again", active.id, e, donor or "its donor")
        if donor:
            self.swarm.distrust(donor)
        await asyncio.to_thread(shutil.rmtree, where, True)
        async with self.sessions() as s, s.begin():
            await repo.add_event(s, kind="job.state_refused", job_id=active.id,
                                 message=f"{e} (from {donor or 'a peer'})")  # fmt: skip
        active.donors = [d for d in active.donors if d != donor]
        active.adopt_step = active.claimed_val = active.adopt_from = None
        # The next try gets a fresh plugin, as the first did: this one holds the refused
        # trainer's model and the sync state built on it (a second model beside it on the
        # device), and the refused donor's anchor and round, with the frames queued since.
        active.plugin = None
        return active.tries < DONOR_TRIES

    async def _record(self, active: ActiveJob, items: Sequence[_Message]) -> None:
        points: list[ProgressPoint] = []
        async with self.sessions() as s, s.begin():
            for item in items:
                if isinstance(item, _Resumed):
                    await repo.delete_progress_after(s, job_id=active.id, step=item.start_step)
                    # What the records lack (a crash loses the last reports, a full disk
                    # some in between), but not the older points they thinned on purpose
                    # (``repo.thin_progress``): those would only be thinned again.
                    thinned = await repo.thinned_until(s, job_id=active.id, keep=self.progress_keep)
                    backfill = [
                        _point(r) for r in item.rows
                        if (thinned is None or int(r["step"]) > thinned)
                        and int(r["step"]) <= item.start_step
                    ]  # fmt: skip
                    await repo.add_progress(s, job_id=active.id, points=backfill)
                    await repo.add_event(
                        s, kind="job.resumed", job_id=active.id,
                        message=f"resumed from step {item.start_step}",
                    )  # fmt: skip
                elif isinstance(item, _Saved):
                    try:
                        digest = await asyncio.to_thread(
                            sha256_file, item.path / "model.safetensors"
                        )
                    except FileNotFoundError:
                        # Recorded late (the database was locked), and pruned since by the
                        # trainer's ``keep_checkpoints``: nothing to record.
                        log.info("job %s: checkpoint %s was removed before it was recorded",
                                 active.id, item.path.name)  # fmt: skip
                        continue
                    await repo.add_checkpoint(
                        s, job_id=active.id, step=item.step, path=str(item.path), sha256=digest
                    )
                    await repo.advance_job(
                        s, job_id=active.id, step=item.step,
                        tokens=item.step * active.spec.tokens_per_step,
                    )  # fmt: skip
                    self.telemetry.checkpoints.inc()
                elif isinstance(item, _Started):
                    active.step = item.start_step
                    active.tokens_seen = item.start_step * active.spec.tokens_per_step
                    self.telemetry.step.set(item.start_step)
                    if not active.stop_event.is_set():
                        await repo.set_job_state(s, job_id=active.id, state="running")
                        await repo.add_event(s, kind="job.running", job_id=active.id, message="")
                        self.telemetry.job_state.state("running")
                else:
                    active.step = max(active.step, item.step)
                    points.append(_point(item))
            if points:
                await repo.add_progress(s, job_id=active.id, points=points)
        self._log_progress(active, points)
        for p in points:
            self.telemetry.step.set(p.step)
            self.telemetry.loss.set(p.loss)
            self.telemetry.tokens_per_s.set(p.tokens_per_s)
            if p.val_loss is not None:
                self.telemetry.val_loss.set(p.val_loss)
            self.telemetry.tokens.inc(max(0, p.tokens - active.tokens_seen))
            active.tokens_seen = max(active.tokens_seen, p.tokens)

    async def _pin_data(self, active: ActiveJob) -> None:
        """Hash the data of a swarm job started here (off the loop, before its trainer is
        built: the announce waits for it), put the hash into the job's spec (recorded), then
        announce the job: every peer that joins checks its own tokens against it. Data that
        cannot be read is left to the trainer, which fails the job with the reason."""
        from atomd.data.dataset import source_sha256
        from atomd.data.tokenizer import load_tokenizer

        spec = local_data(active.spec, self.data_names)
        try:
            sha256 = await asyncio.to_thread(
                lambda: source_sha256(spec.data, load_tokenizer(spec.tokenizer), spec.text_field)
            )
        except AtomdError as e:
            log.warning("job %s: data not hashed: %s", active.id, e)
            return
        active.spec = active.spec.model_copy(update={"data_sha256": sha256})
        async with self.sessions() as s, s.begin():
            await repo.set_job_spec(s, job_id=active.id, spec=active.spec.model_dump())
            await repo.add_event(
                s, kind="job.data_hash", job_id=active.id,
                message=f"data {active.spec.data[:200]!r} hashes to {sha256}: peers must match it",
            )  # fmt: skip
        advert = self.advert()
        if advert is not None and self.swarm is not None:
            self.swarm.announce(advert)

    def _log_progress(self, active: ActiveJob, points: Sequence[ProgressPoint]) -> None:
        """One line per job every ``PROGRESS_LOG_INTERVAL_S`` and at each evaluation."""
        if not points:
            return
        now = time.monotonic()
        last = points[-1]
        evaluated = [p for p in points if p.val_loss is not None]
        if not evaluated and now - active.logged_at < PROGRESS_LOG_INTERVAL_S:
            return
        active.logged_at = now
        val = f", val {evaluated[-1].val_loss:.3f}" if evaluated else ""
        log.info(
            "job %s: step %d/%d, loss %.3f%s, %s tokens/s",
            active.id[:12], last.step, active.spec.total_steps, last.loss, val,
            f"{last.tokens_per_s:,.0f}",
        )  # fmt: skip

    def _release(self, active: ActiveJob) -> None:
        """The daemon is free for another job: called as the job's last state is committed,
        with no await in between, so a client that reads that state can start the next job."""
        if self.active is not active:
            return
        self.active = None
        self.telemetry.job_ended()
        if self.exchange is not None and active.scope == "swarm":
            self.exchange.release(active.id)

    async def _finish(self, active: ActiveJob, fut: asyncio.Future[TrainSummary]) -> None:
        release = functools.partial(self._release, active)
        try:
            summary = fut.result()
        except AtomdError as e:
            await self._set_state(active.id, "failed", str(e), "job.failed", str(e), release)
            return
        except Exception as e:  # a bug, not bad input: keep the traceback in the log
            log.exception("job %s crashed", active.id)
            reason = f"{type(e).__name__}: {e}"
            await self._set_state(active.id, "failed", reason, "job.failed", reason, release)
            return
        await self._record_end(active, summary.state, summary.step)

    async def _record_end(
        self, active: ActiveJob, state: Literal["finished", "stopped"], step: int
    ) -> None:
        """Record how a job ended without an error: finished, stopped by request, or
        interrupted by a shutdown (pending: it resumes from its checkpoint at ``step``)."""
        release = functools.partial(self._release, active)
        at = f"step {step}"
        if state == "finished":
            await self._set_state(active.id, "finished", None, "job.finished", at, release)
        elif active.stop_reason is not None:
            await self._set_state(
                active.id, "stopped", active.stop_reason, "job.stopped", at, release
            )
        else:
            await self._set_state(
                active.id, "pending", SHUTDOWN_REASON, "job.interrupted",
                f"checkpointed at {at}", release,
            )  # fmt: skip

    async def _set_state(
        self,
        job_id: str,
        state: JobState,
        reason: str | None,
        kind: str,
        message: str,
        committed: Callable[[], None] | None = None,
        run: Callable[[AsyncSession], Awaitable[int]] | None = None,
    ) -> JobRecord:
        """Record a job's state and its event; ``committed`` runs right after the commit;
        ``run`` changes the job's run in the same transaction (the event then names it).
        Another process's write lock is waited out (``until_unlocked``; until a shutdown, whose
        next start repairs the record): a state change that failed on it ended the job's task,
        and with it the daemon. State changes commit in the order they were asked for."""

        async def write() -> JobRecord:
            async with self.sessions() as s:
                async with s.begin():
                    said = message if run is None else f"run {await run(s)}"
                    job = await repo.set_job_state(s, job_id=job_id, state=state, reason=reason)
                    await repo.add_event(s, kind=kind, job_id=job_id, message=said)
                # Before ``committed`` frees the daemon: the next job's launch sets its own.
                self.telemetry.job_state.state(state)
                if committed is not None:
                    committed()
            return job

        async with self._state_writes:
            job = await until_unlocked(
                f"recording job {job_id} {state}", write, give_up=self._closing.is_set
            )
        level = logging.ERROR if state == "failed" else logging.INFO
        log.log(level, "job %s: %s%s", job_id, state, f" ({reason})" if reason else "")
        return job
