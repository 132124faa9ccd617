"""The data directory: one process uses it at a time, and what a killed one left is swept.

Who holds it: the daemon (``atomd run``) or ``atomd migrate``, by an exclusive ``flock`` on
``atomd.pid``, which names the holder's pid and role. A daemon that finds a migration there
waits for it (seconds); anything else is refused, naming the holder.

What a kill leaves (files only this folder's holder writes, so only the holder may sweep them,
right after taking the lock): a key being written (``identity.key`` is written to a side file,
then linked into place) and the TLS context's private folder with a copy of the key
(``load_cert_chain`` reads files only). A job's partial checkpoints are swept where that job
launches (``atomd.train.checkpoint.remove_partial``): a job ends and launches again within
one daemon's life too.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from atomd.errors import ConfigError
from atomd.logs import Repeated, get_logger

log = get_logger(__name__)

LOCK_FILE = "atomd.pid"  # flock held by the daemon or ``atomd migrate`` that uses the folder
Role = Literal["run", "migrate"]
KEY_SIDE_FILE = ".identity.key.{pid}.tmp"  # atomd.p2p.identity writes the key here first
TLS_SCRATCH_PREFIX = ".tls-"  # atomd.p2p.tls's folder for the key while a context is made
LEFTOVERS = (KEY_SIDE_FILE.format(pid="*"), TLS_SCRATCH_PREFIX + "*")
WAIT_POLL_S = 0.2


@dataclass(frozen=True)
class Holder:
    pid: str
    role: Role

    @classmethod
    def parse(cls, text: str) -> Holder:
        """What ``atomd.pid`` says: "<pid> <role>" (a daemon of before wrote the pid alone)."""
        pid, _, role = text.strip().partition(" ")
        return cls(pid[:16] or "?", "migrate" if role.strip() == "migrate" else "run")

    def __str__(self) -> str:
        what = "atomd migrate" if self.role == "migrate" else "another atomd"
        return f"{what} (pid {self.pid})"


class DataDirInUseError(ConfigError):
    """The data directory's lock is held by another process."""

    def __init__(self, data_dir: Path, holder: Holder) -> None:
        self.holder = holder
        super().__init__(
            f"the data directory {data_dir} is in use by {holder}: stop it first, or give "
            "this one its own --data-dir"
        )


def lock_data_dir(data_dir: Path, role: Role = "run") -> int:
    """Take the data directory for this process: an exclusive ``flock`` on ``atomd.pid``
    (which then names our pid and ``role``), held until the returned descriptor is closed or
    the process dies, however it dies. Two daemons on one data directory would share its
    identity (one peer id on two addresses), its database and its jobs' checkpoints, and a
    migration would change the schema under a running daemon: the second is refused with
    ``DataDirInUseError`` naming the first."""
    path = data_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = Holder.parse(os.read(fd, 64).decode("ascii", "replace"))
        os.close(fd)
        raise DataDirInUseError(data_dir, holder) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {role}\n".encode(), 0)
    return fd


def sweep(data_dir: Path) -> list[str]:
    """Remove what a killed holder left (``LEFTOVERS``); call it holding the lock. Returns
    the names removed."""
    removed = []
    for pattern in LEFTOVERS:
        for left in data_dir.glob(pattern):
            if left.is_dir() and not left.is_symlink():
                shutil.rmtree(left, ignore_errors=True)
            else:
                left.unlink(missing_ok=True)
            removed.append(left.name)
    if removed:
        log.info("removed what a killed atomd left in %s: %s", data_dir, ", ".join(removed))
    return removed


async def take_data_dir(
    data_dir: Path, role: Role = "run", *, give_up: Callable[[], bool] = lambda: False
) -> int:
    """``lock_data_dir``, waiting while ``atomd migrate`` holds the folder (a daemon started
    during a migration: systemd, a launcher), then ``sweep``. Another holder, or ``give_up()``
    while waiting, raises ``DataDirInUseError``."""
    repeated = Repeated(log, first=5.0, longest=60.0)
    while True:
        try:
            fd = lock_data_dir(data_dir, role)
            break
        except DataDirInUseError as e:
            if e.holder.role != "migrate" or give_up():
                raise
            repeated.log("migrate", logging.INFO, "waiting for %s to finish", e.holder)
        await asyncio.sleep(WAIT_POLL_S)
    try:
        await asyncio.to_thread(sweep, data_dir)
    except BaseException:
        os.close(fd)
        raise
    return fd
