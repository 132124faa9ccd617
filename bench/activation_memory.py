"""``python -m atomd_bench activation_memory``: what ``admit`` counts for a job that trains on
the CPU (16 B/parameter, and ``atomd.devices.host_step_bytes``: one micro-batch's activations,
``activation_bytes``, with the allocator's slack and a reserve) against the peak RSS of real
training steps through the real engine (``build_engine(spec, "cpu")``, as the daemon builds it).

Each configuration runs in a subprocess of its own, so that no peak carries over. It imports
what the daemon loads before a job (``load_training_modules``), makes its batches, reads its
RSS, builds the engine, and trains one step and then ``steps - 1`` more, with the peak RSS
(``VmHWM``, reset through ``/proc/self/clear_refs``) read after the first and after the rest:

- ``step``: a step's peak over what the process holds between steps (weights and AdamW
  moments; gradients are freed by ``zero_grad``): the gradients and one micro-batch's
  activations, against ``activation_bytes + 4 B/parameter``;
- ``total``: the peak over the process before the engine was built, against admit's whole need
  (16 B/parameter and ``host_step_bytes``: the activations with the allocator's slack, and a
  reserve).

Under glibc's default allocator freed chunks below its (adaptive) mmap threshold stay in the
process, so a later step's growth hides in them; ``malloc: mmap`` (``MALLOC_MMAP_THRESHOLD_``
64 KiB) returns every tensor's pages when it is freed, so RSS follows the bytes alive. Both
run: ``mmap`` checks the activation model (``step``), ``default`` (what the daemon runs) what
admit counts (``total``).
~10 min on 2 cores (``quick``: the tiny configurations, ~1 min).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

SWAP_AT_LEAST = {"swap": "on", "swap_micro_batches": 1, "swap_graph_blocks": 0}
# (name, spec fields): sizes that fit a 24 GB machine with room to spare, each under a minute.
CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("tiny-b16", {"preset": "tiny", "micro_batch_size": 16}),
    ("tiny-b64", {"preset": "tiny", "micro_batch_size": 64}),
    ("tiny-b256", {"preset": "tiny", "micro_batch_size": 256}),
    ("tiny-b256-t32", {"preset": "tiny", "micro_batch_size": 256, "seq_len": 32}),
    ("tiny-b256-ga2", {"preset": "tiny", "micro_batch_size": 256, "grad_accum": 2}),
    ("tiny-b64-bf16", {"preset": "tiny", "micro_batch_size": 64, "precision": "bf16"}),
    # the swapping engine at its least (M = 1, no kept graph): what admit counts for it
    ("tiny-b64-swap", {"preset": "tiny", "micro_batch_size": 64, **SWAP_AT_LEAST}),
    ("small-b1-t256", {"preset": "small", "micro_batch_size": 1, "seq_len": 256}),
    ("small-b4-t256", {"preset": "small", "micro_batch_size": 4, "seq_len": 256}),
    ("small-b1-t1024", {"preset": "small", "micro_batch_size": 1, "seq_len": 1024}),
]
QUICK = {"tiny-b16", "tiny-b64", "tiny-b256"}
ALLOCATORS: dict[str, dict[str, str]] = {
    "default": {},
    "mmap": {"MALLOC_MMAP_THRESHOLD_": "65536"},
}
MIB = 2**20


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def child(fields: dict[str, Any], steps: int) -> dict[str, Any]:
    """One configuration, in this process: its measurements and admit's estimate."""
    from atomd.jobs import load_training_modules

    load_training_modules()  # what the daemon imports before it builds a job's engine
    import torch

    from atomd.data.dataset import Batch
    from atomd.devices import TRAIN_BYTES_PER_PARAMETER, activation_bytes, host_step_bytes
    from atomd.engine_choice import build_engine
    from atomd.model.config import num_parameters
    from atomd.spec import JobSpec

    spec = JobSpec.model_validate({**fields, "max_steps": steps})
    gen = torch.Generator().manual_seed(0)
    b, t, v = spec.micro_batch_size, spec.effective_seq_len, spec.model_shape.vocab_size

    def micro_batch() -> Batch:
        tokens = torch.randint(0, v, (b, t + 1), generator=gen)
        return Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())

    batches = [[micro_batch() for _ in range(spec.grad_accum)] for _ in range(steps)]
    before = _status("VmRSS")
    built = build_engine(spec, "cpu")
    built_rss = _status("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    built.engine.train_step(batches[0], 1e-4)
    first_peak = _status("VmHWM")
    between = _status("VmRSS")
    _reset_peak()
    for step in batches[1:]:
        built.engine.train_step(step, 1e-4)
    built.engine.settle()
    later_peak = _status("VmHWM")
    wall = time.perf_counter() - t0
    params = num_parameters(spec.model_shape)
    acts = activation_bytes(spec)
    step_measured = later_peak - between
    total_measured = max(first_peak, later_peak) - before
    step_estimate = acts + 4 * params
    total_estimate = TRAIN_BYTES_PER_PARAMETER * params + host_step_bytes(spec)
    return {
        "engine": built.plan["engine"],
        "precision": built.plan["precision"],
        "parameters": params,
        "tokens_per_micro_batch": b * t,
        "activation_estimate_mib": round(acts / MIB, 1),
        "step": {
            "measured_mib": round(step_measured / MIB, 1),
            "estimate_mib": round(step_estimate / MIB, 1),
            "estimate_over_measured": round(step_estimate / step_measured, 2),
        },
        "total": {
            "measured_mib": round(total_measured / MIB, 1),
            "estimate_mib": round(total_estimate / MIB, 1),
            "estimate_over_measured": round(total_estimate / total_measured, 2),
        },
        "model_built_mib": round((built_rss - before) / MIB, 1),
        "held_between_steps_mib": round((between - before) / MIB, 1),
        "wall_s": round(wall, 1),
    }


def _measure(name: str, fields: dict[str, Any], allocator: str, steps: int) -> dict[str, Any]:
    env = {**os.environ, **ALLOCATORS[allocator]}
    cmd = [sys.executable, "-m", "atomd_bench.activation_memory", "--child", json.dumps(fields),
           "--steps", str(steps)]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{name} ({allocator}) failed:\n{out.stderr[-3000:]}")
    return {"name": name, "spec": fields, "malloc": allocator, **json.loads(out.stdout)}


def run(quick: bool = False, steps: int = 3) -> dict[str, Any]:
    runs = []
    for name, fields in CONFIGS:
        if quick and name not in QUICK:
            continue
        for allocator in ALLOCATORS:
            t0 = time.monotonic()
            r = _measure(name, fields, allocator, steps)
            print(f"activation_memory: {name} ({allocator}): step {r['step']['measured_mib']} "
                  f"MiB measured, {r['step']['estimate_mib']} estimated; "
                  f"{time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)  # fmt: skip
            runs.append(r)
    ratios = [r[k]["estimate_over_measured"] for r in runs for k in ("step", "total")]
    return {
        "steps": steps,
        "threads": int(os.environ.get("OMP_NUM_THREADS", 0)) or os.cpu_count(),
        "runs": runs,
        "estimate_over_measured": {"min": min(ratios), "max": max(ratios)},
        "target": {"estimate_over_measured_at_least": 1.0, "at_most": 2.0},
    }


def _annotation(argv: list[str], load_before: float) -> dict[str, str]:
    repo = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
        return out.stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--", "atomd", "bench"):
        commit += " (with uncommitted changes)"
    with open("/proc/meminfo") as f:
        total = int(f.readline().split()[1]) * 1024
    cpu = platform.machine()
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    return {
        "command": " ".join(["python -m atomd_bench.activation_memory", *argv]),
        "commit": commit,
        "date": date.today().isoformat(),
        "machine": f"{cpu}, {os.cpu_count()} cores, "
        f"{total / 2**30:.0f} GiB, Linux {platform.release()}, torch on the CPU",
        "load": f"load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after",
    }


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m atomd_bench.activation_memory")
    p.add_argument("--quick", action="store_true", help="the tiny configurations only")
    p.add_argument("--steps", type=int, default=3, help="steps per configuration (>= 2)")
    p.add_argument("--out", type=Path, help="also write the annotated JSON here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(json.loads(args.child), args.steps)))
        return
    load_before = os.getloadavg()[0]
    result = run(quick=args.quick, steps=args.steps)
    doc = {"annotation": _annotation(argv, load_before), "bench": "activation_memory", **result}
    text = json.dumps(doc, indent=1)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
