"""When a peer closes its rounds: every fixed H steps, or at a cadence the swarm picks itself.

``sync.every: "auto"`` (the default). Each peer measures, as it trains:

- ``step_s``: one optimizer step's time on its trainer thread (the median of the last steps, so
  an evaluation or a checkpoint does not count), sync work excluded;
- ``work_s``: what one round costs its trainer thread (closing it, merging deltas);
- ``traffic_s``: how long its last rounds' frames took to reach every peer training the job,
  from the hand-off to the event loop to the last upload that succeeded (the median of the
  last few rounds: one slow round does not set the pace, a link that fills shows in three);

and proposes a round period, in seconds of wall time from one round's close to the next::

    T_i = max(MARGIN * traffic_s, work_s * (1 + 1 / WORK_SHARE), MIN_EVERY * step_s + work_s)

the shortest period at which its round's traffic fits MARGIN times into the time between two
rounds, its own round work takes at most WORK_SHARE of the compute between them, and a round
holds at least MIN_EVERY of its steps. Every
frame carries its sender's proposal; the swarm's period T is the largest proposal heard
recently (this peer's own included), so the slowest link or the busiest peer sets the pace of
everyone's rounds and no peer's rounds outrun the others' deltas. A proposal heard counts for
at most ``CLAIM_CAP`` times the lower median of the current proposals, so one member cannot
stall the swarm's rounds by declaring a huge period. A round of H steps lasts
H * step_s + work_s, so a peer closes a round every

    H_i = clamp(round((T - work_s_i) / step_s_i), 1, MAX_EVERY)

steps: rounds come at the same rate in wall time on fast and slow peers (a slower peer puts fewer
steps into each round instead of falling behind). The round work counts in the conversion:
with H = T / step_s, rounds come later than the period says (4 real daemons at 256 kbit/s: a
period of 2.9 s, rounds every 4.2 s, the link a third used). Conditions are re-measured all the
time, so T follows a peer that slows down or a link that fills (or frees up).

And at most one round in flight: a peer does not close a round while its previous round's frame
is still being uploaded. It keeps training meanwhile (nobody waits): a link slower than measured
stretches the round instead of queueing frames behind each other.

Where the link is what spaces the rounds, a sparse codec sends fewer entries (``frame_budget``,
``fit_fraction``): a frame small enough for a round every LINK_EVERY steps (and their round's
work) at the measured rate,
down to MIN_FRACTION of the entries; its traffic time then falls and H with it.

Why the anchors still agree: the cadence changes only *when* a peer closes a round, never what a
round is. Each peer sends one delta per round number, and which deltas a peer commits to its
anchor, with which weights, depends only on round numbers and base versions (``state.py``), not
on how many steps or seconds a round lasted. So every peer commits the same sums, whatever H each
of them used, exactly as with a fixed H and peers of different speeds.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TypeVar

# A round's traffic may fill at most 1/MARGIN of the time between rounds: the rest is headroom
# for membership on the same link and a link that slows down (a round's frames go out one after
# another, so they never crowd each other; a link slower than measured stretches the round by
# the one-round-in-flight rule, it does not queue frames). At 2 the frames use a fifth of the
# link at 256 kbit/s (7 of 32 kB/s); 1.0 buys nothing there (val 0.605 and 0.548 against
# 0.567-0.597): the traffic time includes each upload's answer, and the uplink is ~77 % busy
# already (measured, see research/).
MARGIN = 1.25
# A round's own work on the trainer thread may take at most this share of the compute between
# rounds (at most a third of the wall time). Measured on the tiny model with 4 real daemons,
# the loss guard's probes included (see research/): 0.25 gives rounds every 7 steps, val 1.803
# in 445 s; 0.5 every 3 steps, 1.747 in 502 s (one peer alone: 1.930). Fewer steps per round
# buy far more than the wall time they cost.
WORK_SHARE = 0.5
MAX_EVERY = 1000
STEP_SAMPLES = 16  # steps whose median is the step time
# Rounds whose median traffic time (and rate) counts: a link that fills is seen after three of
# them (meanwhile the one-round-in-flight rule stretches the rounds), and one slow round does
# not set the swarm's pace. Not the largest of the last few: the swarm's period is the largest
# proposal, so the slowest of 4 x 3 rounds would set it, 1.9x the mean traffic time (4 real
# daemons at 256 kbit/s; measured, see research/).
TRAFFIC_SAMPLES = 5
WORK_SAMPLES = 8
# The shortest round, in steps, the automatic cadence proposes. With top-k's outer step
# (momentum 0.7) a round every step is no better than one every 3 and worse than one every 2,
# at twice the rounds' work: `atomd bench sync`, the defaults at H = 1 / 2 / 3: 1.7357 / 1.7242 /
# 1.7368 (measured, see research/). A slower peer still takes fewer steps a round (H_i below):
# the floor is on the swarm's period, not on each peer's H.
MIN_EVERY = 2
PROPOSAL_TTL_S = 10.0  # a peer's proposal counts this long, plus 3 swarm periods
# A proposal heard from another peer counts for at most this many times the lower median of
# all current proposals (this peer's own included): the largest proposal sets the
# pace, so without a cap one member declaring a day would stop everyone's rounds. Honest
# proposals differ by the peers' speeds and links (a slow uplink: 16x a step in the tests); a
# slower link than that gets its rounds stretched by the one-round-in-flight rule instead. The
# same factor as the robust merge's refusal (16x a delta's reference norm).
CLAIM_CAP = 16.0
# Where the link is what spaces the rounds, a sparse codec sends fewer entries so that rounds
# still come every LINK_EVERY steps (or as often as the round work allows, if rarer), down to
# MIN_FRACTION of the entries; below that the rounds grow apart instead. `atomd bench sync` at
# the same bytes a step: see docs/cadence.md.
LINK_EVERY = 5
MIN_FRACTION = 0.0025
# The shares ``fit_fraction`` chooses from: the spec's, then each RUNG times the last (three
# rungs a halving), down to MIN_FRACTION. Halvings wasted up to half the link's budget.
RUNG = 2 ** (-1 / 3)


_Empty = TypeVar("_Empty", float, None)


@dataclass(frozen=True)
class CadenceView:
    """The cadence in force, for reports: H steps per round (None: not measured yet) and the
    swarm's period in seconds (None with a fixed H)."""

    every: int | None
    period_s: float | None
    auto: bool


class Cadence:
    """This peer's round cadence for one job: a fixed H, or ``auto`` (see the module docstring).

    The trainer thread reports steps and round work, the event loop reports traffic and the
    other peers' proposals; every method is safe to call from either."""

    def __init__(self, every: int | None) -> None:
        """``every``: a fixed H, or None for the automatic cadence."""
        if every is not None and every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.fixed = every
        self._lock = threading.Lock()
        self._steps: deque[float] = deque(maxlen=STEP_SAMPLES)
        self._work: deque[float] = deque(maxlen=WORK_SAMPLES)
        self._traffic: deque[float] = deque(maxlen=TRAFFIC_SAMPLES)
        # Bytes a second of the last rounds' frames (frame size over its traffic time).
        self._rates: deque[float] = deque(maxlen=TRAFFIC_SAMPLES)
        self._heard: dict[str, tuple[float, float]] = {}  # peer -> (period_s, monotonic at)

    @property
    def auto(self) -> bool:
        return self.fixed is None

    # -- measurements ------------------------------------------------------------------------

    def step(self, seconds: float) -> None:
        """One optimizer step took ``seconds`` on the trainer thread (sync work excluded)."""
        if seconds > 0:
            with self._lock:
                self._steps.append(seconds)

    def round_work(self, seconds: float) -> None:
        """The trainer-thread time one round cost (closing it and merging deltas)."""
        with self._lock:
            self._work.append(max(0.0, seconds))

    def traffic(self, seconds: float, nbytes: int = 0) -> None:
        """A round's frame (of ``nbytes`` bytes, 0: not said) reached every peer it could reach
        in ``seconds``."""
        with self._lock:
            self._traffic.append(max(0.0, seconds))
            if nbytes > 0 and seconds > 0:
                self._rates.append(nbytes / seconds)

    def heard(self, peer: str, period_s: float, *, now: float | None = None) -> None:
        """Another peer's proposed period (carried by its frames)."""
        if period_s >= 0:
            with self._lock:
                self._heard[peer] = (period_s, time.monotonic() if now is None else now)

    # -- what follows from them --------------------------------------------------------------

    def step_s(self) -> float | None:
        with self._lock:
            return _median(self._steps, None)

    def work_s(self) -> float:
        """What one round costs the trainer thread (the median of the last rounds; 0 before)."""
        with self._lock:
            return _median(self._work, 0.0)

    def rate(self) -> float | None:
        """Bytes a second that the last rounds' frames reached every peer at (their size over
        their traffic time; the median), None before one is measured."""
        with self._lock:
            return _median(self._rates, None)

    def proposal(self) -> float:
        """This peer's period T_i in seconds (0 before anything is measured)."""
        step, work = self.step_s(), self.work_s()
        with self._lock:
            traffic = _median(self._traffic, 0.0)
        return max(MARGIN * traffic, _work_period(work), MIN_EVERY * (step or 0.0) + work)

    def period(self, *, now: float | None = None) -> float:
        """The swarm's period T: the largest recent proposal, this peer's own included."""
        own = self.proposal()
        now = time.monotonic() if now is None else now
        with self._lock:
            heard = []
            for peer, (p, at) in tuple(self._heard.items()):
                if now - at > PROPOSAL_TTL_S + 3 * max(own, p):
                    del self._heard[peer]  # left, died, or stopped training the job
                else:
                    heard.append(p)
        positive = [p for p in (own, *heard) if p > 0]
        if not positive:
            return own
        cap = CLAIM_CAP * statistics.median_low(positive)
        return max([own, *(min(p, cap) for p in heard)])

    def frame_budget(self) -> float | None:
        """The largest frame, in bytes, whose traffic would let rounds come every LINK_EVERY
        steps, or as often as the round work allows if that is rarer (the traffic fits MARGIN
        times into the time between rounds, as in ``proposal``), at the median rate of
        the last rounds' frames; None with a fixed H or before a frame's size and time are
        measured."""
        step, work = self.step_s(), self.work_s()
        if self.fixed is not None or step is None:
            return None
        rate = self.rate()
        if rate is None:
            return None
        target = max(LINK_EVERY * step + work, _work_period(work))
        return target * rate / MARGIN

    def every(self, *, now: float | None = None) -> int:
        """H: steps in this peer's current round."""
        if self.fixed is not None:
            return self.fixed
        step = self.step_s()
        if not step:
            return 1
        steps = (self.period(now=now) - self.work_s()) / step
        return max(1, min(MAX_EVERY, round(steps)))

    def view(self) -> CadenceView:
        if self.fixed is not None:
            return CadenceView(every=self.fixed, period_s=None, auto=False)
        step = self.step_s()
        return CadenceView(every=self.every() if step else None, period_s=self.period(), auto=True)


def _median(values: Collection[float], empty: _Empty) -> float | _Empty:
    """The median of the last samples, ``empty`` before any."""
    return statistics.median(values) if values else empty


def _work_period(work_s: float) -> float:
    """The shortest period in which a round's work takes at most WORK_SHARE of the compute."""
    return work_s * (1 + 1 / WORK_SHARE)


@dataclass
class FrameSize:
    """What a sparse codec's frame weighs at a share of its entries, learnt from the last frame
    sent: its bytes beyond the payload (tensor headers, signature) and what zstd kept of the
    payload's raw size at that share."""

    overhead: int | None = None  # None before a frame is measured
    packed: float = 1.0

    def measured(self, frame_bytes: int, payload_bytes: int, raw_bytes: int | None) -> None:
        """A frame of ``frame_bytes`` carried ``payload_bytes`` of payload, ``raw_bytes`` before
        zstd (None: a codec without a share of entries)."""
        self.overhead = frame_bytes - payload_bytes
        if raw_bytes is not None:
            self.packed = min(1.0, payload_bytes / raw_bytes) if raw_bytes else 1.0

    def fit(self, ceiling: float, budget: float, raw: Callable[[float], int]) -> float | None:
        """``fit_fraction`` for frames of this size (``raw``: the payload's bytes before zstd
        at a share); None before a frame is measured."""
        overhead, packed = self.overhead, self.packed
        if overhead is None:
            return None
        return fit_fraction(ceiling, budget, lambda f: overhead + packed * raw(f))


def fit_fraction(ceiling: float, budget: float, size: Callable[[float], float]) -> float:
    """The share of entries a sparse codec sends to fit its frame into ``budget`` bytes: the
    largest of ``ceiling``, ``ceiling`` * RUNG, * RUNG^2, ... and MIN_FRACTION (the last, never
    below it) whose frame ``size(fraction)`` fits; the smallest when none does. A ladder, not
    the exact fit: a measured rate that wobbles does not change the frame every round."""
    ladder = [ceiling]
    while ladder[-1] * RUNG > MIN_FRACTION * (1 + 1e-9):  # the floor itself comes exact
        ladder.append(ladder[-1] * RUNG)
    if ladder[-1] > MIN_FRACTION:
        ladder.append(MIN_FRACTION)
    return next((f for f in ladder if size(f) <= budget), ladder[-1])
