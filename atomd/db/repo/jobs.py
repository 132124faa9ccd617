"""The node's identity, jobs, their runs and their checkpoints."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import delete, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from atomd.db.models import (
    JOB_SCOPES,
    JOB_STATES,
    Checkpoint,
    Job,
    Node,
    utcnow,
)
from atomd.db.repo.rows import check_allowed, job_row
from atomd.db.schemas import (
    ACTIVE_JOB_STATES,
    TERMINAL_JOB_STATES,
    CheckpointRecord,
    JobRecord,
    NodeRecord,
)
from atomd.errors import ConfigError, NotFoundError

# Node ----------------------------------------------------------------------------------------


async def get_or_create_node(s: AsyncSession, *, peer_id: str, public_key: str) -> NodeRecord:
    """This node's identity, recorded on first start. Raises ``ConfigError`` if the database
    belongs to another identity (the key in the data directory was replaced)."""
    node = await s.get(Node, 1)
    if node is None:
        node = Node(id=1, peer_id=peer_id, public_key=public_key)
        s.add(node)
        await s.flush()
    elif (node.peer_id, node.public_key) != (peer_id, public_key):
        raise ConfigError(
            f"the database belongs to peer {node.peer_id} (public key {node.public_key}), but "
            f"the identity key is peer {peer_id} (public key {public_key}); restore the "
            "original key or start from an empty data directory"
        )
    return NodeRecord.model_validate(node)


# Jobs ----------------------------------------------------------------------------------------


async def create_job(
    s: AsyncSession,
    *,
    job_id: str,
    spec: dict[str, Any],
    out_dir: str,
    state: str = "pending",
    scope: str = "local",
    origin: str | None = None,
    origin_key: str | None = None,
    origin_signature: str | None = None,
    run: int = 0,
) -> JobRecord:
    """Record a new job (``scope`` "swarm": announced to the peers; ``origin``: who started it;
    a joined job's ``origin_key`` and ``origin_signature``: its origin's seal of its advert,
    and ``run``: the run of the job that advert named)."""
    check_allowed("job state", state, JOB_STATES)
    check_allowed("job scope", scope, JOB_SCOPES)
    now = utcnow()
    job = Job(
        id=job_id,
        spec=spec,
        state=state,
        out_dir=out_dir,
        scope=scope,
        origin=origin,
        origin_key=origin_key,
        origin_signature=origin_signature,
        run=run,
        created_at=now,
        started_at=now if state == "running" else None,
        updated_at=now,
    )
    s.add(job)
    await s.flush()
    return JobRecord.model_validate(job)


async def get_job(s: AsyncSession, *, job_id: str) -> JobRecord | None:
    """The job, or ``None``."""
    job = await s.get(Job, job_id)
    return None if job is None else JobRecord.model_validate(job)


async def list_jobs(s: AsyncSession, *, limit: int = 100) -> list[JobRecord]:
    """The newest ``limit`` jobs, newest first."""
    rows = await s.scalars(select(Job).order_by(Job.created_at.desc(), Job.id).limit(limit))
    return [JobRecord.model_validate(j) for j in rows]


async def active_jobs(s: AsyncSession) -> list[JobRecord]:
    """Jobs pending, running or stopping, oldest first: what to resume after a restart."""
    stmt = select(Job).where(Job.state.in_(ACTIVE_JOB_STATES)).order_by(Job.created_at, Job.id)
    return [JobRecord.model_validate(j) for j in await s.scalars(stmt)]


async def jobs_touched_since(s: AsyncSession, *, since: datetime | None) -> list[str]:
    """Ids of the jobs active now or updated at or after ``since`` (all, if ``None``): those
    that may have logged progress or rounds since. Oldest first."""
    stmt = select(Job.id).order_by(Job.created_at, Job.id)
    if since is not None:
        stmt = stmt.where(or_(Job.state.in_(ACTIVE_JOB_STATES), Job.updated_at >= since))
    return list(await s.scalars(stmt))


async def set_job_state(
    s: AsyncSession, *, job_id: str, state: str, reason: str | None = None
) -> JobRecord:
    """Move a job to ``state``. ``started_at`` is set the first time it runs; ``finished_at``
    when it stops, finishes or fails (and cleared if it becomes active again). ``reason``
    replaces the old one when given; going back to pending or running clears it."""
    check_allowed("job state", state, JOB_STATES)
    job = await job_row(s, job_id)
    now = utcnow()
    if state == "running" and job.started_at is None:
        job.started_at = now
    if state in TERMINAL_JOB_STATES:
        if job.finished_at is None:
            job.finished_at = now
    else:
        job.finished_at = None
    if reason is not None:
        job.reason = reason
    elif state in ("pending", "running"):
        job.reason = None
    job.state = state
    job.updated_at = now
    await s.flush()
    return JobRecord.model_validate(job)


async def advance_job(s: AsyncSession, *, job_id: str, step: int, tokens: int) -> JobRecord:
    """The job has reached ``step`` (a checkpoint was written there): its record's step and
    tokens move up to it, never back (a stopped job's step is its last checkpoint's)."""
    job = await job_row(s, job_id)
    if step > job.step:
        job.step, job.tokens = step, tokens
        job.updated_at = utcnow()
        await s.flush()
    return JobRecord.model_validate(job)


async def set_job_spec(s: AsyncSession, *, job_id: str, spec: dict[str, Any]) -> JobRecord:
    """Replace a job's spec (the data hash its origin measured, filled in after creation)."""
    job = await job_row(s, job_id)
    job.spec = spec
    job.updated_at = utcnow()
    await s.flush()
    return JobRecord.model_validate(job)


async def set_job_plan(s: AsyncSession, *, job_id: str, plan: dict[str, Any]) -> JobRecord:
    """Record the swap plan a job runs with."""
    job = await job_row(s, job_id)
    job.plan = plan
    job.updated_at = utcnow()
    await s.flush()
    return JobRecord.model_validate(job)


async def delete_job(s: AsyncSession, *, job_id: str) -> None:
    """Delete a job with its progress, rounds and checkpoint records (not its files)."""
    result = await s.execute(delete(Job).where(Job.id == job_id))
    if result.rowcount == 0:  # type: ignore[attr-defined]
        raise NotFoundError(f"no job {job_id!r}")


# Checkpoints ---------------------------------------------------------------------------------


async def add_checkpoint(
    s: AsyncSession, *, job_id: str, step: int, path: str, sha256: str
) -> CheckpointRecord:
    """Record a checkpoint written to ``path``."""
    await job_row(s, job_id)
    ckpt = Checkpoint(job_id=job_id, step=step, path=path, sha256=sha256, at=utcnow())
    s.add(ckpt)
    await s.flush()
    return CheckpointRecord.model_validate(ckpt)


async def latest_checkpoint(s: AsyncSession, *, job_id: str) -> CheckpointRecord | None:
    """The job's checkpoint with the highest step (the newest record on a tie), or ``None``."""
    await job_row(s, job_id)
    stmt = (
        select(Checkpoint)
        .where(Checkpoint.job_id == job_id)
        .order_by(Checkpoint.step.desc(), Checkpoint.id.desc())
        .limit(1)
    )
    ckpt = await s.scalar(stmt)
    return None if ckpt is None else CheckpointRecord.model_validate(ckpt)


# Runs ----------------------------------------------------------------------------------------


async def set_run(s: AsyncSession, *, job_id: str, run: int, origin_signature: str) -> None:
    """A joined job goes on in a later ``run`` of its origin's, sealed by ``origin_signature``
    (the origin's signature of its advert of that run)."""
    job = await job_row(s, job_id)
    job.run, job.origin_signature = run, origin_signature


async def next_run(s: AsyncSession, *, job_id: str) -> int:
    """Count one more run of ``job_id`` (its origin resumes it) and return it."""
    job = await job_row(s, job_id)
    job.run += 1
    return job.run
