"""One peer's sync state for one job: anchor, outer optimizer, error feedback, round boundary.

Transport-agnostic: the daemon's trainer thread calls ``round_boundary`` every H inner steps with
the deltas its inbox holds and ships the returned ``Outgoing`` to the swarm, and ``absorb`` after
the steps in between with whatever has arrived since; the benchmark (``bench/sync.py``) calls
both with simulated deliveries. Nothing here knows about the network.

A round r closes, for a peer whose anchor holds every round before r-1, like this:
1. own delta = replica - start point of the round; compressed. What receivers reconstruct
   (``sent``) is what this peer merges too, so all peers sum the same deltas.
2. each received delta's staleness s = version - base_version; refused beyond ``max_staleness``,
   otherwise weighted by ``outer.staleness_weight(s)`` (1: every delta counts in full).
3. *commit*: the deltas of every round before r (own and received), and those of round r when
   a synchronous swarm has all ``n_peers`` of them (``prepare``/``merge``), make one outer gradient
   and one outer step on the anchor. A round counts as the mean of its deltas: k deltas commit
   g = -(1/k) * sum_j w_j * delta_j, and a delta of the round that comes after it was committed
   commits the change of that mean, (S + d) / (k + 1) - S / k, S the sum committed so far
   (kept for the rounds that can still take a late delta: ``rounds.PendingRounds``). Whoever a peer
   counts as training the job, once every peer has merged the same deltas of a round they have
   committed the same sum: anchors that part at a membership change (a peer that counts one
   more or one less for a round or three) meet again.
4. the deltas of round r still incomplete stay *pending* while the anchor waits a round for the
   late ones, and the replica restarts from the *start point*: where the anchor will be after
   that commit (a look-ahead of the outer step, momentum included), the round's mean so far
   standing for the deltas still missing. A peer that has heard from nobody keeps its own
   progress whole. When a late delta arrives mid-round, ``absorb`` moves the replica by as much
   as the start point moves, so what it trained since stays. When every delta arrives within a
   round, every peer commits the same sums and the anchors agree; the start points differ only
   by deltas in flight.
5. the unsent part of a lossy codec's delta waits for the next round in the replica (error
   reset as in CSER: the replica restarts from the start point plus the residual, and the next
   delta carries it). Inner optimizer state (AdamW) is not touched: it carries over (DiLoCo).

A peer alone in its round (no other peer trains the job) commits its whole delta, residual
included, straight into the anchor (``prepare(whole=True)``): the anchor stays its model. A peer
that joins or restarts trains on from its donor's model, keeping apart the donor's progress not
sent yet (``adopt``, ``offset.InheritedOffset``).

The parts: ``rounds`` (the pending and committed sums of each round, the direction reference),
``offset`` (the donor's progress a joiner keeps), ``pace`` (the rounds the other peers claim),
``snapshot`` (the state as tensors, for checkpoints and state transfer); ``SyncState`` owns
them and the anchor, the outer optimizer, the codec and its error feedback.

With fp32, no momentum, outer lr 1 and a synchronous swarm a round makes the anchor the mean of
the replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from atomd.logs import get_logger
from atomd.spec import SyncSpec
from atomd.sync import snapshot
from atomd.sync.anchor import AnchorState
from atomd.sync.codecs import Codec, Encoded, ErrorFeedback
from atomd.sync.encoder import DeltaEncoder, Encoding
from atomd.sync.intake import Contribution, Intake
from atomd.sync.offset import Drained
from atomd.sync.outer import staleness_weight
from atomd.sync.pace import SwarmPace
from atomd.sync.replica import Replica
from atomd.sync.robust import DeltaStats, Progress, RobustRule, Screen
from atomd.sync.rounds import Change, RoundDirections

if TYPE_CHECKING:
    from atomd.train.step_engine import StepEngine

log = get_logger(__name__)

DEFAULT_RULE = RobustRule()


@dataclass(frozen=True)
class Outgoing:
    """What a round boundary hands to the transport: this peer's encoded delta.

    ``raw_bytes`` is the delta's size as fp32; ``wire_ratio`` is ``raw_bytes`` over the encoded
    payload bytes (what the codec saved; framing not included).
    """

    round: int
    base_version: int
    tensors: list[tuple[str, Encoded]]
    raw_bytes: int
    wire_ratio: float

    @property
    def payload_bytes(self) -> int:
        return sum(len(enc.payload) for _, enc in self.tensors)


@dataclass(frozen=True)
class AppliedDelta:
    sender: str
    round: int
    staleness: int
    weight: float
    note: str | None = None  # what the robust merge clipped, if anything
    strike: bool = False  # clipped so hard that it counts against the sender
    cosine: float | None = None  # with this peer's own delta of the round (robust.Screen)


@dataclass(frozen=True)
class RefusedDelta:
    sender: str
    round: int
    reason: str
    strike: bool = False  # counts against the sender: it sent what no honest peer sends
    cosine: float | None = None  # with this peer's own delta of the round (robust.Screen)


@dataclass(frozen=True)
class Taken:
    """A delta merged into a pending round, as merged (clipped), for ``SyncState.retract``."""

    contribution: Contribution
    tensors: dict[str, Tensor]
    weight: float
    stats: DeltaStats | None  # as the robust rule's reference holds it (None: no rule)
    drained: Drained | None = None  # what it cleared of the inherited offset, for a retract


@dataclass
class MergeReport:
    """What one round boundary did with its inbox (for the sync-rounds records)."""

    version: int
    applied: list[AppliedDelta] = field(default_factory=list)
    refused: list[RefusedDelta] = field(default_factory=list)
    taken: list[Taken] = field(default_factory=list)  # what ``applied`` merged, retractable


class SyncState:
    """Anchor, outer-optimizer state and error feedback of one peer for one job, and the round
    boundary that moves them."""

    def __init__(
        self,
        params: Mapping[str, Tensor],
        spec: SyncSpec,
        *,
        peer_id: str = "",
        robust: RobustRule | None = DEFAULT_RULE,
        lr: Callable[[int], float] | None = None,
    ) -> None:
        """``params``: the replica's live parameter tensors (any device, any float dtype); the
        anchor is a CPU fp32 copy of them, and the replica is written back to in place.
        ``peer_id``: the id receivers see as ``Contribution.sender``. ``robust``: the rule that
        bounds received deltas (None merges them as they come); ``lr``: the job's learning rate
        at each (0-based) step, by which the rule weighs a longer round (``Screen``)."""
        bad = [n for n, p in params.items() if not p.is_floating_point()]
        if bad:
            raise ValueError(f"sync needs floating-point tensors; not: {', '.join(bad)}")
        self.spec = spec
        self.peer_id = peer_id
        self.params = dict(params)
        self.committed = AnchorState(params, spec)
        self.anchor = self.committed.tensors
        self.rounds = self.committed.rounds
        self.encoder = DeltaEncoder(spec)
        self.replica = Replica(self.params, self.encoder.feedback)
        self.offset = self.replica.offset
        self.averaging = False  # the plain average from now on (``average_from_now``)
        self.version = 0  # rounds closed; round r's deltas carry base_version r
        self.round = 0  # rounds this peer has sent (its own counter; differs after a join)
        self.last_merge = MergeReport(version=0)
        self.directions = RoundDirections(self.anchor)
        self.pace = SwarmPace(peer_id, spec.max_staleness)
        self.screen = Screen(robust, lr=lr) if robust is not None else None
        self.intake = Intake(
            self.anchor, max_staleness=spec.max_staleness, screen=self.screen, pace=self.pace
        )
        # Whether this peer has merged another peer's delta (or taken a state that had).
        self.together = False
        self._own: Encoding | None = None  # between prepare() and merge(): the own delta
        self._whole = False  # the own delta of this round is whole (``prepare(whole=True)``)

    @classmethod
    def of_engine(cls, engine: StepEngine, spec: SyncSpec, **kw: Any) -> SyncState:
        """The state of a replica trained by ``engine`` (settled): its live parameters (host
        masters when swapping), and top-k ranked by its AdamW state (``DeltaEncoder.rank_by``)."""
        state = cls(dict(engine.model.named_parameters()), spec, **kw)
        state.encoder.rank_by(engine.second_moments)
        return state

    @property
    def codec(self) -> Codec:
        return self.encoder.codec

    @property
    def feedback(self) -> ErrorFeedback:
        return self.encoder.feedback

    @property
    def fraction(self) -> float | None:
        """The share of entries the codec sends (None: a dense codec sends them all)."""
        return self.encoder.fraction

    def set_fraction(self, fraction: float) -> None:
        """Send ``fraction`` of the entries from the next round on (a sparse codec only): what
        this peer merges of its own delta is still exactly what the others decode."""
        self.encoder.set_fraction(fraction)

    def codec_at(self, fraction: float) -> Codec:
        """The job's codec sending ``fraction`` of the entries (a sparse codec's)."""
        return self.encoder.at(fraction)

    def payload_estimate(self, fraction: float) -> int:
        """Payload bytes of a delta (all tensors, before zstd) at ``fraction`` of the entries."""
        codec = self.encoder.at(fraction, zstd=False)
        return sum(codec.raw_nbytes_for(tuple(t.shape)) for t in self.anchor.values())

    @property
    def numel(self) -> int:
        return sum(t.numel() for t in self.anchor.values())

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
        """Close this peer's round: compress its delta, merge it with ``inbox``, step the
        anchor.

        ``n_peers``: peers training the job (this one included); ``steps_short``, ``steps``,
        ``first``: the round's length for the robust rule (``Screen.record_own``); ``whole``:
        False keeps a peer alone in the round from committing its whole delta at once
        (``prepare``), as one whose rounds others still follow must. Returns the encoded delta
        to send; ``last_merge`` says what was applied or refused and why."""
        whole = whole and n_peers == 1
        out = self.prepare(whole=whole)
        # Asynchronous: rounds commit a round later everywhere, unless a peer is alone.
        self.merge(
            inbox,
            n_peers=n_peers,
            commit_complete=whole,
            steps_short=steps_short,
            steps=steps,
            first=first,
        )
        return out

    @torch.no_grad()
    def prepare(self, *, whole: bool = False) -> Outgoing:
        """First half of a round boundary: encode this peer's delta (a synchronous swarm sends
        it, waits for the others' deltas of the round, then calls ``merge``; no training
        between).

        ``whole``: a peer alone in the round commits its whole delta, the error feedback's
        residual included: with nobody to average with there is nothing to compress for, and the
        anchor (what a joiner starts from) stays the model. The frame is still the codec's, for
        peers that listen."""
        if self._own is not None:
            raise RuntimeError("prepare() called twice without merge()")
        if whole:  # alone: nobody sends the donor's progress, so this peer commits it
            self.offset.fold()
        start = self.start_point()
        own = self.encoder.encode(self.replica.deltas(start), whole=whole, draining=self.averaging)
        self._own, self._whole = own, whole
        return Outgoing(
            round=self.round,
            base_version=self.version,
            tensors=own.tensors,
            raw_bytes=own.raw_bytes,
            wire_ratio=own.raw_bytes / max(1, sum(len(e.payload) for _, e in own.tensors)),
        )

    @torch.no_grad()
    def merge(
        self,
        inbox: Sequence[Contribution],
        *,
        n_peers: int,
        commit_complete: bool = True,
        steps_short: float = 1.0,
        steps: int | None = None,
        first: int | None = None,
    ) -> MergeReport:
        """Second half: merge the own delta and ``inbox``, commit what is due, reset the
        replica.

        ``commit_complete``: commit this round at once when all ``n_peers`` deltas are in (a
        synchronous swarm). Asynchronous peers cannot know the others hold a whole round too, so
        every round commits one round later everywhere and the anchors stay equal."""
        if n_peers < 1:
            raise ValueError(f"n_peers must be >= 1, got {n_peers}")
        own, self._own = self._own, None
        if own is None:
            raise RuntimeError("merge() needs prepare() first")
        report = MergeReport(version=self.version)
        self._add_pending(self.version, own.sent, 1.0)
        self.intake.seen.add((self.peer_id, self.version))
        self.intake.record_own(
            self.version, own.framed, steps_short=steps_short, steps=steps, first=first
        )
        self._take([*self.intake.take_held(), *inbox], report)
        if self._whole and self.rounds.count(self.version) == 1:
            self.committed.commit_whole(self.version)  # alone (``prepare(whole=True)``)
        # Commit every earlier round, and this one once all its deltas are in.
        due = sorted(
            b
            for b in self.rounds.sums
            if b < self.version
            or (commit_complete and b == self.version and self.rounds.counts[b] >= n_peers)
        )
        self._close(due, keep=own.kept)
        self.round += 1
        self.last_merge = report
        return report

    def _close(self, due: Sequence[int], *, keep: Mapping[str, Tensor]) -> None:
        """Commit the ``due`` rounds in one outer step and move on to the next version; the
        replica restarts from the new start point plus ``keep``. Each round commits the change
        of its mean, so peers that counted its peers differently still commit the same sum."""
        self.committed.commit(due)
        self.version += 1
        self.replica.restart(self.start_point(), keep=keep)
        self.offset.fold_if_gone(self.version, self.spec.max_staleness)
        floor = self.version - self.spec.max_staleness
        self.intake.prune(floor)
        self.pace.closed(
            self.version, together=self.together, only_own=self.intake.merged_only(self.peer_id)
        )
        self.rounds.prune(floor)

    @torch.no_grad()
    def follow(self, inbox: Sequence[Contribution]) -> bool:
        """After this peer's last round: close round ``version`` without a delta of its own,
        merging the deltas of the others, who still train a few rounds, as they do; its model of
        the swarm then ends where theirs does. What it trained and has not sent stays in the
        replica. The deltas are judged by the newest own delta's norms (no direction check).
        False, and nothing done, when there is nothing to judge them by."""
        if self._own is not None:
            raise RuntimeError("follow() between prepare() and merge()")
        if self.screen is not None and not self.screen.record_stand_in(self.version):
            return False
        own = dict(self.replica.deltas(self.start_point()))  # it restarts with the offset
        report = MergeReport(version=self.version)
        self._take([*self.intake.take_held(), *inbox], report, following=True)
        self._close(sorted(b for b in self.rounds.sums if b < self.version), keep=own)
        self.last_merge = report
        return True

    @torch.no_grad()
    def absorb(self, inbox: Sequence[Contribution]) -> MergeReport:
        """Merge deltas that arrive between round boundaries into the pending rounds; the
        replica moves by exactly as much as its start point does, so what it trained since
        stays. Deltas of a round this peer has not closed only wait. Call on the trainer thread,
        between steps."""
        report = MergeReport(version=self.version)
        if not inbox:
            return report
        before = dict(self.rounds.counts)
        taken = self._take(inbox, report)
        added = {b: [(t.weight, t.tensors) for t in ts] for b, ts in taken.items()}
        self._shift_replica(before, added)
        self.last_merge = report
        return report

    @torch.no_grad()
    def retract(self, taken: Sequence[Taken]) -> None:
        """Take merged deltas out again, as if they had never come (the loss guard's rollback):
        their rounds must not be committed yet. The replica moves back as its start point does."""
        before = dict(self.rounds.counts)
        removed: dict[int, list[Change]] = {}
        for t in taken:
            b = t.contribution.base_version
            if b >= self.version or b not in self.rounds.sums:
                raise ValueError(f"round {b} is not a closed, uncommitted round here")
            self.rounds.remove(b, t.tensors, t.weight)
            self.intake.seen.discard((t.contribution.sender, b))
            if self.screen is not None and t.stats is not None:
                self.screen.forget(b, t.stats)
            removed.setdefault(b, []).append((-t.weight, t.tensors))
            self.offset.undrain(t.drained)
        self._shift_replica(before, removed)
        self.rounds.drop_empty()

    def _shift_replica(
        self, before: Mapping[int, int], changes: Mapping[int, Sequence[Change]]
    ) -> None:
        """Move the replica by as much as the start point moved when ``changes`` (weight,
        tensors) joined (negative weight: left) the pending rounds, whose counts were
        ``before``."""
        shift = self.committed.shift(self.version, before, changes)
        if shift is not None:
            self.replica.move(shift)

    def _take(
        self, inbox: Sequence[Contribution], report: MergeReport, *, following: bool = False
    ) -> dict[int, list[Taken]]:
        """Add every delta of ``inbox`` the intake accepts to its pending round; record the
        rest. Returns the deltas taken, as merged, by round. ``following``: no own progress is
        trained any more, so no direction check (``follow``)."""
        taken: dict[int, list[Taken]] = {}
        toward = None if following else self._direction_reference()
        for v in self.intake.judge(inbox, self.version, toward):
            c = v.contribution
            if v.tensors is None:
                why = v.reason or "refused"
                report.refused.append(RefusedDelta(c.sender, c.round, why, v.strike, v.cosine))
                continue
            s = max(0, self.version - c.base_version)  # rounds it lags behind
            w = staleness_weight(s)
            self._add_pending(c.base_version, v.tensors, w)
            drained = None
            if self.offset.drains(c.sender):
                drained = self.offset.drain(v.tensors, self.version)
            self.intake.seen.add((c.sender, c.base_version))
            self.together = self.together or c.sender != self.peer_id
            report.applied.append(
                AppliedDelta(c.sender, c.round, s, w, v.reason, v.strike, v.cosine)
            )
            t = Taken(c, v.tensors, w, v.stats, drained)
            report.taken.append(t)
            taken.setdefault(c.base_version, []).append(t)
        return taken

    def _direction_reference(self) -> Callable[[int], Progress] | None:
        """The robust rule's direction reference for one inbox (``RoundDirections.reference``);
        None in consolidation, where deltas point against it by design."""
        if self.averaging:
            return None
        return self.directions.reference(self.own_progress, dense=self.fraction is None)

    def own_progress(self) -> dict[str, Tensor]:
        """What this peer trained that the swarm does not hold yet: the replica beyond its start
        point, plus the error feedback's residual (the robust rule's direction reference)."""
        return self.unsent_from(self.start_point())

    def unsent_from(self, reference: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """This peer's model beyond ``reference`` (the anchor, or ``settled()``), plus the error
        feedback's residual (CPU fp32): where the peers' references agree, the reference plus
        the mean of these is the average of their models (``atomd.sync.average``)."""
        return self.replica.beyond(reference)

    def settled(self) -> dict[str, Tensor]:
        """Where the anchor ends once every closed round commits and the outer momentum runs
        out: the same at peers that merged the same deltas, whenever each committed them."""
        return self.committed.settled(self.version)

    def _add_pending(self, base_version: int, tensors: Mapping[str, Tensor], w: float) -> None:
        if self.fraction is None:  # the direction reference (``RoundDirections``)
            self.directions.add(base_version, tensors)
        self.rounds.add(base_version, tensors, w)

    def average_from_now(self) -> None:
        """Make every later commit the plain average (outer lr 1, no momentum), as consolidation
        needs: the mean of the peers' models stays where it is while they send their
        differences. Every peer switches at the same round, so the switch is part of the state."""
        self.committed.average_from_now()
        self.averaging = True
        self.offset.fold()  # the peers' models are averaged: this one's as it is

    def alone_in_fact(self) -> bool:
        """No other peer's delta merged within the last ``max_staleness`` rounds, none held."""
        return not self.intake.held and self.intake.merged_only(self.peer_id)

    def parted_alone(self) -> bool:
        """This peer merged other peers' deltas once, then none for ``max_staleness`` rounds,
        and the first delta after was of a round past its own: a swarm went on without it, and
        the anchors have parted. A fresh joiner, a job's first peer and a peer whose others were
        gone are not."""
        return self.pace.parted

    def rounds_behind(self, *, capped: bool = True) -> int:
        """Rounds the swarm has closed that this peer has not (``SwarmPace.rounds_behind``)."""
        return self.pace.rounds_behind(self.version, capped=capped)

    def rounds_ahead(self, among: Collection[str]) -> int:
        """Rounds this peer has closed past ``among``, the peers training the job now."""
        return self.pace.rounds_ahead(self.version, among)

    def senders_in(self, base_version: int) -> set[str]:
        """The peers (this one included) whose delta of round ``base_version`` is in here:
        merged, held, or come and refused as one that will not come again. By identity: a sender
        that no longer counts, or one delta sent twice, fills no other peer's place."""
        return self.intake.senders_in(base_version)

    def drop_excluded(self, excluded: Callable[[str], bool]) -> int:
        """Forget the held deltas and claimed rounds of senders now ``excluded`` (quarantined or
        banned); how many held deltas that was."""
        return self.intake.drop_excluded(excluded)

    def deltas_in(self, base_version: int) -> int:
        """Deltas (own included) this peer holds of round ``base_version`` not yet committed
        (those waiting to be judged included)."""
        return self.rounds.count(base_version) + self.intake.held_in(base_version)

    def held(self) -> int:
        """Received deltas waiting for this peer to close their round before they are judged."""
        return len(self.intake.held)

    def start_point(self) -> dict[str, Tensor]:
        """Where the replica restarts: where the anchor will be once the closed rounds commit,
        their missing deltas counted as the mean of those in (``AnchorState.start_point``)."""
        return self.committed.start_point(self.version)

    def reset_replica(self) -> None:
        """Copy the start point into the replica, in place: the swarm's model (an inherited
        offset is left out; the next round boundary puts it back)."""
        self.replica.restart(self.start_point(), keep={}, offset=False)

    @torch.no_grad()
    def adopt(self, donor: str | None = None) -> None:
        """After ``load_state_tensors`` and the donor's model (the replica), on a join or a
        restart: train on from the donor's model, keeping its unsent progress apart
        (``InheritedOffset``) until the donor's deltas carry it, so that no anchor counts it
        twice; the donor's error feedback is dropped. ``donor``: its peer id as the state
        transfer verified it (else its state's)."""
        self.feedback.load_state_tensors({})
        if self.averaging:  # consolidation averages the models as they are
            self.offset.fold()
            return
        self.offset.take(self.start_point(), donor=donor, me=self.peer_id, version=self.version)

    def state_tensors(self) -> dict[str, Tensor]:
        """Anchor, pending deltas, outer momentum, error-feedback residuals, counters (CPU)."""
        return snapshot.write(self)

    def load_state_tensors(self, d: Mapping[str, Tensor]) -> None:
        """Restore what ``state_tensors`` produced (checkpoint or state transfer); the replica
        is not touched (after a state transfer, with the donor's model loaded, call ``adopt``)."""
        snapshot.read(self, d)
