"""The job manager: one training job at a time, and the commands and queries about jobs."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from pathlib import Path

from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from atomd.config import PROGRESS_KEEP
from atomd.db import repo
from atomd.db.health import is_locked, until_unlocked
from atomd.db.schemas import JobRecord, ProgressPoint
from atomd.errors import JobConflictError, NotFoundError
from atomd.jobs.active import ActiveJob, Scope, resumed_job
from atomd.jobs.admission import admit, local_data
from atomd.jobs.donor_state import SwarmStateTaker
from atomd.jobs.driving import JobDriver
from atomd.jobs.joining import SWARM_STOP_REASON, SwarmJoiner
from atomd.jobs.links import DeltaLink, JobLinks, SwarmLink
from atomd.jobs.recording import JobRecorder
from atomd.logs import get_logger
from atomd.p2p.messages import JobAdvert, job_id_for
from atomd.spec import JobSpec
from atomd.telemetry import Telemetry

log = get_logger("atomd.jobs")

SWARM_STOPS_KEPT = 100  # the newest swarm-wide stops a restarted daemon still tells stragglers
RESUMING_REASON = "resuming from the last good checkpoint"


def _origin_only(job_id: str, origin: str, more: str = "") -> JobConflictError:
    """The refusal of a swarm-wide stop of ``job_id`` by a daemon other than its ``origin``."""
    return JobConflictError(
        f"job {job_id} was started by peer {origin}: only its origin stops it on every peer{more}"
    )


class JobManager:
    """Starts, stops and answers for jobs; ``run()`` lives in the daemon's TaskGroup. Its parts:
    ``recorder`` (the database), ``driver`` (the trainer thread), ``donor_state`` (a swarm
    job's state from its donors) and ``joiner`` (the swarm's jobs this daemon takes up)."""

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
        self.telemetry = telemetry
        self.device = device
        self.peer_id = peer_id
        self.links = JobLinks()
        self.active: ActiveJob | None = None
        self.task_group: asyncio.TaskGroup | None = None  # ``run()``'s: the per-job tasks
        self._closing = asyncio.Event()
        self._started = asyncio.Event()
        # Check free, record, launch: one job at a time (two POSTs at once would both find the
        # daemon free across the record's await, and the second job would orphan the first).
        self.launching = asyncio.Lock()
        # Swarm jobs this daemon started and stopped swarm-wide, not resumed since: job id ->
        # the run the stop ended (``StopNotice.run``). A member that missed the stop (asleep,
        # cut off, restarted) and advertises one is told again (``SwarmNode``).
        self._swarm_stopped: dict[str, int] = {}
        self.recorder = JobRecorder(
            sessions=sessions, telemetry=telemetry, progress_keep=progress_keep,
            closing=self._closing,
        )  # fmt: skip
        self.donor_state = SwarmStateTaker(self.links, self.recorder, self.release)
        self.driver = JobDriver(self, trainer_nice)
        self.joiner = SwarmJoiner(self)

    # The links the daemon sets once the swarm is up (``atomd.daemon``).

    @property
    def swarm(self) -> SwarmLink | None:
        return self.links.swarm

    @swarm.setter
    def swarm(self, swarm: SwarmLink | None) -> None:
        self.links.swarm = swarm

    @property
    def exchange(self) -> DeltaLink | None:
        return self.links.exchange

    @exchange.setter
    def exchange(self, exchange: DeltaLink | None) -> None:
        self.links.exchange = exchange

    @property
    def data_names(self) -> dict[str, str]:
        """The datasets registered by name: name -> local path."""
        return self.links.data_names

    @data_names.setter
    def data_names(self, names: dict[str, str]) -> None:
        self.links.data_names = names

    @property
    def sessions(self) -> async_sessionmaker[AsyncSession]:
        return self.recorder.sessions

    @sessions.setter
    def sessions(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self.recorder.sessions = sessions

    @property
    def closing(self) -> bool:
        """Whether the daemon shuts down (``shutdown()``)."""
        return self._closing.is_set()

    async def run(self) -> None:
        """Own the per-job tasks until ``shutdown()``; resume interrupted jobs first."""
        try:
            async with asyncio.TaskGroup() as tg:
                self.task_group = tg
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
            self.driver.executor.shutdown(wait=True)

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

    def advert(self) -> JobAdvert | None:
        """The swarm job this daemon trains, as told to peers (None if none)."""
        a = self.active
        if a is None or a.scope != "swarm" or a.stop_event.is_set() or self.driver.hash_pending(a):
            return None
        return JobAdvert(
            id=a.id, spec=a.spec, origin=a.origin, origin_key=a.origin_key,
            signature=a.origin_signature, run=a.run,
        )  # fmt: skip

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

    def stopped_swarm_wide(self, job_id: str) -> int | None:
        """The run of ``job_id`` this daemon started and stopped on every peer (and has not
        resumed since), or None."""
        return self._swarm_stopped.get(job_id)

    async def live_state(self, job_id: str, at_least: int = 0) -> bool:
        """Checkpoint the live state of ``job_id`` for a joining peer (``JobDriver.live_state``)."""
        return await self.driver.live_state(job_id, at_least)

    def job_dir(self, job_id: str) -> Path:
        return self.jobs_dir / job_id

    # -- commands ----------------------------------------------------------------------------

    def _check_started(self) -> None:
        """Refuse a command before the jobs the daemon's last run left are taken up: a job a
        SIGKILL interrupted still reads "running" then, and a job started meanwhile would make
        it fail ("another job was resumed first"). ``GET /readyz`` says when."""
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
        async with self.launching:
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
            self.launch(active)
        if scope == "swarm" and self.swarm is not None:
            advert = self.advert()
            if advert is not None:
                self.swarm.announce(advert)
        return job

    async def resume(self, job_id: str, later: tuple[int, str] | None = None) -> JobRecord:
        """Continue a stopped or failed job here from its newest good checkpoint (a job that
        stopped on a full disk, once there is space again). ``later``: a joined copy goes on
        in that later run of its origin's, sealed by that signature (``SwarmJoiner.rejoin``)."""
        async with self.launching:
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
            job = await self.recorder.set_state(
                job_id, "pending", RESUMING_REASON, "job.resuming", "", run=run
            )
            self._swarm_stopped.pop(job_id, None)
            self.launch(resumed_job(job, spec))
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
                await self.recorder.event(job_id, "job.swarm_stopped", f"run {job.run}")
                self._swarm_stopped[job_id] = job.run  # once recorded: a failed write is retried
            swarm.broadcast_stop(job_id, job.run)
        active = self.active
        if active is None or active.id != job_id:
            if scope == "swarm":
                return job  # not training it here, but the swarm has been told
            raise JobConflictError(f"job {job_id} is {job.state}, not active; nothing to stop")
        return await self.request_stop(active, "stopped by request")

    async def stop_from_peer(
        self, job_id: str, peer_id: str, via: str | None = None, run: int | None = None
    ) -> None:
        """A peer stopped ``job_id`` swarm-wide: stop our copy (if we train it), if that peer
        started the job. ``JobConflictError`` from another: any member could otherwise end
        every peer's copy of every job with one message each, and a stopped job is not joined
        again. ``via``: the member that passed on the origin's signed stop
        (``atomd.p2p.messages.StopNotice``), checked there; ``run``: the run it ends, and
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
        await self.request_stop(active, f"{SWARM_STOP_REASON} (peer {peer_id[:12]}{told})")

    async def request_stop(self, active: ActiveJob, reason: str) -> JobRecord:
        """Stop ``active`` for ``reason``, recorded as stopping until the trainer has stopped."""
        active.stop_reason = reason
        active.stop()
        return await self.recorder.set_state(active.id, "stopping", reason, "job.stopping", reason)

    def offer(self, advert: JobAdvert, donors: list[str]) -> None:
        """A peer trains ``advert``: join it if we are free and have never had it."""
        self.joiner.offer(advert, donors)

    async def newer_run(self, advert: JobAdvert) -> None:
        """The origin signed a later run of the job trained here (``SwarmJoiner.newer_run``)."""
        await self.joiner.newer_run(advert)

    # -- the one job -------------------------------------------------------------------------

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
                # who: a copy the swarm stopped rejoins a later run, ``SwarmJoiner.rejoin``).
                reason = job.reason or "stopped"
                await self.recorder.set_state(
                    job.id, "stopped", f"{reason} (daemon restarted)", "job.stopped", ""
                )
                continue
            if self.active is not None:
                await self.recorder.set_state(
                    job.id, "failed", "another job was resumed first", "job.failed", ""
                )
                continue
            log.info("resuming job %s from %s", job.id, job.out_dir)
            # Pending until the trainer has loaded the checkpoint and runs again.
            await self.recorder.set_state(job.id, "pending", RESUMING_REASON, "job.resuming", "")
            self.launch(resumed_job(job, JobSpec.model_validate(job.spec)))

    def launch(self, active: ActiveJob) -> None:
        """Make ``active`` the job of this daemon and drive it in a task of ``run()``'s."""
        assert self.task_group is not None, "JobManager.run() is not running"
        assert self.active is None, f"job {self.active.id} is active"  # ``launching``
        self.active = active
        self.telemetry.job_launched()
        if self._closing.is_set():  # shutdown came while it was recorded: stop as it would
            active.stop()
        if active.scope == "swarm" and self.swarm is not None and self.exchange is not None:
            # From now on its frames are kept until its plugin exists: a restarted daemon
            # loads torch for seconds while the others already send it their rounds.
            self.exchange.expect(active.id, active.spec)
        self.task_group.create_task(self.driver.drive(active), name=f"job-{active.id}")

    def release(self, active: ActiveJob) -> None:
        """The daemon is free for another job: called as the job's last state is committed,
        with no await in between, so a client that reads that state can start the next job."""
        if self.active is not active:
            return
        self.active = None
        self.telemetry.job_ended()
        if self.exchange is not None and active.scope == "swarm":
            self.exchange.release(active.id)
