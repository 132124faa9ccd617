"""A job's records kept bounded however long it runs: its sync rounds and its progress.

A job logs a progress point every ``log_interval`` steps and a round row per delta sent or
received (a swarm of 8 can write 9 a step), for as long as it runs. Once a minute the daemon
(``PeerRecords.keep_tidy``, beside the events' retention) cuts each job that may have
written since to its newest ``ATOMD_ROUNDS_KEEP`` rounds, and keeps its newest
``ATOMD_PROGRESS_KEEP`` progress points with the older ones thinned to about as many again,
spread over the run (``repo.thin_progress``): the whole curve stays, at a bounded cost.

Each call of ``repo`` here is one short transaction of at most ``repo.PRUNE_BATCH`` rows, run
on aiosqlite's thread: the event loop never waits for it, and the job's own writes wait for
at most one batch.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from atomd.db import repo
from atomd.errors import NotFoundError


@dataclass(frozen=True)
class Pruned:
    """What one pass deleted: from how many jobs, rounds and progress points, in how long."""

    jobs: int
    rounds: int
    progress: int
    seconds: float


async def prune_jobs(
    sessions: async_sessionmaker[AsyncSession],
    *,
    since: datetime | None,
    rounds_keep: int,
    progress_keep: int,
    rows: int = repo.PRUNE_BATCH,
) -> Pruned:
    """Cut the rounds and thin the progress of the jobs active now or updated at or after
    ``since`` (every job, if ``None``: the first pass after a start). A job deleted meanwhile
    is skipped."""
    t0 = time.perf_counter()
    async with sessions() as s:
        job_ids = await repo.jobs_touched_since(s, since=since)
    rounds = progress = 0
    for job_id in job_ids:
        try:
            rounds += await _prune_rounds(sessions, job_id, rounds_keep, rows)
            progress += await _thin_progress(sessions, job_id, progress_keep, rows)
        except NotFoundError:
            continue
    return Pruned(len(job_ids), rounds, progress, time.perf_counter() - t0)


async def _prune_rounds(
    sessions: async_sessionmaker[AsyncSession], job_id: str, keep: int, rows: int
) -> int:
    deleted = 0
    while True:
        async with sessions() as s, s.begin():
            n = await repo.prune_rounds(s, job_id=job_id, keep=keep, rows=rows)
        deleted += n
        if n < rows:
            return deleted
        await asyncio.sleep(0)  # the job's writers, between two batches


async def _thin_progress(
    sessions: async_sessionmaker[AsyncSession], job_id: str, keep: int, rows: int
) -> int:
    deleted, at = 0, None
    while True:
        async with sessions() as s, s.begin():
            n, at = await repo.thin_progress(
                s, job_id=job_id, keep=keep, older=keep, from_step=at, rows=rows
            )
        deleted += n
        if at is None:
            return deleted
        await asyncio.sleep(0)
