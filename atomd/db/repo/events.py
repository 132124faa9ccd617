"""The audit log of events, and the swarm-wide stops it remembers."""

from __future__ import annotations

from typing import Any

from sqlalchemy import delete, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from atomd.db.models import (
    Event,
    Job,
    utcnow,
)
from atomd.db.schemas import (
    EventRecord,
)


async def add_event(
    s: AsyncSession,
    *,
    kind: str,
    message: str,
    job_id: str | None = None,
    peer_id: str | None = None,
    data: dict[str, Any] | None = None,
) -> None:
    """Append to the audit log. ``job_id`` need not exist: the log outlives deleted jobs."""
    s.add(Event(at=utcnow(), kind=kind, message=message, job_id=job_id, peer_id=peer_id, data=data))
    await s.flush()


async def prune_events(s: AsyncSession, *, keep: int) -> int:
    """Delete all but the newest ``keep`` events; how many were deleted."""
    newest = await s.scalar(select(func.max(Event.id)))
    if newest is None or newest <= keep:
        return 0
    result = await s.execute(delete(Event).where(Event.id <= newest - keep))
    return int(getattr(result, "rowcount", 0) or 0)


async def swarm_stopped_jobs(s: AsyncSession, *, limit: int) -> dict[str, int]:
    """The jobs among the newest ``limit`` swarm-wide stops (``job.swarm_stopped`` events) not
    resumed since here (no later ``job.resuming`` event), whatever their state now, each with
    its run (the run the stop ended: a resume starts the next)."""
    stopped = (
        select(Event.job_id, func.max(Event.id).label("at"))
        .where(Event.kind == "job.swarm_stopped", Event.job_id.is_not(None))
        .group_by(Event.job_id)
        .order_by(func.max(Event.id).desc())
        .limit(limit)
        .subquery()
    )
    resumed = (
        select(Event.job_id, func.max(Event.id).label("at"))
        .where(Event.kind == "job.resuming", Event.job_id.is_not(None))
        .group_by(Event.job_id)
        .subquery()
    )
    stmt = (
        select(stopped.c.job_id, Job.run)
        .join(Job, Job.id == stopped.c.job_id)
        .join(resumed, resumed.c.job_id == stopped.c.job_id, isouter=True)
        .where(or_(resumed.c.at.is_(None), resumed.c.at < stopped.c.at))
    )
    return {str(j): int(run) for j, run in (await s.execute(stmt)).all()}


async def list_events(
    s: AsyncSession, *, limit: int = 100, kind: str | None = None
) -> list[EventRecord]:
    """The newest ``limit`` events, newest first, only those of ``kind`` if given."""
    stmt = select(Event)
    if kind is not None:
        stmt = stmt.where(Event.kind == kind)
    rows = await s.scalars(stmt.order_by(Event.id.desc()).limit(limit))
    return [EventRecord.model_validate(e) for e in rows]
