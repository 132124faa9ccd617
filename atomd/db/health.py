"""Is the database file still the one the daemon opened? SQLite keeps writing to a file that
was deleted or replaced under it, so nobody would notice until a restart found the history
gone. The daemon checks the file (stat and header, microseconds) for ``/readyz`` and every few
seconds, and never re-creates a missing database on its own."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from sqlalchemy.exc import OperationalError

from atomd.errors import ConfigError
from atomd.logs import Repeated, get_logger

log = get_logger(__name__)
T = TypeVar("T")

SQLITE_HEADER = b"SQLite format 3\x00"


class DatabaseFile:
    """The database file as opened at start; ``problem()`` says what is wrong with it now.

    The header is read through a descriptor opened once, here, and closed only by ``close()``
    once the daemon's SQLite connections are closed: closing any descriptor of the file drops
    every POSIX lock this process holds on it, SQLite's included (sqlite.org/howtocorrupt.html,
    2.2). A check that opened and closed the file would let the next process to read the
    database and close it (a test, the sqlite3 shell, a backup) take the lock SQLite thinks it
    holds, checkpoint and delete the write-ahead log under the daemon: every record written
    from then on would go to the deleted file and be lost."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        st = os.fstat(self._fd)
        self._identity = (st.st_dev, st.st_ino)

    def close(self) -> None:
        """Close the descriptor (after the last SQLite connection of this process; idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def problem(self) -> str | None:
        """None while the file is there, the same file, and readable as SQLite (blocking)."""
        try:
            st = os.stat(self.path)
            # The file at the path is the one the descriptor holds (checked below), so its
            # header is read there: no descriptor of the file is closed while SQLite has it.
            header = os.pread(self._fd, len(SQLITE_HEADER), 0)
        except FileNotFoundError:
            return (
                f"the database {self.path} has disappeared (deleted or moved while the daemon "
                "ran); records written now are lost at the next restart: restore the file and "
                "restart the daemon"
            )
        except OSError as e:
            return f"the database {self.path} cannot be read: {e.strerror or e}"
        if (st.st_dev, st.st_ino) != self._identity:
            return f"the database {self.path} was replaced by another file while the daemon ran"
        if header != SQLITE_HEADER:
            return f"the database {self.path} is no longer an SQLite file (header {header!r})"
        return None


def refuse_lost_database(data_dir: Path, db_path: Path) -> None:
    """Refuse to start on a data folder that has been used but whose database is missing:
    starting would silently make an empty one and forget every job."""
    if db_path.exists():
        return
    used = [p.name for p in (data_dir / "identity.key", data_dir / "jobs") if _nonempty(p)]
    if used:
        raise ConfigError(
            f"the database {db_path} is missing, but {data_dir} has been used "
            f"({' and '.join(used)} exist): restore the database file, or create an empty one "
            f"deliberately with `atomd migrate --data-dir {data_dir}` (the job history is lost)"
        )


def _nonempty(p: Path) -> bool:
    return p.is_file() or (p.is_dir() and any(p.iterdir()))


LOCKED_RETRY_S = 1.0  # how often a start-up step retries a database another process holds


def is_locked(e: BaseException) -> bool:
    """Whether ``e`` is SQLite's "database is locked": another process held a write lock for
    longer than the busy timeout (``engine.BUSY_TIMEOUT_MS``)."""
    return isinstance(e, OperationalError) and "database is locked" in str(e)


async def until_unlocked(
    what: str, call: Callable[[], Awaitable[T]], give_up: Callable[[], bool] = lambda: False
) -> T:
    """``await call()``, again every LOCKED_RETRY_S while another process holds the database
    (the sqlite3 shell in a transaction, a backup tool), saying so at a backoff. A start-up
    step waits so, not ready (``/readyz`` 503), rather than ending the daemon with a
    traceback, and goes on once the lock is gone. Any other error
    is raised, and "locked" too once ``give_up()`` (the daemon shuts down: a stop must not
    wait on another process for ever)."""
    repeated = Repeated(log, first=5.0, longest=60.0)
    while True:
        try:
            return await call()
        except OperationalError as e:
            if not is_locked(e) or give_up():
                raise
            repeated.log(
                "locked", logging.WARNING,
                "%s waits: another process holds a write lock on the database (an open "
                "transaction in the sqlite3 shell or a backup, for example); retrying", what,
            )  # fmt: skip
        await asyncio.sleep(LOCKED_RETRY_S)
