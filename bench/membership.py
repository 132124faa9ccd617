"""Membership timings of a real swarm on loopback: N daemons from one seed, then SIGTERM,
restart and SIGKILL of members, each timed until every other daemon agrees."""

from __future__ import annotations

import os
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


def idle(n: int = 4, seconds: float = 30.0, settle_s: float = 10.0) -> dict[str, Any]:
    """Bytes per second each peer's link carries while a swarm of ``n`` idles (membership
    only), in network namespaces (root): the settled pace (the default) beside one pace
    throughout (``ATOMD_GOSSIP_SETTLED_INTERVAL`` = the gossip interval), measured in the
    same run. Target: <= 4 kB/s a direction per peer."""
    from atomd_bench import netns
    from atomd_bench.swarm_daemon import Daemon, idle_bytes, wait_formed

    why = netns.namespaces_available()
    if why is not None:
        return {"skipped": why}
    out: dict[str, Any] = {"daemons": n, "seconds": seconds, "load_before": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory() as tmp:
        for name, env in (("one_pace", {"ATOMD_GOSSIP_SETTLED_INTERVAL": "0.5"}), ("settled", {})):
            net = netns.Namespaces(n, upload_kbit=None)
            ds: list[Daemon] = []
            try:
                for i in range(n):
                    d = Daemon(i, Path(tmp) / name, net, seed=ds[0].peer_url if ds else None,
                               threads=1)  # fmt: skip
                    d.env.update(env)
                    ds.append(d)
                    d.start()
                wait_formed(ds, deadline=time.monotonic() + 180)
                time.sleep(settle_s)  # the join's news spread, connections made
                rates = [{k: round(v) for k, v in r.items()}
                         for r in idle_bytes(net, n, seconds) or []]  # fmt: skip
            finally:
                for d in ds:
                    d.stop()
                net.close()
            out[name] = {
                "bytes_per_s": rates,
                "worst_direction_bytes_per_s": max(max(r.values()) for r in rates),
            }
    out["target_bytes_per_s"] = 4000
    out["load_after"] = os.getloadavg()[0]
    return out
