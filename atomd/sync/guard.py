"""The loss guard: a merge after which the replica's loss jumps is rolled back, its source refused.

The robust rule (``atomd.sync.robust``) bounds each received delta by its size. A delta of
honest size can still be poison (its sign flipped, or shaped to hit one weakness of the model);
what shows it is the loss. ``LossGuard`` wraps a ``SyncState`` and a *probe* (the replica's
loss on one fixed batch, forward only): it measures the probe before and after every merge that
moves the replica, and when the loss has jumped (non-finite, or up by more than ``max_rise``
nats and ``max_rise_ratio`` of its value) it takes the merged deltas out again
(``SyncState.retract``), then merges them back one at a time, probing each, so that only the
culprit is refused (a strike against its sender) and the honest deltas merged beside it stay.

Nothing is written from a poisoned replica: the guard runs inside the merge, on the trainer
thread, before the next training step and before any checkpoint. Cost: one forward pass of the
probe batch per merge that brings deltas (none when nothing arrived), two when the last probe is
too old, and the rollback's passes only when a merge is refused. The loss *before* a merge is the
probe's value after the previous merge when at most ``REUSE_STEPS`` moves of the replica lie
between them: training steps (the runner reports each: ``stepped``) and round boundaries (the
restart from the anchor, which moves the replica by the deltas merged, each judged already, and
the outer step). What a few of them change in the probe loss is small against a jump of
``MAX_RISE`` = 0.5 nats, and a round's work on the trainer thread (which the automatic cadence
charges) shrinks: the probe is 60 % of a round's work on the tiny model (forward passes of 8
sequences; a training step is 16 with a backward), and were a boundary to void the last
probe, a round at H=2 would run two (the loss before its merge and after) instead of one. A
jump judged against an older probe is judged again against a fresh one before anything is
refused: the replica without the merged deltas is probed, then each delta is merged back
alone (``_roll_back``), so an older probe can start that careful path but never refuse a delta
by itself (a hostile delta that raises the loss by less than a jump, amplified by the outer
step at the next boundary, cannot get the honest deltas merged after it refused).

Deltas enter the replica in two ways, and both are guarded: ``absorb`` (between boundaries,
deltas of rounds this peer has closed) and the round boundary (the deltas of the round it
closes, judged once its own delta is known). Deltas of older rounds that are still in the inbox
at a boundary are absorbed (guarded) just before it, which merges them exactly as the boundary
would have (both leave them pending until the boundary commits them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

from atomd.logs import get_logger
from atomd.sync.intake import Contribution
from atomd.sync.state import MergeReport, Outgoing, RefusedDelta, SyncState, Taken

log = get_logger(__name__)
_T = TypeVar("_T")

MAX_RISE = 0.5
"""Nats: a merge may raise the probe loss by this much (and ``MAX_RISE_RATIO`` of it)."""
MAX_RISE_RATIO = 0.15
REUSE_STEPS = 4
"""Training steps after which the probe loss after a merge no longer stands for the loss before
the next one (it is measured again)."""


class LossGuard:
    """Guards the merges of one ``SyncState`` with a probe of the replica's loss."""

    def __init__(
        self,
        state: SyncState,
        probe: Callable[[], float],
        *,
        max_rise: float = MAX_RISE,
        max_rise_ratio: float = MAX_RISE_RATIO,
        reuse_steps: int = REUSE_STEPS,
    ) -> None:
        if state.screen is None:
            raise ValueError("the loss guard needs the robust rule (SyncState(robust=...))")
        self.state = state
        self.probe = probe
        self.max_rise = max_rise
        self.max_rise_ratio = max_rise_ratio
        self.reuse_steps = reuse_steps
        self.rollbacks = 0  # merges rolled back (for the records and tests)
        self.largest_rise = 0.0  # the largest rise of a merge that was kept, in nats
        self.probes = 0  # probe passes run (for the records and tests)
        # The probe loss of the replica as it was after the last merge, and the moves of the
        # replica since (training steps and round boundaries); None before the first probe.
        self._last: tuple[float, int] | None = None
        # Whether the loss before the merge being judged is an older probe's (not measured on
        # the replica as it was just before the merge): a jump against it is judged again.
        self._reused = False

    def stepped(self) -> None:
        """The replica has moved once more since the last probe (a training step, a restart)."""
        if self._last is not None:
            self._last = (self._last[0], self._last[1] + 1)

    def forget(self) -> None:
        """The replica was replaced (a state taken from another peer): no probe stands for it."""
        self._last = None

    def _measure(self) -> float:
        self.probes += 1
        loss = self.probe()
        self._last = (loss, 0)
        return loss

    def _before(self) -> float:
        """The probe loss before a merge: the last one while it is recent enough."""
        last = self._last
        if last is not None and last[1] <= self.reuse_steps:
            self._reused = last[1] > 0
            return last[0]
        self._reused = False
        return self._measure()

    def jumped(self, before: float, after: float) -> bool:
        """Whether ``after`` is a jump from ``before`` (non-finite always is)."""
        if not math.isfinite(after):
            return True
        rise = after - before
        if rise > self.max_rise and rise > self.max_rise_ratio * abs(before):
            return True
        self.largest_rise = max(self.largest_rise, rise)
        return False

    def absorb(self, inbox: Sequence[Contribution]) -> MergeReport:
        """``SyncState.absorb``, guarded."""
        state = self.state
        if not any(c.base_version < state.version for c in inbox):
            return state.absorb(inbox)  # at most held for a round not closed: nothing moves
        before = self._before()
        report = state.absorb(inbox)
        moved = [t for t in report.taken if t.contribution.base_version < state.version]
        if not moved:
            return report
        after = self._measure()
        if not self.jumped(before, after):
            return report
        return self._roll_back(report, moved, before, after)

    def round_boundary(
        self,
        inbox: Sequence[Contribution],
        *,
        n_peers: int,
        steps_short: float = 1.0,
        whole: bool = True,
        steps: int | None = None,
        first: int | None = None,
    ) -> Outgoing:
        """``SyncState.round_boundary``, guarded; ``state.last_merge`` says what was applied."""
        return self._closing(
            inbox,
            lambda later: self.state.round_boundary(
                later,
                n_peers=n_peers,
                steps_short=steps_short,
                whole=whole,
                steps=steps,
                first=first,
            ),
        )

    def follow(self, inbox: Sequence[Contribution]) -> bool:
        """``SyncState.follow``, guarded; ``state.last_merge`` says what was applied."""
        return self._closing(inbox, self.state.follow)

    def _closing(
        self, inbox: Sequence[Contribution], close: Callable[[list[Contribution]], _T]
    ) -> _T:
        """Close a round with ``close`` (given the deltas of rounds not closed yet), the loss
        measured before and after the deltas of the round it closes are merged."""
        state = self.state
        early = self.absorb([c for c in inbox if c.base_version < state.version])
        later = [c for c in inbox if c.base_version >= state.version]
        # The loss before is only needed when deltas of the round being closed may be merged.
        before = self._before() if later or state.held() else math.nan
        version = state.version
        out = close(later)
        if state.version == version:  # nothing closed (a follow with nothing to judge by)
            state.last_merge = early
            return out
        self.stepped()  # the boundary restarted the replica: one more move since the probe
        self._reused = True  # ``before`` was measured before that restart
        report = state.last_merge
        closing = [t for t in report.taken if t.contribution.base_version == state.version - 1]
        if closing:
            after = self._measure()
            if self.jumped(before, after):
                report = self._roll_back(report, closing, before, after)
        report.applied[:0] = early.applied
        report.refused[:0] = early.refused
        report.taken[:0] = early.taken
        state.last_merge = report
        return out

    def _roll_back(
        self, report: MergeReport, moved: list[Taken], before: float, after: float
    ) -> MergeReport:
        """Take ``moved`` out, then merge each back alone; refuse those that make it jump."""
        state = self.state
        self.rollbacks += 1
        log.warning(
            "the probe loss went %.4g -> %.4g after merging %d delta(s)%s; rolled back, "
            "merging them one at a time",
            before, after, len(moved), " (the loss before: an older probe's)" if self._reused
            else "",
        )  # fmt: skip
        state.retract(moved)
        if self._reused:  # judge each delta against the replica as it is without them
            before = self._measure()
        out = MergeReport(version=report.version, refused=list(report.refused))
        ids = {id(t) for t in moved}
        for a, t in zip(report.applied, report.taken, strict=True):
            if id(t) not in ids:  # not moved (held or of a later round): stays as it was
                out.applied.append(a)
                out.taken.append(t)
        for t in moved:
            c = t.contribution
            alone = state.absorb([c])
            if not alone.taken:
                out.refused += alone.refused
                continue
            loss = self._measure()
            if self.jumped(before, loss):
                state.retract(alone.taken)
                reason = (
                    f"loss jump: the probe loss went {before:.4g} -> {loss:.4g} with this delta "
                    f"merged; rolled back (at most +{self.max_rise:g} nats and "
                    f"{self.max_rise_ratio:.0%} allowed)"
                )
                log.warning("delta from %s (round %d) refused: %s", c.sender, c.round, reason)
                out.refused.append(RefusedDelta(c.sender, c.round, reason, True))
            else:
                out.applied += alone.applied
                out.taken += alone.taken
                before = loss
        self._last = (before, 0)  # the replica holds what was kept: its loss is ``before``
        return out
