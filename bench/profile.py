"""Where a swapped step's time goes on the device: busy time of compute kernels, host->device
and device->host copies, and how much of each hides behind the others, read from a
``torch.profiler`` trace (Chrome trace JSON, as ``export_chrome_trace`` writes it).

The question it answers: are loads and stores overlapping compute (busy times near the wall
time, large overlaps), is the device waiting on the host (GPU idle while the wall clock runs:
the Python thread or the host optimizer), or is the link the bound (copies busy nearly all the
window)? The numbers are seconds over the profiled window.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

Interval = tuple[float, float]


def _union(intervals: Iterable[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _length(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def _intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Intersection of two sorted, disjoint interval lists."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def kind_of(event: dict[str, Any]) -> str | None:
    """'compute', 'h2d', 'd2h' or None (not device work) for one trace event."""
    if event.get("ph") != "X":
        return None
    cat = str(event.get("cat", "")).lower()
    name = str(event.get("name", ""))
    if cat == "gpu_memcpy" or name.startswith("Memcpy"):
        if "HtoD" in name:
            return "h2d"
        if "DtoH" in name:
            return "d2h"
        return "compute"  # device-to-device copies occupy the SMs or a copy engine alike
    if cat in ("kernel", "gpu_memset"):
        return "compute"
    return None


def summarize(trace: dict[str, Any], steps: int) -> dict[str, Any]:
    """Busy and overlap seconds per kind of device work over the profiled window."""
    spans: dict[str, list[Interval]] = {"compute": [], "h2d": [], "d2h": []}
    for ev in trace.get("traceEvents", []):
        kind = kind_of(ev)
        if kind is None:
            continue
        start = float(ev["ts"]) / 1e6  # microseconds in Chrome traces
        spans[kind].append((start, start + float(ev.get("dur", 0.0)) / 1e6))
    merged = {k: _union(v) for k, v in spans.items()}
    everything = _union(iv for v in merged.values() for iv in v)
    if not everything:
        return {"steps": steps, "device_events": 0, "note": "no device work in the trace (CPU)"}
    window = everything[-1][1] - everything[0][0]
    compute = merged["compute"]
    busy = {k: round(_length(v), 4) for k, v in merged.items()}
    return {
        "steps": steps,
        "device_events": sum(len(v) for v in spans.values()),
        "window_s": round(window, 4),
        "busy_s": busy,
        "compute_busy_fraction": round(busy["compute"] / window, 3) if window else None,
        "h2d_hidden_by_compute_s": round(_length(_intersect(merged["h2d"], compute)), 4),
        "d2h_hidden_by_compute_s": round(_length(_intersect(merged["d2h"], compute)), 4),
        "h2d_d2h_together_s": round(_length(_intersect(merged["h2d"], merged["d2h"])), 4),
        "device_idle_s": round(window - _length(everything), 4),
    }


def read_trace(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data: dict[str, Any] = json.load(f)
    return data


def write_gz(src: Path, dst: Path) -> None:
    """Compress the exported trace (tens of MB of JSON for a few steps) and drop the original."""
    with open(src, "rb") as f, gzip.open(dst, "wb", compresslevel=6) as g:
        g.write(f.read())
    src.unlink()
