"""Which slot each layer visit uses, and when each load may be issued.

A wave of training visits the swapped layers forward, then backward: ``s0 s1 .. sq-1`` then
``sq-1 .. s0`` (evaluation: forward only). With K slots a visit finds its layer already in a
slot (a *hit*: the last layers of the forward pass at the turn, or layers left in slots by the
previous wave of the same optimizer step) or needs a *load*. A load goes into the slot whose
layer is needed again furthest in the future (Belady's rule; on ties, the slot whose last visit
was earliest) and may be issued as soon as that slot's previous visit has been issued to the
device: this is the prefetch, K - 1 visits ahead in the steady state.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

NEVER = 1 << 30  # "not visited again in this wave"


@dataclass(frozen=True)
class Load:
    """Copy ``layer``'s weights into ``slot`` once visit ``after`` is issued (-1: at once)."""

    layer: int
    slot: int
    after: int


@dataclass(frozen=True)
class SlotSchedule:
    slot_of: list[int]
    """The slot each visit uses (same length as the visits)."""
    loads: list[Load]
    """Loads, in the order the visits need them."""
    final: list[int | None]
    """The layer each slot holds after the wave."""


def schedule_slots(visits: Sequence[int], slots: Sequence[int | None]) -> SlotSchedule:
    """Plan one wave: ``visits`` are layer ids in visit order, ``slots`` what each slot holds
    now (``None``: empty or stale). Needs at least two slots."""
    if len(slots) < 2:
        raise ValueError(f"the swap engine needs at least 2 slots, got {len(slots)}")
    holds = list(slots)
    last_visit = [-1] * len(slots)  # the last visit that used each slot; -1: none this wave
    at: dict[int, list[int]] = {}  # layer -> its visit positions, ascending
    for p, layer in enumerate(visits):
        at.setdefault(layer, []).append(p)
    slot_of: list[int] = []
    loads: list[Load] = []
    for p, layer in enumerate(visits):
        if layer in holds:
            s = holds.index(layer)
        else:

            def next_visit(q: int, *, p: int = p) -> int:
                held = holds[q]
                if held is None:
                    return NEVER + 1  # an empty slot is the best victim
                i = bisect.bisect_left(at.get(held, []), p)
                return at[held][i] if i < len(at.get(held, [])) else NEVER

            # The victim's next visit, if any, is after p (one before p would have hit); it is
            # simply loaded again then.
            s = max(range(len(holds)), key=lambda q: (next_visit(q), -last_visit[q]))
            loads.append(Load(layer=layer, slot=s, after=last_visit[s]))
            holds[s] = layer
        slot_of.append(s)
        last_visit[s] = p
    return SlotSchedule(slot_of=slot_of, loads=loads, final=holds)


def training_visits(swapped: Sequence[int]) -> list[int]:
    """Forward then backward over the swapped layers (the turn visits the last one twice)."""
    return [*swapped, *reversed(swapped)]


def count_loads(swapped: Sequence[int], slots: int, waves: int) -> tuple[int, int]:
    """Weight loads per optimizer step, for ``waves`` waves: (first wave, the whole step)."""
    visits = training_visits(swapped)
    first = schedule_slots(visits, [None] * slots)
    if waves == 1:
        return len(first.loads), len(first.loads)
    # Every later wave starts from what the backward pass left in the slots: the same state.
    later = schedule_slots(visits, first.final)
    return len(first.loads), len(first.loads) + (waves - 1) * len(later.loads)
