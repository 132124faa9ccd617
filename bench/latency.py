"""The control API stays quick on a busy machine: p50/p99 of ``POST /v1/jobs`` and of
``/healthz`` while a job trains flat out, and how soon a peer that auto-joins starts training
after the announce; each quiet and beside a CPU hog load of 4x the core count.

The announce leaves with the 201, so the joiner's times count from the 201. Real daemons on
loopback: ``trainer`` (the seed) and ``joiner`` (its peer, auto-join) train one
swarm job together while ``/healthz`` of the trainer is timed; ``creator`` (no auto-join)
creates local jobs one after another, each stopped before the next, timing each 201.
Targets: job creation p99 < 1 s and /healthz p99 < 50 ms under the hog load; the
joiner trains within 3 s of the announce.

Where the hogs run matters as much as how many there are (``atomd_bench.load``): the targets
are for ``background`` (the hogs in one session of their own, as a parallel build started from
another terminal); the full run also measures ``prober`` (the hogs in the timing process's own
session) and ``each`` (a session per hog).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from atomd.launch import (
    DaemonProcess,
    interrupts,
    start_swarm,
    stop_all,
    wait_until,
)
from atomd_bench import load

# log_interval 1: the first step shows in the job's record as soon as it is done.
SPEC: dict[str, Any] = {
    "preset": "tiny", "max_steps": 1_000_000, "micro_batch_size": 16, "log_interval": 1,
}  # fmt: skip
SETTLE_S = 20.0  # between the daemons' start and the first job


def _ms(samples: list[float]) -> dict[str, float]:
    q = statistics.quantiles(samples, n=100, method="inclusive")
    return {
        "n": len(samples),
        "p50_ms": round(q[49] * 1000, 1),
        "p99_ms": round(q[98] * 1000, 1),
        "max_ms": round(max(samples) * 1000, 1),
    }


def _timed(c: httpx.Client, method: str, path: str, **kw: Any) -> tuple[float, httpx.Response]:
    t0 = time.perf_counter()
    r = c.request(method, path, **kw)
    return time.perf_counter() - t0, r


def _job(c: httpx.Client, job_id: str) -> dict[str, Any]:
    r = c.get(f"/v1/jobs/{job_id}")
    return dict(r.json()) if r.status_code == 200 else {}


def _condition(
    root: Path, *, hogs: int, arrangement: str, creations: int, probes: int, nice: int | None
) -> dict[str, Any]:
    env = {} if nice is None else {"ATOMD_TRAINER_NICE": str(nice)}
    load0 = os.getloadavg()
    # the hogs get 5 s to take the cores before anything is timed
    with load.beside(hogs, arrangement):
        daemons: list[DaemonProcess] = []
        try:
            t0 = time.monotonic()
            trainer, joiner = start_swarm(root / "swarm", 2, started=daemons, env=env)
            creator = DaemonProcess(root / "creator", extra_args=["--no-auto-join"], env=env)
            daemons.append(creator)
            creator.start()
            ready_s = time.monotonic() - t0
            with trainer.client(timeout=120) as t, joiner.client(timeout=120) as j:
                wait_until(lambda: len(j.get("/v1/peers").json()) == 2, timeout=300,
                           what="the joiner to see the trainer")  # fmt: skip
                # A running daemon has loaded torch in the background by the time a job comes
                # (``Daemon._preload``): the joiner's clock measures the join, not that first load.
                time.sleep(SETTLE_S)
                # The announce goes out with the 201: the joiner's clock starts then.
                post_s, r = _timed(t, "POST", "/v1/jobs", json=SPEC)
                r.raise_for_status()
                jid, t201 = r.json()["id"], time.monotonic()
                # Training has started when the trainer is built and its job is "running"; the
                # first step is done when step 1 is recorded.
                wait_until(lambda: _job(j, jid).get("state") == "running", timeout=600,
                           interval=0.05, what="the joiner to start training")  # fmt: skip
                join_running_s = time.monotonic() - t201
                wait_until(lambda: _job(j, jid).get("step", 0) >= 1, timeout=600,
                           interval=0.05, what="the joiner's first step")  # fmt: skip
                join_step_s = time.monotonic() - t201
                wait_until(lambda: _job(t, jid).get("step", 0) >= 1, timeout=600,
                           interval=0.05, what="the trainer's first step")  # fmt: skip
                time.sleep(2)
                healthz = []
                for _ in range(probes):
                    dt, h = _timed(t, "GET", "/healthz")
                    h.raise_for_status()
                    healthz.append(dt)
                    time.sleep(0.02)
                steps = _job(t, jid)["step"]
            create: list[float] = []
            with creator.client(timeout=120) as c:
                for _ in range(creations):
                    dt, r = _timed(c, "POST", "/v1/jobs?scope=local", json=SPEC)
                    if r.status_code != 201:
                        what = f"job creation {len(create) + 1}"
                        raise RuntimeError(f"{what}: {r.status_code} {r.text}")
                    create.append(dt)
                    cid = r.json()["id"]
                    c.post(f"/v1/jobs/{cid}/stop")
                    wait_until(lambda cid=cid: _job(c, cid).get("state") == "stopped", timeout=300,
                               what="the created job to stop")  # fmt: skip
            load1 = os.getloadavg()
        finally:
            stop_all(daemons)
    return {
        "cpu_hogs": hogs,
        "hogs_arrangement": arrangement if hogs else None,
        "trainer_nice": "default (10)" if nice is None else nice,
        "loadavg_1m_before": round(load0[0], 2),
        "loadavg_1m_after": round(load1[0], 2),
        "three_daemons_ready_s": round(ready_s, 2),
        "first_job_after_ready_s": SETTLE_S,
        "first_job_create_s": round(post_s, 3),
        "joiner_running_after_announce_s": round(join_running_s, 2),
        "joiner_first_step_after_announce_s": round(join_step_s, 2),
        "healthz_while_training": _ms(healthz),
        "job_create": _ms(create),
        "trainer_steps_by_then": steps,
    }


def run(quick: bool = False) -> dict[str, Any]:
    cores = os.cpu_count() or 1
    creations, probes = (8, 100) if quick else (30, 400)
    out: dict[str, Any] = {"cores": cores, "quick": quick, "arrangements": load.ARRANGEMENTS}
    hogs = 4 * cores
    conditions: dict[str, tuple[int, str, int | None]] = {
        "quiet": (0, "background", None), "loaded": (hogs, "background", None),
    }  # fmt: skip
    if not quick:
        # ..._nice0: the same with the training threads as nice as the event loop (the
        # reference for ATOMD_TRAINER_NICE, measured side by side)
        conditions |= {
            "loaded_nice0": (hogs, "background", 0),
            "loaded_prober": (hogs, "prober", None),
            "loaded_each": (hogs, "each", None),
            "loaded_each_nice0": (hogs, "each", 0),
        }
    with tempfile.TemporaryDirectory() as tmp, interrupts():
        for name, (n, arrangement, nice) in conditions.items():
            out[name] = _condition(Path(tmp) / name, hogs=n, arrangement=arrangement,
                                   creations=creations, probes=probes, nice=nice)  # fmt: skip
    loaded = out["loaded"]
    out["targets"] = {
        "job_create_p99_ms_below": 1000,
        "healthz_p99_ms_below": 50,
        "joiner_first_step_s_within": 3,
        "met_under_load": {
            "job_create": loaded["job_create"]["p99_ms"] < 1000,
            "healthz": loaded["healthz_while_training"]["p99_ms"] < 50,
            "join": loaded["joiner_running_after_announce_s"] <= 3,
        },
    }
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(run(quick="--quick" in sys.argv), indent=2))
