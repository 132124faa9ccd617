"""A job's rounds and progress kept bounded (``atomd.db.retention``), on real SQLite files."""

from __future__ import annotations

import asyncio
import itertools
import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from sqlalchemy import insert

from atomd.config import Settings
from atomd.db import migrate, repo
from atomd.db.connection import make_engine, make_sessionmaker
from atomd.db.models import SyncRound
from atomd.db.retention import prune_jobs
from atomd.db.schemas import ProgressPoint
from atomd.errors import NotFoundError
from tests.unit.conftest import Sessions

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def _point(step: int, *, val_loss: float | None = None) -> ProgressPoint:
    return ProgressPoint(
        step=step, tokens=step * 100, loss=5.0 - step / 10_000, val_loss=val_loss,
        tokens_per_s=1000.0, lr=1e-3, at=T0 + timedelta(seconds=step),
    )  # fmt: skip


def _val(step: int) -> float | None:
    """A validation loss every 100th step, as ``eval_interval`` 100 logs it."""
    return 3.0 - step / 100_000 if step % 100 == 0 else None


async def _job(sessions: Sessions, job_id: str = "j1", state: str = "running") -> None:
    async with sessions() as s, s.begin():
        await repo.create_job(s, job_id=job_id, spec={}, out_dir=f"/o/{job_id}", state=state)


async def _log(sessions: Sessions, steps: range, job_id: str = "j1") -> None:
    async with sessions() as s, s.begin():
        points = [_point(n, val_loss=_val(n)) for n in steps]
        await repo.add_progress(s, job_id=job_id, points=points)


async def _rounds(sessions: Sessions, job_id: str, rounds: range, peers: int = 1) -> None:
    """Rows as a swarm writes them: one sent and ``peers - 1`` received a round."""
    common = {"bytes": 1000, "codec": "topk", "compression_ratio": 4.0, "applied": True,
              "reason": None, "at": T0, "every": 1}  # fmt: skip
    rows = [
        {**common, "job_id": job_id, "round": r, "peer_id": f"peer{p}",
         "direction": "sent" if p == 0 else "received", "staleness": None if p == 0 else 0}
        for r in rounds
        for p in range(peers)
    ]  # fmt: skip
    async with sessions() as s, s.begin():
        await s.execute(insert(SyncRound), rows)


def _count(db: Path, table: str, job_id: str) -> int:
    with sqlite3.connect(db) as conn:  # the file itself, not the session
        (n,) = conn.execute(f"SELECT count(*) FROM {table} WHERE job_id = ?", (job_id,)).fetchone()
    return int(n)


async def _steps(sessions: Sessions, job_id: str = "j1") -> list[int]:
    async with sessions() as s:
        return [p.step for p in await repo.list_progress(s, job_id=job_id, limit=1_000_000)]


async def _thin(sessions: Sessions, *, keep: int, older: int, rows: int) -> tuple[int, int]:
    """One whole pass of ``thin_progress`` over j1: (rows deleted, calls)."""
    deleted, calls, at = 0, 0, None
    while True:
        async with sessions() as s, s.begin():
            n, at = await repo.thin_progress(
                s, job_id="j1", keep=keep, older=older, from_step=at, rows=rows
            )
        deleted, calls = deleted + n, calls + 1
        if at is None:
            return deleted, calls


# Rounds --------------------------------------------------------------------------------------


async def test_rounds_are_cut_to_the_newest_per_job_in_batches(
    db: Path, sessions: Sessions
) -> None:
    await _job(sessions, "j1")
    await _job(sessions, "j2")
    await _rounds(sessions, "j1", range(100), peers=5)  # 500 rows
    await _rounds(sessions, "j2", range(10), peers=5)  # 50: under the bound
    await _rounds(sessions, "j1", range(100, 110), peers=5)  # later than j2's
    async with sessions() as s:
        before = await repo.list_rounds(s, job_id="j1", limit=120)
    assert _count(db, "sync_rounds", "j1") == 550

    batches = []
    while True:
        async with sessions() as s, s.begin():
            batches.append(await repo.prune_rounds(s, job_id="j1", keep=120, rows=200))
        if batches[-1] < 200:
            break
    assert batches == [200, 200, 30], "at most `rows` a call, the oldest first"
    async with sessions() as s, s.begin():
        assert await repo.prune_rounds(s, job_id="j2", keep=120) == 0
        assert await repo.prune_rounds(s, job_id="j1", keep=120) == 0, "idempotent"
        with pytest.raises(NotFoundError):
            await repo.prune_rounds(s, job_id="nope", keep=120)
    assert _count(db, "sync_rounds", "j1") == 120 and _count(db, "sync_rounds", "j2") == 50
    async with sessions() as s:
        after = await repo.list_rounds(s, job_id="j1", limit=1000)
    assert after == before, "the newest rows, newest first, as they were"
    assert {r.round for r in after} == set(range(86, 110))


async def test_a_jobs_rounds_are_read_newest_first_without_a_sort(db: Path) -> None:
    """``list_rounds`` and ``prune_rounds`` walk the (job_id, id) index (migration 0007)
    instead of sorting every row of the job."""
    await asyncio.to_thread(migrate.upgrade, db)
    with sqlite3.connect(db) as conn:
        for sql in (
            "SELECT * FROM sync_rounds WHERE job_id = 'j' ORDER BY id DESC LIMIT 200",
            "SELECT id FROM sync_rounds WHERE job_id = 'j' ORDER BY id DESC LIMIT 1 OFFSET 9",
            "SELECT id FROM sync_rounds WHERE job_id = 'j' AND id <= 9 ORDER BY id LIMIT 5",
        ):
            plan = " ".join(str(row[-1]) for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}"))
            assert "ix_sync_rounds_job_id_id" in plan and "TEMP B-TREE" not in plan, plan


# Progress ------------------------------------------------------------------------------------


async def test_progress_keeps_its_newest_points_and_a_thinned_whole_run(
    db: Path, sessions: Sessions
) -> None:
    await _job(sessions)
    await _log(sessions, range(1, 5001))  # every step, a validation loss every 100th
    deleted, calls = await _thin(sessions, keep=500, older=100, rows=300)
    steps = await _steps(sessions)
    assert calls > 1, "in several short calls"
    assert deleted == 5000 - len(steps)

    assert steps[-500:] == list(range(4501, 5001)), "the newest 500 as logged"
    older = steps[:-500]
    assert older[0] == 1, "the first point is kept"
    assert set(range(100, 5001, 100)) <= set(steps), "every validation loss is kept"
    plain = [n for n in older if n % 100]
    assert len(plain) <= 100, "the older points thinned to about `older`"
    assert len(steps) <= 500 + 100 + 50 + 1
    # Spread over the run: runs of 64 steps (the smallest power of two that fits 4,500 steps
    # in 100 runs) each keep their first point.
    assert max(b - a for a, b in itertools.pairwise(older)) <= 64
    assert await _thin(sessions, keep=500, older=100, rows=300) == (0, 1), "idempotent"

    # The run goes on: the older range doubles, its runs merge, and what stays was kept.
    await _log(sessions, range(5001, 10001))
    await _thin(sessions, keep=500, older=100, rows=300)
    again = await _steps(sessions)
    assert again[-500:] == list(range(9501, 10001))
    runs = {1 + 128 * k for k in range(36)}  # now 128 steps each, 4,481 the last below 4,500
    assert runs <= set(older) and runs <= set(again), "each one's first point was, and is, kept"
    assert set(again) >= {1, *range(100, 10001, 100)}
    assert len([n for n in again[:-500] if n % 100]) <= 100
    assert max(b - a for a, b in itertools.pairwise(again[:-500])) <= 128
    assert _count(db, "progress", "j1") == len(again) <= 500 + 100 + 100 + 1


async def test_thinning_leaves_a_short_run_and_other_jobs_alone(sessions: Sessions) -> None:
    await _job(sessions, "j1")
    await _job(sessions, "j2")
    await _log(sessions, range(1, 301), job_id="j1")
    await _log(sessions, range(1, 3001), job_id="j2")
    async with sessions() as s, s.begin():
        assert await repo.thin_progress(s, job_id="j1", keep=300, older=10) == (0, None)
        assert await repo.thinned_until(s, job_id="j1", keep=300) is None
        assert await repo.thinned_until(s, job_id="j1", keep=299) == 1
        with pytest.raises(NotFoundError):
            await repo.thin_progress(s, job_id="nope", keep=300, older=10)
        with pytest.raises(ValueError):
            await repo.thin_progress(s, job_id="j1", keep=0, older=10)
    # j1 beyond its newest 100: steps 1..200 in runs of 32, each its first point, and the
    # validation losses.
    assert await _thin(sessions, keep=100, older=10, rows=10_000) == (191, 1)
    assert await _steps(sessions, "j1") == [1, 33, 65, 97, 100, 129, 161, 193, *range(200, 301)]
    assert len(await _steps(sessions, "j2")) == 3000


async def test_the_curve_and_the_job_record_after_thinning(sessions: Sessions) -> None:
    await _job(sessions)
    await _log(sessions, range(1, 20_001))
    await _thin(sessions, keep=1000, older=200, rows=2000)
    async with sessions() as s:
        curve = await repo.progress_curve(s, job_id="j1", points=200)
        job = await repo.get_job(s, job_id="j1")
    got = [p.step for p in curve]
    assert got == sorted(set(got)) and len(got) <= 402, "steps ascending, within its bound"
    assert got[0] == 1 and got[-1] == 20_000, "the whole run"
    assert max(b - a for a, b in itertools.pairwise(got)) <= 400, "spread over it"
    assert [p.step for p in curve if p.val_loss is not None][-1] == 20_000
    assert job is not None and (job.step, job.val_loss) == (20_000, _val(20_000))


async def test_resuming_from_a_thinned_step_after_thinning(sessions: Sessions) -> None:
    """A job resumes from a checkpoint older than its full-resolution points, at a step the
    thinning deleted: the job takes the newest point left (and the newest validation loss),
    and the resumed run logs its steps again."""
    await _job(sessions)
    await _log(sessions, range(1, 5001))
    await _thin(sessions, keep=500, older=100, rows=1000)
    kept = await _steps(sessions)
    resume_at = 3050
    assert resume_at not in kept
    async with sessions() as s, s.begin():
        assert await repo.delete_progress_after(s, job_id="j1", step=resume_at) > 500
        job = await repo.get_job(s, job_id="j1")
    below = [n for n in kept if n <= resume_at]
    assert job is not None and job.step == below[-1] < resume_at
    assert job.val_loss == _val(3000)
    await _log(sessions, range(resume_at + 1, resume_at + 11))
    async with sessions() as s:
        job = await repo.get_job(s, job_id="j1")
    assert job is not None and job.step == resume_at + 10
    steps = await _steps(sessions)
    assert steps == sorted(set(steps)) and steps[-10:] == list(range(3051, 3061))


async def test_a_resume_backfills_what_is_missing_but_not_what_was_thinned(
    tmp_path: Path,
) -> None:
    """The job manager's resume: the points a crash lost before its checkpoint come back from
    the metrics file; the older points the thinning deleted do not (the file has them all)."""
    from atomd.jobs import JobManager
    from atomd.jobs.active import TrainerResumed
    from atomd.spec import JobSpec
    from atomd.telemetry import Telemetry

    settings = Settings(data_dir=tmp_path / "d", device="cpu")
    await asyncio.to_thread(migrate.upgrade, settings.db_path)
    engine = make_engine(settings.db_path)
    sessions = make_sessionmaker(engine)
    jobs = JobManager(jobs_dir=settings.jobs_dir, sessions=sessions, telemetry=Telemetry(),
                      device="cpu", progress_keep=500)  # fmt: skip
    try:
        await _job(sessions)
        await _log(sessions, range(1, 4801))  # the records stop at 4800, the file at 5000
        await _thin(sessions, keep=500, older=100, rows=1000)
        kept = await _steps(sessions)
        rows = [_point(n, val_loss=_val(n)).model_dump(mode="json") for n in range(1, 5001)]
        active = SimpleNamespace(id="j1", step=0, tokens_seen=0, logged_at=0.0,
                                 spec=JobSpec(preset="tiny"))  # fmt: skip
        await jobs.recorder.record(cast(Any, active), [TrainerResumed(start_step=4950, rows=rows)])
        steps = await _steps(sessions)
        assert steps == [*kept, *range(4801, 4951)]
        async with sessions() as s:
            job = await repo.get_job(s, job_id="j1")
        assert job is not None and (job.step, job.val_loss) == (4950, _val(4900))
    finally:
        await engine.dispose()


# The daemon's pass ---------------------------------------------------------------------------


async def test_one_pass_bounds_every_job_that_wrote_since_the_last(
    db: Path, sessions: Sessions
) -> None:
    await _job(sessions, "a")
    await _job(sessions, "b", state="finished")
    for job_id in ("a", "b"):
        await _rounds(sessions, job_id, range(400), peers=9)  # 3,600 rows each
        await _log(sessions, range(1, 3001), job_id=job_id)
    assert _count(db, "sync_rounds", "a") == 3600 and _count(db, "progress", "a") == 3000

    first = await prune_jobs(sessions, since=None, rounds_keep=1000, progress_keep=400, rows=700)
    assert (first.jobs, first.rounds) == (2, 2 * 2600)
    for job_id in ("a", "b"):
        assert _count(db, "sync_rounds", job_id) == 1000
        assert _count(db, "progress", job_id) <= 400 + 400 + 30 + 1
    assert first.progress == 2 * 3000 - _count(db, "progress", "a") - _count(db, "progress", "b")

    # Later passes: the active job, and those updated since (b is not).
    since = datetime.now(UTC)
    await _rounds(sessions, "a", range(400, 500), peers=9)
    await _rounds(sessions, "b", range(400, 500), peers=9)
    later = await prune_jobs(sessions, since=since, rounds_keep=1000, progress_keep=400)
    assert (later.jobs, later.rounds) == (1, 900)
    assert _count(db, "sync_rounds", "a") == 1000 and _count(db, "sync_rounds", "b") == 1900
    async with sessions() as s, s.begin():
        await repo.set_job_state(s, job_id="b", state="failed")  # updated: looked at again
    later = await prune_jobs(sessions, since=since, rounds_keep=1000, progress_keep=400)
    assert (later.jobs, later.rounds) == (2, 900)
    assert _count(db, "sync_rounds", "b") == 1000


async def test_the_daemon_prunes_with_its_settings(tmp_path: Path) -> None:
    """``SwarmNode.prune_records``, what its once-a-minute task runs: ATOMD_ROUNDS_KEEP and
    ATOMD_PROGRESS_KEEP applied, every job on the first pass."""
    from atomd.p2p.identity import Identity
    from atomd.p2p.node import SwarmNode
    from atomd.telemetry import Telemetry

    settings = Settings(data_dir=tmp_path / "n", device="cpu", rounds_keep=1000, progress_keep=100)
    await asyncio.to_thread(migrate.upgrade, settings.db_path)
    engine = make_engine(settings.db_path)
    sessions = make_sessionmaker(engine)
    fake_jobs = SimpleNamespace(advert=lambda: None)
    node = SwarmNode(settings=settings, identity=Identity.generate(), sessions=sessions,
                     telemetry=Telemetry(), jobs=cast(Any, fake_jobs))  # fmt: skip
    try:
        await _job(sessions, "a", state="stopped")
        await _rounds(sessions, "a", range(300), peers=9)
        await _log(sessions, range(1, 2001), job_id="a")
        pruned = await node.prune_records()
        assert (pruned.jobs, pruned.rounds) == (1, 1700)
        assert _count(settings.db_path, "sync_rounds", "a") == 1000
        assert _count(settings.db_path, "progress", "a") <= 100 + 100 + 20 + 1
        assert (await node.prune_records()).jobs == 0, "the stopped job did not change since"
    finally:
        await engine.dispose()
