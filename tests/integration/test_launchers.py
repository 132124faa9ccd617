"""No launcher leaves a daemon behind: ``atomd demo`` and the test fixtures' ``DaemonProcess``
are stopped or killed at several points of the start-up, and every ``atomd run`` they started
must be gone (a killed launcher's daemons get SIGTERM from the kernel: PR_SET_PDEATHSIG)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from atomd.launch import STOP_TIMEOUT

# Several training daemons: one such test at a time under `make test`'s two workers.
pytestmark = pytest.mark.xdist_group("swarm")


def daemons_under(root: Path) -> list[int]:
    """Pids of live ``atomd run`` processes whose command line names a path under ``root``."""
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            argv = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"run" in argv and any(str(root).encode() in a for a in argv):
            pids.append(int(p.name))
    return pids


def _until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.1)


def _launch(args: list[str], out: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATOMD_")}
    with out.open("wb") as f:
        return subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=env)


def _assert_none_left(root: Path) -> None:
    _until(lambda: not daemons_under(root), STOP_TIMEOUT, f"every daemon under {root} gone")


def test_the_check_sees_a_daemon(tmp_path: Path) -> None:
    """``daemons_under`` finds a daemon that runs (else the tests below could not fail)."""
    script = (
        "import sys, time; from pathlib import Path; from atomd.launch import DaemonProcess\n"
        "d = DaemonProcess(Path(sys.argv[1]) / 'd0').start(); print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    out = tmp_path / "out.txt"
    p = _launch([sys.executable, "-c", script, str(tmp_path)], out)
    try:
        _until(lambda: "ready" in out.read_text(), 300, "the daemon ready")
        assert len(daemons_under(tmp_path)) == 1
    finally:
        p.kill()
        p.wait()
    _assert_none_left(tmp_path)  # the fixture's launcher was SIGKILLed: its daemon follows


# (signal, when): the demo's stdout or files say how far the start-up has come.
POINTS = [
    (signal.SIGKILL, "seed's log"),
    (signal.SIGINT, "second daemon's log"),
    (signal.SIGKILL, "daemons ready"),
    (signal.SIGTERM, "job started"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "when"), POINTS, ids=[f"{s.name}-{w}" for s, w in POINTS])
def test_demo_killed_during_start_up_leaves_no_daemon(
    tmp_path: Path, sig: signal.Signals, when: str
) -> None:
    out = tmp_path / "demo.out"
    demo = _launch(
        [sys.executable, "-m", "atomd", "demo", "--out", str(tmp_path), "--peers", "2",
         "--max-steps", "400", "--every", "10"],
        out,
    )  # fmt: skip

    def reached() -> bool:
        logs = {p.name for p in tmp_path.glob("demo-swarm-*/*.log")}
        text = out.read_text()
        return {
            "seed's log": "peer0.log" in logs,
            "second daemon's log": "peer1.log" in logs,
            "daemons ready": "daemons ready in" in text,
            "job started": "started job" in text,
        }[when]

    try:
        _until(reached, 300, when)
        demo.send_signal(sig)
        code = demo.wait(timeout=STOP_TIMEOUT + 30)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    _assert_none_left(tmp_path)
    text = out.read_text()
    if sig != signal.SIGKILL:  # it stopped them itself, and says so truthfully
        assert code == (0 if sig == signal.SIGINT else 143), text
        # the lone daemon (the demo's comparison) starts once the swarm's two are ready
        n = 3 if when == "job started" else 2
        assert f"all {n} daemons stopped." in text, text
        # each daemon is accounted for: stopped, or (signalled as its log appeared, before
        # its process was registered) never started
        stopped, never = text.count(" after SIGTERM in "), text.count(": never started")
        assert stopped >= 1 and stopped + never == n, text
