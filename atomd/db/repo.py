"""Repository functions: the only way atomd reads and writes its records.

Transactions: every function runs inside the caller's transaction and flushes, but never
commits. Callers own the unit of work::

    async with sessionmaker() as s, s.begin():
        await repo.set_job_state(s, job_id=job_id, state="running")
        await repo.add_event(s, kind="job.started", message="...", job_id=job_id)

Functions take the session first and everything else by keyword, and return frozen records
from ``atomd.db.schemas``, never ORM rows. Every function that takes a ``job_id`` of an
existing job (all but ``create_job`` and ``add_event``) raises ``NotFoundError`` if there is
no such job. Lists of logs (jobs, rounds, events) come newest first; progress comes in step
order, a series to plot or page through with ``after_step``.

Retention: the events keep their newest rows (``prune_events``), a job its newest rounds
(``prune_rounds``) and its newest progress points with the older ones thinned over the run
(``thin_progress``); ``atomd.db.retention`` runs the last two in short batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Select, delete, func, or_, select
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.sql.elements import ColumnElement

from atomd.db.models import (
    DIRECTIONS,
    JOB_SCOPES,
    JOB_STATES,
    PEER_STATES,
    Checkpoint,
    Event,
    Job,
    Node,
    Peer,
    PeerBan,
    PeerQuarantine,
    Progress,
    SyncRound,
    utcnow,
)
from atomd.db.schemas import (
    ACTIVE_JOB_STATES,
    TERMINAL_JOB_STATES,
    BanRecord,
    CheckpointRecord,
    EventRecord,
    JobRecord,
    NodeRecord,
    PeerRecord,
    ProgressPoint,
    QuarantineRecord,
    RoundRecord,
)
from atomd.errors import ConfigError, NotFoundError

# Rows one retention call deletes or looks at (``prune_rounds``, ``thin_progress``): a few
# milliseconds of SQLite each, so the daemon's other writers wait no longer than that.
PRUNE_BATCH = 5000


async def _job(s: AsyncSession, job_id: str) -> Job:
    job = await s.get(Job, job_id)
    if job is None:
        raise NotFoundError(f"no job {job_id!r}")
    return job


def _check(what: str, value: str, allowed: tuple[str, ...]) -> None:
    # The database has a CHECK too; this names the allowed values instead of "constraint failed".
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; expected one of {', '.join(allowed)}")


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
    _check("job state", state, JOB_STATES)
    _check("job scope", scope, JOB_SCOPES)
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
    _check("job state", state, JOB_STATES)
    job = await _job(s, job_id)
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
    job = await _job(s, job_id)
    if step > job.step:
        job.step, job.tokens = step, tokens
        job.updated_at = utcnow()
        await s.flush()
    return JobRecord.model_validate(job)


async def set_job_spec(s: AsyncSession, *, job_id: str, spec: dict[str, Any]) -> JobRecord:
    """Replace a job's spec (the data hash its origin measured, filled in after creation)."""
    job = await _job(s, job_id)
    job.spec = spec
    job.updated_at = utcnow()
    await s.flush()
    return JobRecord.model_validate(job)


async def set_job_plan(s: AsyncSession, *, job_id: str, plan: dict[str, Any]) -> JobRecord:
    """Record the swap plan a job runs with."""
    job = await _job(s, job_id)
    job.plan = plan
    job.updated_at = utcnow()
    await s.flush()
    return JobRecord.model_validate(job)


async def delete_job(s: AsyncSession, *, job_id: str) -> None:
    """Delete a job with its progress, rounds and checkpoint records (not its files)."""
    result = await s.execute(delete(Job).where(Job.id == job_id))
    if result.rowcount == 0:  # type: ignore[attr-defined]
        raise NotFoundError(f"no job {job_id!r}")


# Progress ------------------------------------------------------------------------------------


async def add_progress(s: AsyncSession, *, job_id: str, points: Sequence[ProgressPoint]) -> int:
    """Insert progress points, skipping steps already recorded, and copy the newest step's
    numbers onto the job (``val_loss`` from the newest point that has one). Points older than
    the job's step are recorded but leave the job as it is. Returns the rows inserted."""
    if not points:
        return 0
    job = await _job(s, job_id)
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
    job = await _job(s, job_id)
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
    await _job(s, job_id)
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
    await _job(s, job_id)
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
    await _job(s, job_id)
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


# Checkpoints ---------------------------------------------------------------------------------


async def add_checkpoint(
    s: AsyncSession, *, job_id: str, step: int, path: str, sha256: str
) -> CheckpointRecord:
    """Record a checkpoint written to ``path``."""
    await _job(s, job_id)
    ckpt = Checkpoint(job_id=job_id, step=step, path=path, sha256=sha256, at=utcnow())
    s.add(ckpt)
    await s.flush()
    return CheckpointRecord.model_validate(ckpt)


async def latest_checkpoint(s: AsyncSession, *, job_id: str) -> CheckpointRecord | None:
    """The job's checkpoint with the highest step (the newest record on a tie), or ``None``."""
    await _job(s, job_id)
    stmt = (
        select(Checkpoint)
        .where(Checkpoint.job_id == job_id)
        .order_by(Checkpoint.step.desc(), Checkpoint.id.desc())
        .limit(1)
    )
    ckpt = await s.scalar(stmt)
    return None if ckpt is None else CheckpointRecord.model_validate(ckpt)


# Events --------------------------------------------------------------------------------------


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


async def set_run(s: AsyncSession, *, job_id: str, run: int, origin_signature: str) -> None:
    """A joined job goes on in a later ``run`` of its origin's, sealed by ``origin_signature``
    (the origin's signature of its advert of that run)."""
    job = await _job(s, job_id)
    job.run, job.origin_signature = run, origin_signature


async def next_run(s: AsyncSession, *, job_id: str) -> int:
    """Count one more run of ``job_id`` (its origin resumes it) and return it."""
    job = await _job(s, job_id)
    job.run += 1
    return job.run


async def list_events(
    s: AsyncSession, *, limit: int = 100, kind: str | None = None
) -> list[EventRecord]:
    """The newest ``limit`` events, newest first, only those of ``kind`` if given."""
    stmt = select(Event)
    if kind is not None:
        stmt = stmt.where(Event.kind == kind)
    rows = await s.scalars(stmt.order_by(Event.id.desc()).limit(limit))
    return [EventRecord.model_validate(e) for e in rows]


# Sync rounds ---------------------------------------------------------------------------------


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
    _check("direction", direction, DIRECTIONS)
    await _job(s, job_id)
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
    await _job(s, job_id)
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
    await _job(s, job_id)
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


# Peers ---------------------------------------------------------------------------------------


async def upsert_peer(
    s: AsyncSession,
    *,
    peer_id: str,
    url: str,
    public_key: str | None,
    state: str,
    incarnation: int,
    rtt_ms: float | None = None,
) -> PeerRecord:
    """Insert or update a peer. ``first_seen_at`` is set on insert, ``last_seen_at`` always;
    a ``None`` public key or round-trip time keeps the one already known."""
    _check("peer state", state, PEER_STATES)
    if not 0 <= incarnation < 2**63:  # SQLite's INTEGER; the peer plane keeps them below 2^62
        raise ValueError(f"incarnation {incarnation} does not fit a 64-bit integer")
    now = utcnow()
    stmt = sqlite_insert(Peer).values(
        id=peer_id,
        url=url,
        public_key=public_key,
        state=state,
        incarnation=incarnation,
        first_seen_at=now,
        last_seen_at=now,
        rtt_ms=rtt_ms,
    )
    stmt = stmt.on_conflict_do_update(
        index_elements=[Peer.id],
        set_={
            "url": stmt.excluded.url,
            "public_key": func.coalesce(stmt.excluded.public_key, Peer.public_key),
            "state": stmt.excluded.state,
            "incarnation": stmt.excluded.incarnation,
            "last_seen_at": stmt.excluded.last_seen_at,
            "rtt_ms": func.coalesce(stmt.excluded.rtt_ms, Peer.rtt_ms),
        },
    )
    # populate_existing: a Peer already loaded in this session must not shadow the new row.
    peer = await s.scalar(stmt.returning(Peer), execution_options={"populate_existing": True})
    assert peer is not None  # an upsert always returns its row
    return PeerRecord.model_validate(peer)


async def list_peers(s: AsyncSession) -> list[PeerRecord]:
    """Every peer ever seen, by id."""
    return [PeerRecord.model_validate(p) for p in await s.scalars(select(Peer).order_by(Peer.id))]


# -- bans --------------------------------------------------------------------------------------


async def add_ban(s: AsyncSession, *, public_key: str, reason: str) -> BanRecord:
    """Ban a key (lowercase hex); banning it again replaces the reason."""
    stmt = sqlite_insert(PeerBan).values(public_key=public_key, reason=reason, created_at=utcnow())
    await s.execute(
        stmt.on_conflict_do_update(index_elements=[PeerBan.public_key], set_={"reason": reason})
    )
    await s.flush()
    ban = await s.get(PeerBan, public_key, populate_existing=True)
    assert ban is not None
    return BanRecord.model_validate(ban)


async def remove_ban(s: AsyncSession, *, public_key: str) -> bool:
    """Lift a ban; False if the key was not banned."""
    result = await s.execute(delete(PeerBan).where(PeerBan.public_key == public_key))
    return bool(getattr(result, "rowcount", 0))


async def list_bans(s: AsyncSession) -> list[BanRecord]:
    return [
        BanRecord.model_validate(b)
        for b in await s.scalars(select(PeerBan).order_by(PeerBan.created_at))
    ]


# -- quarantines -------------------------------------------------------------------------------


async def add_quarantine(
    s: AsyncSession, *, peer_id: str, public_key: str | None, reason: str, until: datetime
) -> QuarantineRecord:
    """Quarantine a member until ``until``; quarantining it again replaces reason and end.
    The quarantines that have ended are deleted here (a write path already), not as they
    are listed: the daemon lists them before its peer plane listens, with reads alone."""
    await s.execute(delete(PeerQuarantine).where(PeerQuarantine.until <= utcnow()))
    values = {"public_key": public_key, "reason": reason, "until": until}
    stmt = sqlite_insert(PeerQuarantine).values(peer_id=peer_id, created_at=utcnow(), **values)
    await s.execute(
        stmt.on_conflict_do_update(index_elements=[PeerQuarantine.peer_id], set_=values)
    )
    await s.flush()
    row = await s.get(PeerQuarantine, peer_id, populate_existing=True)
    assert row is not None
    return QuarantineRecord.model_validate(row)


async def remove_quarantines(
    s: AsyncSession, *, peer_ids: Sequence[str] = (), public_key: str | None = None
) -> int:
    """End the quarantine of these members and of every member with ``public_key``; how many."""
    conds: list[ColumnElement[bool]] = []
    if peer_ids:
        conds.append(PeerQuarantine.peer_id.in_(list(peer_ids)))
    if public_key is not None:
        conds.append(PeerQuarantine.public_key == public_key)
    if not conds:
        return 0
    result = await s.execute(delete(PeerQuarantine).where(or_(*conds)))
    return int(getattr(result, "rowcount", 0) or 0)


async def list_quarantines(
    s: AsyncSession, *, now: datetime | None = None
) -> list[QuarantineRecord]:
    """The quarantines still running at ``now`` (default: now). Reads only
    (``add_quarantine`` deletes those that ended)."""
    now = now or utcnow()
    stmt = select(PeerQuarantine).where(PeerQuarantine.until > now)
    rows = await s.scalars(stmt.order_by(PeerQuarantine.until))
    return [QuarantineRecord.model_validate(q) for q in rows]
