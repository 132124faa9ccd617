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
   (kept for the rounds that can still take a late delta: ``_committed``). Whoever a peer
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
sent yet (``adopt``).

With fp32, no momentum, outer lr 1 and a synchronous swarm a round makes the anchor the mean of
the replicas.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from atomd.logs import get_logger
from atomd.spec import SyncSpec
from atomd.sync.codecs import Codec, Encoded, ErrorFeedback, make_codec
from atomd.sync.outer import NesterovOuter, staleness_weight
from atomd.sync.robust import DeltaStats, Progress, RobustRule, Screen, lower_median

if TYPE_CHECKING:
    from atomd.train.engine import StepEngine

log = get_logger(__name__)

# AdamW's eps squared: a weight no gradient has reached yet (v = 0) ranks as one whose v is
# this, as AdamW's own step divides by sqrt(v) + eps.
RANK_EPS = 1e-16
# Top-k ranks by |delta| x (v + RANK_EPS) ** power (``SyncSpec.topk_rank`` 'moment'), the power
# by how often rounds come (``SyncSpec.frequent``). `atomd bench sync`, 4 peers, top-k 1 %, one
# run each (the spread between runs of one setting is ~0.01; docs/notes/issue-14.md):
#   H=50: power 0 (|delta|) 1.917, -0.5 1.890, -1 1.877, -2 1.868; fp32's plain average 1.872
#   H=2:  power 0 1.707, -0.5 1.703, -1 1.724
# Rare rounds gain most from the weights the other peers' data rarely move (small v): they are
# what a peer knows alone. Frequent rounds rank by |delta| (power 0): ranked by v their anchor
# ended at 3.89 where |delta|'s is 1.70 (the replicas alike), and on real daemons a restarted
# peer, which then started from the anchor, refused every donor's state and its job failed (run
# fn; a joiner keeps the donor's model since: ``SyncState.adopt``). At H=50 the anchor is poor
# either way (3.67).
RANK_POWER = {"frequent": 0.0, "rare": -2.0}

_ANCHOR, _MOMENTUM, _EF = "anchor.", "outer.momentum.", "ef."
_PENDING, _PENDING_COUNT = "pending.", "pending_count."
# A committed round's sum (``SyncState._committed``): dense as "committed.<b>.<name>", or its
# nonzero entries as "committed_at.<b>.<name>" (flat indices) and "committed_val.<b>.<name>".
_COMMITTED, _COMMITTED_AT, _COMMITTED_VAL = "committed.", "committed_at.", "committed_val."
_COMMITTED_COUNT = "committed_count."
_VERSION, _ROUND, _AVERAGING = "sync.version", "sync.round", "sync.averaging"
# The deltas merged recently, as UTF-8 lines "sender<TAB>base version" (a uint8 tensor): a peer
# that takes this state refuses them as duplicates when they reach it too.
_SEEN = "sync.seen"
# The donor's progress a peer that took its state holds and does not send (``adopt``), whose
# peer that is, and the version this peer last merged a delta of that peer at; and who served
# a state (its own peer id, read by the peer that takes it).
_OFFSET, _OFFSET_FROM, _OFFSET_HEARD, _SERVED_BY = (
    "inherited.", "sync.inherited_from", "sync.inherited_heard", "sync.served_by",
)  # fmt: skip
# The newest own delta's reference statistics (the robust rule's): the overall norm then each
# tensor's, and each tensor's largest |x|, in the anchor's order (float64).
_REF_NORMS, _REF_MAXABS = "sync.ref.norms", "sync.ref.maxabs"
# After taking a state: the most rounds the donor's reference statistics stay the floor of this
# peer's own, each statistic until an own delta reaches it (``SyncState.merge``).
INHERIT_ROUNDS = 64
MAX_PEER_ID = 64  # bytes of a peer id read back from a state (ids are 32 hex digits)
MAX_SOURCES = 16  # peers whose deltas drain an inherited offset, read back from a state
MAX_SEEN = 65_536  # entries read back from a state: (senders) x (max_staleness + 1) rounds
# Rounds whose sums of unit deltas a peer keeps for the direction reference (codecs that send
# every entry: ``SyncState._swarm_direction``): a delta is judged by the newest before its own.
DIRECTION_ROUNDS = 3

# A round claimed further ahead than this counts for nothing in ``rounds_behind``: no honest
# peer runs that far ahead of a live swarm (a joiner takes the donor's version).
MAX_CLAIM_AHEAD = 64
# A sender's claim counts in ``rounds_ahead`` while it sent a delta within this many of this
# peer's rounds: a peer that stopped sending (gone) holds nobody back for long.
CLAIM_FRESH_ROUNDS = 8
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
    # What it cleared of the inherited offset (``SyncState._drain_offset``): name -> (flat
    # positions, amounts), given back on a retract.
    drained: dict[str, tuple[Tensor, Tensor]] | None = None


@dataclass
class MergeReport:
    """What one round boundary did with its inbox (for the sync-rounds records)."""

    version: int
    applied: list[AppliedDelta] = field(default_factory=list)
    refused: list[RefusedDelta] = field(default_factory=list)
    taken: list[Taken] = field(default_factory=list)  # what ``applied`` merged, retractable


class SyncState:
    """Anchor, outer-optimizer state and error feedback of one peer for one job."""

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
        # base_version -> weighted sum of that round's deltas not committed yet, and how many.
        self._pending: dict[int, dict[str, Tensor]] = {}
        self._pending_count: dict[int, int] = {}
        # base_version -> the weighted sum of that round's deltas committed so far (each
        # tensor flat, sparse where mostly zero: ``_compact``) and how many they are, for the
        # rounds that can still take a late delta: its commit is the change of the round's mean.
        self._committed: dict[int, tuple[dict[str, Tensor], int]] = {}
        self._seen: set[tuple[str, int]] = set()  # (sender, base_version) merged recently
        # Whether this peer has merged another peer's delta (or taken a state that had); then
        # whether it has since closed max_staleness rounds merging none (cut off: its rounds
        # went into its anchor alone), and whether a delta then came from a swarm that went on
        # past it meanwhile (``parted_alone``).
        self.together = False
        self._cut_off = False
        self._parted = False
        # Received deltas of rounds this peer has not closed: judged once its own delta of
        # that round is known (they touch nothing before: only closed rounds move the replica).
        self._held: list[Contribution] = []
        # sender -> the newest base version it sent (any delta but one refused as a strike),
        # and this peer's version when it last sent one (``rounds_behind``, ``rounds_ahead``)
        self._claims: dict[str, tuple[int, int]] = {}
        # base version -> senders whose delta of that round came and was refused as too far
        # ahead, or as stale for this peer's last round: it will not come again (``senders_in``)
        self._gone: dict[int, set[str]] = {}
        self.screen = Screen(robust, lr=lr) if robust is not None else None
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
        # (its error feedback starts empty: ``load_state``), each until an own delta reaches it,
        # at most until round ``_inherited_until``.
        self._inherited: DeltaStats | None = None
        self._inherited_until = 0
        # Where the codec sends every entry: base_version -> the sum of that round's merged
        # deltas (own included), each as a unit vector (``_swarm_direction``); the newest few.
        self._directions: dict[int, dict[str, Tensor]] = {}
        # After taking a state (``adopt``): the donor's progress the anchor does not hold yet,
        # which the replica keeps and this peer does not send; whose it is (the donor's peer
        # id, read from its state), and the version this peer last merged a delta of it at.
        self._offset: dict[str, Tensor] = {}
        self._offset_from: set[str] = set()
        self._offset_heard = 0
        self._served_by: str | None = None  # the peer id a loaded state names as its server

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
        """The job's codec sending ``fraction`` of the entries (a sparse codec's)."""
        s = self.spec
        return make_codec(s.codec, topk_fraction=fraction, zstd=zstd)

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
        round; its size is the robust rule's: ``_judge``)."""
        return self._refusal(c)[0]

    def _refusal(self, c: Contribution) -> tuple[str | None, bool]:
        """(why refused or None, whether that is a strike against the sender)."""
        s = self.version - c.base_version
        if s > self.spec.max_staleness:
            return (
                f"stale: base version {c.base_version} lags {s} rounds behind version "
                f"{self.version}; at most {self.spec.max_staleness} allowed"
            ), False
        ahead = max(1, self.spec.max_staleness)  # the next round's deltas are the normal spread
        if -s > ahead:  # each round waiting here holds a model-sized sum
            return (
                f"ahead: base version {c.base_version} is {-s} rounds ahead of version "
                f"{self.version}; at most {ahead} allowed"
            ), False
        held = any(h.sender == c.sender and h.base_version == c.base_version for h in self._held)
        if held or (c.sender, c.base_version) in self._seen:
            return (
                f"duplicate: a delta from {c.sender} on base version {c.base_version} was merged"
            ), False
        missing = sorted(set(self.anchor) - set(c.tensors))
        extra = sorted(set(c.tensors) - set(self.anchor))
        if missing or extra:
            return f"tensors do not fit: missing {missing[:5]}, unexpected {extra[:5]}", True
        for name, t in c.tensors.items():
            want = self.anchor[name].shape
            if t.shape != want:
                return f"tensor {name} has shape {tuple(t.shape)}, expected {tuple(want)}", True
            if not t.is_floating_point():
                return f"tensor {name} has dtype {t.dtype}, expected a float", True
            if not bool(torch.isfinite(t).all()):
                return f"tensor {name} holds NaN or Inf", True
        return None, False

    def _not_again(self, c: Contribution, reason: str) -> bool:
        """``c``, refused for ``reason`` (not a strike), is its sender's delta of a round that
        a hold might wait for, and it will not come again: too far ahead (yet not beyond the
        claims that count), or stale for this peer's last round (``max_staleness`` 0)."""
        if reason.startswith("ahead"):
            return c.base_version <= self.version + MAX_CLAIM_AHEAD
        return reason.startswith("stale") and c.base_version == self.version - 1

    def _note_claim(self, c: Contribution) -> None:
        """Remember the newest round each sender claims, and that it is sending now (for
        ``rounds_behind`` and ``rounds_ahead``)."""
        newest = max(c.base_version, self._claims.get(c.sender, (-1, 0))[0])
        self._claims[c.sender] = (newest, self.version)
        if self._cut_off and c.sender != self.peer_id:
            # The first word from the others after a while alone: from a swarm that went on
            # without this peer (its round past this one's), or from peers that took this
            # peer's state or were gone themselves (the episode ends).
            self._parted = self._parted or c.base_version > self.version
            self._cut_off = self._parted

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
            self._fold_offset()
        start = self.start_point()
        encoded: list[tuple[str, Encoded]] = []
        sent: dict[str, Tensor] = {}
        framed: dict[str, Tensor] = {}  # what receivers decode: the robust rule's reference
        raw_bytes = 0
        # Consolidation rounds (after ``average_from_now``'s last training round) drain what is
        # left largest first: ranked by v they drained 5x slower (bench's consolidation test).
        weights = {} if self.rank_weights is None or self._draining else self.rank_weights()
        self._draining = self.averaging
        for name, p in self.params.items():
            delta = p.detach().to("cpu", torch.float32) - start[name]
            if name in self._offset:
                delta.sub_(self._offset[name].reshape(delta.shape))
            enc, reconstructed = self.feedback.compress(name, delta, weights.get(name))
            framed[name] = reconstructed.to("cpu", torch.float32).reshape(delta.shape).clone()
            if whole:  # the residual is committed too: nothing waits
                sent[name] = framed[name] + self.feedback.split(name, 1.0).reshape(delta.shape)
            else:  # what is committed is what is sent (one tensor for both)
                sent[name] = framed[name]
                self._kept[name] = self.feedback.split(name, 1.0)  # the replica trains on
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
        self._seen.add((self.peer_id, self.version))
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
        held, self._held = self._held, []
        self._take([*held, *inbox], report)
        if self._whole and self._pending_count[self.version] == 1:
            # Alone in the round (``prepare(whole=True)``): the anchor takes the whole delta as
            # it is, no outer step (its momentum would carry the model past where it trained).
            whole = self._pending.pop(self.version)
            for name, x in whole.items():
                self.anchor[name].add_(x)
            del self._pending_count[self.version]
            self._committed[self.version] = (_compact(whole), 1)
        # Commit every earlier round, and this one once all its deltas are in.
        due = sorted(
            b
            for b in self._pending
            if b < self.version
            or (commit_complete and b == self.version and self._pending_count[b] >= n_peers)
        )
        self._close(due, keep=self._kept)
        self.round += 1
        self._kept = {}
        self.last_merge = report
        return report

    def _close(self, due: Sequence[int], *, keep: Mapping[str, Tensor]) -> None:
        """Commit the ``due`` rounds in one outer step and move on to the next version; the
        replica restarts from the new start point plus ``keep``.

        Each round commits the change of its mean (``_coefficients``), whatever the peers
        counted: one that counts a peer more or less than another for a round (it saw a
        member leave or join a round earlier, it started before the others' adverts reached
        it) still commits the same sum once it has merged the same deltas. Divided by the
        peers counted, the rounds around every membership change differed from peer to peer
        for good: 4 real daemons at 256 kbit/s (2026-12-05) counted 2, 3, 2 and 3 peers in
        round 0; one merged the round's three other deltas after committing it, each at 1/2,
        and the anchors ended 2.0 % apart, the final models 1.810-1.857."""
        if due:
            self.outer.step(self.anchor, self._outer_grad(due))
            for b in due:  # kept until they can take no late delta (pruned below)
                got, count = self._pending.pop(b), self._pending_count.pop(b)
                done = self._committed.get(b)
                if done is not None:  # S + P, in place where S is dense
                    for name, x in got.items():
                        x.add_(_expand(done[0][name], x))
                    count += done[1]
                self._committed[b] = (_compact(got), count)
        self.version += 1
        self._restart_replica(keep=keep)
        if self._offset and self.version - self._offset_heard > self.spec.max_staleness:
            self._fold_offset()  # the donor left: nobody else will send its progress
        floor = self.version - self.spec.max_staleness
        self._seen = {key for key in self._seen if key[1] >= floor}
        if self.together and self._merged_only_own():
            self._cut_off = True
        self._committed = {b: c for b, c in self._committed.items() if b >= floor}
        fresh = self.version - CLAIM_FRESH_ROUNDS
        self._claims = {p: (b, at) for p, (b, at) in self._claims.items() if at >= fresh}
        self._gone = {b: s for b, s in self._gone.items() if b >= min(floor, self.version - 1)}

    @torch.no_grad()
    def follow(self, inbox: Sequence[Contribution]) -> bool:
        """After this peer's last round: close round ``version`` without a delta of its own.

        A peer that reaches the job's last step before the others has sent its last delta
        (its frame says so, and the others average their later rounds without it); the others
        still train a few rounds. Following them, it merges their deltas of those rounds as
        they do (each round the mean of its deltas), so that its model of the swarm ends where
        theirs does instead of a few rounds behind. What this peer trained and has not sent
        stays in the replica. The deltas are judged
        against the newest own delta's norms (no direction check: there is no own delta of
        the round to compare with); ``last_merge`` says what was applied. False, and nothing
        done, when there is nothing to judge them by."""
        if self._sent is not None:
            raise RuntimeError("follow() between prepare() and merge()")
        if self.screen is not None and not self.screen.record_stand_in(self.version):
            return False
        start = self.start_point()
        own = {n: p.detach().to("cpu", torch.float32) - start[n] for n, p in self.params.items()}
        for n, o in self._offset.items():  # the replica restarts with it anyway
            own[n].sub_(o.reshape(own[n].shape))
        report = MergeReport(version=self.version)
        held, self._held = self._held, []
        self._following = True
        try:
            self._take([*held, *inbox], report)
        finally:
            self._following = False
        self._close(sorted(b for b in self._pending if b < self.version), keep=own)
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
        before = dict(self._pending_count)
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
        before = dict(self._pending_count)
        removed: dict[int, list[tuple[float, Mapping[str, Tensor]]]] = {}
        for t in taken:
            b = t.contribution.base_version
            if b >= self.version or b not in self._pending:
                raise ValueError(f"round {b} is not a closed, uncommitted round here")
            acc = self._pending[b]
            for name, x in t.tensors.items():
                acc[name].sub_(x.to("cpu", torch.float32).reshape(acc[name].shape), alpha=t.weight)
            self._pending_count[b] -= 1
            self._seen.discard((t.contribution.sender, b))
            if self.screen is not None and t.stats is not None:
                self.screen.forget(b, t.stats)
            removed.setdefault(b, []).append((-t.weight, t.tensors))
            self._undrain(t.drained)
        self._shift_replica(before, removed)
        for b in [b for b, k in self._pending_count.items() if k <= 0]:
            del self._pending[b], self._pending_count[b]

    def _shift_replica(
        self,
        before: Mapping[int, int],
        added: Mapping[int, Sequence[tuple[float, Mapping[str, Tensor]]]],
    ) -> None:
        """Move the replica by as much as the start point moved when ``added`` (weight, tensors)
        joined (negative weight: left) the pending rounds, whose counts were ``before``.

        Closed rounds whose estimate changed, with their coefficients before and after
        (``_coefficients``). The outer gradient holds -(a * P + c * S), P the pending sum and S
        the committed one; with P = P_old + A (A: the deltas added) it changes by
        (a_old - a_new) * P - a_old * A + (c_old - c_new) * S."""
        changed = {
            b: (self._coefficients(b, before.get(b, 0)), self._coefficients(b, k))
            for b, k in self._pending_count.items()
            if b < self.version and k != before.get(b, 0)
        }
        if not changed:
            return
        for name, p in self.params.items():
            dg = torch.zeros_like(self.anchor[name])  # change of the estimated outer gradient
            for b, ((a_old, c_old), (a_new, c_new)) in changed.items():
                dg.add_(self._pending[b][name], alpha=a_old - a_new)
                for w, tensors in added.get(b, ()):
                    dg.add_(tensors[name].reshape(dg.shape), alpha=-a_old * w)
                if c_old != c_new:
                    dg.add_(_expand(self._committed[b][0][name], dg), alpha=c_old - c_new)
            p.add_(self.outer.peek_shift(dg).to(p.device, p.dtype).reshape(p.shape))

    def _take(self, inbox: Sequence[Contribution], report: MergeReport) -> dict[int, list[Taken]]:
        """Add every acceptable delta of ``inbox`` to its pending round, bounded by the robust
        rule; hold those of rounds this peer has not closed; record the rest.

        Returns the deltas taken, as merged, by round."""
        taken: dict[int, list[Taken]] = {}
        # The direction references (rule 4 of ``atomd.sync.robust``): the own progress made
        # once for the inbox (before any of it moves the start point), the swarm's last round
        # (``_swarm_direction``) once per round; none where deltas point against them by design
        # (consolidation) or no own progress is trained any more (following the last rounds).
        own: Progress | None = None
        towards: dict[int, Progress] = {}
        judge_direction = not (self.averaging or self._following)
        for c in inbox:
            reason, strike = self._refusal(c)
            if not strike:  # stale ones too: a peer far behind is behind, not gone
                self._note_claim(c)
            if reason is not None and not strike and self._not_again(c, reason):
                self._gone.setdefault(c.base_version, set()).add(c.sender)
            tensors, note, stats, cos = dict(c.tensors), None, None, None
            if reason is None and self.screen is not None:
                if not self.screen.knows(c.base_version) and c.base_version >= self.version:
                    self._held.append(c)  # judged when this peer closes that round
                    continue
                toward = None
                if judge_direction:
                    toward = towards.get(c.base_version)
                    if toward is None:
                        swarm = self._swarm_direction(c.base_version)
                        if swarm is not None:
                            toward = towards[c.base_version] = Progress.of(swarm)
                        else:
                            toward = own = own or Progress.of(self.own_progress())
                judged = self.screen.judge(c.base_version, c.tensors, toward=toward, every=c.every)
                cos = judged.cosine
                if judged.tensors is None:
                    reason, strike = judged.reason or "refused", judged.strike
                    # Its delta of the round came and will not come again: a hold does not
                    # wait for it (a sign flipper refused every round held each honest peer's
                    # rounds until it stopped counting, SILENT_ROUNDS later, bench attack).
                    self._gone.setdefault(c.base_version, set()).add(c.sender)
                else:  # a hard clip is a strike too: merged, bounded, and counted against it
                    tensors, note, strike = judged.tensors, judged.reason, judged.strike
                    stats = judged.stats
            if reason is not None:
                report.refused.append(RefusedDelta(c.sender, c.round, reason, strike, cos))
                log.info("delta from %s (round %d) refused: %s", c.sender, c.round, reason)
                continue
            s = self.staleness(c)
            w = staleness_weight(s)
            self._add_pending(c.base_version, tensors, w)
            drained = None
            if self._offset and c.sender in self._offset_from:
                drained = self._drain_offset(tensors)
            self._seen.add((c.sender, c.base_version))
            self.together = self.together or c.sender != self.peer_id
            report.applied.append(AppliedDelta(c.sender, c.round, s, w, note, strike, cos))
            t = Taken(c, tensors, w, stats, drained)
            report.taken.append(t)
            taken.setdefault(c.base_version, []).append(t)
        return taken

    def _swarm_direction(self, base_version: int) -> dict[str, Tensor] | None:
        """The robust rule's direction reference for deltas of round ``base_version`` where
        the codec sends every entry: the newest round before it this peer has merged deltas of
        (its own included), each delta as a unit vector, summed. Nearly the same at every peer
        (the same in a synchronous swarm), so honest receivers take the same decision, and no
        member weighs more in it than one honest delta does. None (the own progress judges)
        where the codec sends a share (top-k's frames share few entries with the last round's;
        the unsent residual, in the own progress, is where its next frames come from), and
        before any round of this peer's.

        Why: a one-step dense delta is mostly its sender's noise. Against the receiver's own
        one-step progress honest cosines went down to -0.17 (fp32 a round a step, a helper's
        300-step runs), the pair that disagreed refused each other while the others merged
        both, and the anchors parted (``atomd bench sync``'s fp32-h1-sync-plain: 0.109); against
        the swarm's last round they were >= 0.21. Plain sums (0fed8da, reverted) let a member
        whose aligned delta counted 4x steer the reference until honest deltas pointed against
        it; as unit vectors its share is one honest delta's (docs/robust-merge.md)."""
        if self.fraction is not None:
            return None
        rounds = [b for b in self._directions if b < base_version]
        if not rounds:
            return None
        return self._directions[max(rounds)]

    @torch.no_grad()
    def own_progress(self) -> dict[str, Tensor]:
        """What this peer trained that the swarm does not hold yet: its replica minus its start
        point, plus the error feedback's residual (float32, CPU). Deltas merged here move the
        replica and the start point alike, so only this peer's own steps and the part of its
        own deltas not sent are in it (``robust.Screen.judge``'s direction reference)."""
        return self._beyond(self.start_point())

    def unsent_from(self, reference: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """This peer's model beyond ``reference`` (the anchor, or ``settled()``): the replica
        minus it, plus the error feedback's residual (float32, CPU). Where the peers' references
        agree, the reference plus the mean of these over the peers is the average of their
        models (``atomd.sync.average``)."""
        return self._beyond(reference)

    @torch.no_grad()
    def settled(self) -> dict[str, Tensor]:
        """Where the anchor ends once every closed round's pending deltas are committed and the
        outer momentum has run out with no more: the same at peers that have merged the same
        deltas, whenever each committed them (``NesterovOuter.settle``). The anchors themselves
        differ by when each peer committed a late delta, and by the late deltas still pending
        at the job's end (4 real daemons at 256 kbit/s: one peer ended with a delta of the last
        round pending and its anchor 1.1 % from the others', and its final average 0.0066 worse
        than theirs)."""
        closed = self._closed_pending()
        return self.outer.settle(self.anchor, self._outer_grad(closed) if closed else {})

    @torch.no_grad()
    def _beyond(self, reference: Mapping[str, Tensor]) -> dict[str, Tensor]:
        residual = self.feedback.state_tensors()
        out = {}
        for name, p in self.params.items():
            ref = reference[name]
            x = p.detach().to("cpu", torch.float32).reshape(ref.shape) - ref
            r = residual.get(name)
            out[name] = x if r is None else x + r.reshape(x.shape)
        return out

    def _add_pending(self, base_version: int, tensors: Mapping[str, Tensor], w: float) -> None:
        if self.fraction is None:  # the direction reference (``_swarm_direction``)
            norm = DeltaStats.of(tensors).norm
            if norm > 0:
                units = self._directions.setdefault(
                    base_version, {n: torch.zeros_like(a) for n, a in self.anchor.items()}
                )
                for name, t in tensors.items():
                    # Divided in float64: 1 / norm of a delta of norm under ~3e-39 (finite,
                    # well-formed, accepted as small) does not fit a float32 alpha, and the
                    # trainer thread raised, failing the job on every peer that merged it (a
                    # review of 2026-12-06).
                    x = t.to("cpu", torch.float64).reshape(units[name].shape) / norm
                    units[name].add_(x.to(torch.float32))
                for b in sorted(self._directions)[:-DIRECTION_ROUNDS]:
                    del self._directions[b]
        acc = self._pending.get(base_version)
        if acc is None:
            acc = self._pending[base_version] = {
                n: torch.zeros_like(a) for n, a in self.anchor.items()
            }
            self._pending_count[base_version] = 0
        for name, t in tensors.items():
            acc[name].add_(t.to("cpu", torch.float32).reshape(acc[name].shape), alpha=w)
        self._pending_count[base_version] += 1

    def _coefficients(self, base_version: int, count: int) -> tuple[float, float]:
        """(a, c): committing round ``base_version``'s ``count`` pending deltas (sum P) adds
        a * P + c * S to the anchor's outer gradient (negated), S the round's committed sum of
        k deltas: the round's mean (S + P) / (k + count) minus the mean committed, S / k. A
        round not committed yet (k = 0) gives the mean of its deltas; none pending, nothing."""
        if count <= 0:
            return 0.0, 0.0
        k = self._committed[base_version][1] if base_version in self._committed else 0
        return 1.0 / (k + count), (-count / (k * (k + count)) if k else 0.0)

    def _closed_pending(self) -> list[int]:
        """The rounds this peer has closed that hold deltas not committed yet."""
        return [b for b, k in self._pending_count.items() if b < self.version and k > 0]

    def _outer_grad(self, rounds: Iterable[int]) -> dict[str, Tensor]:
        """The outer gradient that committing ``rounds``' pending deltas makes (see
        ``_coefficients``): minus the change of each round's mean."""
        coefficients = {b: self._coefficients(b, self._pending_count[b]) for b in rounds}
        grads = {}
        for name, x in self.anchor.items():
            g = torch.zeros_like(x)
            for b, (a, c) in coefficients.items():
                g.add_(self._pending[b][name], alpha=a)
                if c:
                    g.add_(_expand(self._committed[b][0][name], g), alpha=c)
            grads[name] = g.neg_()
        return grads

    def average_from_now(self) -> None:
        """Make every later commit the plain average (outer lr 1, no momentum), as consolidation
        needs: the mean of the peers' models then stays where it is while they send their
        differences. What a replica already holds of the outer step's look-ahead is measured
        against the plain start point from now on, so it travels as progress: nothing is lost.
        Every peer must switch at the same round (all do, before their last boundary), so the
        switch is part of the state (a checkpoint or a state transfer carries it)."""
        self.outer = NesterovOuter(lr=1.0, momentum=0.0)
        self.averaging = True
        self._fold_offset()  # the peers' models are averaged: this one's as it is

    def alone_in_fact(self) -> bool:
        """No other peer's delta merged within the last ``max_staleness`` rounds, none held."""
        return not self._held and self._merged_only_own()

    def _merged_only_own(self) -> bool:
        """No other peer's delta merged within the last ``max_staleness`` rounds."""
        return all(sender == self.peer_id for sender, _ in self._seen)

    def parted_alone(self) -> bool:
        """This peer merged other peers' deltas once, then none for ``max_staleness`` rounds
        (it was cut off, or the others were), and the first delta that came after was of a
        round past its own: a swarm went on without it. The rounds it closed alone are in its
        anchor only, and the swarm's are not in it, so the anchors have parted however near
        the rounds (4 real daemons, a peer's link cut for 20 s: 5 rounds behind, within what a
        delta may lead, caught up, and the settled anchors ended 0.22 apart, gain 0.816:
        ``atomd bench swarm`` partition, run fc). A fresh joiner (it has merged nothing), the
        first peer of a job and a peer whose others were gone (their first deltas after are of
        its round or before: they took its state, or were stopped) are not parted."""
        return self._parted

    def rounds_behind(self, *, capped: bool = True) -> int:
        """Rounds the swarm has closed that this one has not, from the newest round each
        sender has claimed (stale ones left out: they count in ``rounds_ahead``): 0 when the
        median claim is older than this peer's current round, 1 when it is the current round,
        2 when the next (a round behind), ... The median (the lower one), so that one member's
        claim cannot set the pace; claims more than ``MAX_CLAIM_AHEAD`` rounds ahead count for
        nothing (``capped``; uncapped, for whether to take the swarm's state again: a peer
        stopped long enough is that far behind, and a liar can claim within the cap too)."""
        floor = self.version - self.spec.max_staleness
        top = self.version + MAX_CLAIM_AHEAD if capped else math.inf
        claims = [b for b, _ in self._claims.values() if floor <= b <= top]  # not the stale
        if not claims:
            return 0
        return max(0, int(lower_median([float(b) for b in claims])) - self.version + 1)

    def rounds_ahead(self, among: Collection[str]) -> int:
        """Rounds this peer has closed past the swarm: from the newest round each of ``among``
        (the peers training the job now) claims, if it sent a delta within the last
        ``CLAIM_FRESH_ROUNDS`` rounds, stale ones included (one that did not counts as this
        peer's own last round), and this peer's own last round; the lower median of them all:
        0 when that is this peer's last round, 1 when the round before (a delta in flight), 2
        when they are a round behind, ... With its own round in the median one member's claim
        moves it only in a swarm of two.

        A peer far ahead of the others counts them as silent (none of their deltas merged:
        all stale here) and so holds no round for theirs (``SyncPlugin._previous_open``); they,
        the majority, do not chase it either (``rounds_behind`` takes the median). Without this
        the two stayed apart for good: 3 real daemons at a fixed H=5, two stalled while the
        third ran 40 steps on, were 14-16 rounds apart 150 steps later, every delta refused
        (``tests/integration/test_sync.py``). Peers that left or have sent their last delta
        are not in ``among``: their claims stay where they stopped."""
        top = self.version + MAX_CLAIM_AHEAD
        claims = {p: b for p, (b, _) in self._claims.items() if p in among and b <= top}
        mine = self.version - 1
        # A peer of ``among`` without a claim to go by (it has sent nothing lately: fetching
        # the state, or stalled) counts as in step: so one member's stale claims set the median
        # only in a swarm of two, as the README says (a review of 2026-12-06 found a third
        # peer that had not sent left the stale member alone in the median).
        unknown = sum(1 for p in set(among) if p not in claims)
        values = [*claims.values(), *[mine] * (unknown + 1)]
        return max(0, mine - int(lower_median([float(b) for b in values])))

    def senders_in(self, base_version: int) -> set[str]:
        """The peers (this one included) whose delta of round ``base_version`` is in here:
        merged (committed or pending, a whole own round included), held until this peer closes
        that round, or come and refused as too far ahead, or as stale for this peer's last
        round, which will not come again. ``SyncPlugin`` holds a round for the peers it counts
        that are not among them. By identity, not by count: a sender that no longer counts
        (quarantined, gone, silent) or one delta sent twice fills no other peer's place.
        Without the refused ones, peers behind a peer far ahead held their rounds for its
        deltas while it held its own for theirs, and the gap never closed (the CI run of
        d185216: 5-7 rounds apart for 150 steps)."""
        held = {h.sender for h in self._held if h.base_version == base_version}
        merged = {sender for sender, b in self._seen if b == base_version}
        return merged | held | self._gone.get(base_version, set())

    def drop_excluded(self, excluded: Callable[[str], bool]) -> int:
        """Forget what senders now ``excluded`` (quarantined or banned) left here: their held
        deltas, which would be merged when this peer closes their round, and the rounds they
        claimed, which would otherwise pace this peer's (``rounds_behind``: a member
        quarantined while it claimed rounds ahead made a peer whose only other member it was
        close rounds early). How many held deltas that was."""
        before = len(self._held)
        self._held = [h for h in self._held if not excluded(h.sender)]
        self._claims = {p: c for p, c in self._claims.items() if not excluded(p)}
        return before - len(self._held)

    def deltas_in(self, base_version: int) -> int:
        """Deltas (own included) this peer holds of round ``base_version`` not yet committed
        (those waiting to be judged included)."""
        held = sum(1 for c in self._held if c.base_version == base_version)
        return self._pending_count.get(base_version, 0) + held

    def held(self) -> int:
        """Received deltas waiting for this peer to close their round before they are judged."""
        return len(self._held)

    def start_point(self) -> dict[str, Tensor]:
        """Where the replica restarts: where the anchor will be once the pending rounds commit.

        A round commits the mean of its deltas, so those still missing count as that mean: a
        peer that has heard from nobody yet keeps its own progress whole instead of shrinking
        it to 1/n, and the outer step (momentum included) is the one the commit will take. Unless
        more deltas come, this is exactly the anchor after the commit. Deltas of a round this
        peer has not closed yet are left out until it has.
        """
        closed = self._closed_pending()
        if not closed:
            return self.anchor
        return self.outer.peek(self.anchor, self._outer_grad(closed))

    @torch.no_grad()
    def _restart_replica(self, *, keep: Mapping[str, Tensor], offset: bool = True) -> None:
        start = self.start_point()
        for name, p in self.params.items():
            x = start[name]
            for add in (keep.get(name), self._offset.get(name) if offset else None):
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
        which the donor sends itself over its next rounds. This peer keeps that progress in
        its replica, apart (the inherited offset): its deltas are measured from the start point
        plus the offset, so no anchor counts the donor's progress twice, and the offset gives
        way by what the donor's deltas carry (``_drain_offset``), as the donor's own replica
        does when it sends them. Where the donor sends nothing for ``max_staleness`` + 1
        rounds (it left), this peer sends the offset as its own (``_fold_offset``). The donor's
        error feedback is dropped. ``donor``: its peer id as the state transfer verified it
        (else the id its state names); a donor that held an offset itself passes on its sources,
        whose deltas drain the offset too.

        Why not from the start point alone (until 2026-12-07): where rounds are rare the codec
        has sent little of a peer's progress, and the anchor is far behind the models (top-k
        1 %, a round every 50 steps: the anchor's validation loss 3.67 against the models'
        1.92, ``atomd bench sync``); a restarted peer then refused every donor's state as far
        worse than the members measured, and its job failed. Why not the donor's replica sent
        whole (before 2026-12-02): the donor's unsent progress then reached every anchor twice
        (``python -m atomd_bench join``)."""
        self.feedback.load_state_tensors({})
        me = donor or self._served_by
        theirs = sorted(self._offset_from - {me, self.peer_id})[: MAX_SOURCES - 1]
        self._offset_from = set(theirs) | ({me} if me and me != self.peer_id else set())
        self._offset_heard = self.version
        if self.averaging:  # consolidation averages the models as they are
            self._fold_offset()
            return
        start = self.start_point()
        self._offset = {
            n: p.detach().to("cpu", torch.float32).reshape(start[n].shape) - start[n]
            for n, p in self.params.items()
        }

    @torch.no_grad()
    def _drain_offset(self, tensors: Mapping[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
        """A delta of the donor's (``tensors``) is merged: the inherited offset gives way by as
        much as it sent, entry by entry, towards zero and never past it (the replica with it),
        as the donor's replica gives way by what it sends; whatever the codec (top-k's entries,
        a dense or low-rank delta). Returns what it cleared, for ``retract``."""
        self._offset_heard = self.version
        drained = {}
        for name, x in tensors.items():
            o = self._offset.get(name)
            if o is None:
                continue
            xs = x.to("cpu", torch.float32).reshape(-1)
            at = xs.nonzero().squeeze(1)
            ov, xv = o.view(-1)[at], xs[at]
            give = torch.where(ov * xv > 0, ov.sign() * torch.minimum(ov.abs(), xv.abs()), 0.0)
            self._move_offset(name, at, -give)
            drained[name] = (at, give)
        return drained

    def _undrain(self, drained: Mapping[str, tuple[Tensor, Tensor]] | None) -> None:
        """Give back what ``_drain_offset`` cleared (a retracted delta of the donor's)."""
        for name, (at, give) in (drained or {}).items():
            if name in self._offset:  # else folded since: the replica holds it and sends it
                self._move_offset(name, at, give)

    @torch.no_grad()
    def _move_offset(self, name: str, at: Tensor, by: Tensor) -> None:
        """Add ``by`` to the inherited offset of ``name`` at flat positions ``at``, and to the
        replica, which holds the offset."""
        self._offset[name].view(-1).index_add_(0, at, by)
        p = self.params[name]
        p.view(-1).index_add_(0, at.to(p.device), by.to(p.device, p.dtype))

    def _fold_offset(self) -> None:
        """Send the inherited offset as this peer's own progress from the next delta on: the
        replica holds it already, so it is only no longer subtracted."""
        self._offset, self._offset_from = {}, set()

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
        out = {_ANCHOR + n: t.clone() for n, t in self.anchor.items()}
        out.update({_MOMENTUM + n: t for n, t in self.outer.state_tensors().items()})
        out.update(
            {_EF + n: t.detach().cpu().clone() for n, t in self.feedback.state_tensors().items()}
        )
        for b, acc in self._pending.items():
            out.update({f"{_PENDING}{b}.{n}": t.clone() for n, t in acc.items()})
            out[f"{_PENDING_COUNT}{b}"] = torch.tensor(self._pending_count[b], dtype=torch.int64)
        out[_VERSION] = torch.tensor(self.version, dtype=torch.int64)
        out[_ROUND] = torch.tensor(self.round, dtype=torch.int64)
        out[_SERVED_BY] = _text_tensor(self.peer_id)
        if self._offset:
            out.update({_OFFSET + n: t.clone() for n, t in self._offset.items()})
            out[_OFFSET_FROM] = _text_tensor("\n".join(sorted(self._offset_from)))
            out[_OFFSET_HEARD] = torch.tensor(self._offset_heard, dtype=torch.int64)
        if self.averaging:
            out[_AVERAGING] = torch.tensor(1, dtype=torch.int64)
        seen = "".join(f"{sender}\t{b}\n" for sender, b in sorted(self._seen))
        out[_SEEN] = _text_tensor(seen)
        for b, (sums, count) in self._committed.items():
            out[f"{_COMMITTED_COUNT}{b}"] = torch.tensor(count, dtype=torch.int64)
            for n, t in sums.items():
                if t.is_sparse:
                    out[f"{_COMMITTED_AT}{b}.{n}"] = t.indices()[0].clone()
                    out[f"{_COMMITTED_VAL}{b}.{n}"] = t.values().clone()
                else:
                    out[f"{_COMMITTED}{b}.{n}"] = t.clone()
        ref = self.screen.newest_own() if self.screen is not None else None
        if ref is not None:
            names = list(self.anchor)
            out[_REF_NORMS] = torch.tensor(
                [ref.norm, *(ref.tensor_norms.get(n, 0.0) for n in names)], dtype=torch.float64
            )
            out[_REF_MAXABS] = torch.tensor(
                [ref.tensor_maxabs.get(n, 0.0) for n in names], dtype=torch.float64
            )
        return out

    def load_state_tensors(self, d: Mapping[str, Tensor]) -> None:
        """Restore what ``state_tensors`` produced (checkpoint or state transfer).

        The replica is not touched: after a state transfer, with the donor's model loaded,
        call ``adopt``.
        """
        self._directions = {}  # rounds of before the state: no reference for its rounds
        anchor = {k[len(_ANCHOR) :]: t for k, t in d.items() if k.startswith(_ANCHOR)}
        if set(anchor) != set(self.anchor):
            missing = sorted(set(self.anchor) - set(anchor))
            extra = sorted(set(anchor) - set(self.anchor))
            raise ValueError(
                f"sync state does not fit: missing {missing[:5]}, unexpected {extra[:5]}"
            )
        for name, t in anchor.items():
            if t.shape != self.anchor[name].shape:
                raise ValueError(
                    f"sync state anchor {name} has shape {tuple(t.shape)}, "
                    f"expected {tuple(self.anchor[name].shape)}"
                )
        with torch.no_grad():
            for name, t in anchor.items():
                self.anchor[name].copy_(t)
        self.outer.load_state_tensors(
            {k[len(_MOMENTUM) :]: t for k, t in d.items() if k.startswith(_MOMENTUM)}
        )
        self.feedback.load_state_tensors(
            {k[len(_EF) :]: t for k, t in d.items() if k.startswith(_EF)}
        )
        self._pending, self._pending_count = {}, {}
        for k, t in d.items():
            if k.startswith(_PENDING_COUNT):
                self._pending_count[int(k[len(_PENDING_COUNT) :])] = int(t)
            elif k.startswith(_PENDING):
                b, _, name = k[len(_PENDING) :].partition(".")
                acc = self._pending.setdefault(int(b), {})
                acc[name] = t.detach().to("cpu", torch.float32).clone()
        self.version = int(d[_VERSION]) if _VERSION in d else 0
        self.round = int(d[_ROUND]) if _ROUND in d else 0
        if _AVERAGING in d and int(d[_AVERAGING]):  # restarted in the middle of consolidation
            self.average_from_now()
        self._seen = _read_seen(d.get(_SEEN), floor=self.version - self.spec.max_staleness)
        self.together = not self._merged_only_own()
        self._committed = _read_committed(
            d, rounds=range(self.version - self.spec.max_staleness, self.version), like=self.anchor
        )
        self._inherited = _read_ref(d.get(_REF_NORMS), d.get(_REF_MAXABS), list(self.anchor))
        self._inherited_until = self.version + max(INHERIT_ROUNDS, self.spec.max_staleness + 1)
        if self._inherited is not None and self.screen is not None:
            # The rounds closed before the state was taken: judged by the donor's statistics.
            first = max(0, self.version - self.spec.max_staleness)
            self.screen.inherit(self._inherited, range(first, self.version))
        self._held = []
        self._claims = {}
        self._gone = {}
        self._served_by = _read_text(d.get(_SERVED_BY))
        self._offset = {}
        for k, t in d.items():
            name = k[len(_OFFSET) :]
            if k.startswith(_OFFSET) and name in self.anchor:
                if t.numel() != self.anchor[name].numel():
                    raise ValueError(f"sync state offset {name} has {t.numel()} entries")
                self._offset[name] = t.detach().to("cpu", torch.float32).reshape(
                    self.anchor[name].shape).clone()  # fmt: skip
        sources = _read_text(d.get(_OFFSET_FROM), limit=MAX_PEER_ID * MAX_SOURCES)
        self._offset_from = set()
        if self._offset and sources is not None:
            self._offset_from = {s for s in sources.split("\n")[:MAX_SOURCES] if s}
        heard = d.get(_OFFSET_HEARD)
        self._offset_heard = int(heard) if heard is not None else self.version


def _text_tensor(text: str) -> Tensor:
    return torch.tensor(list(text.encode()), dtype=torch.uint8)


def _read_text(t: Tensor | None, limit: int = MAX_PEER_ID) -> str | None:
    """Text stored by ``_text_tensor`` (None: none, or not text of 1 to ``limit`` bytes)."""
    if t is None or t.dtype != torch.uint8 or t.dim() != 1 or not 0 < t.numel() <= limit:
        return None
    try:
        return bytes(t.tolist()).decode()
    except UnicodeDecodeError:
        return None


def _read_seen(t: Tensor | None, *, floor: int) -> set[tuple[str, int]]:
    """The merged deltas ``state_tensors`` wrote (from a checkpoint or another peer's state):
    lines that do not read as "sender<TAB>base version" are skipped, rounds before ``floor``
    (stale anyway) dropped, at most ``MAX_SEEN`` entries kept."""
    if t is None or t.dtype != torch.uint8 or t.dim() != 1:
        return set()
    seen: set[tuple[str, int]] = set()
    for line in bytes(t.tolist()).decode("utf-8", "replace").splitlines():
        sender, _, b = line.partition("\t")
        if sender and b.isdigit() and len(b) < 19 and int(b) >= floor:
            seen.add((sender, int(b)))
            if len(seen) >= MAX_SEEN:
                break
    return seen


def _read_committed(
    d: Mapping[str, Tensor], *, rounds: range, like: Mapping[str, Tensor]
) -> dict[int, tuple[dict[str, Tensor], int]]:
    """The committed sums ``state_tensors`` wrote, of ``rounds`` (older ones take no more late
    deltas). A round is read whole or not at all: its count (1 to ``MAX_SEEN``) and, for every
    tensor of ``like``, either a dense float tensor of its size or flat int64 indices, in
    range and increasing, with as many finite values. A round left out counts as never
    committed here: a late delta of it commits the mean of what comes (the state of a donor
    from before 2026-12-05, or one that wrote something else)."""
    out: dict[int, tuple[dict[str, Tensor], int]] = {}
    for b in rounds:
        count = d.get(f"{_COMMITTED_COUNT}{b}")
        if count is None or count.dtype != torch.int64 or count.numel() != 1:
            continue
        if not 1 <= int(count) <= MAX_SEEN:
            continue
        sums: dict[str, Tensor] = {}
        for name, ref in like.items():
            t = _read_sum(d, f"{b}.{name}", ref.numel())
            if t is None:
                break
            sums[name] = t
        else:
            out[b] = (sums, int(count))
    return out


def _read_sum(d: Mapping[str, Tensor], key: str, numel: int) -> Tensor | None:
    """One tensor of a committed sum (see ``_read_committed``), flat, or None."""
    dense = d.get(_COMMITTED + key)
    if dense is not None:
        if not dense.is_floating_point() or dense.numel() != numel or dense.is_sparse:
            return None
        t = dense.detach().to("cpu", torch.float32).reshape(-1).clone()
        return t if bool(torch.isfinite(t).all()) else None
    at, val = d.get(_COMMITTED_AT + key), d.get(_COMMITTED_VAL + key)
    if at is None or val is None or at.dtype != torch.int64 or not val.is_floating_point():
        return None
    if at.dim() != 1 or val.dim() != 1 or at.numel() != val.numel() or at.numel() > numel:
        return None
    if at.numel() and (int(at[0]) < 0 or int(at[-1]) >= numel or bool((at[1:] <= at[:-1]).any())):
        return None
    values = val.detach().to("cpu", torch.float32)
    if not bool(torch.isfinite(values).all()):
        return None
    return torch.sparse_coo_tensor(
        at.reshape(1, -1).clone(), values.clone(), (numel,), check_invariants=True
    ).coalesce()


def _compact(sums: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``sums`` flat, each tensor sparse (its nonzero entries) where at most a quarter of it is
    nonzero: a round of a sparse codec's deltas (4 peers at top-k 1 %: ~4 %) is kept at a
    tenth of its dense size."""
    out = {}
    for name, t in sums.items():
        flat = t.reshape(-1)
        nonzero = int(torch.count_nonzero(flat))
        out[name] = flat.to_sparse().coalesce() if 4 * nonzero <= flat.numel() else flat
    return out


def _expand(t: Tensor, like: Tensor) -> Tensor:
    """A tensor of ``_compact``'s, dense and shaped like ``like``."""
    return (t.to_dense() if t.is_sparse else t).reshape(like.shape)


def _read_ref(norms: Tensor | None, maxabs: Tensor | None, names: list[str]) -> DeltaStats | None:
    """The reference statistics ``state_tensors`` wrote, or None when absent or not what they
    must be (one norm per tensor plus the overall one, one largest |x| per tensor, all finite
    and not negative)."""
    if norms is None or maxabs is None or norms.dim() != 1 or maxabs.dim() != 1:
        return None
    if norms.numel() != len(names) + 1 or maxabs.numel() != len(names):
        return None
    n, m = norms.double(), maxabs.double()
    if not (bool(torch.isfinite(n).all()) and bool(torch.isfinite(m).all())):
        return None
    if bool((n < 0).any()) or bool((m < 0).any()) or float(n[0]) <= 0.0:
        return None
    return DeltaStats(
        float(n[0]),
        {name: float(v) for name, v in zip(names, n[1:].tolist(), strict=True)},
        {name: float(v) for name, v in zip(names, m.tolist(), strict=True)},
    )
