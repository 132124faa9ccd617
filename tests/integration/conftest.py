"""Real ``atomd run`` processes on free loopback ports, always cleaned up."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from atomd.launch import DaemonProcess, stop_all
from tests.polling import wait_for

# A spec that trains the tiny model quickly on the CPU (steps of 128 tokens).
FAST_JOB: dict[str, Any] = {
    "preset": "tiny",
    "seq_len": 32,
    "micro_batch_size": 4,
    "eval_batches": 2,
    "eval_interval": 50,
    "log_interval": 1,
    "checkpoint_interval": 5,
    "warmup_steps": 2,
}


# How much of each daemon's log a failed test's report shows.
LOG_TAIL_CHARS = 6000


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A failed test's report carries the end of the log of every daemon it started (each
    writes ``<name>.log`` beside its data folder under the test's ``tmp_path``): a failure on a
    busy CI machine is otherwise a timeout that says nothing of what the daemons did."""
    report = yield
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if report.when == "call" and report.failed and tmp is not None:
        for log in sorted(Path(tmp).rglob("*.log")):
            tail = log.read_text(errors="replace")[-LOG_TAIL_CHARS:]
            report.sections.append((f"log {log.relative_to(tmp)} (its end)", tail))
    return report


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[Any]:
    """Factory of daemons; every one is stopped (then killed) at the end of the test."""
    started: list[DaemonProcess] = []

    def make(name: str = "d0", **kw: Any) -> DaemonProcess:
        d = DaemonProcess(tmp_path / name, **kw)
        started.append(d)
        return d

    yield make
    stop_all(started)


@contextlib.contextmanager
def restarted_while_database_held(d: DaemonProcess) -> Iterator[httpx.Response]:
    """Start ``d`` again while another connection holds a write lock on its database, and
    yield its first ``/readyz`` answer; the lock goes when the block ends. Reads still work,
    so the daemon comes up, but it cannot record that it takes up the job a SIGKILL
    interrupted: the start-up window before that stays open for the block (the daemon's
    writes wait ``BUSY_TIMEOUT_MS``, 5 s, then fail, and the take-up is tried again)."""

    def answer() -> httpx.Response | None:
        try:
            return httpx.get(d.url + "/readyz", headers=d.headers, timeout=5)
        except httpx.HTTPError:  # not listening yet
            return None

    lock = sqlite3.connect(d.data_dir / "atomd.db", isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")
    try:
        d.start(wait=False)
        yield wait_for(answer, what=f"a first answer from {d.name}")
    finally:
        lock.execute("ROLLBACK")
        lock.close()
