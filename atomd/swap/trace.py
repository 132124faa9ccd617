"""A simulator that replays recorded swapped steps (``atomd.swap.record``) with given rates.

``simulate`` replays the recorded work with the durations a ``Costs`` gives it (the planner's
FLOPs and bytes for a real shape, at given rates): each lane runs its work first in first
out; a piece of work starts when its lane is free, what it waits for is done and the issuing
thread has reached it. It returns each step's time and the critical path: the chain of work
that set the end of the run, each link named by what held it (its lane, a wait, the issuing
thread).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atomd.swap.hardware import Hardware
from atomd.swap.plan import MODEL_FLOPS_FRACTION, LayerSizes, Shape, SwapPlan, flops
from atomd.swap.record import Block, Event, Recorder, Work


@dataclass(frozen=True)
class Costs:
    """Seconds of recorded work for one shape, plan and set of rates (the planner's model:
    FLOPs at ``MODEL_FLOPS_FRACTION`` of the matmul rate, bytes over the link rates, the host
    worker's per-element rates)."""

    shape: Shape
    plan: SwapPlan
    hw: Hardware

    def seconds(self, w: Work) -> float:
        sizes = LayerSizes.of(self.shape.cfg)
        f_block, f_head = flops(self.shape, sizes)
        rate = self.hw.flops_per_s * MODEL_FLOPS_FRACTION
        m = int(w.what.get("m", 1))
        btc = self.shape.micro_batch_size * self.shape.seq_len * self.shape.cfg.n_embd
        if w.lane == "compute":
            per = {"fwd": 1.0, "bwd": 2.0 if w.what.get("kept") else 3.0}.get(w.kind)
            if per is not None:
                return m * per * f_block / rate
            return m * 3 * f_head / rate if w.kind == "head" else 0.0
        if w.lane in ("load", "store"):
            link = self.hw.h2d_bytes_per_s if w.lane == "load" else self.hw.d2h_bytes_per_s
            nbytes = {
                "weights": sizes.link_bytes(self.plan.link),
                "grads": sizes.link_bytes(self.plan.link),
                "device_step": 12 * sizes.block,
                "device_state": 12 * sizes.block,
                "spill": m * btc * 4,
            }.get(w.kind, 0)
            return nbytes / link
        return self._host(w, sizes)

    def _host(self, w: Work, sizes: LayerSizes) -> float:
        hw, bf16 = self.hw, self.plan.link != "fp32"
        t = 0.0
        if w.what.get("accumulate"):
            t += (sizes.block_matrix / hw.widen_per_s if bf16 else 0.0) + sizes.block / hw.add_per_s
        if w.what.get("norms"):
            t += sizes.block / hw.add_per_s
        if w.what.get("step"):
            t += sizes.block / hw.host_adam_params_per_s
            if bf16 and self.plan.waves == 1:
                t += sizes.block_matrix / hw.widen_per_s
        if bf16 and (w.what.get("step") or w.kind == "refresh"):
            t += sizes.block_matrix / hw.narrow_per_s
        return t


@dataclass(frozen=True)
class Timed:
    """A piece of work placed in time, and what set its start."""

    work: Work
    start: float
    finish: float
    cause: str
    """'lane' (its lane's previous work), 'wait' (work it waited for), 'issue' (the issuing
    thread reached it only then) or 'start'."""
    by: Work | None


@dataclass
class Simulation:
    timed: list[Timed]
    step_ends: list[float]
    """When each recorded step's last read of the loss returned (the issuing thread's time)."""
    step_end_by: list[Work | None]
    """The work each of those reads waited for last."""
    busy: dict[str, float] = field(default_factory=dict)

    @property
    def step_s(self) -> list[float]:
        ends = [0.0, *self.step_ends]
        return [b - a for a, b in itertools.pairwise(ends)]

    def critical_path(self) -> list[Timed]:
        """The chain of work the last step's end waited for, back to the start, each link the
        one that held the next, in time order. (Host work still running after the last read
        of the loss belongs to the next step, which was not recorded.)"""
        by_work = {t.work.index: t for t in self.timed}
        last = self.step_end_by[-1] if self.step_end_by else None
        t = by_work[last.index] if last is not None else max(self.timed, key=lambda x: x.finish)
        path = [t]
        while t.by is not None and t.by.index in by_work:
            t = by_work[t.by.index]
            path.append(t)
        return path[::-1]

    def summary(self, *, last: int = 12) -> dict[str, Any]:
        path = self.critical_path()
        on_path: dict[str, float] = {}
        for t in path:
            on_path[t.work.lane] = on_path.get(t.work.lane, 0.0) + t.finish - t.start
        return {
            "step_s": [round(s, 6) for s in self.step_s],
            "busy_s": {k: round(v, 6) for k, v in self.busy.items()},
            "critical_path_s_by_lane": {k: round(v, 6) for k, v in on_path.items()},
            "critical_path_tail": [
                {
                    "work": t.work.describe(),
                    "step": t.work.step,
                    "start": round(t.start, 6),
                    "finish": round(t.finish, 6),
                    "held_by": t.cause,
                }
                for t in path[-last:]
            ],
        }


def simulate(events: Sequence[Event], costs: Costs) -> Simulation:
    """Replay ``events`` (a recorder's, in issue order) with ``costs`` (see the module
    docstring)."""
    finish: dict[int, float] = {}
    lane_free: dict[str, tuple[float, Work | None]] = {}
    issue, issue_by = 0.0, None  # the issuing thread's time, and the work that set it
    timed: list[Timed] = []
    step_ends: list[float] = []
    step_end_by: list[Work | None] = []
    busy: dict[str, float] = {}
    for e in events:
        if isinstance(e, Block):
            if e.on is not None and finish[e.on.index] > issue:
                issue, issue_by = finish[e.on.index], e.on
            if e.why == "loss":
                step_ends.append(issue)
                step_end_by.append(issue_by)
            continue
        free, prev = lane_free.get(e.lane, (0.0, None))
        start, cause, by = issue, "issue", issue_by
        if free > start:
            start, cause, by = free, "lane", prev
        for w in e.waits:
            if finish[w.index] > start:
                start, cause, by = finish[w.index], "wait", w
        if start == 0.0:
            cause, by = "start", None
        seconds = costs.seconds(e)
        finish[e.index] = start + seconds
        lane_free[e.lane] = (finish[e.index], e)
        busy[e.lane] = busy.get(e.lane, 0.0) + seconds
        timed.append(Timed(e, start, finish[e.index], cause, by))
    return Simulation(timed=timed, step_ends=step_ends, step_end_by=step_end_by, busy=busy)


def write(path: Path, recorder: Recorder, sim: Simulation, costs: Costs) -> None:
    """The recorded work, the plan and the simulation as one JSON file (``--trace``)."""
    path.write_text(
        json.dumps(
            {
                "plan": costs.plan.to_dict(),
                "simulation": sim.summary(last=40),
                "events": recorder.to_json(),
            },
            indent=1,
        )
    )
