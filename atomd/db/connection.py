"""The async engine and session factory for atomd's SQLite database."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import URL, Connection, Engine, NullPool, create_engine, event
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

BUSY_TIMEOUT_MS = 5000


def _set_pragmas(dbapi_connection: Any, *, foreign_keys: bool) -> None:
    cursor = dbapi_connection.cursor()
    try:
        # WAL: the API reads while the job manager writes. It is a property of the file, so
        # setting it on every connection is a cheap no-op after the first.
        cursor.execute("PRAGMA journal_mode=WAL")
        # FULL: a commit is on disk before it returns. NORMAL (in WAL mode, never a corrupt
        # file) lets a power cut roll back the last commits, and those include what a user was
        # told happened: a stop, a ban, a job's end. The cost is an fsync a commit (0.4 ms on
        # this project's CI disk); the trainer's reports are recorded in batches.
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute(f"PRAGMA foreign_keys={'ON' if foreign_keys else 'OFF'}")
        # Wait for a concurrent writer instead of failing at once with "database is locked".
        cursor.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    finally:
        cursor.close()


def make_engine(db_path: Path) -> AsyncEngine:
    """An ``sqlite+aiosqlite`` engine on the existing database ``db_path`` (WAL, foreign keys
    on, 5 s busy timeout). Migrate first (``atomd.db.migrate`` creates the file and tables).

    Its connections open the file read-write but never create it (SQLite's ``mode=rw``): if
    the file is deleted under a running daemon, the next new connection fails ("unable to open
    database file") instead of silently making an empty database, which would lose what is
    written to it and hide the loss from the next start (``health.refuse_lost_database``)."""
    url = URL.create(
        "sqlite+aiosqlite",
        database=db_path.resolve().as_uri(),
        query={"mode": "rw", "uri": "true"},
    )
    engine = create_async_engine(url)

    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        _set_pragmas(dbapi_connection, foreign_keys=True)

    return engine


def make_sync_engine(db_path: Path) -> Engine:
    """A blocking ``sqlite`` engine for migrations: each transaction covers DDL too, so a
    migration that fails or is killed half-way leaves the schema as it was."""
    db_path.parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(URL.create("sqlite", database=str(db_path)), poolclass=NullPool)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Foreign keys off: batch migrations copy and drop whole tables, which with them on
        # would cascade-delete child rows. ``migrate`` runs foreign_key_check afterwards.
        _set_pragmas(dbapi_connection, foreign_keys=False)
        # sqlite3 would not open a transaction before DDL; take over and BEGIN ourselves.
        dbapi_connection.isolation_level = None

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN")

    return engine


def make_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    """Sessions whose objects stay readable after commit (records are built from them)."""
    return async_sessionmaker(engine, expire_on_commit=False)
