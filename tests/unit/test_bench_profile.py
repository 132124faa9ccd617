"""The trace summary of ``atomd bench swap --profile`` on hand-made traces."""

from __future__ import annotations

from typing import Any

import pytest

from atomd_bench.profile import kind_of, summarize


def _ev(name: str, cat: str, start_us: float, dur_us: float) -> dict[str, Any]:
    return {"ph": "X", "name": name, "cat": cat, "ts": start_us, "dur": dur_us}


def test_kinds() -> None:
    assert kind_of(_ev("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 0, 1)) == "h2d"
    assert kind_of(_ev("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", 0, 1)) == "d2h"
    assert kind_of(_ev("Memcpy DtoD (Device -> Device)", "gpu_memcpy", 0, 1)) == "compute"
    assert kind_of(_ev("ampere_bf16_gemm", "kernel", 0, 1)) == "compute"
    assert kind_of(_ev("aten::mm", "cpu_op", 0, 1)) is None  # host-side op, not device work
    assert kind_of({"ph": "i", "name": "Memcpy HtoD", "ts": 0}) is None


def test_busy_overlap_and_idle() -> None:
    trace = {
        "traceEvents": [
            # compute 0-4 s and 6-10 s (two overlapping kernels in the first)
            _ev("gemm", "kernel", 0, 3e6),
            _ev("gemm", "kernel", 1e6, 3e6),
            _ev("gemm", "kernel", 6e6, 4e6),
            # loads 3-7 s: 1 s under the first kernels, 1 s under the last, 2 s exposed
            _ev("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 3e6, 4e6),
            # stores 8-9 s, under compute; loads and stores never together
            _ev("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", 8e6, 1e6),
            _ev("aten::mm", "cpu_op", 0, 20e6),  # ignored
        ]
    }
    out = summarize(trace, steps=2)
    assert out["window_s"] == pytest.approx(10)
    assert out["busy_s"] == {"compute": 8.0, "h2d": 4.0, "d2h": 1.0}
    assert out["compute_busy_fraction"] == pytest.approx(0.8)
    assert out["h2d_hidden_by_compute_s"] == pytest.approx(2.0)
    assert out["d2h_hidden_by_compute_s"] == pytest.approx(1.0)
    assert out["h2d_d2h_together_s"] == 0
    assert out["device_idle_s"] == pytest.approx(0)  # 4-6 s is covered by the load


def test_gaps_count_as_idle() -> None:
    trace = {"traceEvents": [_ev("k", "kernel", 0, 1e6), _ev("k", "kernel", 3e6, 1e6)]}
    out = summarize(trace, steps=1)
    assert out["window_s"] == pytest.approx(4) and out["device_idle_s"] == pytest.approx(2)


def test_a_cpu_trace_has_no_device_work() -> None:
    out = summarize({"traceEvents": [_ev("aten::mm", "cpu_op", 0, 5)]}, steps=1)
    assert out["device_events"] == 0 and "CPU" in out["note"]
