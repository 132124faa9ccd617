"""``metrics.jsonl``: one JSON object per logged step, appended and flushed as it happens."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class StepReport:
    """What the loop reports after each optimizer step."""

    step: int
    tokens: int
    loss: float
    lr: float
    tokens_per_s: float
    val_loss: float | None
    elapsed_s: float
    sync: dict[str, Any] | None = None  # swarm jobs: the delta exchange's figures (cadence...)
    precision: dict[str, Any] | None = None  # fp16: loss_scale, skipped_steps (so far)

    def to_row(self) -> dict[str, Any]:
        row = asdict(self)
        for key in ("val_loss", "sync"):
            if row[key] is None:
                del row[key]
        row.update(row.pop("precision") or {})  # loss_scale, skipped_steps at the top level
        return row


class MetricsLog:
    """Append-only JSON lines. On resume, rows past the checkpoint's step are dropped first,
    so a resumed run never shows a step twice."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        keep = [r for r in read_metrics(self.path) if int(r.get("step", 0)) <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        os.replace(tmp, self.path)

    def write(self, row: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Rows of a metrics file; a torn last line (crash mid-write) is ignored."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
