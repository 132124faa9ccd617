"""Writing a job's life to the database: its states and events, and what its trainer reports
(progress points, checkpoints, its start and resume), with the telemetry that mirrors them."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any, Literal

from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from atomd.db import repo
from atomd.db.health import is_locked, until_unlocked
from atomd.db.schemas import JobRecord, JobState, ProgressPoint
from atomd.jobs.active import (
    ActiveJob,
    CheckpointSaved,
    TrainerMessage,
    TrainerResumed,
    TrainerStarted,
)
from atomd.logs import get_logger
from atomd.telemetry import Telemetry
from atomd.train.checkpoint import sha256_file
from atomd.train.metrics import StepReport

log = get_logger("atomd.jobs")

# Job progress goes to the daemon's log at most this often (and at every evaluation).
PROGRESS_LOG_INTERVAL_S = 30.0
SHUTDOWN_REASON = "interrupted by daemon shutdown; resumes when the daemon starts"
# How long the trainer's reports wait for room on a full disk (``record_when_room``).
RECORD_FULL_S = 30.0
RECORD_RETRY_S = 0.5


def progress_point(r: StepReport | dict[str, Any], at: datetime | None = None) -> ProgressPoint:
    """A trainer's step report, or a row of its ``metrics.jsonl``, as a progress point."""
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


class JobRecorder:
    """Records jobs in the database. ``closing``: set at shutdown, when the waits for another
    process's write lock give up."""

    def __init__(
        self,
        *,
        sessions: async_sessionmaker[AsyncSession],
        telemetry: Telemetry,
        progress_keep: int,
        closing: asyncio.Event,
    ) -> None:
        self.sessions = sessions
        self.telemetry = telemetry
        # Points kept at full resolution (``atomd.db.retention``): a resume backfills those.
        self.progress_keep = progress_keep
        self._closing = closing
        # A job's state changes commit in the order they were asked for: a stop's "stopping"
        # and the end a cancelled transfer writes at once could wait on another process's
        # lock side by side, and the later commit would win ("stopping" for ever, nothing
        # running).
        self._state_writes = asyncio.Lock()

    async def event(self, job_id: str, kind: str, message: str) -> None:
        """One event of ``job_id``, in a transaction of its own."""
        async with self.sessions() as s, s.begin():
            await repo.add_event(s, kind=kind, job_id=job_id, message=message)

    async def set_state(
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
        next start repairs the record): a state change that failed on it would end the job's
        task, and with it the daemon. State changes commit in the order they were asked for."""

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

    async def record_end(
        self,
        active: ActiveJob,
        state: Literal["finished", "stopped"],
        step: int,
        release: Callable[[], None],
    ) -> None:
        """Record how a job ended without an error: finished, stopped by request, or
        interrupted by a shutdown (pending: it resumes from its checkpoint at ``step``);
        ``release`` runs as the state is committed."""
        at = f"step {step}"
        if state == "finished":
            await self.set_state(active.id, "finished", None, "job.finished", at, release)
        elif active.stop_reason is not None:
            await self.set_state(
                active.id, "stopped", active.stop_reason, "job.stopped", at, release
            )
        else:
            await self.set_state(
                active.id, "pending", SHUTDOWN_REASON, "job.interrupted",
                f"checkpointed at {at}", release,
            )  # fmt: skip

    async def record_when_room(self, active: ActiveJob, items: Sequence[TrainerMessage]) -> None:
        """``record``, again while the database's disk is full, for up to RECORD_FULL_S, and
        while another process holds the database, for as long as it does (the reports wait in
        the queue meanwhile; ``until_unlocked``). The trainer's checkpoint can fill the disk
        for a moment before it fails and is removed (the job then fails with the reason): a
        progress commit in that moment must not raise out of the job's task and end the
        daemon. Past the bound the items are dropped, said in the log (the trainer's
        metrics.jsonl has them)."""
        deadline = time.monotonic() + RECORD_FULL_S
        while True:
            try:
                await until_unlocked(
                    f"recording job {active.id}'s progress", lambda: self.record(active, items),
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

    async def record(self, active: ActiveJob, items: Sequence[TrainerMessage]) -> None:
        """Record what the trainer reported, in one transaction, then mirror it in telemetry."""
        points: list[ProgressPoint] = []
        async with self.sessions() as s, s.begin():
            for item in items:
                if isinstance(item, TrainerResumed):
                    await self._resumed(s, active, item)
                elif isinstance(item, CheckpointSaved):
                    await self._saved(s, active, item)
                elif isinstance(item, TrainerStarted):
                    active.step = item.start_step
                    active.tokens_seen = item.start_step * active.spec.tokens_per_step
                    self.telemetry.step.set(item.start_step)
                    if not active.stop_event.is_set():
                        await repo.set_job_state(s, job_id=active.id, state="running")
                        await repo.add_event(s, kind="job.running", job_id=active.id, message="")
                        self.telemetry.job_state.state("running")
                else:
                    active.step = max(active.step, item.step)
                    points.append(progress_point(item))
            if points:
                await repo.add_progress(s, job_id=active.id, points=points)
        self.log_progress(active, points)
        for p in points:
            self.telemetry.step.set(p.step)
            self.telemetry.loss.set(p.loss)
            self.telemetry.tokens_per_s.set(p.tokens_per_s)
            if p.val_loss is not None:
                self.telemetry.val_loss.set(p.val_loss)
            self.telemetry.tokens.inc(max(0, p.tokens - active.tokens_seen))
            active.tokens_seen = max(active.tokens_seen, p.tokens)

    async def _resumed(self, s: AsyncSession, active: ActiveJob, item: TrainerResumed) -> None:
        await repo.delete_progress_after(s, job_id=active.id, step=item.start_step)
        # What the records lack (a crash loses the last reports, a full disk some in between),
        # but not the older points they thinned on purpose (``repo.thin_progress``): those
        # would only be thinned again.
        thinned = await repo.thinned_until(s, job_id=active.id, keep=self.progress_keep)
        backfill = [
            progress_point(r) for r in item.rows
            if (thinned is None or int(r["step"]) > thinned) and int(r["step"]) <= item.start_step
        ]  # fmt: skip
        await repo.add_progress(s, job_id=active.id, points=backfill)
        await repo.add_event(
            s, kind="job.resumed", job_id=active.id, message=f"resumed from step {item.start_step}"
        )

    async def _saved(self, s: AsyncSession, active: ActiveJob, item: CheckpointSaved) -> None:
        try:
            digest = await asyncio.to_thread(sha256_file, item.path / "model.safetensors")
        except FileNotFoundError:
            # Recorded late (the database was locked), and pruned since by the trainer's
            # ``keep_checkpoints``: nothing to record.
            log.info("job %s: checkpoint %s was removed before it was recorded",
                     active.id, item.path.name)  # fmt: skip
            return
        await repo.add_checkpoint(
            s, job_id=active.id, step=item.step, path=str(item.path), sha256=digest
        )
        await repo.advance_job(
            s, job_id=active.id, step=item.step, tokens=item.step * active.spec.tokens_per_step
        )
        self.telemetry.checkpoints.inc()

    def log_progress(self, active: ActiveJob, points: Sequence[ProgressPoint]) -> None:
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
