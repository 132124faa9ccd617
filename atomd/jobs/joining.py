"""Joining the swarm's jobs: a free daemon takes up a job a peer advertises (auto-join), and a
copy trained here goes on in a later run its origin signs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from atomd.data.sources import shard_for_peer
from atomd.db import repo
from atomd.db.schemas import JobRecord
from atomd.errors import AtomdError, SpecError
from atomd.jobs.active import ActiveJob
from atomd.jobs.admission import admit, advert_problem, disk_problem, local_data
from atomd.logs import get_logger
from atomd.p2p.messages import JobAdvert, shared_spec
from atomd.spec import JobSpec

if TYPE_CHECKING:
    from atomd.jobs.manager import JobManager

log = get_logger("atomd.jobs")

SWARM_STOP_REASON = "stopped by the swarm"  # how a copy's reason begins once its origin stopped it


class SwarmJoiner:
    """Decides whether ``jobs`` (the manager) joins a job a peer advertises, records and
    launches it, and moves a copy trained here to a later run of its origin's."""

    def __init__(self, jobs: JobManager) -> None:
        self.jobs = jobs
        self._considering: set[str] = set()  # jobs whose adverts are being checked now

    def offer(self, advert: JobAdvert, donors: list[str]) -> None:
        """A peer trains ``advert``: join it if we are free and have never had it."""
        jobs, job_id = self.jobs, advert.id
        if (
            jobs.task_group is None
            or jobs.closing
            or jobs.active is not None
            or not job_id
            or job_id in self._considering
        ):
            return
        self._considering.add(job_id)
        jobs.task_group.create_task(self.join(advert, donors), name=f"join-{job_id}")

    async def refuse(self, job_id: str, problem: str) -> None:
        """Not joining the swarm's ``job_id``: say why in the log and a ``job.refused`` event."""
        log.warning("not joining the swarm's job %s: %s", job_id, problem)
        await self.jobs.recorder.event(job_id, "job.refused", f"not joined: {problem}")

    async def join(self, advert: JobAdvert, donors: list[str]) -> None:
        """Join ``advert``'s job unless this daemon had it, may not train it, or is busy."""
        jobs, job_id = self.jobs, advert.id
        try:
            run = advert.run
            if jobs.swarm is not None and run < jobs.swarm.latest_run(job_id):
                return  # a later run was heard of since: its advert is offered in turn
            async with jobs.sessions() as s:
                had = await repo.get_job(s, job_id=job_id)
            if had is not None:  # stopped, finished or failed here: not joined again, but
                await self.rejoin(had, advert)  # a later run of a stop of the swarm's
                return
            spec = advert.spec
            problem = advert_problem(spec, jobs.data_names)
            if problem is not None:
                await self.refuse(job_id, problem)
                return
            if spec.num_shards > 1:
                spec = spec.model_copy(
                    update={"shard_index": shard_for_peer(jobs.peer_id, spec.num_shards)}
                )
            try:
                admit(local_data(spec, jobs.data_names), jobs.device)
            except SpecError as e:  # e.g. an advert's micro-batch whose activations do not fit
                await self.refuse(job_id, str(e))
                return
            problem = disk_problem(spec, jobs.jobs_dir)
            if problem is not None:
                await self.refuse(job_id, problem)
                return
            await self._record_and_launch(advert, spec, donors)
        except (AtomdError, ValueError) as e:
            log.warning("not joining job %s: %s", job_id, e)
        finally:
            self._considering.discard(job_id)

    async def _record_and_launch(self, advert: JobAdvert, spec: JobSpec, donors: list[str]) -> None:
        jobs, job_id = self.jobs, advert.id
        async with jobs.launching:
            if jobs.active is not None or jobs.closing:
                return
            out_dir = jobs.job_dir(job_id)
            origin = advert.origin or None
            # The origin's seal of the advert (``SwarmNode`` checked it), carried on in ours.
            key, signature = advert.origin_key, advert.signature
            async with jobs.sessions() as s, s.begin():
                await repo.create_job(
                    s,
                    job_id=job_id,
                    spec=spec.model_dump(),
                    out_dir=str(out_dir),
                    scope="swarm",
                    origin=origin,
                    origin_key=key,
                    origin_signature=signature,
                    run=advert.run,
                )
                await repo.add_event(
                    s,
                    kind="job.joined",
                    job_id=job_id,
                    message=f"joined the swarm's job from {origin or 'a peer'}",
                )
            jobs.launch(
                ActiveJob(
                    id=job_id, spec=spec, out_dir=out_dir, resume=True, scope="swarm",
                    origin=origin, donors=donors, origin_key=key, origin_signature=signature,
                    run=advert.run,
                )
            )  # fmt: skip

    async def rejoin(self, had: JobRecord, advert: JobAdvert) -> None:
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
        later = self.later_run(had.id, had.origin, had.run, spec, advert)
        if later is None:
            return
        log.info("job %s: its origin resumed it (run %d); this copy, stopped by the swarm in "
                 "run %d, goes on", had.id, later[0], had.run)  # fmt: skip
        await self.jobs.resume(had.id, later=later)

    async def newer_run(self, advert: JobAdvert) -> None:
        """The origin of the job trained here signed a later run of it in ``advert`` (the swarm
        node checked the seal): the copy goes on in that run, and carries that seal on. A stop
        of the run it trained before, which a member may have kept, then ends it no more. The
        spec must be the one trained here (an origin resumes a job as it was)."""
        a = self.jobs.active
        later = None if a is None else self.later_run(a.id, a.origin, a.run, a.spec, advert)
        if a is None or later is None:
            return
        run, signature = later
        log.info("job %s: its origin resumed it; this copy goes on in run %d (was %d)",
                 a.id, run, a.run)  # fmt: skip
        a.run, a.origin_signature = run, signature
        async with self.jobs.sessions() as s, s.begin():
            await repo.set_run(s, job_id=a.id, run=run, origin_signature=signature)
            await repo.add_event(s, kind="job.run", job_id=a.id, message=f"run {run}")

    def later_run(
        self, job_id: str, origin: str | None, run: int, spec: JobSpec, advert: JobAdvert
    ) -> tuple[int, str] | None:
        """(run, the origin's signature) of ``advert`` if it names a later run than ``run`` of
        the joined job ``job_id`` of ``origin`` trained here as ``spec`` (the swarm node
        checked its seal; an origin resumes a job as it was, so another spec is refused),
        else None."""
        later, signature = advert.run, advert.signature
        if (
            advert.id != job_id
            or origin in (None, self.jobs.peer_id)
            or origin != advert.origin
            or later <= run
            or signature is None
        ):
            return None
        if shared_spec(advert.spec) != shared_spec(spec):
            log.warning("job %s: its run %d has another spec; this copy stays in run %d",
                        job_id, later, run)  # fmt: skip
            return None
        return later, signature
