"""The sync rounds a job closed, and their retention."""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from atomd.db.models import (
    DIRECTIONS,
    SyncRound,
    utcnow,
)
from atomd.db.repo.rows import PRUNE_BATCH, check_allowed, job_row
from atomd.db.schemas import (
    RoundRecord,
)


async def add_round(
    s: AsyncSession,
    *,
    job_id: str,
    round: int,
    direction: str,
    peer_id: str,
    bytes: int,
    codec: str,
    compression_ratio: float,
    staleness: int | None,
    applied: bool,
    reason: str | None,
    every: int | None = None,
) -> None:
    """Record one delta sent or received; ``reason`` says why it was not applied, ``every``
    how many steps the sender's round lasted."""
    check_allowed("direction", direction, DIRECTIONS)
    await job_row(s, job_id)
    s.add(
        SyncRound(
            job_id=job_id,
            round=round,
            direction=direction,
            peer_id=peer_id,
            bytes=bytes,
            codec=codec,
            compression_ratio=compression_ratio,
            staleness=staleness,
            applied=applied,
            reason=reason,
            at=utcnow(),
            every=every,
        )
    )
    await s.flush()


async def list_rounds(s: AsyncSession, *, job_id: str, limit: int = 1000) -> list[RoundRecord]:
    """The job's newest ``limit`` rounds, newest first."""
    await job_row(s, job_id)
    stmt = (
        select(SyncRound)
        .where(SyncRound.job_id == job_id)
        .order_by(SyncRound.id.desc())
        .limit(limit)
    )
    return [RoundRecord.model_validate(r) for r in await s.scalars(stmt)]


async def prune_rounds(s: AsyncSession, *, job_id: str, keep: int, rows: int = PRUNE_BATCH) -> int:
    """Delete the oldest of the job's rounds beyond its newest ``keep``, at most ``rows`` of
    them; how many were deleted (call it again, in a new short transaction, while that is
    ``rows``)."""
    if keep < 0 or rows < 1:
        raise ValueError(f"keep {keep} must be >= 0 and rows {rows} >= 1")
    await job_row(s, job_id)
    mine = SyncRound.job_id == job_id
    newest_gone = await s.scalar(
        select(SyncRound.id).where(mine).order_by(SyncRound.id.desc()).offset(keep).limit(1)
    )
    if newest_gone is None:
        return 0
    doomed = (
        select(SyncRound.id)
        .where(mine, SyncRound.id <= newest_gone)
        .order_by(SyncRound.id)
        .limit(rows)
    )
    result = await s.execute(
        delete(SyncRound).where(SyncRound.id.in_(doomed)),
        execution_options={"synchronize_session": False},
    )
    return int(getattr(result, "rowcount", 0) or 0)
