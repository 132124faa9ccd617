"""Membership timings of a real swarm on loopback: N daemons from one seed, then SIGTERM,
restart and SIGKILL of members, each timed until every other daemon agrees."""

from __future__ import annotations

import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from atomd.launch import DaemonProcess, peer_id, peer_view, start_swarm, wait_until


def _everyone(ds: list[DaemonProcess], pid: str, state: str) -> bool:
    return all(peer_view(d).get(pid) == state for d in ds)


def run(n: int = 8) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        ds = start_swarm(Path(tmp), n)
        started = time.monotonic() - t0
        try:
            ids = [peer_id(d) for d in ds]
            formed = wait_until(
                lambda: all(peer_view(d) == dict.fromkeys(ids, "alive") for d in ds), timeout=60
            )
            leaver, others = ds[1], [d for d in ds if d is not ds[1]]
            t = time.monotonic()
            leaver.signal(signal.SIGTERM)
            wait_until(lambda: _everyone(others, ids[1], "left"), timeout=30)
            left = time.monotonic() - t
            leaver.wait(timeout=30)
            t = time.monotonic()
            leaver.start()
            wait_until(lambda: _everyone(ds, ids[1], "alive"), timeout=60)
            rejoined = time.monotonic() - t
            victim, rest = ds[0], ds[1:]
            t = time.monotonic()
            victim.signal(signal.SIGKILL)
            wait_until(lambda: _everyone(rest, ids[0], "dead"), timeout=60)
            dead = time.monotonic() - t
        finally:
            for d in ds:
                d.stop()
    return {
        "daemons": n,
        "start_all_ready_s": round(started, 2),
        "all_alive_after_ready_s": round(formed, 2),
        "sigterm_to_left_everywhere_s": round(left, 2),
        "restart_to_alive_everywhere_s": round(rejoined, 2),
        "sigkill_to_dead_everywhere_s": round(dead, 2),
        "targets_s": {"all_alive": 10, "left": 2, "rejoined": 10, "dead": 15},
    }
