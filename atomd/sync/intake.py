"""Which received deltas a peer merges, and which senders' deltas of a round are in.

``Intake`` refuses a delta by its form and its round (stale, too far ahead, a duplicate,
tensors that do not fit), holds those of rounds this peer has not closed until its own delta
of that round is known, and has the robust rule (``robust.Screen``) judge the rest. It keeps
the deltas merged recently (``seen``), by which a duplicate is refused and a round's senders
are known. What it accepts, ``SyncState`` merges.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from atomd.logs import get_logger
from atomd.sync.pace import SwarmPace
from atomd.sync.robust import DeltaStats, Progress, Screen

log = get_logger(__name__)

# After taking a state: the most rounds the donor's reference statistics stay the floor of this
# peer's own, each statistic until an own delta reaches it (``Intake.record_own``).
INHERIT_ROUNDS = 64


@dataclass(frozen=True)
class Contribution:
    """A delta received from another peer, decoded: ``replica - anchor`` of the sender."""

    sender: str
    round: int
    base_version: int
    tensors: dict[str, Tensor]
    every: int | None = None  # the steps its round lasted, as its frame says (None: not said)


@dataclass(frozen=True)
class Verdict:
    """What became of one received delta: refused (``reason`` without ``tensors``) or
    accepted as ``tensors`` (clipped by the robust rule: ``note`` says how)."""

    contribution: Contribution
    tensors: dict[str, Tensor] | None
    reason: str | None = None  # why refused, or what the rule clipped
    strike: bool = False  # counts against the sender
    cosine: float | None = None  # with this peer's own delta of the round (robust.Screen)
    stats: DeltaStats | None = None  # as the robust rule's reference holds it


class Intake:
    """The refusals, the held deltas and the merged senders of one peer's rounds."""

    def __init__(
        self,
        anchor: Mapping[str, Tensor],
        *,
        max_staleness: int,
        screen: Screen | None,
        pace: SwarmPace,
    ) -> None:
        self._anchor = anchor
        self.max_staleness = max_staleness
        self.screen = screen
        self.pace = pace
        # Received deltas of rounds this peer has not closed: judged once its own delta of
        # that round is known (they touch nothing before: only closed rounds move the replica).
        self.held: list[Contribution] = []
        self.seen: set[tuple[str, int]] = set()  # (sender, base_version) merged recently
        # After taking a state: the donor's reference statistics, the floor of this peer's own
        # (its error feedback starts empty), each until an own delta reaches it, at most until
        # round ``_inherited_until``.
        self._inherited: DeltaStats | None = None
        self._inherited_until = 0

    def record_own(
        self,
        version: int,
        framed: Mapping[str, Tensor],
        *,
        steps_short: float,
        steps: int | None,
        first: int | None,
    ) -> None:
        """This peer's own delta of round ``version``, as receivers decode it (others' deltas
        are frames too), is the robust rule's reference for the round's deltas
        (``robust.Screen.record_own``)."""
        if self.screen is None:
            return
        floor = self._inherited if version < self._inherited_until else None
        own = self.screen.record_own(
            version, framed, steps_short=steps_short, floor=floor, steps=steps, first=first
        )
        if floor is not None:  # each statistic holds until an own delta reaches it
            self._inherited = floor.unmet_by(own)

    def restart(self, reference: DeltaStats | None, version: int) -> None:
        """A state was loaded at ``version``: nothing held; the donor's reference statistics
        (None: none in the state) judge the rounds it closed and floor this peer's own."""
        self.held = []
        self._inherited = reference
        self._inherited_until = version + max(INHERIT_ROUNDS, self.max_staleness + 1)
        if reference is not None and self.screen is not None:
            first = max(0, version - self.max_staleness)
            self.screen.inherit(reference, range(first, version))

    def refusal(self, c: Contribution, version: int) -> tuple[str | None, bool]:
        """(why ``c`` cannot be merged at ``version`` or None, whether that is a strike)."""
        s = version - c.base_version
        if s > self.max_staleness:
            return (
                f"stale: base version {c.base_version} lags {s} rounds behind version "
                f"{version}; at most {self.max_staleness} allowed"
            ), False
        ahead = max(1, self.max_staleness)  # the next round's deltas are the normal spread
        if -s > ahead:  # each round waiting here holds a model-sized sum
            return (
                f"ahead: base version {c.base_version} is {-s} rounds ahead of version "
                f"{version}; at most {ahead} allowed"
            ), False
        held = any(h.sender == c.sender and h.base_version == c.base_version for h in self.held)
        if held or (c.sender, c.base_version) in self.seen:
            return (
                f"duplicate: a delta from {c.sender} on base version {c.base_version} was merged"
            ), False
        missing = sorted(set(self._anchor) - set(c.tensors))
        extra = sorted(set(c.tensors) - set(self._anchor))
        if missing or extra:
            return f"tensors do not fit: missing {missing[:5]}, unexpected {extra[:5]}", True
        for name, t in c.tensors.items():
            want = self._anchor[name].shape
            if t.shape != want:
                return f"tensor {name} has shape {tuple(t.shape)}, expected {tuple(want)}", True
            if not t.is_floating_point():
                return f"tensor {name} has dtype {t.dtype}, expected a float", True
            if not bool(torch.isfinite(t).all()):
                return f"tensor {name} holds NaN or Inf", True
        return None, False

    def judge(
        self,
        inbox: Sequence[Contribution],
        version: int,
        toward: Callable[[int], Progress] | None,
    ) -> Iterator[Verdict]:
        """The verdicts on ``inbox`` at ``version``, one at a time (the caller merges each
        before the next is judged: a second delta of a sender's round is a duplicate), those of
        deltas now held left out. ``toward``: the direction reference of each round's deltas
        (None: no direction check: consolidation, or following the last rounds)."""
        for c in inbox:
            reason, strike = self.refusal(c, version)
            if not strike:  # stale ones too: a peer far behind is behind, not gone
                self.pace.note(c.sender, c.base_version, version)
            if reason is not None:
                if not strike:
                    self.pace.refused(c.sender, c.base_version, reason, version)
                yield self._refused(Verdict(c, None, reason, strike))
                continue
            if self.screen is None:
                yield Verdict(c, dict(c.tensors))
                continue
            if not self.screen.knows(c.base_version) and c.base_version >= version:
                self.held.append(c)  # judged when this peer closes that round
                continue
            direction = toward(c.base_version) if toward is not None else None
            judged = self.screen.judge(c.base_version, c.tensors, toward=direction, every=c.every)
            if judged.tensors is None:
                # Its delta of the round came and will not come again: a hold does not wait
                # for it (one refused every round would hold each honest peer's rounds).
                self.pace.mark_gone(c.base_version, c.sender)
                why = judged.reason or "refused"
                yield self._refused(Verdict(c, None, why, judged.strike, judged.cosine))
            else:  # a hard clip is a strike too: merged, bounded, and counted against it
                yield Verdict(
                    c, judged.tensors, judged.reason, judged.strike, judged.cosine, judged.stats
                )

    @staticmethod
    def _refused(v: Verdict) -> Verdict:
        c = v.contribution
        log.info("delta from %s (round %d) refused: %s", c.sender, c.round, v.reason)
        return v

    def take_held(self) -> list[Contribution]:
        held, self.held = self.held, []
        return held

    def held_in(self, base_version: int) -> int:
        return sum(1 for c in self.held if c.base_version == base_version)

    def merged_only(self, peer_id: str) -> bool:
        """No other peer's delta merged within the last ``max_staleness`` rounds."""
        return all(sender == peer_id for sender, _ in self.seen)

    def prune(self, floor: int) -> None:
        """Forget the merged deltas of rounds before ``floor``: refused as stale anyway."""
        self.seen = {key for key in self.seen if key[1] >= floor}

    def senders_in(self, base_version: int) -> set[str]:
        """The peers whose delta of round ``base_version`` is merged, held, or come and
        refused as one that will not come again."""
        held = {h.sender for h in self.held if h.base_version == base_version}
        merged = {sender for sender, b in self.seen if b == base_version}
        return merged | held | self.pace.gone_in(base_version)

    def drop_excluded(self, excluded: Callable[[str], bool]) -> int:
        """Forget the held deltas and the claims of senders now ``excluded``; how many held
        deltas that was."""
        before = len(self.held)
        self.held = [h for h in self.held if not excluded(h.sender)]
        self.pace.forget(excluded)
        return before - len(self.held)
