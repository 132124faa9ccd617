"""The event loop stays free while training: ``/healthz`` latency (p50/p99) of a real daemon,
idle and while a job trains flat out on every core, measured side by side in one run."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from atomd.launch import DaemonProcess


def _latencies(client: httpx.Client, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = client.get("/healthz")
        out.append((time.perf_counter() - t0) * 1000)
        r.raise_for_status()
        time.sleep(0.01)
    return out


def _summary(ms: list[float]) -> dict[str, float]:
    q = statistics.quantiles(ms, n=100)
    return {"p50_ms": round(q[49], 2), "p99_ms": round(q[98], 2), "max_ms": round(max(ms), 2)}


def run(requests: int = 400) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        d = DaemonProcess(Path(tmp) / "d0").start()
        try:
            with d.client() as c:
                _latencies(c, 20)  # warm up connections
                idle = _latencies(c, requests)
                job = c.post("/v1/jobs", json={"preset": "tiny", "max_steps": 100000}).json()
                deadline = time.monotonic() + 60
                while c.get(f"/v1/jobs/{job['id']}").json()["step"] < 5:
                    if time.monotonic() > deadline:
                        raise RuntimeError("the job did not start training")
                    time.sleep(0.2)
                step0, t0 = c.get(f"/v1/jobs/{job['id']}").json()["step"], time.monotonic()
                busy = _latencies(c, requests)
                step1, t1 = c.get(f"/v1/jobs/{job['id']}").json()["step"], time.monotonic()
                c.post(f"/v1/jobs/{job['id']}/stop")
        finally:
            d.stop()
    i, b = _summary(idle), _summary(busy)
    return {
        "requests_each": requests,
        "idle": i,
        "training": b,
        "training_steps_per_s": round((step1 - step0) / (t1 - t0), 2),
        "p99_ratio_training_vs_idle": round(b["p99_ms"] / i["p99_ms"], 2),
    }
