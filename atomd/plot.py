"""Loss curves to a PNG (``atomd plot``): train and validation loss against steps, from a run's
``metrics.jsonl`` or a daemon job's progress. matplotlib renders with its Agg backend (no
display, no browser)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atomd.errors import DataError

METRICS_FILE = "metrics.jsonl"


@dataclass
class Curves:
    title: str
    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    val_steps: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)


def curves_from_rows(rows: Sequence[dict[str, Any]], title: str) -> Curves:
    """Curves from metrics rows (``metrics.jsonl``) or progress points (the REST API)."""
    c = Curves(title=title)
    for r in rows:
        step, loss, val = r.get("step"), r.get("loss"), r.get("val_loss")
        if not isinstance(step, int):
            continue
        if isinstance(loss, int | float):
            c.steps.append(step)
            c.loss.append(float(loss))
        if isinstance(val, int | float):
            c.val_steps.append(step)
            c.val_loss.append(float(val))
    return c


def metrics_path(run: Path) -> Path:
    """A run's folder, or its metrics.jsonl itself."""
    return run if run.is_file() else run / METRICS_FILE


def curves_from_run(run: Path) -> Curves:
    from atomd.train.metrics import read_metrics

    path = metrics_path(run)
    if not path.is_file():
        raise DataError(f"{run} holds no {METRICS_FILE} (is it a run's --out folder?)")
    return curves_from_rows(read_metrics(path), title=str(run))


def render(curves: Curves, out: Path, *, log_y: bool = False) -> None:
    """Write the curves to ``out`` as a PNG; a run without a loss value is an error."""
    if not curves.steps and not curves.val_steps:
        raise DataError(f"{curves.title}: no loss values to plot (no metrics written yet)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    try:
        if curves.steps:
            ax.plot(curves.steps, curves.loss, label="train loss", linewidth=1.2)
        if curves.val_steps:
            ax.plot(curves.val_steps, curves.val_loss, "o-", label="validation loss", linewidth=1.5)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats per token)")
        if log_y:
            ax.set_yscale("log")
        ax.set_title(curves.title, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, format="png")
    finally:
        plt.close(fig)
