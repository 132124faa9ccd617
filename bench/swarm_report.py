"""The swarm benchmark's report: each peer's figures from its own records, a scenario's
summary, the distances between the peers' final anchors, and the targets checked."""

from __future__ import annotations

import re
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from atomd_bench import netns
from atomd_bench.swarm_daemon import Daemon, tcp_congestion_of
from atomd_bench.swarm_scenarios import Fault, Scenario, ScenarioRecord

# The targets: gain_recovered per scenario, bytes per round vs the fp32 model, membership
# bytes/s per idle peer, time blocked on sync as a share of wall time.
GAIN_BARS = {"unlimited": 0.9, "upload-256kbit": 0.7, "sigkill": 0.8}
RATIO_BAR = 100.0
IDLE_BAR = 4000.0
WAIT_BAR = 0.02


def anchor_divergence(data_dirs: Sequence[Path], job_id: str) -> float | None:
    """The largest relative L2 distance between two peers' anchors (``sync.anchor.*``) in
    their newest checkpoints of the job, each written as the peer ended it: ~0 where every
    peer commits the same sums (``atomd bench sync``: ~1e-8); None with fewer than two."""
    states = _final_sync_states(data_dirs, job_id)
    return _widest([{k: v for k, v in s.items() if k.startswith("anchor.")} for s in states])


def settled_divergence(
    data_dirs: Sequence[Path], job_id: str, sync: Mapping[str, Any]
) -> float | None:
    """As ``anchor_divergence``, of the settled anchors (``SyncState.settled``: every pending
    delta committed, the outer momentum run out), what the final average is relative to. With
    outer momentum the anchors differ by when each peer committed a late delta and by deltas
    still pending at the end; the settled anchors of peers that merged the same deltas agree."""
    from atomd.spec import SyncSpec
    from atomd.sync.state import SyncState

    spec = SyncSpec(**sync)
    settled = []
    for tensors in _final_sync_states(data_dirs, job_id):
        anchor = {k[len("anchor.") :]: v for k, v in tensors.items() if k.startswith("anchor.")}
        if anchor:
            s = SyncState({k: v.clone() for k, v in anchor.items()}, spec, robust=None)
            s.load_state_tensors(tensors)
            settled.append(s.settled())
    return _widest(settled)


def _final_sync_states(data_dirs: Sequence[Path], job_id: str) -> list[dict[str, Any]]:
    """Each peer's sync state (``sync.*``, the prefix dropped) in its newest checkpoint of the
    job; peers without one are left out."""
    from safetensors.torch import load_file

    out = []
    for d in data_dirs:
        steps = sorted((d / "jobs" / job_id / "checkpoints").glob("step-*"))
        state = steps[-1] / "state.safetensors" if steps else None
        if state is not None and state.exists():
            out.append({k[len("sync.") :]: v for k, v in load_file(str(state)).items()
                        if k.startswith("sync.")})  # fmt: skip
    return out


def _widest(models: Sequence[Mapping[str, Any]]) -> float | None:
    """The largest relative L2 distance between two of ``models`` (None with fewer than two)."""
    models = [m for m in models if m]
    if len(models) < 2:
        return None

    def rel(a: Mapping[str, Any], b: Mapping[str, Any]) -> float:
        num = sum(float((a[k].double() - b[k].double()).square().sum()) for k in a)
        den = sum(float(a[k].double().square().sum()) for k in a)
        return (num / den) ** 0.5 if den > 0 else 0.0

    return max(rel(a, b) for i, a in enumerate(models) for b in models[i + 1 :])


def _code(reason: str | None) -> str:
    """A refusal's or failure's kind: the wire reason ("stale"), an HTTP status, a timeout."""
    text = reason or "?"
    answered = re.search(r"answered (\d{3})", text)
    if answered:
        return f"http {answered.group(1)}"
    if "timed out" in text:
        return "timeout"
    if " failed: " in text:
        return "unreachable"
    return text.split(":", 1)[0].strip()[:40]


_TIMINGS = (
    ("atomd_sync_upload_seconds", "upload_s_mean"),
    ("atomd_sync_round_traffic_seconds", "round_traffic_s_mean"),
    ("atomd_sync_answer_held_seconds", "answer_held_s_mean"),
)


def mean_seconds(metrics: str) -> dict[str, float | None]:
    """From a daemon's /metrics: the mean of each sync timing histogram (None: no sample)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(metrics):
        if family.name in {name for name, _ in _TIMINGS}:
            for sample in family.samples:
                kind = sample.name.removeprefix(family.name)
                totals.setdefault(family.name, {})[kind] = sample.value
    out: dict[str, float | None] = {}
    for name, key in _TIMINGS:
        t = totals.get(name, {})
        count = t.get("_count", 0.0)
        out[key] = round(t.get("_sum", 0.0) / count, 4) if count else None
    return out


def peer_report(d: Daemon, job_id: str) -> dict[str, Any]:
    """One peer's figures from its own records (job, progress, rounds)."""
    if not d.alive():
        return {"peer": d.i, "state": "dead"}
    job = d.json(f"/v1/jobs/{job_id}")
    rounds = d.json(f"/v1/jobs/{job_id}/rounds?limit=10000")
    sent = [r for r in rounds if r["direction"] == "sent"]
    received = [r for r in rounds if r["direction"] == "received"]
    sent_ok = [r for r in sent if r["applied"]]
    got = [r for r in received if r["applied"]]
    refused = [r for r in received if not r["applied"]]
    frames = {(r["round"]): r for r in sent}  # one frame per round, sent to every peer
    every = [r["every"] for r in frames.values() if r.get("every")]
    sync = job.get("sync") or {}
    model_bytes = max((r["compression_ratio"] * r["bytes"] for r in sent), default=0.0)
    frame_bytes = [r["bytes"] for r in frames.values()]
    return {
        "peer": d.i,
        "tcp_congestion": tcp_congestion_of(d.log_path),
        "state": job["state"],
        "step": job["step"],
        "val_loss": job["val_loss"],
        "rounds_sent": len(frames),
        "delta_bytes_sent": sum(r["bytes"] for r in sent_ok),
        "delta_bytes_received": sum(r["bytes"] for r in got),
        "frame_bytes_mean": statistics.fmean(frame_bytes) if frame_bytes else None,
        "model_fp32_bytes": round(model_bytes),
        "deltas_merged": len(got),
        # Committed one round late is on time; staleness 2+ arrived after its round's commit.
        "staleness": dict(sorted(Counter(r["staleness"] or 0 for r in got).items())),
        "deltas_late": sum(1 for r in got if (r["staleness"] or 0) >= 2),
        "deltas_refused": len(refused),
        "refusals": dict(Counter(_code(r["reason"]) for r in refused)),
        "sends_failed": sum(1 for r in sent if not r["applied"]),
        "send_failures": dict(Counter(_code(r["reason"]) for r in sent if not r["applied"])),
        "every": {
            "min": min(every, default=None),
            "median": statistics.median(every) if every else None,
            "max": max(every, default=None),
            "final": sync.get("every"),
        },
        "period_s_final": sync.get("period_s"),
        "sync_busy_s": sync.get("busy_s"),
        "sync_wait_s": sync.get("wait_s"),
        "sync_held_steps": sync.get("held_steps"),  # due rounds held for the previous one
        "sync_probes": sync.get("probes"),  # the loss guard's probe passes
        "final_model": sync.get("final_model"),  # the swarm's model, its own, or the average
        # The final average: the others' shares in it, and its time (sending, waiting, making).
        "average_shares": sync.get("average_shares"),
        "average_s": sync.get("average_s"),
        "fraction_final": sync.get("fraction"),  # a sparse codec's share of entries at the end
        # Each upload until its answer, and a round's whole traffic (the cadence's measure).
        **mean_seconds(d.request("GET", "/metrics").text),
    }


def scenario_report(
    scenario: Scenario,
    mode: str,
    netem: str | None,
    peers: list[dict[str, Any]],
    idle: list[dict[str, float]] | None,
    at_start: Sequence[netns.LinkBytes | None],
    at_end: Sequence[netns.LinkBytes | None],
    seen: ScenarioRecord,
    wall: float,
    load_start: list[float],
    load_end: list[float],
) -> dict[str, Any]:
    vals = [p.get("val_loss") for p in peers]
    finite = [v for v in vals if isinstance(v, float)]
    for p, a, b in zip(peers, at_start, at_end, strict=True):
        p["wire_bytes"] = None if a is None or b is None else {"tx": b.tx - a.tx, "rx": b.rx - a.rx}
        done = seen.finished.get(p["peer"])
        p["wall_s"] = None if done is None else round(done - seen.started, 1)
        wait = p.get("sync_wait_s")
        p["sync_wait_share"] = None if wait is None or not p["wall_s"] else wait / p["wall_s"]
    frames = [p["frame_bytes_mean"] for p in peers if p.get("frame_bytes_mean")]
    model = max((p.get("model_fp32_bytes") or 0 for p in peers), default=0)
    fault = seen.fault
    return {
        "scenario": scenario.name,
        "network": mode,
        "upload_limit_kbit": scenario.upload_kbit,
        "delay_emulated": False,
        "netem": "not tried on loopback" if mode == "loopback" else (netem or "available"),
        "job_id": seen.job_id,
        "timed_out": seen.timed_out,
        "wall_s": round(wall, 1),
        "load_avg_start": load_start,
        "load_avg_end": load_end,
        "val_loss_per_peer": vals,
        "swarm_mean_val_loss": statistics.fmean(finite) if finite else None,
        "frame_bytes_mean": statistics.fmean(frames) if frames else None,
        "model_fp32_bytes": model,
        "bytes_ratio_vs_fp32_model": model / statistics.fmean(frames) if frames else None,
        "idle_membership_bytes_per_s": idle,
        **{
            how: fault_report(fault, seen.started)
            if fault is not None and fault.how == how
            else None
            for how in ("sigkill", "sigstop", "partition")
        },
        "peers": peers,
    }


def fault_report(fault: Fault, started: float) -> dict[str, Any]:
    def since(t: float | None) -> float | None:
        return None if t is None else round(t - started, 1)

    return {
        "victim": fault.victim,
        "at_step": fault.at_step,
        "killed_step": fault.killed_step,
        "killed_at_s": since(fault.killed_at),
        "restarted_at_s": since(fault.restarted_at),
    }


def targets(scenarios: list[dict[str, Any]], refs: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for s in scenarios:
        t: dict[str, Any] = {}
        bar = GAIN_BARS.get(s["scenario"])
        if bar is not None and s.get("gain_recovered") is not None:
            t["gain_recovered"] = {"value": s["gain_recovered"], "bar": bar,
                                   "ok": s["gain_recovered"] >= bar}  # fmt: skip
        ratio = s.get("bytes_ratio_vs_fp32_model")
        if ratio is not None:
            t["bytes_ratio"] = {"value": ratio, "bar": RATIO_BAR, "ok": ratio >= RATIO_BAR}
        idle = s.get("idle_membership_bytes_per_s")
        if idle:
            worst = max(max(p["tx"], p["rx"]) for p in idle)
            t["idle_membership_bytes_per_s"] = {
                "value": worst, "what": "the busier direction of the busiest peer's link",
                "bar": IDLE_BAR, "ok": worst <= IDLE_BAR,
            }  # fmt: skip
        waits = [p["sync_wait_share"] for p in s["peers"] if p.get("sync_wait_share") is not None]
        if waits:
            worst = max(waits)
            t["sync_wait_share_of_wall"] = {
                "value": worst,
                "bar": WAIT_BAR,
                "ok": worst <= WAIT_BAR,
            }
        out[s["scenario"]] = t
    return out
