"""``SimulatedLink``: a link of a fixed rate between simulated peers, and the daemon's automatic
cadence over it."""

from __future__ import annotations

import math
from collections.abc import Sequence

from atomd.sync.cadence import Cadence, FrameSize
from atomd.sync.state import Outgoing, SyncState


class SimulatedLink:
    """A link of ``rate`` bytes a step to each other peer, and the automatic cadence
    (``sync.every: "auto"``) over it as ``atomd.sync.cadence`` runs it in the daemon (a fixed H
    calls only ``after_round``, ``transit`` and ``closes_after``): every step takes one
    simulated second and a round's work none (the link alone spaces the rounds), so each
    ``Cadence`` measurement is exact. Peers are alike (one step time, one link), so one cadence
    stands for every peer's: it sizes the share of entries a frame carries (``FrameSize.fit``
    of ``Cadence.frame_budget``) and H (``Cadence.every``), from the largest frame of the
    last rounds. As in the daemon, a round's traffic time is known once its frames have gone,
    so the next round's H comes from the rounds before; a peer's uploads go one after another
    on its uplink, so its k-th upload of a round (of n - 1) is done (k + 1) / (n - 1) of its
    frame's traffic time after the round closes; and a peer does not close a round while its
    last frame is still on its way (the daemon's one round in flight)."""

    def __init__(self, rate: float) -> None:
        if rate <= 0:
            raise ValueError(f"a link's rate must be positive, got {rate}")
        self.rate = rate
        self.cadence = Cadence(None)
        self.frame = FrameSize()
        self.now = 0.0
        self.traffic_s = 0.0  # the last round's: its largest frame over the rate
        self.every: list[int] = []  # H of each round
        self.fractions: list[float | None] = []  # each round's share of entries
        self.frames: list[int] = []  # each round's largest frame, bytes

    def step(self) -> None:
        self.cadence.step(1.0)
        self.now += 1.0

    def before_round(self, states: Sequence[SyncState], ceiling: float) -> None:
        """Each peer's share of entries for the round it closes now (the daemon's
        ``SyncPlugin._fit_fraction``)."""
        budget = self.cadence.frame_budget()
        for state in states:
            if state.fraction is not None and budget is not None:
                fraction = self.frame.fit(ceiling, budget, state.payload_estimate)
                if fraction is not None and fraction != state.fraction:
                    state.set_fraction(fraction)
        self.fractions.append(states[0].fraction)

    def after_round(
        self, states: Sequence[SyncState], outs: Sequence[Outgoing], frame_bytes: Sequence[int]
    ) -> None:
        """The round's frames left: the largest one's traffic time, and what it weighed."""
        k = max(range(len(outs)), key=lambda i: frame_bytes[i])
        fraction = states[k].fraction
        raw = None if fraction is None else states[k].payload_estimate(fraction)
        self.frame.measured(frame_bytes[k], outs[k].payload_bytes, raw)
        self.frames.append(frame_bytes[k])
        self.traffic_s = frame_bytes[k] / self.rate
        self.cadence.traffic(self.traffic_s, frame_bytes[k])

    def transit(self, nbytes: int, k: int, n: int) -> int:
        """Steps until a frame of ``nbytes`` has gone on its (k+1)-th upload of n - 1."""
        return math.ceil((k + 1) * nbytes / self.rate / max(1, n - 1))

    def next_every(self) -> int:
        """H of the round that starts now, by what is measured so far."""
        return self.cadence.every(now=self.now)

    def closes_after(self, every: int) -> int:
        """Steps the round that starts now lasts: ``every``, or until the last frame has gone."""
        h = max(every, math.ceil(self.traffic_s))
        self.every.append(h)
        return h
