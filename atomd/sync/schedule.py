"""When a peer of a swarm job closes its rounds.

``RoundSchedule`` says, after each step, whether the round is due (H steps after the last, the
fixed ``sync.every`` or the automatic cadence's), held (the previous round still misses a
delta of a peer training the job, so a peer ahead falls back in step), closed early (the swarm
is two rounds on, or this peer is the last of its round), or whether the swarm has moved on
so far that this peer must take its state again. It also tracks the frame in flight.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from atomd.errors import SwarmMovedOnError
from atomd.logs import get_logger

if TYPE_CHECKING:
    from atomd.sync.runner import SyncPlugin

log = get_logger(__name__)

# A round's frame counts as in flight at most this long (its uploads give up well before: two
# attempts of 30 s), so a frame the loop never got cannot hold the next round back for good.
MAX_IN_FLIGHT_S = 90.0
# Alone (no other peer trains the job) a round has nobody to tell: the automatic cadence closes
# one only every ALONE_EVERY steps, so that a lone peer does not pay for rounds every step.
ALONE_EVERY = 50
# The automatic cadence merges deltas of closed rounds after the step they arrive in, unless the
# next boundary is less than ABSORB_AHEAD steps away: then they wait for it and it merges them in
# the same guarded pass as the round's own delta (one probe pass, ``guard``, instead of two).
# Waiting longer mid-round left the replicas training on an old model of the swarm (measured
# in research/ on real daemons at a slow link).
ABSORB_AHEAD = 2
# In phase: a round that is due while this peer's previous round still misses deltas is held
# (training goes on) for at most max(H, HOLD_MIN) more steps.
HOLD_MIN = 2


class RoundSchedule:
    """The step the current round started at, the frame in flight, the steps held."""

    def __init__(self, plugin: SyncPlugin) -> None:
        """``plugin``: the job's round driver, whose state and peers the schedule reads."""
        self._plugin = plugin
        self.round_start: int | None = None  # the step the current round started at
        # The round whose frame is still being uploaded, when it left the trainer, its bytes.
        self.in_flight: tuple[int, float, int] | None = None
        self.held_steps = 0  # steps a due round was held for the previous round's deltas

    def moved_on(self, step: int) -> None:
        """Raise ``SwarmMovedOnError`` (with ``may_retake``) when the swarm's newest rounds are
        further ahead than any delta this peer can merge (the lower median of the senders'
        claims, ``rounds_behind``, beyond the ``ahead`` bound of ``SyncState``): the rounds it
        missed meanwhile (it was stopped, or dead to the others, who sent it nothing) are
        nowhere to be had, and closing its rounds early to catch up (``catch_up``) would put it
        back in step with an anchor that lacks them, parted from theirs for good; a peer that
        restarts takes the swarm's state, and so does this one. So too, however
        near, a peer that closed rounds alone after it had been with the swarm and finds the
        swarm a round past its own (``SyncState.parted_alone``: its link was cut)."""
        assert self._plugin.state is not None
        if not self._plugin.may_retake:
            return
        behind = self._plugin.state.rounds_behind(capped=False)
        if behind - 1 > max(1, self._plugin.spec.max_staleness):
            why = "more than its deltas can bridge"
        elif self._plugin.state.parted_alone():  # cut off from the swarm a while (``parted_alone``)
            why = "after rounds it closed alone"
        else:
            return
        raise SwarmMovedOnError(
            f"the swarm has closed {behind - 1} round(s) past this peer's round "
            f"{self._plugin.state.version}, {why}: taking the swarm's state",
            step,
        )

    def catch_up(self, step: int) -> bool:
        """Close the round before its H steps? When the swarm is two rounds on (see
        ``after_step``); with the automatic cadence also when this peer is the last of the round:
        every other peer's delta of it is in. That keeps the peers in phase (a peer that joined
        or resumed late closes its rounds right after the others' instead of a round behind, where
        its deltas would reach them after they committed the round)."""
        assert self._plugin.state is not None
        behind = self._plugin.state.rounds_behind()
        if self._plugin.cadence.auto:
            if self.uploading():
                return False
            if behind < 2:
                version = self._plugin.state.version
                return self._plugin.n_peers(version) > 1 and not self._plugin.missing(version)
        elif behind < 2:
            return False
        log.info("step %d: the swarm has closed %d rounds this peer has not; closing "
                 "round %d early", step, behind, self._plugin.state.round)  # fmt: skip
        return True

    def every(self) -> int:
        """H of the current round (automatic cadence)."""
        every = self._plugin.cadence.every()
        if self._plugin.n_peers(self._plugin.version) <= 1:
            every = max(every, ALONE_EVERY)
        return every

    def defer(self, step: int) -> bool:
        """Whether deltas of closed rounds wait for the boundary: with the automatic cadence
        when it is less than ABSORB_AHEAD steps away (a fixed H merges them after every step)."""
        if (
            self._plugin.cadence.fixed is not None
            or self.round_start is None
            or self._plugin.state is None
        ):
            return False
        return self.every() - (step - self.round_start) < ABSORB_AHEAD

    def due(self, step: int) -> bool:
        """H steps after the last round closed: the fixed ``sync.every`` or the automatic
        cadence's (which also waits for the previous frame to leave); a short last round is
        left to ``finish``. Either way a due round is held while the previous round still
        misses a delta (``previous_open``), for at most max(H, HOLD_MIN) more steps: a peer
        ahead of the others falls back in step with them (closing at every multiple of H, the
        first peer of a job, a round or more on before the joiners had loaded, would take
        their deltas stale while they refused its as ahead)."""
        assert self.round_start is not None
        fixed = self._plugin.cadence.fixed
        if fixed is None and self.uploading():
            return False
        every, elapsed = fixed or self.every(), step - self.round_start
        if elapsed < every or self._last_round_takes(step, every, elapsed):
            return False
        if elapsed < every + max(every, HOLD_MIN) and self.previous_open():
            self.held_steps += 1
            return False
        return True

    def _last_round_takes(self, step: int, every: int, elapsed: int) -> bool:
        """Fewer than H steps are left after ``step`` (the round ``elapsed``
        steps long): the job's last round (``finish``) takes them, if it then holds at most 2H
        steps (the robust screen's allowance for a longer round), rather than a round now and
        a final one of a step or two right after it, two frames on the link just when the
        others wait for the last deltas. Rule 3 (``catch_up``) still closes in phase."""
        if self._plugin.total_steps is None:
            return False
        left = self._plugin.total_steps - step
        return 0 < left < every and elapsed + left <= 2 * every

    def previous_open(self) -> bool:
        """In phase: this peer's previous round still misses a delta of a peer training the
        job. Closing the next round now would commit it without that delta (and the delta,
        arriving later, would count a round late): a peer ahead of the others trains on a
        little longer instead, so that its rounds close just after theirs. Never a wait.

        So too when the peers training the job are two rounds or more behind it
        (``rounds_ahead``): their deltas of its previous round are not even on their way, and,
        stale here, they do not make them count among the peers it waits for."""
        assert self._plugin.state is not None
        last = self._plugin.state.version - 1
        if last < 0:
            return False
        among = [p for p in self._plugin.training(last) if not self._plugin.excluded(p)]
        if self._plugin.state.rounds_ahead(among) >= 2:
            return True
        return bool(self._plugin.missing(last, queued=True))  # none counted: nothing to wait for

    def uploading(self) -> bool:
        """The previous round's frame is still on its way (one round in flight at most)."""
        flight = self.in_flight
        return flight is not None and time.monotonic() - flight[1] < MAX_IN_FLIGHT_S

    def delivered(self, round: int, seconds: float) -> None:
        """The loop: round ``round``'s frame has reached every peer it could, in ``seconds``
        (since it left the trainer); negative when it reached none: the round is done, but
        there is nothing to measure."""
        flight = self.in_flight
        nbytes = flight[2] if flight is not None and flight[0] == round else 0
        if seconds >= 0:
            self._plugin.cadence.traffic(seconds, nbytes)
        if flight is not None and flight[0] == round:
            self.in_flight = None
