"""The work a swapped step issues, as the engine issues it (``SwapEngine.recording()``).

Every compute segment (a layer's forward, its backward, the head's turn), copy (a load of
weights, a store of gradients, a spill) and host task (an AdamW step, a gradient sum, a bf16
copy refreshed) is written down in the order the engine issues it, with its lane (``compute``,
``load``, ``store``, ``host``: the host optimizer's one worker), the work it waits for (the
events a stream waits on, the copy a host task waits for) and what it is. ``Block``s are where
the issuing thread itself waits: for a host task (a load needs its layer's update) or for a
lane (reading the loss, the clipping coefficient). It runs on the CPU as on CUDA, and on a
small stand-in model: the schedule depends on the plan's choices and the layer count, not on
layer widths. ``atomd.swap.trace`` replays it in time; ``check_schedule`` checks it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

LANES = ("compute", "load", "store", "host")


@dataclass(eq=False, repr=False)
class Work:
    """One piece of recorded work."""

    index: int
    """Position in the order the engine issued everything (work and blocks)."""
    lane: str
    kind: str
    layer: int
    what: dict[str, int | bool]
    waits: list[Work]
    """Work on other lanes (or earlier on this one) it waits for: the events its stream waits
    on, or the copy a host task waits for."""
    after: Work | None
    """The previous work on the same lane (lanes run first in first out)."""
    step: int

    def describe(self) -> str:
        extra = ", ".join(f"{k}={v}" for k, v in self.what.items())
        return f"{self.lane}:{self.kind}[layer {self.layer}{', ' + extra if extra else ''}]"

    def __repr__(self) -> str:  # not the dataclass's: it would follow every chain of waits
        return f"Work({self.index}, {self.describe()}, step {self.step})"


@dataclass(eq=False, repr=False)
class Block:
    """The issuing thread waits for ``on`` (None: it was done already) before going on."""

    index: int
    on: Work | None
    why: str
    step: int

    def __repr__(self) -> str:
        return f"Block({self.index}, on {self.on!r}, {self.why})"


Event = Work | Block


class Recorder:
    """Collects what the engine issues (see the module docstring)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._last: dict[str, Work | None] = {lane: None for lane in LANES}
        self._pending: dict[str, list[Work]] = {lane: [] for lane in LANES}
        self.step = 0

    def last(self, lane: str) -> Work | None:
        return self._last[lane]

    def wait(self, lane: str, done: Iterable[Work | None]) -> None:
        """The next work on ``lane`` waits for ``done`` (None: nothing recorded to wait for)."""
        self._pending[lane].extend(w for w in done if w is not None)

    def work(self, lane: str, kind: str, layer: int, what: dict[str, int | bool]) -> Work:
        w = Work(
            index=len(self.events),
            lane=lane,
            kind=kind,
            layer=layer,
            what=dict(what),
            waits=self._pending[lane],
            after=self._last[lane],
            step=self.step,
        )
        self._pending[lane] = []
        self._last[lane] = w
        self.events.append(w)
        return w

    def block(self, on: Work | None, why: str) -> None:
        self.events.append(Block(index=len(self.events), on=on, why=why, step=self.step))

    def end_step(self) -> None:
        self.step += 1

    def works(self) -> list[Work]:
        return [e for e in self.events if isinstance(e, Work)]

    def to_json(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in self.events:
            if isinstance(e, Work):
                out.append(
                    {
                        "index": e.index,
                        "lane": e.lane,
                        "kind": e.kind,
                        "layer": e.layer,
                        **e.what,
                        "waits": [w.index for w in e.waits],
                        "step": e.step,
                    }
                )
            else:
                on = e.on.index if e.on is not None else None
                out.append({"index": e.index, "block_on": on, "why": e.why, "step": e.step})
        return out


def check_schedule(recorder: Recorder) -> list[str]:
    """What the recorded schedule does that it must not (empty: nothing):
    - a load of weights waits for compute that does not read its slot (it may only wait for
      the visit that last read the slot, and for its own layer's last copy back to the host);
    - a gradient store waits for a load (the two directions of the link are independent);
    - the issuing thread waits for a host task other than the one its next use of a layer
      needs (AdamW, sums and refreshes run on the worker, off the issuing path)."""
    problems: list[str] = []
    for w in recorder.works():
        if w.lane == "load" and w.kind == "weights":
            for dep in w.waits:
                if dep.lane == "compute" and dep.what.get("slot") != w.what.get("slot"):
                    problems.append(f"{w.describe()} waits for {dep.describe()}")
                if dep.lane == "store" and dep.layer != w.layer and dep.kind != "device_state":
                    problems.append(f"{w.describe()} waits for {dep.describe()}")
        if w.lane == "store" and w.kind == "grads":
            problems.extend(
                f"{w.describe()} waits for {dep.describe()}"
                for dep in w.waits
                if dep.lane == "load"
            )
    return problems
