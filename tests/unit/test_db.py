"""The records layer on real SQLite files: migrations, pragmas, repository, crash safety."""

from __future__ import annotations

import asyncio
import itertools
import shutil
import sqlite3
import subprocess
import sys
import textwrap
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from pydantic import ValidationError
from sqlalchemy import text

from atomd.db import migrate, repo
from atomd.db.connection import make_engine, make_sync_engine
from atomd.db.health import DatabaseFile
from atomd.db.models import Base
from atomd.db.schemas import ProgressPoint
from atomd.errors import ConfigError, NotFoundError
from tests.unit.conftest import Sessions

TABLES = {
    "node", "peers", "peer_bans", "peer_quarantines", "jobs", "progress", "sync_rounds",
    "checkpoints", "events"
}  # fmt: skip
T0 = datetime(2025, 1, 1, tzinfo=UTC)


def _tables(db: Path) -> set[str]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
    return {r[0] for r in rows} - {"alembic_version"}


def _point(step: int, *, loss: float = 2.0, val_loss: float | None = None) -> ProgressPoint:
    return ProgressPoint(
        step=step,
        tokens=step * 100,
        loss=loss,
        val_loss=val_loss,
        tokens_per_s=1000.0,
        lr=1e-3,
        at=T0 + timedelta(seconds=step),
    )


def _assert_utc(*stamps: datetime | None) -> None:
    for t in stamps:
        assert t is not None
        assert t.utcoffset() == timedelta(0), t


async def _job(sessions: Sessions, job_id: str = "j1") -> None:
    async with sessions() as s, s.begin():
        await repo.create_job(s, job_id=job_id, spec={"preset": "tiny"}, out_dir=f"/o/{job_id}")


async def test_a_deleted_database_is_never_recreated_by_a_new_connection(tmp_path: Path) -> None:
    """The running daemon's engine opens the file but never creates it: a database deleted
    under it is not silently replaced by an empty one (which would lose what is written and
    let the next start take the used data folder for a new one). Odd characters in the path
    are escaped in the SQLite URI."""
    db = tmp_path / "a b#?%" / "atomd.db"
    await asyncio.to_thread(migrate.upgrade, db)
    engine = make_engine(db)
    try:
        async with engine.connect() as c:
            assert (await c.execute(text("SELECT count(*) FROM events"))).scalar() == 0
        await engine.dispose()  # the next connection is a new one
        for suffix in ("", "-wal", "-shm"):
            await asyncio.to_thread(Path(f"{db}{suffix}").unlink, missing_ok=True)
        with pytest.raises(Exception, match="unable to open database file"):
            async with engine.connect() as c:
                await c.execute(text("SELECT 1"))
        assert not await asyncio.to_thread(db.exists)
    finally:
        await engine.dispose()


def _count_in_another_process(db: Path) -> int:
    """The events another process reads (it opens the database, reads and closes it, as the
    sqlite3 shell or a backup would)."""
    code = "import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); " \
        "print(c.execute('SELECT count(*) FROM events').fetchone()[0]); c.close()"  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code, str(db)], capture_output=True, text=True,
                         check=True, timeout=60)  # fmt: skip
    return int(out.stdout)


async def test_the_database_check_keeps_sqlites_locks(sessions: Sessions, db: Path) -> None:
    """The daemon's check of its database file (``/readyz``, every few seconds) must not close
    a descriptor of the file: that drops the process's POSIX locks, SQLite's too, and the next
    process to read the database and close it would delete the write-ahead log under the
    daemon, whose later records would be lost (under load, a peer's events stopped at the
    test's first read of its database)."""
    database = DatabaseFile(db)
    try:
        async with sessions() as s, s.begin():
            await repo.add_event(s, kind="test", message="before")
        assert await asyncio.to_thread(database.problem) is None
        assert await asyncio.to_thread(_count_in_another_process, db) == 1
        async with sessions() as s, s.begin():
            await repo.add_event(s, kind="test", message="after")
        assert await asyncio.to_thread(_count_in_another_process, db) == 2
    finally:
        database.close()


# Migrations ----------------------------------------------------------------------------------


def test_upgrade_downgrade_upgrade(db: Path) -> None:
    assert migrate.current_revision(db) is None
    assert not db.exists(), "asking for the revision must not create the file"
    head = migrate.head_revision()

    migrate.upgrade(db)  # creates data/ too
    assert _tables(db) == TABLES
    assert migrate.current_revision(db) == head
    migrate.upgrade(db)  # already at head: nothing to do
    assert migrate.current_revision(db) == head

    migrate.downgrade(db, "base")
    assert _tables(db) == set()
    assert migrate.current_revision(db) is None

    migrate.upgrade(db)
    assert _tables(db) == TABLES
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)


FAILING_MIGRATION = """
import sqlalchemy as sa
from alembic import op

revision = "9999"
down_revision = "{head}"
branch_labels = None
depends_on = None


def upgrade():
    op.create_table("junk", sa.Column("id", sa.Integer, primary_key=True))
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("extra", sa.Integer))
    raise RuntimeError("migration failed half-way")


def downgrade():
    pass
"""


def test_failed_migration_rolls_back(
    db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    migrate.upgrade(db)
    head = migrate.head_revision()
    scripts = tmp_path / "migrations"
    shutil.copytree(migrate.migrations_dir(), scripts, ignore=shutil.ignore_patterns("__pycache__"))
    (scripts / "versions" / "9999_fails.py").write_text(FAILING_MIGRATION.format(head=head))
    monkeypatch.setattr(migrate, "migrations_dir", lambda: scripts)

    with pytest.raises(RuntimeError, match="half-way"):
        migrate.upgrade(db)
    assert migrate.current_revision(db) == head
    assert _tables(db) == TABLES
    with sqlite3.connect(db) as conn:
        assert "extra" not in {row[1] for row in conn.execute("PRAGMA table_info(jobs)")}


def test_models_match_migrations(db: Path) -> None:
    migrate.upgrade(db)
    engine = make_sync_engine(db)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            assert compare_metadata(ctx, Base.metadata) == []
    finally:
        engine.dispose()


async def test_pragmas(db: Path, sessions: Sessions) -> None:
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    async with sessions() as s:
        pragmas = {
            name: (await s.execute(text(f"PRAGMA {name}"))).scalar()
            for name in ("journal_mode", "synchronous", "foreign_keys", "busy_timeout")
        }
    assert pragmas == {
        "journal_mode": "wal",
        "synchronous": 2,  # FULL: a commit is on disk before it returns
        "foreign_keys": 1,
        "busy_timeout": 5000,
    }


# Node and jobs -------------------------------------------------------------------------------


async def test_node_identity(sessions: Sessions) -> None:
    async with sessions() as s, s.begin():
        first = await repo.get_or_create_node(s, peer_id="p1", public_key="ab" * 32)
    async with sessions() as s, s.begin():
        again = await repo.get_or_create_node(s, peer_id="p1", public_key="ab" * 32)
        assert again == first
        _assert_utc(again.created_at)
        with pytest.raises(ConfigError, match="belongs to peer p1"):
            await repo.get_or_create_node(s, peer_id="p2", public_key="cd" * 32)


async def test_job_lifecycle(sessions: Sessions) -> None:
    async with sessions() as s, s.begin():
        job = await repo.create_job(s, job_id="j1", spec={"preset": "tiny"}, out_dir="/o/j1")
    assert (job.state, job.step, job.tokens, job.loss, job.plan) == ("pending", 0, 0, None, None)
    assert job.started_at is None and job.finished_at is None

    async with sessions() as s, s.begin():
        running = await repo.set_job_state(s, job_id="j1", state="running")
        plan = await repo.set_job_plan(s, job_id="j1", plan={"slots": 2})
    assert running.started_at is not None and running.finished_at is None
    assert running.updated_at >= job.updated_at
    assert plan.plan == {"slots": 2}

    async with sessions() as s, s.begin():
        stopping = await repo.set_job_state(s, job_id="j1", state="stopping", reason="by user")
        stopped = await repo.set_job_state(s, job_id="j1", state="stopped")
    assert stopping.finished_at is None
    assert (stopped.state, stopped.reason) == ("stopped", "by user")
    assert stopped.finished_at is not None and stopped.started_at == running.started_at

    async with sessions() as s:  # a fresh session reads from the file, not the identity map
        got = await repo.get_job(s, job_id="j1")
    assert got == stopped
    assert got.spec == {"preset": "tiny"}
    _assert_utc(got.created_at, got.started_at, got.finished_at, got.updated_at)

    async with sessions() as s, s.begin():  # resumed: active again, reason cleared
        resumed = await repo.set_job_state(s, job_id="j1", state="running")
    assert resumed.finished_at is None and resumed.reason is None
    assert resumed.started_at == running.started_at


async def test_unknown_job_and_state(sessions: Sessions) -> None:
    await _job(sessions)
    async with sessions() as s:
        assert await repo.get_job(s, job_id="nope") is None
        with pytest.raises(NotFoundError, match="nope"):
            await repo.set_job_state(s, job_id="nope", state="running")
        with pytest.raises(ValueError, match="expected one of pending"):
            await repo.set_job_state(s, job_id="j1", state="paused")
        for call in (
            repo.add_progress(s, job_id="nope", points=[_point(1)]),
            repo.list_progress(s, job_id="nope"),
            repo.delete_progress_after(s, job_id="nope", step=0),
            repo.add_checkpoint(s, job_id="nope", step=1, path="/c", sha256="0" * 64),
            repo.latest_checkpoint(s, job_id="nope"),
            repo.list_rounds(s, job_id="nope"),
            repo.delete_job(s, job_id="nope"),
        ):
            with pytest.raises(NotFoundError):
                await call


async def test_list_and_active_jobs(sessions: Sessions) -> None:
    for i, state in enumerate(["pending", "running", "stopping", "stopped", "finished", "failed"]):
        async with sessions() as s, s.begin():
            await repo.create_job(s, job_id=f"j{i}", spec={}, out_dir="/o", state=state)
    async with sessions() as s:
        jobs = await repo.list_jobs(s)
        assert [j.id for j in jobs] == ["j5", "j4", "j3", "j2", "j1", "j0"]
        assert [j.id for j in await repo.list_jobs(s, limit=2)] == ["j5", "j4"]
        assert [j.id for j in await repo.active_jobs(s)] == ["j0", "j1", "j2"]
    assert jobs[4].started_at is not None  # created running


# Progress ------------------------------------------------------------------------------------


async def test_progress(sessions: Sessions) -> None:
    await _job(sessions)
    async with sessions() as s, s.begin():
        assert await repo.add_progress(s, job_id="j1", points=[]) == 0
        # Out of order in; a val_loss only on step 2.
        pts = [_point(3, loss=1.5), _point(1), _point(2, val_loss=1.8)]
        assert await repo.add_progress(s, job_id="j1", points=pts) == 3
        # Steps 2 and 3 again (e.g. a retried report): ignored, not an error.
        assert (
            await repo.add_progress(s, job_id="j1", points=[_point(2), _point(3), _point(4)]) == 1
        )

    async with sessions() as s:
        points = await repo.list_progress(s, job_id="j1")
        job = await repo.get_job(s, job_id="j1")
    assert [p.step for p in points] == [1, 2, 3, 4]
    assert points[2].loss == 1.5, "the first write of a step wins"
    assert points[0] == _point(1)
    _assert_utc(*(p.at for p in points))
    assert job is not None
    assert (job.step, job.tokens, job.loss, job.val_loss) == (4, 400, 2.0, 1.8)

    async with sessions() as s:
        assert [p.step for p in await repo.list_progress(s, job_id="j1", after_step=2)] == [3, 4]
        assert [p.step for p in await repo.list_progress(s, job_id="j1", limit=2)] == [1, 2]
        # A job's latest progress (``atomd job show``): the last points, still ascending.
        newest = await repo.list_progress(s, job_id="j1", limit=2, newest=True)
        assert [p.step for p in newest] == [3, 4]
        newest = await repo.list_progress(s, job_id="j1", after_step=3, limit=2, newest=True)
        assert [p.step for p in newest] == [4]

    async with sessions() as s, s.begin():  # an old point does not move the job back
        await repo.add_progress(s, job_id="j1", points=[_point(0, loss=9.0)])
        job = await repo.get_job(s, job_id="j1")
    assert job is not None and (job.step, job.loss) == (4, 2.0)


async def test_progress_curve_spans_the_whole_run_within_its_bound(sessions: Sessions) -> None:
    await _job(sessions)
    async with sessions() as s:
        assert await repo.progress_curve(s, job_id="j1", points=50) == []
    # 1,000 logged steps (every 3rd step of a run), a validation loss every 30th.
    steps = [3 * i for i in range(1, 1001)]
    pts = [_point(n, loss=5.0 - n / 1000, val_loss=1.0 if n % 30 == 0 else None) for n in steps]
    async with sessions() as s, s.begin():
        await repo.add_progress(s, job_id="j1", points=pts)
    async with sessions() as s:
        curve = await repo.progress_curve(s, job_id="j1", points=50)
        with pytest.raises(NotFoundError):
            await repo.progress_curve(s, job_id="nope", points=50)
    got = [p.step for p in curve]
    assert len(got) <= 102 and got == sorted(got)
    assert got[0] == 3 and got[-1] == 3000, "first and newest step"
    gaps = [b - a for a, b in itertools.pairwise(got)]
    assert max(gaps) <= 3 * 20, "spread over the run, not its first 100 steps"
    vals = [p.step for p in curve if p.val_loss is not None]
    assert len(vals) >= 50 and vals[-1] == 3000, "validation losses over the whole run"
    assert max(b - a for a, b in itertools.pairwise(vals)) <= 2 * 30 * 2
    async with sessions() as s:  # a short run: every step, as logged
        whole = await repo.progress_curve(s, job_id="j1", points=5000)
    assert [p.step for p in whole] == steps


def test_progress_times_are_aware_and_stored_as_utc() -> None:
    with pytest.raises(ValidationError):
        ProgressPoint(step=1, tokens=1, loss=1.0, tokens_per_s=1.0, at=datetime(2025, 1, 1))


async def test_progress_other_timezone_reads_back_utc(sessions: Sessions) -> None:
    await _job(sessions)
    plus2 = datetime(2025, 6, 1, 14, 0, tzinfo=timezone(timedelta(hours=2)))
    point = _point(1).model_copy(update={"at": plus2})
    async with sessions() as s, s.begin():
        await repo.add_progress(s, job_id="j1", points=[point])
    async with sessions() as s:
        (got,) = await repo.list_progress(s, job_id="j1")
    assert got.at == plus2 and got.at.tzinfo is UTC and got.at.hour == 12


async def test_delete_progress_after(sessions: Sessions) -> None:
    await _job(sessions)
    async with sessions() as s, s.begin():
        await repo.add_progress(
            s, job_id="j1", points=[_point(1, val_loss=2.5), _point(2), _point(3, val_loss=1.0)]
        )
        assert await repo.delete_progress_after(s, job_id="j1", step=2) == 1
    async with sessions() as s:
        job = await repo.get_job(s, job_id="j1")
        assert [p.step for p in await repo.list_progress(s, job_id="j1")] == [1, 2]
    assert job is not None and (job.step, job.tokens, job.val_loss) == (2, 200, 2.5)
    async with sessions() as s, s.begin():  # the resumed run logs step 3 afresh
        assert await repo.add_progress(s, job_id="j1", points=[_point(3, loss=0.5)]) == 1
        job = await repo.get_job(s, job_id="j1")
    assert job is not None and (job.step, job.loss) == (3, 0.5)


# Checkpoints, events, rounds, peers ----------------------------------------------------------


async def test_checkpoints(sessions: Sessions) -> None:
    await _job(sessions)
    async with sessions() as s, s.begin():
        assert await repo.latest_checkpoint(s, job_id="j1") is None
        for step in (10, 30, 20):
            await repo.add_checkpoint(
                s, job_id="j1", step=step, path=f"/c/{step}", sha256="ab" * 32
            )
    async with sessions() as s:
        latest = await repo.latest_checkpoint(s, job_id="j1")
    assert latest is not None and (latest.step, latest.path) == (30, "/c/30")
    _assert_utc(latest.at)


async def test_events(sessions: Sessions) -> None:
    async with sessions() as s, s.begin():
        await repo.add_event(s, kind="job.started", message="a", job_id="j1")
        await repo.add_event(s, kind="peer.dead", message="b", peer_id="p1", data={"rtt": [1, 2]})
        await repo.add_event(s, kind="job.started", message="c")
    async with sessions() as s:
        events = await repo.list_events(s)
        started = await repo.list_events(s, kind="job.started", limit=1)
    assert [e.message for e in events] == ["c", "b", "a"]
    assert (events[1].peer_id, events[1].data) == ("p1", {"rtt": [1, 2]})
    assert [e.message for e in started] == ["c"]
    _assert_utc(*(e.at for e in events))


async def test_rounds(sessions: Sessions) -> None:
    await _job(sessions)
    async with sessions() as s, s.begin():
        for r, applied in ((1, True), (2, False)):
            await repo.add_round(
                s,
                job_id="j1",
                round=r,
                direction="received",
                peer_id="p2",
                bytes=1234,
                codec="topk-int8",
                compression_ratio=48.5,
                staleness=r - 1,
                applied=applied,
                reason=None if applied else "stale by 3 rounds, limit 2",
            )
        with pytest.raises(ValueError, match="direction"):
            await repo.add_round(
                s, job_id="j1", round=3, direction="up", peer_id="p2", bytes=1, codec="x",
                compression_ratio=1.0, staleness=None, applied=True, reason=None,
            )  # fmt: skip
    async with sessions() as s:
        rounds = await repo.list_rounds(s, job_id="j1")
        assert len(await repo.list_rounds(s, job_id="j1", limit=1)) == 1
    assert [(r.round, r.applied, r.reason) for r in rounds] == [
        (2, False, "stale by 3 rounds, limit 2"),
        (1, True, None),
    ]
    assert rounds[0].direction == "received" and rounds[0].compression_ratio == 48.5
    _assert_utc(rounds[0].at)


async def test_peers_upsert(sessions: Sessions) -> None:
    async with sessions() as s, s.begin():
        b = await repo.upsert_peer(
            s, peer_id="b", url="http://b", public_key="k", state="alive", incarnation=0, rtt_ms=3.0
        )
        await repo.upsert_peer(
            s, peer_id="a", url="http://a", public_key=None, state="alive", incarnation=0
        )
        assert b.first_seen_at == b.last_seen_at
    async with sessions() as s, s.begin():
        assert [p.id for p in await repo.list_peers(s)] == ["a", "b"]  # loaded in this session
        b2 = await repo.upsert_peer(
            s, peer_id="b", url="http://b2", public_key=None, state="suspect", incarnation=4
        )
        assert (await repo.list_peers(s))[1] == b2, "the session's copy of b was refreshed"
        with pytest.raises(ValueError, match="peer state"):
            await repo.upsert_peer(
                s, peer_id="c", url="u", public_key=None, state="gone", incarnation=0
            )
    assert (b2.url, b2.state, b2.incarnation) == ("http://b2", "suspect", 4)
    assert (b2.public_key, b2.rtt_ms) == ("k", 3.0), "unknown values keep what was known"
    assert b2.first_seen_at == b.first_seen_at and b2.last_seen_at > b.last_seen_at
    async with sessions() as s:
        peers = await repo.list_peers(s)
    assert peers[1] == b2
    _assert_utc(peers[1].first_seen_at, peers[1].last_seen_at)


async def test_events_are_pruned_to_the_retention_limit(sessions: Sessions) -> None:
    async with sessions() as s, s.begin():
        for i in range(30):
            await repo.add_event(s, kind="auth.rejected", message=f"e{i}")
    async with sessions() as s, s.begin():
        assert await repo.prune_events(s, keep=10) == 20
        assert await repo.prune_events(s, keep=10) == 0
    async with sessions() as s:
        kept = await repo.list_events(s, limit=100)
    assert sorted(e.message for e in kept) == sorted(f"e{i}" for i in range(20, 30))


async def test_bans_persist_replace_and_lift(sessions: Sessions) -> None:
    key = "ab" * 32
    async with sessions() as s, s.begin():
        await repo.add_ban(s, public_key=key, reason="poisoned deltas")
        again = await repo.add_ban(s, public_key=key, reason="still poisoning")
    assert again.reason == "still poisoning"
    async with sessions() as s:
        bans = await repo.list_bans(s)
    assert [(b.public_key, b.reason) for b in bans] == [(key, "still poisoning")]
    _assert_utc(bans[0].created_at)
    async with sessions() as s, s.begin():
        assert await repo.remove_ban(s, public_key=key)
        assert not await repo.remove_ban(s, public_key=key)
    async with sessions() as s:
        assert await repo.list_bans(s) == []


async def test_quarantines_persist_expire_and_lift(db: Path, sessions: Sessions) -> None:
    """A quarantine is kept until its end: listed while it runs, not after (the
    rows that ended are deleted as the next is added, so that listing only reads), lifted by
    peer id or by key."""
    now = datetime.now(UTC)
    async with sessions() as s, s.begin():
        await repo.add_quarantine(s, peer_id="a", public_key="aa" * 32, reason="3 strikes",
                                  until=now + timedelta(hours=1))  # fmt: skip
        again = await repo.add_quarantine(
            s, peer_id="a", public_key="aa" * 32, reason="3 more", until=now + timedelta(hours=2)
        )
        await repo.add_quarantine(s, peer_id="b", public_key=None, reason="old",
                                  until=now - timedelta(seconds=1))  # fmt: skip
        await repo.add_quarantine(s, peer_id="c", public_key="cc" * 32, reason="x",
                                  until=now + timedelta(minutes=5))  # fmt: skip
    assert again.reason == "3 more"
    _assert_utc(again.until, again.created_at)
    assert abs((again.until - (now + timedelta(hours=2))).total_seconds()) < 1e-3
    async with sessions() as s, s.begin():
        held = await repo.list_quarantines(s)
    assert [(q.peer_id, q.reason) for q in held] == [("c", "x"), ("a", "3 more")]
    async with sessions() as s, s.begin():
        later = await repo.list_quarantines(s, now=now + timedelta(minutes=10))
        assert [q.peer_id for q in later] == ["a"], "c's ended: not listed"
        assert await repo.remove_quarantines(s, public_key="aa" * 32) == 1
        assert await repo.remove_quarantines(s, peer_ids=["a", "zz"]) == 0
        assert await repo.remove_quarantines(s) == 0
    with sqlite3.connect(db) as conn:  # the file itself: b's row went as c was added
        rows = conn.execute("SELECT peer_id FROM peer_quarantines").fetchall()
    assert rows == [("c",)]


async def test_delete_job_cascades(sessions: Sessions) -> None:
    await _job(sessions, "j1")
    await _job(sessions, "j2")
    async with sessions() as s, s.begin():
        for job_id in ("j1", "j2"):
            await repo.add_progress(s, job_id=job_id, points=[_point(1), _point(2)])
            await repo.add_checkpoint(s, job_id=job_id, step=2, path="/c", sha256="0" * 64)
            await repo.add_round(
                s, job_id=job_id, round=1, direction="sent", peer_id="p", bytes=1, codec="x",
                compression_ratio=1.0, staleness=None, applied=True, reason=None,
            )  # fmt: skip
        await repo.add_event(s, kind="job.created", message="", job_id="j1")
        await repo.delete_job(s, job_id="j1")
    async with sessions() as s:
        counts = {}
        for table in ("progress", "checkpoints", "sync_rounds", "events"):
            sql = f"SELECT job_id, count(*) FROM {table} GROUP BY job_id"
            counts[table] = [tuple(row) for row in await s.execute(text(sql))]
    assert counts == {
        "progress": [("j2", 2)],
        "checkpoints": [("j2", 1)],
        "sync_rounds": [("j2", 1)],
        "events": [("j1", 1)],  # the audit log keeps it
    }


async def test_concurrent_writers(sessions: Sessions) -> None:
    async def write(i: int) -> None:
        async with sessions() as s, s.begin():
            await repo.add_event(s, kind="test", message=str(i))

    await asyncio.gather(*(write(i) for i in range(30)))
    async with sessions() as s:
        assert len(await repo.list_events(s, limit=100)) == 30


# Crash safety --------------------------------------------------------------------------------

WRITER = textwrap.dedent(
    """
    import asyncio, sys
    from datetime import UTC, datetime
    from pathlib import Path
    from atomd.db import repo
    from atomd.db.connection import make_engine, make_sessionmaker
    from atomd.db.schemas import ProgressPoint

    async def main() -> None:
        sessions = make_sessionmaker(make_engine(Path(sys.argv[1])))
        step = 0
        while True:
            step += 1
            async with sessions() as s, s.begin():
                point = ProgressPoint(step=step, tokens=step, loss=1.0, tokens_per_s=1.0,
                                      at=datetime.now(UTC))
                await repo.add_progress(s, job_id="j1", points=[point])
                await repo.add_event(s, kind="test", message="x" * 2000)
            print(step, flush=True)  # only after the commit returned

    asyncio.run(main())
    """
)


async def test_survives_sigkill_mid_write(db: Path, sessions: Sessions) -> None:
    await _job(sessions)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", WRITER, str(db), stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    committed = 0
    try:
        async with asyncio.timeout(20):
            while committed < 50:
                line = await proc.stdout.readline()
                assert line, f"writer exited early with {await proc.wait()}"
                committed = int(line)
    finally:
        proc.kill()  # SIGKILL: no cleanup, no WAL checkpoint
        await proc.wait()

    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    async with sessions() as s:
        steps = [p.step for p in await repo.list_progress(s, job_id="j1", limit=100_000)]
    assert steps[:committed] == list(range(1, committed + 1))
    assert steps == list(range(1, len(steps) + 1)), "no gaps: each commit is all or nothing"


async def test_start_up_steps_wait_out_another_processs_lock(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """SQLite's "database is locked" (another process held a write lock past the busy
    timeout) is waited out, said once; any other error is raised at once."""
    from sqlalchemy.exc import OperationalError

    from atomd.db import health

    monkeypatch.setattr(health, "LOCKED_RETRY_S", 0.01)
    tries: list[int] = []

    async def locked_twice() -> str:
        tries.append(1)
        if len(tries) <= 2:
            raise OperationalError("INSERT", {}, sqlite3.OperationalError("database is locked"))
        return "written"

    assert await health.until_unlocked("a test", locked_twice) == "written"
    assert len(tries) == 3
    assert caplog.text.count("a test waits: another process holds a write lock") == 1

    async def broken() -> None:
        raise OperationalError("INSERT", {}, sqlite3.OperationalError("disk I/O error"))

    with pytest.raises(OperationalError, match="disk I/O error"):
        await health.until_unlocked("a test", broken)
