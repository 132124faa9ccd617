"""The training threads yield to the control plane: they run nicer than the event loop."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from atomd.config import Settings
from atomd.jobs import JobManager
from atomd.jobs.trainer_thread import lower_thread_priority

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="per-thread niceness is Linux's")


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _in_thread(fn: Any) -> Any:
    box: list[Any] = []
    t = threading.Thread(target=lambda: box.append(fn()))
    t.start()
    t.join()
    return box[0]


@linux_only
def test_lowers_only_the_calling_thread_and_what_it_starts() -> None:
    base = _nice()

    def body() -> tuple[int, int]:
        lower_thread_priority(3)
        return _nice(), _in_thread(_nice)

    mine, child = _in_thread(body)
    assert mine == min(19, base + 3) and child == mine
    assert _nice() == base  # the caller's own thread is untouched


@linux_only
def test_zero_changes_nothing_and_19_is_the_ceiling() -> None:
    base = _nice()
    assert _in_thread(lambda: (lower_thread_priority(0), _nice())[1]) == base
    assert _in_thread(lambda: (lower_thread_priority(50), _nice())[1]) == 19


@linux_only
def test_the_job_managers_trainer_thread_runs_nicer(tmp_path: Path) -> None:
    base = _nice()
    jobs = JobManager(
        jobs_dir=tmp_path, sessions=None, telemetry=None, device="cpu",  # type: ignore[arg-type]
        trainer_nice=Settings().trainer_nice,
    )  # fmt: skip
    try:
        assert jobs.driver.executor.submit(_nice).result(timeout=10) == min(19, base + 10)
    finally:
        jobs.driver.executor.shutdown(wait=True)


def test_trainer_nice_is_bounded() -> None:
    assert Settings(trainer_nice=0).trainer_nice == 0
    for bad in (-1, 20):
        with pytest.raises(ValidationError):
            Settings(trainer_nice=bad)
