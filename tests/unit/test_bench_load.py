"""The background load of the latency benchmark and of ``python -m atomd_bench.load``: the
arrangement it promises, and nothing of it left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from atomd_bench import load
from tests.polling import wait_for


def _spinners(session: int | None = None) -> set[int]:
    """Pids of spinning processes (in ``session`` when given)."""
    out = set()
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            sid = os.getsid(pid)
        except OSError:
            continue
        if b"while True: pass" in cmd and (session is None or sid == session):
            out.add(pid)
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_background_is_one_session_of_n_and_stop_leaves_none() -> None:
    procs = load.start(3, "background")
    try:
        (leader,) = procs
        sid = os.getsid(leader.pid)
        assert sid == leader.pid and sid != os.getsid(0)  # a session of its own
        wait_for(lambda: len(_spinners(sid)) == 3, what="3 spinners in the session")
    finally:
        load.stop(procs)
    time.sleep(0.2)
    assert _spinners(sid) == set()  # its own session's: another test's may run beside it


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_prober_hogs_share_the_callers_session() -> None:
    procs = load.start(2, "prober")
    try:
        assert {os.getsid(p.pid) for p in procs} == {os.getsid(0)}
    finally:
        load.stop(procs)


def test_the_command_line_runs_the_command_beside_the_load_and_reports() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "atomd_bench.load", "2", "--", sys.executable, "-c",
         "import sys; sys.exit(3)"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 3
    assert '"hogs": 2' in done.stderr and '"exit": 3' in done.stderr


def test_an_unknown_arrangement_is_refused() -> None:
    with pytest.raises(ValueError, match="background"):
        load.start(1, "somewhere")
