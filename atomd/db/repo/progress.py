"""A job's progress points: recorded, paged, drawn as a curve, and thinned over the run."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Select, delete, func, or_, select
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncSession

from atomd.db.models import (
    Progress,
    utcnow,
)
from atomd.db.repo.rows import PRUNE_BATCH, job_row
from atomd.db.schemas import (
    ProgressPoint,
)


async def add_progress(s: AsyncSession, *, job_id: str, points: Sequence[ProgressPoint]) -> int:
    """Insert progress points, skipping steps already recorded, and copy the newest step's
    numbers onto the job (``val_loss`` from the newest point that has one). Points older than
    the job's step are recorded but leave the job as it is. Returns the rows inserted."""
    if not points:
        return 0
    job = await job_row(s, job_id)
    stmt = (
        sqlite_insert(Progress)
        .on_conflict_do_nothing(index_elements=[Progress.job_id, Progress.step])
        .returning(Progress.id)
    )
    rows = [{"job_id": job_id, **p.model_dump()} for p in points]
    inserted = len((await s.scalars(stmt, rows)).all())

    newest = max(points, key=lambda p: p.step)
    if newest.step >= job.step:
        evaluated = [p for p in points if p.val_loss is not None and p.step >= job.step]
        job.step, job.tokens, job.loss = newest.step, newest.tokens, newest.loss
        job.sync = newest.sync
        if evaluated:
            job.val_loss = max(evaluated, key=lambda p: p.step).val_loss
        job.updated_at = utcnow()
        await s.flush()
    return inserted


async def delete_progress_after(s: AsyncSession, *, job_id: str, step: int) -> int:
    """Forget the points after ``step`` (a job resumed from an older checkpoint will log those
    steps again) and copy the newest remaining point onto the job. Returns the rows deleted."""
    job = await job_row(s, job_id)
    result = await s.execute(
        delete(Progress).where(Progress.job_id == job_id, Progress.step > step)
    )
    last = await s.scalar(
        select(Progress).where(Progress.job_id == job_id).order_by(Progress.step.desc()).limit(1)
    )
    last_val = await s.scalar(
        select(Progress.val_loss)
        .where(Progress.job_id == job_id, Progress.val_loss.is_not(None))
        .order_by(Progress.step.desc())
        .limit(1)
    )
    job.step = last.step if last else 0
    job.tokens = last.tokens if last else 0
    job.loss = last.loss if last else None
    job.sync = last.sync if last else None
    job.val_loss = last_val
    job.updated_at = utcnow()
    await s.flush()
    return int(result.rowcount)  # type: ignore[attr-defined]


async def list_progress(
    s: AsyncSession,
    *,
    job_id: str,
    after_step: int | None = None,
    limit: int = 1000,
    newest: bool = False,
) -> list[ProgressPoint]:
    """Up to ``limit`` points in step order, those after ``after_step`` if given: the first
    of them, or with ``newest`` the last (a job's latest progress)."""
    await job_row(s, job_id)
    stmt = select(Progress).where(Progress.job_id == job_id)
    if after_step is not None:
        stmt = stmt.where(Progress.step > after_step)
    if newest:
        rows = list(await s.scalars(stmt.order_by(Progress.step.desc()).limit(limit)))
        rows.reverse()
    else:
        rows = list(await s.scalars(stmt.order_by(Progress.step).limit(limit)))
    return [ProgressPoint.model_validate(p) for p in rows]


async def progress_curve(s: AsyncSession, *, job_id: str, points: int) -> list[ProgressPoint]:
    """A plot of the whole run in at most ``2 * points + 2`` logged steps, in step order: every
    ``n / points``-th step and the newest, and among the steps with a validation loss every
    ``v / points``-th and the newest. One query, however long the run."""
    await job_row(s, job_id)
    has_val = Progress.val_loss.is_not(None)
    n, v = (
        await s.execute(
            select(func.count(), func.count(Progress.val_loss)).where(Progress.job_id == job_id)
        )
    ).one()
    if n == 0:
        return []
    stride, val_stride = max(1, -(-n // points)), max(1, -(-v // points))
    numbered = (
        select(
            Progress.id,
            func.row_number().over(order_by=Progress.step).label("rn"),
            func.row_number().over(partition_by=has_val, order_by=Progress.step).label("vn"),
        )
        .where(Progress.job_id == job_id)
        .subquery()
    )
    c = numbered.c
    stmt = (
        select(Progress)
        .join(numbered, c.id == Progress.id)
        .where(
            or_(
                (c.rn - 1) % stride == 0,
                c.rn == n,
                has_val & or_((c.vn - 1) % val_stride == 0, c.vn == v),
            )
        )
        .order_by(Progress.step)
        .limit(2 * points + 2)
    )
    return [ProgressPoint.model_validate(p) for p in await s.scalars(stmt)]


def _below_newest(job_id: str, keep: int) -> Select[int]:
    # The job's step below its newest ``keep``: a walk of ``keep`` entries of its index.
    return (
        select(Progress.step)
        .where(Progress.job_id == job_id)
        .order_by(Progress.step.desc())
        .offset(keep)
        .limit(1)
    )


async def thinned_until(s: AsyncSession, *, job_id: str, keep: int) -> int | None:
    """The newest step ``thin_progress`` may thin when it keeps the newest ``keep`` points at
    full resolution: the step below them (``None``: the job has no more than ``keep``)."""
    await job_row(s, job_id)
    return await s.scalar(_below_newest(job_id, keep))


async def thin_progress(
    s: AsyncSession,
    *,
    job_id: str,
    keep: int,
    older: int,
    from_step: int | None = None,
    rows: int = PRUNE_BATCH,
) -> tuple[int, int | None]:
    """Keep the job's newest ``keep`` points and thin the older ones to about ``older``,
    spread over their steps; returns the rows deleted and the step to go on from (``None``:
    done). One call looks at about ``rows`` older points from ``from_step`` (default: the
    first); call it again, each in a short transaction, until it returns ``None``.

    Of the older points, each run of ``2**k`` steps from the first point keeps its first
    point, ``k`` the smallest that leaves at most ``older`` runs. The first point and every
    point with a validation loss are always kept. Idempotent, and what is kept stays kept as
    the job grows: a run of ``2**(k+1)`` steps is two of ``2**k``, its first point theirs.
    """
    if keep < 1 or older < 1 or rows < 1:  # keep >= 1: the job's newest point stays
        raise ValueError(f"keep {keep}, older {older} and rows {rows}: each must be >= 1")
    last = await thinned_until(s, job_id=job_id, keep=keep)
    mine = Progress.job_id == job_id
    bound = _below_newest(job_id, keep).scalar_subquery()
    first = await s.scalar(select(func.min(Progress.step)).where(mine))
    if last is None or first is None:
        return 0, None
    width = 1
    while (last - first) // width + 1 > older:
        width *= 2
    # A chunk starts and (but for the last) ends at a run's start, so runs are never split.
    start = first if from_step is None else max(first, from_step)
    start = first + (start - first) // width * width
    if start > last:
        return 0, None
    ahead = await s.scalar(
        select(Progress.step)
        .where(mine, Progress.step >= start)
        .order_by(Progress.step)
        .offset(rows)
        .limit(1)
    )
    end = last + 1 if ahead is None else first + -(-(ahead - first) // width) * width
    end = min(end, last + 1)
    runs = (
        select(
            Progress.id,
            Progress.step,
            Progress.val_loss,
            func.row_number()
            .over(partition_by=(Progress.step - first) // width, order_by=Progress.step)
            .label("nth"),
        )
        # The bound again inside the statement: a resume may have deleted the newest points
        # since it was read (the reads above need not share the delete's snapshot).
        .where(mine, Progress.step >= start, Progress.step < end, Progress.step <= bound)
        .subquery()
    )
    doomed = select(runs.c.id).where(runs.c.nth > 1, runs.c.val_loss.is_(None), runs.c.step > first)
    result = await s.execute(
        delete(Progress).where(Progress.id.in_(doomed)),
        execution_options={"synchronize_session": False},
    )
    return int(getattr(result, "rowcount", 0) or 0), (None if end > last else end)
