"""Device slots, per-step transfer statistics, and the walk through one wave's visits."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import Tensor

from atomd.swap.schedule import schedule_slots
from atomd.swap.streams import DONE, Marker


@dataclass
class Slot:
    """Device room for one block: its weights (in the link dtype per group: bf16 matrices with
    a bf16 link) and fp32 gradient accumulators (and, with the optimizer on the device, its
    AdamW moments). ``weights`` and ``grads`` are per parameter, views of the per-group flat
    buffers that copies move in one piece."""

    weights: list[Tensor]
    grads: list[Tensor]
    flat_weights: list[Tensor] = field(default_factory=list)
    flat_grads: list[Tensor] = field(default_factory=list)
    moments: list[Tensor] = field(default_factory=list)
    """With the optimizer on the device: AdamW's exp_avg then exp_avg_sq, one per weight."""
    index: int = 0
    """Which of the engine's slots (for the recorded schedule)."""
    layer: int | None = None
    """The layer whose current weights the slot holds (None: empty, or stale after a step)."""
    loaded: Marker = DONE
    """Load-stream work into this slot (its weights; with the device optimizer, the step) is
    done."""
    used: Marker = DONE
    """Compute-stream work reading this slot is done (it may be overwritten)."""
    stored: Marker = DONE
    """The gradient copy out of this slot is done (its buffer may be reused)."""
    saved: Marker = DONE
    """With the optimizer on the device: the copy of updated weights and moments out of this
    slot is done."""


@dataclass
class SwapStats:
    """What the last ``train_step`` or ``evaluate`` moved (bytes) and held on the device."""

    layer_loads: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    peak_held_bytes: int = 0
    """Layer inputs, kept graphs' saved tensors and gradients held on the device between layers
    (on the CPU the only activation figure there is; the transient working set inside a layer
    is not counted)."""
    extra: dict[str, int] = field(default_factory=dict)


def nbytes(ts: Sequence[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def pinned_size(t: Tensor) -> int:
    """Host memory a pinned tensor of this size holds: torch's pinned-memory allocator rounds
    each allocation up to a power of two (a 2048 x 6144 fp32 matrix, 48 MiB, takes 64)."""
    size = t.numel() * t.element_size()
    return 1 << (size - 1).bit_length() if size > 1 else size


class Wave:
    """Walks one wave's visits of swapped layers, issuing each load at its scheduled point."""

    def __init__(
        self,
        slots: list[Slot],
        visits: list[int],
        load_weights: Callable[[int, Slot], None],
    ) -> None:
        self.slots, self.visits, self.load_weights = slots, visits, load_weights
        self.sched = schedule_slots(visits, [s.layer for s in slots])
        self.loads_after: dict[int, list[tuple[int, int]]] = {}
        for ld in self.sched.loads:
            self.loads_after.setdefault(ld.after, []).append((ld.layer, ld.slot))
        self.p = -1
        self._issue(-1)

    def next(self, layer: int) -> Slot:
        self.p += 1
        assert self.visits[self.p] == layer, (self.visits, self.p, layer)
        return self.slots[self.sched.slot_of[self.p]]

    def done(self) -> None:
        """The current visit is issued: issue the loads that waited for its slot."""
        self._issue(self.p)

    def _issue(self, p: int) -> None:
        for layer, slot in self.loads_after.pop(p, []):
            self.load_weights(layer, self.slots[slot])
