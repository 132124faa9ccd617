"""The foundation's acceptance number: the demo budget (tiny preset, bundled corpus, default
spec) and the validation loss it reaches, with wall time and throughput, on this machine."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from atomd.engine_choice import build_engine
from atomd.spec import JobSpec
from atomd.train.metrics import read_metrics
from atomd.train.trainer import Trainer


def run(max_steps: int = 600) -> dict[str, Any]:
    spec = JobSpec(preset="tiny", max_steps=max_steps)
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        built = build_engine(spec, "cpu")
        trainer = Trainer(spec, Path(d), built.engine, plan=built.plan)
        summary = trainer.run()
        wall = time.perf_counter() - t0
        rows = read_metrics(Path(d) / "metrics.jsonl")
    curve = [(r["step"], round(r["val_loss"], 4)) for r in rows if "val_loss" in r]
    return {
        "preset": "tiny",
        "steps": summary.step,
        "tokens": summary.tokens,
        "tokens_per_step": spec.tokens_per_step,
        "final_val_loss": summary.val_loss,
        "val_curve": curve,
        "wall_s": round(wall, 1),
        "mean_tokens_per_s": round(summary.tokens / wall),
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "target": {"val_loss_below": 2.0, "wall_s_at_most": 300},
    }
