"""The data directory's lock: one process uses a data directory at a time."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from atomd.errors import ConfigError

LOCK_FILE = "atomd.pid"  # flock held by the daemon or ``atomd migrate`` that uses the folder


def lock_data_dir(data_dir: Path) -> int:
    """Take the data directory for this process: an exclusive ``flock`` on ``atomd.pid``
    (which then holds our pid), held until the returned descriptor is closed or the process
    dies, however it dies. Two daemons on one data directory would share its identity (one
    peer id on two addresses), its database and its jobs' checkpoints, and a migration would
    change the schema under a running daemon: the second is refused with a ``ConfigError``
    naming the first."""
    path = data_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode("ascii", "replace").strip() or "?"
        os.close(fd)
        raise ConfigError(
            f"the data directory {data_dir} is in use by another atomd (pid {holder}): stop "
            "it first, or give this one its own --data-dir"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
