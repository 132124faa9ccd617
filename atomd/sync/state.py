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

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from atomd.logs import get_logger
from atomd.spec import SyncSpec
from atomd.sync import snapshot
from atomd.sync.codecs import Codec, Encoded, ErrorFeedback, make_codec
from atomd.sync.intake import Intake
from atomd.sync.offset import Drained, InheritedOffset
from atomd.sync.outer import NesterovOuter, staleness_weight
from atomd.sync.pace import SwarmPace
from atomd.sync.robust import DeltaStats, Progress, RobustRule, Screen
from atomd.sync.rounds import Change, PendingRounds, RoundDirections

if TYPE_CHECKING:
    from atomd.train.engine import StepEngine

log = get_logger(__name__)

# AdamW's eps squared: a weight no gradient has reached yet (v = 0) ranks as one whose v is
# this, as AdamW's own step divides by sqrt(v) + eps.
RANK_EPS = 1e-16
# Top-k ranks by |delta| x (v + RANK_EPS) ** power (``SyncSpec.topk_rank`` 'moment'), the power
# by how often rounds come (``SyncSpec.frequent``), as measured in research/ with `atomd bench
# sync`: rare rounds gain most from the weights the other peers' data rarely move (small v),
# what a peer knows alone; frequent rounds rank by |delta| (power 0), since ranked by v their
# anchor fell far behind the replicas.
RANK_POWER = {"frequent": 0.0, "rare": -2.0}
# After taking a state: the most rounds the donor's reference statistics stay the floor of this
# peer's own, each statistic until an own delta reaches it (``SyncState.merge``).
INHERIT_ROUNDS = 64
DEFAULT_RULE = RobustRule()


@dataclass(frozen=True)
class Contribution:
    """A delta received from another peer, decoded: ``replica - anchor`` of the sender."""

    sender: str
    round: int
    base_version: int
    tensors: dict[str, Tensor]
    every: int | None = None  # the steps its round lasted, as its frame says (None: not said)


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
        """``params``: the replica's live parameter tensors (any device, any float dtype).

        The anchor is a CPU fp32 copy of them; the replica is written back to in place.
        ``peer_id`` is the id receivers see as ``Contribution.sender``. ``robust``: the rule
        that bounds received deltas (``atomd.sync.robust``); None merges them as they come
        (for experiments that measure what the rule buys); ``lr``: the job's learning rate at
        each (0-based) step, by which the rule weighs a longer round (``Screen``).
        """
        bad = [n for n, p in params.items() if not p.is_floating_point()]
        if bad:
            raise ValueError(f"sync needs floating-point tensors; not: {', '.join(bad)}")
        self.spec = spec
        self.peer_id = peer_id
        self.params = dict(params)
        with torch.no_grad():
            self.anchor = {
                n: p.detach().to("cpu", torch.float32, copy=True) for n, p in params.items()
            }
        self.codec = self._codec(spec.topk_fraction, zstd=spec.zstd)
        self.feedback = ErrorFeedback(self.codec)
        self.outer = NesterovOuter(lr=spec.outer_lr, momentum=spec.outer_momentum)
        self.averaging = False  # the plain average from now on (``average_from_now``)
        self._following = False  # closing a round without an own delta (``follow``)
        self.version = 0  # rounds closed; round r's deltas carry base_version r
        self.round = 0  # rounds this peer has sent (its own counter; differs after a join)
        self.last_merge = MergeReport(version=0)
        self.rounds = PendingRounds(self.anchor)
        self.directions = RoundDirections(self.anchor)
        self.offset = InheritedOffset(self.params)
        self.pace = SwarmPace(peer_id, spec.max_staleness)
        self.screen = Screen(robust, lr=lr) if robust is not None else None
        self.intake = Intake(
            self.anchor, max_staleness=spec.max_staleness, screen=self.screen, pace=self.pace
        )
        # Whether this peer has merged another peer's delta (or taken a state that had).
        self.together = False
        # Between prepare() and merge(): own sent delta and the rest, which the replica keeps.
        self._sent: dict[str, Tensor] | None = None
        self._kept: dict[str, Tensor] = {}
        self._whole = False  # the own delta of this round is whole (``prepare(whole=True)``)
        self._framed: dict[str, Tensor] = {}  # this round's delta as receivers decode it
        # How top-k ranks each tensor's entries at the next ``prepare`` (name -> weight of
        # |delta|: ``SyncSpec.topk_rank``), read once a round; None: by |delta| alone.
        self.rank_weights: Callable[[], Mapping[str, Tensor]] | None = None
        self._draining = False  # past the last training round before consolidation rounds
        # After taking a state: the donor's reference statistics, the floor of this peer's own
        # (its error feedback starts empty), each until an own delta reaches it, at most until
        # round ``_inherited_until``.
        self._inherited: DeltaStats | None = None
        self._inherited_until = 0

    @classmethod
    def of_engine(cls, engine: StepEngine, spec: SyncSpec, **kw: Any) -> SyncState:
        """The state of a replica trained by ``engine`` (settled): its live parameters (host
        masters when swapping), and top-k ranked by its AdamW state (``rank_by``)."""
        state = cls(dict(engine.model.named_parameters()), spec, **kw)
        state.rank_by(engine.second_moments)
        return state

    def rank_by(self, second_moments: Callable[[], Mapping[str, Tensor]]) -> None:
        """Rank top-k's entries by |delta| x v ** power (``SyncSpec.topk_rank`` 'moment',
        ``RANK_POWER`` by the cadence; power 0 ranks by |delta| and reads nothing), v read
        from ``second_moments`` (the engine's AdamW state, settled) at each ``prepare``."""
        power = RANK_POWER["frequent" if self.spec.frequent else "rare"]
        if self.spec.topk_rank != "moment" or power == 0.0:
            return
        self.rank_weights = lambda: {
            n: torch.pow(v + RANK_EPS, power) for n, v in second_moments().items()
        }

    @property
    def fraction(self) -> float | None:
        """The share of entries the codec sends (None: a dense codec sends them all)."""
        fraction = getattr(self.codec, "fraction", None)
        return float(fraction) if fraction is not None else None

    def set_fraction(self, fraction: float) -> None:
        """Send ``fraction`` of the entries from the next round on (a sparse codec only). A
        frame says how many entries each tensor holds (``k`` in its meta) and any k decodes, so
        peers need not agree on it; what this peer merges of its own delta is still exactly
        what the others decode, so the anchors agree as before."""
        if self.fraction is None:
            raise ValueError(f"codec {self.spec.codec} sends every entry: no fraction to set")
        if fraction != self.fraction:
            self.codec = self._codec(fraction, zstd=self.spec.zstd)
            self.feedback.codec = self.codec

    def codec_at(self, fraction: float) -> Codec:
        """The job's codec sending ``fraction`` of the entries (a sparse codec's)."""
        return self._codec(fraction, zstd=self.spec.zstd)

    def _codec(self, fraction: float, *, zstd: bool) -> Codec:
        return make_codec(self.spec.codec, topk_fraction=fraction, zstd=zstd)

    def payload_estimate(self, fraction: float) -> int:
        """Payload bytes of a delta (all tensors, before zstd) at ``fraction`` of the entries."""
        codec = self._codec(fraction, zstd=False)
        return sum(codec.raw_nbytes_for(tuple(t.shape)) for t in self.anchor.values())

    @property
    def numel(self) -> int:
        return sum(t.numel() for t in self.anchor.values())

    def staleness(self, c: Contribution) -> int:
        """Rounds a delta lags behind this peer's (0 when it is not behind)."""
        return max(0, self.version - c.base_version)

    def refusal(self, c: Contribution) -> str | None:
        """Why a received delta cannot be merged now, or None when it can (its form and its
        round; its size is the robust rule's)."""
        return self.intake.refusal(c, self.version)[0]

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
        """Close this peer's round: compress its delta, merge it with ``inbox``, step the anchor.

        ``n_peers``: peers training the job (this one included); ``steps_short``: the round's
        steps over those this peer trained in it, when it closed the round early (see
        ``robust.Screen.record_own``; ``steps``: the steps it trained in the round, for the
        same); ``whole``: False keeps a peer alone in the round from committing its whole delta
        at once (see ``prepare``): one whose rounds others still follow commits as they do, so
        that its anchor stays theirs.
        Returns the encoded delta to send; ``last_merge`` says what was applied or refused and
        why.
        """
        whole = whole and n_peers == 1
        out = self.prepare(whole=whole)
        # Asynchronous: a peer holding a whole round cannot know the others do, so rounds are
        # committed a round later everywhere (alone, there is no one to disagree with; one
        # whose rounds others follow commits them as they do).
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
        """First half of a round boundary: encode this peer's delta.

        A synchronous swarm sends this, waits for the others' deltas of the round, then calls
        ``merge``; the replica must not train in between.

        ``whole``: a peer alone in the round (``round_boundary`` with one peer) commits its
        whole delta, the error feedback's residual included, where a lossy codec would commit
        only what it sends: with nobody to average with there is nothing to compress for, and
        the anchor (the swarm's model when a peer joins) stays the model instead of falling
        behind it by everything top-k has not sent yet. The frame is still the codec's (for a
        peer that only listens: one that went silent, or finished and follows the rounds).
        """
        if self._sent is not None:
            raise RuntimeError("prepare() called twice without merge()")
        if whole:  # alone: nobody sends the donor's progress, so this peer commits it
            self.offset.fold()
        start = self.start_point()
        encoded: list[tuple[str, Encoded]] = []
        sent: dict[str, Tensor] = {}
        framed: dict[str, Tensor] = {}  # what receivers decode: the robust rule's reference
        raw_bytes = 0
        # Consolidation rounds (after ``average_from_now``'s last training round) drain what is
        # left largest first: ranked by v they drain far slower.
        weights = {} if self.rank_weights is None or self._draining else self.rank_weights()
        self._draining = self.averaging
        for name, p in self.params.items():
            delta = p.detach().to("cpu", torch.float32) - start[name]
            if name in self.offset.tensors:
                delta.sub_(self.offset.tensors[name].reshape(delta.shape))
            enc, reconstructed = self.feedback.compress(name, delta, weights.get(name))
            framed[name] = reconstructed.to("cpu", torch.float32).reshape(delta.shape).clone()
            if whole:  # the residual is committed too: nothing waits
                sent[name] = framed[name] + self.feedback.split(name, 1.0).reshape(delta.shape)
            else:  # what is committed is what is sent; the replica trains on with the rest
                sent[name] = framed[name]
                self._kept[name] = self.feedback.split(name, 1.0)
            encoded.append((name, enc))
            raw_bytes += delta.numel() * 4
        self._sent, self._whole, self._framed = sent, whole, framed
        return Outgoing(
            round=self.round,
            base_version=self.version,
            tensors=encoded,
            raw_bytes=raw_bytes,
            wire_ratio=raw_bytes / max(1, sum(len(e.payload) for _, e in encoded)),
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
        """Second half: merge the own delta and ``inbox``, commit what is due, reset the replica.

        ``commit_complete``: commit this round at once when all ``n_peers`` deltas are in (a
        synchronous swarm, where every peer has them). ``round_boundary`` passes False unless the
        peer is alone: in an asynchronous swarm a peer that happens to hold a whole round cannot
        know the others do, so every round is committed one round later everywhere and the
        anchors stay equal.
        """
        if n_peers < 1:
            raise ValueError(f"n_peers must be >= 1, got {n_peers}")
        if self._sent is None:
            raise RuntimeError("merge() needs prepare() first")
        own, self._sent = self._sent, None
        framed, self._framed = self._framed, {}
        report = MergeReport(version=self.version)
        self._add_pending(self.version, own, 1.0)
        self.intake.seen.add((self.peer_id, self.version))
        if self.screen is not None:  # the reference of this round's deltas is known now
            floor = self._inherited if self.version < self._inherited_until else None
            # The reference is the frame (others' deltas are frames too), not a whole commit.
            own_stats = self.screen.record_own(
                self.version,
                framed,
                steps_short=steps_short,
                floor=floor,
                steps=steps,
                first=first,
            )
            if floor is not None:  # each statistic holds until an own delta reaches it
                self._inherited = floor.unmet_by(own_stats)
        self._take([*self.intake.take_held(), *inbox], report)
        if self._whole and self.rounds.count(self.version) == 1:
            # Alone in the round (``prepare(whole=True)``): the anchor takes the whole delta as
            # it is, no outer step (its momentum would carry the model past where it trained).
            for name, x in self.rounds.take_whole(self.version).items():
                self.anchor[name].add_(x)
        # Commit every earlier round, and this one once all its deltas are in.
        due = sorted(
            b
            for b in self.rounds.sums
            if b < self.version
            or (commit_complete and b == self.version and self.rounds.counts[b] >= n_peers)
        )
        self._close(due, keep=self._kept)
        self.round += 1
        self._kept = {}
        self.last_merge = report
        return report

    def _close(self, due: Sequence[int], *, keep: Mapping[str, Tensor]) -> None:
        """Commit the ``due`` rounds in one outer step and move on to the next version; the
        replica restarts from the new start point plus ``keep``.

        Each round commits the change of its mean (``PendingRounds.coefficients``), whatever
        the peers counted: one that counts a peer more or less than another for a round (it saw
        a member leave or join a round earlier) still commits the same sum once it has merged
        the same deltas, so the anchors do not part at a membership change."""
        if due:
            self.outer.step(self.anchor, self.rounds.outer_grad(due))
            self.rounds.commit(due)  # kept until they can take no late delta (pruned below)
        self.version += 1
        self._restart_replica(keep=keep)
        self.offset.fold_if_gone(self.version, self.spec.max_staleness)
        floor = self.version - self.spec.max_staleness
        self.intake.prune(floor)
        self.pace.closed(self.version, together=self.together, only_own=self._merged_only_own())
        self.rounds.prune(floor)

    @torch.no_grad()
    def follow(self, inbox: Sequence[Contribution]) -> bool:
        """After this peer's last round: close round ``version`` without a delta of its own.

        A peer that reaches the job's last step before the others has sent its last delta
        (its frame says so, and the others average their later rounds without it); the others
        still train a few rounds. Following them, it merges their deltas of those rounds as
        they do (each round the mean of its deltas), so that its model of the swarm ends where
        theirs does instead of a few rounds behind. What this peer trained and has not sent
        stays in the replica. The deltas are judged against the newest own delta's norms (no
        direction check: there is no own delta of the round to compare with); ``last_merge``
        says what was applied. False, and nothing done, when there is nothing to judge them by.
        """
        if self._sent is not None:
            raise RuntimeError("follow() between prepare() and merge()")
        if self.screen is not None and not self.screen.record_stand_in(self.version):
            return False
        start = self.start_point()
        own = {n: p.detach().to("cpu", torch.float32) - start[n] for n, p in self.params.items()}
        for n, o in self.offset.tensors.items():  # the replica restarts with it anyway
            own[n].sub_(o.reshape(own[n].shape))
        report = MergeReport(version=self.version)
        held = self.intake.take_held()
        self._following = True
        try:
            self._take([*held, *inbox], report)
        finally:
            self._following = False
        self._close(sorted(b for b in self.rounds.sums if b < self.version), keep=own)
        self.last_merge = report
        return True

    @torch.no_grad()
    def absorb(self, inbox: Sequence[Contribution]) -> MergeReport:
        """Merge deltas that arrive between round boundaries, without waiting for the next one.

        They join the pending rounds, and the replica moves by exactly as much as its start
        point does: what it trained since the boundary (and any residual it keeps) stays. Deltas
        of a round this peer has not closed yet only wait: its own delta of that round is still
        being trained. Call between optimizer steps, on the thread that trains the replica.
        """
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
        """Take merged deltas out again, as if they had never come: the rounds they joined must
        not be committed yet (rounds before ``version``: the loss guard's rollback, right after
        the merge). The replica moves back by as much as its start point does."""
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
        change = self.rounds.grad_change(self.version, before, changes)
        if change is None:
            return
        for name, p in self.params.items():
            p.add_(self.outer.peek_shift(change[name]).to(p.device, p.dtype).reshape(p.shape))

    def _take(self, inbox: Sequence[Contribution], report: MergeReport) -> dict[int, list[Taken]]:
        """Add every delta of ``inbox`` the intake accepts to its pending round; record the
        rest. Returns the deltas taken, as merged, by round."""
        taken: dict[int, list[Taken]] = {}
        for v in self.intake.judge(inbox, self.version, self._direction_reference()):
            c = v.contribution
            if v.tensors is None:
                why = v.reason or "refused"
                report.refused.append(RefusedDelta(c.sender, c.round, why, v.strike, v.cosine))
                continue
            s = self.staleness(c)
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
        """The robust rule's direction reference of each round's deltas for one inbox (rule 4
        of ``atomd.sync.robust``): the swarm's last round (``_swarm_direction``), else the own
        progress, made once for the inbox; None where deltas point against them by design
        (consolidation) or no own progress is trained any more (following the last rounds)."""
        if self.averaging or self._following:
            return None
        towards: dict[int, Progress] = {}
        own: list[Progress] = []

        def toward(base_version: int) -> Progress:
            if base_version not in towards:
                swarm = self._swarm_direction(base_version)
                if swarm is not None:
                    towards[base_version] = Progress.of(swarm)
                else:
                    if not own:
                        own.append(Progress.of(self.own_progress()))
                    return own[0]
            return towards[base_version]

        return toward

    def _swarm_direction(self, base_version: int) -> dict[str, Tensor] | None:
        """The robust rule's direction reference for deltas of round ``base_version`` where
        the codec sends every entry: the newest round before it this peer has merged deltas of
        (``RoundDirections``). None (the own progress judges) where the codec sends a share
        (top-k's frames share few entries with the last round's; the unsent residual, in the
        own progress, is where its next frames come from), and before any round of this
        peer's."""
        if self.fraction is not None:
            return None
        return self.directions.before(base_version)

    @torch.no_grad()
    def own_progress(self) -> dict[str, Tensor]:
        """What this peer trained that the swarm does not hold yet: its replica minus its start
        point, plus the error feedback's residual (float32, CPU). Deltas merged here move the
        replica and the start point alike, so only this peer's own steps and the part of its
        own deltas not sent are in it (``robust.Screen.judge``'s direction reference)."""
        return self.unsent_from(self.start_point())

    @torch.no_grad()
    def unsent_from(self, reference: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """This peer's model beyond ``reference`` (the anchor, or ``settled()``): the replica
        minus it, plus the error feedback's residual (float32, CPU). Where the peers' references
        agree, the reference plus the mean of these over the peers is the average of their
        models (``atomd.sync.average``)."""
        residual = self.feedback.state_tensors()
        out = {}
        for name, p in self.params.items():
            ref = reference[name]
            x = p.detach().to("cpu", torch.float32).reshape(ref.shape) - ref
            r = residual.get(name)
            out[name] = x if r is None else x + r.reshape(x.shape)
        return out

    @torch.no_grad()
    def settled(self) -> dict[str, Tensor]:
        """Where the anchor ends once every closed round's pending deltas are committed and the
        outer momentum has run out with no more: the same at peers that have merged the same
        deltas, whenever each committed them (``NesterovOuter.settle``). The anchors themselves
        differ by when each peer committed a late delta, and by the late deltas still pending
        at the job's end."""
        closed = self.rounds.closed(self.version)
        return self.outer.settle(self.anchor, self.rounds.outer_grad(closed) if closed else {})

    def _add_pending(self, base_version: int, tensors: Mapping[str, Tensor], w: float) -> None:
        if self.fraction is None:  # the direction reference (``_swarm_direction``)
            self.directions.add(base_version, tensors)
        self.rounds.add(base_version, tensors, w)

    def average_from_now(self) -> None:
        """Make every later commit the plain average (outer lr 1, no momentum), as consolidation
        needs: the mean of the peers' models then stays where it is while they send their
        differences. What a replica already holds of the outer step's look-ahead is measured
        against the plain start point from now on, so it travels as progress: nothing is lost.
        Every peer must switch at the same round (all do, before their last boundary), so the
        switch is part of the state (a checkpoint or a state transfer carries it)."""
        self.outer = NesterovOuter(lr=1.0, momentum=0.0)
        self.averaging = True
        self.offset.fold()  # the peers' models are averaged: this one's as it is

    def alone_in_fact(self) -> bool:
        """No other peer's delta merged within the last ``max_staleness`` rounds, none held."""
        return not self.intake.held and self._merged_only_own()

    def _merged_only_own(self) -> bool:
        return self.intake.merged_only(self.peer_id)

    def parted_alone(self) -> bool:
        """This peer merged other peers' deltas once, then none for ``max_staleness`` rounds
        (it was cut off, or the others were), and the first delta that came after was of a
        round past its own: a swarm went on without it. The rounds it closed alone are in its
        anchor only, and the swarm's are not in it, so the anchors have parted however near
        the rounds. A fresh joiner (it has merged nothing), the first peer of a job and a peer
        whose others were gone (their first deltas after are of its round or before: they took
        its state, or were stopped) are not parted."""
        return self.pace.parted

    def rounds_behind(self, *, capped: bool = True) -> int:
        """Rounds the swarm has closed that this one has not (``SwarmPace.rounds_behind``);
        uncapped, for whether to take the swarm's state again: a peer stopped long enough is
        that far behind."""
        return self.pace.rounds_behind(self.version, capped=capped)

    def rounds_ahead(self, among: Collection[str]) -> int:
        """Rounds this peer has closed past ``among``, the peers training the job now
        (``SwarmPace.rounds_ahead``). Peers that left or have sent their last delta are not in
        ``among``: their claims stay where they stopped."""
        return self.pace.rounds_ahead(self.version, among)

    def senders_in(self, base_version: int) -> set[str]:
        """The peers (this one included) whose delta of round ``base_version`` is in here:
        merged (committed or pending, a whole own round included), held until this peer closes
        that round, or come and refused as one that will not come again. ``SyncPlugin`` holds a
        round for the peers it counts that are not among them. By identity, not by count: a
        sender that no longer counts (quarantined, gone, silent) or one delta sent twice fills
        no other peer's place."""
        return self.intake.senders_in(base_version)

    def drop_excluded(self, excluded: Callable[[str], bool]) -> int:
        """Forget what senders now ``excluded`` (quarantined or banned) left here: their held
        deltas and the rounds they claimed, which would otherwise pace this peer's. How many
        held deltas that was."""
        return self.intake.drop_excluded(excluded)

    def deltas_in(self, base_version: int) -> int:
        """Deltas (own included) this peer holds of round ``base_version`` not yet committed
        (those waiting to be judged included)."""
        return self.rounds.count(base_version) + self.intake.held_in(base_version)

    def held(self) -> int:
        """Received deltas waiting for this peer to close their round before they are judged."""
        return len(self.intake.held)

    def start_point(self) -> dict[str, Tensor]:
        """Where the replica restarts: where the anchor will be once the pending rounds commit.

        A round commits the mean of its deltas, so those still missing count as that mean: a
        peer that has heard from nobody yet keeps its own progress whole instead of shrinking
        it to 1/n, and the outer step (momentum included) is the one the commit will take. Unless
        more deltas come, this is exactly the anchor after the commit. Deltas of a round this
        peer has not closed yet are left out until it has.
        """
        closed = self.rounds.closed(self.version)
        if not closed:
            return self.anchor
        return self.outer.peek(self.anchor, self.rounds.outer_grad(closed))

    @torch.no_grad()
    def _restart_replica(self, *, keep: Mapping[str, Tensor], offset: bool = True) -> None:
        start = self.start_point()
        for name, p in self.params.items():
            x = start[name]
            for add in (keep.get(name), self.offset.tensors.get(name) if offset else None):
                if add is not None:
                    x = x.add(add.reshape(x.shape))
            p.copy_(x.reshape(p.shape))

    def reset_replica(self) -> None:
        """Copy the start point (anchor plus pending deltas) into the replica, in place: the
        swarm's model, the same at peers that merged the same deltas (an inherited offset is
        left out; the next round boundary puts it back)."""
        self._restart_replica(keep={}, offset=False)

    @torch.no_grad()
    def adopt(self, donor: str | None = None) -> None:
        """After ``load_state_tensors`` and the donor's model (the replica) from another peer
        (a join or a restart): train on from the donor's model, and send only what this peer
        trains from it.

        The donor's model is the start point plus its progress the codec has not sent yet,
        which the donor sends itself over its next rounds: this peer keeps that progress apart
        (``InheritedOffset``) until the donor's deltas carry it. The donor's error feedback is
        dropped. ``donor``: its peer id as the state transfer verified it (else the id its
        state names); a donor that held an offset itself passes on its sources, whose deltas
        drain the offset too.

        Not from the start point alone: where rounds are rare the codec has sent little of a
        peer's progress, and the anchor is far behind the models. Not the donor's replica sent
        whole either: the donor's unsent progress would then reach every anchor twice."""
        self.feedback.load_state_tensors({})
        if self.averaging:  # consolidation averages the models as they are
            self.offset.fold()
            return
        self.offset.take(self.start_point(), donor=donor, me=self.peer_id, version=self.version)

    def divergence(self, other_anchor: Mapping[str, Tensor]) -> float:
        """Relative L2 distance ``|a - b| / |a|`` between this anchor and another, all tensors."""
        diff = norm = 0.0
        for name, a in self.anchor.items():
            b = other_anchor[name].to("cpu", torch.float32)
            diff += float((a - b).double().square().sum())
            norm += float(a.double().square().sum())
        return math.sqrt(diff) / max(math.sqrt(norm), 1e-30)

    def state_tensors(self) -> dict[str, Tensor]:
        """Anchor, pending deltas, outer momentum, error-feedback residuals, counters (CPU)."""
        return snapshot.write(self)

    def load_state_tensors(self, d: Mapping[str, Tensor]) -> None:
        """Restore what ``state_tensors`` produced (checkpoint or state transfer).

        The replica is not touched: after a state transfer, with the donor's model loaded,
        call ``adopt``.
        """
        self.directions.clear()  # rounds of before the state: no reference for its rounds
        snapshot.read(self, d)

    def restored(self, reference: DeltaStats | None) -> None:
        """After ``snapshot.read`` filled the anchor, the rounds and the counters: start the
        rounds with the donor's reference statistics (None: none in the state) and nothing
        held or claimed."""
        self.together = not self._merged_only_own()
        self._inherited = reference
        self._inherited_until = self.version + max(INHERIT_ROUNDS, self.spec.max_staleness + 1)
        if reference is not None and self.screen is not None:
            # The rounds closed before the state was taken: judged by the donor's statistics.
            first = max(0, self.version - self.spec.max_staleness)
            self.screen.inherit(reference, range(first, self.version))
        self.intake.held = []
        self.pace.reset()
