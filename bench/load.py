"""A background CPU load: ``n`` processes that spin, arranged in sessions as real work would be.

Linux shares the CPU between sessions before it shares it between processes
(``sched_autogroup``, on by default; systemd does the same between services with cgroups), so
where the spinning processes run matters as much as how many there are:

- ``background``: all in one session of their own, as a parallel build started from another
  terminal would be (the arrangement the latency targets are measured under);
- ``prober``: in the caller's own session, so whatever the caller times queues behind them;
- ``each``: every one a session of its own (eight unrelated programs).

``python -m atomd_bench.load N [--arrangement A] -- COMMAND ...`` runs a command beside such a
load and prints one JSON line (its exit code, wall time and the load averages) on stderr; the
load is stopped on every way out, and dies with the caller (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

from atomd.launch import die_with_parent, interrupts

SPIN = "while True: pass"
# One session of n spinning processes: the first forks the others, each dies with its parent.
SPIN_GROUP = """
import ctypes, os, signal
for _ in range({n} - 1):
    if os.fork() == 0:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        break
while True: pass
"""
ARRANGEMENTS = {
    "background": "the hogs in one session of their own, like a parallel build started elsewhere",
    "prober": "the hogs in the timing process's own session: its requests wait behind them",
    "each": "every hog in a session of its own",
}


def start(n: int, arrangement: str = "background") -> list[subprocess.Popen[bytes]]:
    if arrangement not in ARRANGEMENTS:
        raise ValueError(f"arrangement {arrangement!r}: one of {', '.join(ARRANGEMENTS)}")
    if n <= 0:
        return []
    dies = die_with_parent(os.getpid())
    if arrangement == "background":
        code = SPIN_GROUP.format(n=n)
        return [
            subprocess.Popen([sys.executable, "-c", code], start_new_session=True, preexec_fn=dies)
        ]
    own = arrangement == "each"
    return [
        subprocess.Popen([sys.executable, "-c", SPIN], start_new_session=own, preexec_fn=dies)
        for _ in range(n)
    ]


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(p.pid) == p.pid:  # a session leader: its whole group
                os.killpg(p.pid, signal.SIGKILL)
        p.kill()
        p.wait()


@contextlib.contextmanager
def beside(n: int, arrangement: str = "background", settle_s: float = 5.0) -> Iterator[None]:
    """Run the block beside ``n`` spinning processes (given ``settle_s`` to take the cores)."""
    procs = start(n, arrangement)
    try:
        if procs:
            time.sleep(settle_s)
        yield
    finally:
        stop(procs)


def main(argv: list[str] | None = None) -> int:
    cores = os.cpu_count() or 1
    parser = argparse.ArgumentParser(
        prog="python -m atomd_bench.load",
        description="Run COMMAND beside N CPU-bound processes; the load stops with it.",
    )
    parser.add_argument("n", type=int, nargs="?", default=4 * cores, help="hogs (default 4x cores)")
    parser.add_argument("--arrangement", choices=list(ARRANGEMENTS), default="background")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give a command after --")
    load0, t0, code = os.getloadavg(), time.monotonic(), 1
    with interrupts(), beside(args.n, args.arrangement):
        code = subprocess.call(command)
    report = {
        "command": command, "hogs": args.n, "arrangement": args.arrangement, "exit": code,
        "wall_s": round(time.monotonic() - t0, 1), "cores": cores,
        "loadavg_1m_before": round(load0[0], 2), "loadavg_1m_after": round(os.getloadavg()[0], 2),
    }  # fmt: skip
    print(json.dumps(report), file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
