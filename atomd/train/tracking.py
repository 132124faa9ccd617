"""Experiment tracking beside ``metrics.jsonl``: TensorBoard event files for every run, and
Weights & Biases when it is installed and configured.

Each logged row goes to both with the same figures: ``train/loss``, ``val/loss``, ``train/lr``,
``train/tokens_per_s``, ``train/tokens``, fp16's ``precision/loss_scale`` and
``precision/skipped_steps``, and in swarm jobs every number of the delta exchange's figures
under ``sync/`` (round, bytes, cadence, ...). Event files go to ``<out>/tensorboard/``
(``tensorboard --logdir <out>``). A resumed run purges the events past its checkpoint's step,
as ``metrics.jsonl`` drops its rows.

W&B is off unless ``ATOMD_WANDB_PROJECT`` is set (and ``wandb`` importable): then each run is
a W&B run of that project, named after its folder, in offline mode unless ``WANDB_MODE`` says
otherwise. A tracker that fails is logged once and dropped; training goes on.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from atomd.logs import get_logger

log = get_logger(__name__)

TB_DIR = "tensorboard"
WANDB_PROJECT_ENV = "ATOMD_WANDB_PROJECT"


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The TensorBoard tags and values of one ``metrics.jsonl`` row."""
    out: dict[str, float] = {}
    names = {
        "loss": "train/loss",
        "val_loss": "val/loss",
        "lr": "train/lr",
        "tokens_per_s": "train/tokens_per_s",
        "tokens": "train/tokens",
        "loss_scale": "precision/loss_scale",
        "skipped_steps": "precision/skipped_steps",
    }
    for key, tag in names.items():
        v = row.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool):
            out[tag] = float(v)
    sync = row.get("sync")
    if isinstance(sync, Mapping):
        _flatten(sync, "sync", out)
    return out


def _flatten(d: Mapping[str, Any], prefix: str, out: dict[str, float]) -> None:
    for k, v in d.items():
        if isinstance(v, Mapping):
            _flatten(v, f"{prefix}/{k}", out)
        elif isinstance(v, int | float) and not isinstance(v, bool):
            out[f"{prefix}/{k}"] = float(v)


def _after_older_event_files(log_dir: Path, limit_s: float = 2.0) -> None:
    """TensorBoard reads a folder's event files in name order, and a name starts with the
    second it was made in, then host, pid and a per-process counter, which sorts ".10" before
    ".9": a resumed run's file made in the same second as an older one could be read first,
    and the older events past the checkpoint would then survive its purge. So wait (under a
    second, at most ``limit_s``) for a second that no older file was made in."""
    seconds = []
    for p in log_dir.glob("events.out.tfevents.*"):
        try:
            seconds.append(int(p.name.split(".")[3]))
        except (IndexError, ValueError):
            continue
    deadline = time.monotonic() + limit_s
    while seconds and int(time.time()) <= max(seconds) and time.monotonic() < deadline:
        time.sleep(0.05)


class Trackers:
    """TensorBoard (always, when the package is there) and W&B (when configured)."""

    def __init__(self, out_dir: Path, *, start_step: int, config: Mapping[str, Any]) -> None:
        self.out_dir = out_dir
        self._tb: Any = None
        self._wandb: Any = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            _after_older_event_files(out_dir / TB_DIR)
            # purge_step drops events a resumed run will write again (past its checkpoint).
            self._tb = SummaryWriter(
                log_dir=str(out_dir / TB_DIR), purge_step=start_step + 1 if start_step else None
            )
        except ImportError as e:  # tensorboard is a dependency; a broken install is not fatal
            log.warning("no TensorBoard event files for %s: %s", out_dir, e)
        project = os.environ.get(WANDB_PROJECT_ENV)
        if project:
            self._start_wandb(project, dict(config))

    def _start_wandb(self, project: str, config: dict[str, Any]) -> None:
        try:  # optional (pip install "atomd[wandb]"): imported by name, only when configured
            wandb = importlib.import_module("wandb")
        except ImportError:
            log.warning("%s is set but wandb is not installed: no W&B run", WANDB_PROJECT_ENV)
            return
        try:
            os.environ.setdefault("WANDB_MODE", "offline")
            self._wandb = wandb.init(
                project=project,
                name=self.out_dir.name,
                dir=str(self.out_dir),
                config=config,
                resume="allow",
                id=f"atomd-{self.out_dir.resolve().name}",
            )
        except Exception as e:  # a tracker never stops training
            log.warning("W&B run not started: %s", e)

    def write(self, row: Mapping[str, Any]) -> None:
        step = int(row["step"])
        values = scalars(row)
        if self._tb is not None:
            try:
                for tag, v in values.items():
                    self._tb.add_scalar(tag, v, step)
                self._tb.flush()
            except Exception as e:
                log.warning("TensorBoard writer failed, dropped: %s", e)
                self._tb = None
        if self._wandb is not None:
            try:
                self._wandb.log(values, step=step)
            except Exception as e:
                log.warning("W&B logging failed, dropped: %s", e)
                self._wandb = None

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
