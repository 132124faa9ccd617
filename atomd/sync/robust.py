"""The robust merge: every received delta is judged before it touches the anchor or a replica.

A member of the swarm may be broken or hostile: it can sign a well-formed frame whose values
are all 5.0, its honest delta times 1e30, noise, or its delta with the sign flipped. The checks
of the wire format (shapes, NaN/Inf, codec layout) pass all of these. ``Screen`` bounds them.

**The rule** (one contribution at a time, as it arrives: the merge is asynchronous, so there is
no set of simultaneous deltas to take a coordinate-wise median or a trimmed mean over, and with
top-k most coordinates carry one delta or none, where a median is 0 and a trimmed mean throws
the signal away):

1. The *reference* of round r is the lower median of the L2 norms of this peer's own delta of
   round r and of the deltas already accepted for round r (after their own clipping), per
   tensor and overall. The own delta is the one nobody can forge; the others make the
   reference follow peers that legitimately send more (faster peers take more steps per
   round). A hostile member moves the lower median by at most one rank, and only with what
   survived its own clipping. Half the own delta's statistics are also its floor
   (``own_floor``): deltas smaller than that never lower it. With two in the pool the lower
   median is the smaller: a member sending near-zero deltas made the next honest delta of the
   round an outlier, and a peer just restarted, whose fresh error feedback sends little in its
   LayerNorm tensors, made the others clip each other's there for ten rounds (their anchors
   then left its own by 4 %: 4 real daemons, a peer killed and restarted; measured, see
   research/).
2. A delta whose norm exceeds ``refuse_ratio`` (16) times the reference is refused (a strike
   against its sender); above ``clip_ratio`` (4) it is scaled down to ``clip_ratio`` times
   the reference (norm clipping, as in Byzantine-robust SGD: it bounds what any one delta can
   move, whatever its direction). 4, not less: with ``sync.every: "auto"`` peers close
   rounds by time, so a peer twice or four times as fast sends a delta of two to four times
   the norm, and honest deltas must pass untouched for the anchors to agree.
   A delta whose frame says its round lasted more steps than this peer's own round of the
   number is clipped at bounds raised by that ratio (its steps counted up to ``steps_ratio``
   (2) times this peer's, each weighed by the job's learning rate: ``Screen._longer``),
   unless it is unaligned (rule 4); its refusal is judged against the bound before the rise,
   its strike against the raised one (``Screen.judge``).
3. Then each tensor's norm is clipped to ``tensor_ratio`` (6) times that tensor's reference
   (an attack concentrated in one small tensor, a LayerNorm gain, has a small overall norm),
   and each coordinate to ``coord_ratio`` (8) times the reference's largest absolute value in
   its tensor (top-k and int8 deltas are made of few large entries; one entry of 1e3 would
   otherwise pass in a large model).

4. *Direction* (``direction``): the cosine between the delta and where this peer sees the
   swarm train (``toward``, dense; ``SyncState._take``): with a codec that sends a share of
   the entries (top-k) its own progress that the swarm does not hold yet (its
   replica minus its start point, plus any error-feedback residual: what its own training
   moved and it has not had merged); with one that sends them all (fp32, bf16, int8) the
   newest round before the delta's that this peer merged deltas of, each delta (its own
   included) as a unit vector, summed (``RoundDirections``; the own progress before
   any).
   Two independent random directions in n dimensions have a cosine of about N(0, 1/n), so
   ``c`` = ``chance_z`` / sqrt(n) (5 sigma) is what chance gives. A delta whose cosine is below
   -c points against where this peer trains (a sign-flipped delta of honest size): refused.
   A delta whose cosine is within +-c shows no sign of pointing where training goes (noise):
   it is held to ``unaligned_ratio`` (1) times the reference instead of ``clip_ratio`` (4).
   Neither is a strike: a strike is judged by the norm alone, as for an aligned delta (below).
   Skipped where c > ``max_chance`` (models under 10,000 weights, where every cosine is within
   chance), where the peer has no progress of its own to compare with (just after taking a
   state), and in consolidation rounds (each peer sends its difference from the mean: opposed
   by design).

   Why the direction bounds a delta but never strikes its sender: strikes are
   for what no honest peer sends, and honest peers out of step send opposed deltas and
   unaligned ones of several times the reference. Three real daemons at H=5, two of them
   stalled (SIGSTOP) while the third runs 40 steps and 8 rounds on, alone: its anchor takes
   its own rounds whole (with top-k's momentum) while theirs take them a third each, and for a
   few rounds after the stall each side judges the other's honest deltas at cosines down to
   -0.083 (15 c): opposed refusals in 13 of 14 runs, 3 of a sender's 10 in 2. Were they
   strikes, 2 of 20 such runs would fail: the one ahead quarantines both others for an hour
   and the swarm splits for good (what
   ``tests/integration/test_sync.py::test_a_peer_far_ahead_falls_back_in_step`` covers).
   Sparing only the opposed ones is not enough either: the peer back from the stall sends
   deltas within chance of 0 (cosines -0.0024 to 0.002) at 2.4-2.8x the reference, each held
   to 1x and so struck, three in a row (measured, see research/). (A joiner can quarantine
   an honest donor that way too where the rounds' steps are not weighed: ``Screen._longer``.)
   A sign flipper's deltas come at -0.006 to -0.093 (``bench attack``), and noise of 10x sent
   in top-k arrives at ~2.9x the reference: what the direction sees does not tell them apart from
   an honest peer out of step. The refusal keeps every opposed delta out of the model and the
   1x bound holds each unaligned one to what an honest delta moves (the unprotected case of
   noise under 1x); a norm beyond what an aligned delta may have still strikes, and the loss
   guard still refuses what makes the loss jump.

   Why the own progress and not the own *frame* of the round: two
   peers' top-k frames share few entries, and at the small shares a slow link gets (0.25 %)
   honest cosines between frames fall within chance (28 of 720 judgements in
   ``atomd bench sync`` at top-k 0.25 %, H=10: as low as 0.0028 against c = 0.0054). Honest
   deltas are then clipped by some peers and not by others, and the anchors drift apart
   (9e-4). Against the dense own progress the same deltas' cosines are at least 0.037
   (6.8 c; median 0.052). It costs no memory either: nothing of the own frames is kept.

   Why the swarm's last round where every entry is sent: a whole delta of a short round is
   mostly its sender's own noise, and two peers' one-step deltas can point against each other
   (fp32 a round a step, 300-step runs of ``atomd bench sync``: cosines down to -0.17). Each
   judged against the receiver's own one-step progress, the two refuse each other, the others
   merge both, and the anchors part for good (fp32, a round a step, on the full task: 0.109,
   val 1.7511). Against the swarm's last round the same deltas' cosines are at least 0.21,
   every receiver takes the same decision (in a synchronous swarm the very same reference),
   and the anchors agree (1.2e-8, val 1.6863). Each delta counts as a unit vector there, so
   that no member weighs more than one honest delta: with plain sums a member's aligned delta
   counts up to 4x and can steer the reference until honest deltas point against it. Not where
   a share is sent: a top-k frame shares few entries with the last round's (at top-k 1 %, a
   round a step, cosines fall to 0.0014, within chance), while its own progress holds the
   residual its next frames come from.

Honest deltas of peers at the same pace differ in norm by a few percent (the study in
``bench/robust_sim.py``: within 3%, per tensor within 1.5x), so at these ratios an honest
swarm's deltas pass untouched and its anchors stay equal; only outliers are clipped or
refused. What norm clipping cannot see (a sign-flipped delta of honest size, noise under 4x)
the direction check refuses or holds to an honest size; the loss guard of ``SyncPlugin``
catches what makes the loss jump. The judgements are local (each peer's own delta is in its
reference), so two honest peers may clip an outlier by slightly different factors: their
anchors then differ by at most that outlier's difference, never by an honest delta.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

# ``Screen._longer`` weighs rounds of at most this many steps by their learning rates (a sum
# over the steps, ~1.4 ms a judged delta at this length); longer rounds by their steps (a
# warm-up is usually shorter than such a round).
MASS_STEPS = 1024


@dataclass(frozen=True)
class RobustRule:
    """Thresholds of the robust merge, as multiples of the round's reference norms."""

    clip_ratio: float = 4.0
    """A delta's norm above this times the reference is scaled down to it (honest peers of one
    swarm take up to 4x each other's steps per round with ``sync.every: "auto"``)."""
    refuse_ratio: float = 16.0
    """A delta's norm above this times the reference is refused (a strike)."""
    tensor_ratio: float = 6.0
    """Each tensor's norm is clipped to this times its own reference."""
    coord_ratio: float = 8.0
    """Each coordinate is clipped to this times the reference's largest |x| in its tensor."""
    strike_scale: float = 0.5
    """A delta scaled by less than this counts as a strike too (far outside the swarm)."""
    direction: bool = True
    """Judge a delta's direction against where this peer sees the swarm train (rule 4): one
    that points against it beyond chance is refused; one that does not point along it beyond
    chance is held to ``unaligned_ratio`` (not ``clip_ratio``) times the reference. Neither
    is a strike: honest peers out of step send such deltas (module docstring)."""
    chance_z: float = 5.0
    """Two independent random directions in n dimensions have a cosine of about N(0, 1/n):
    a cosine within ``chance_z`` / sqrt(n) of 0 is no evidence either way."""
    max_chance: float = 0.05
    """The direction check runs only where that chance bound is below this (n >= 10,000 at
    z = 5): in a toy model of a few dozen weights every cosine is within chance."""
    unaligned_ratio: float = 1.0
    """The norm bound of a delta that does not point along the reference beyond chance, as a
    multiple of the reference: what an honest peer of equal pace sends."""
    own_floor: float = 0.5
    """Each statistic of the reference is at least this times the own delta's: a smaller
    delta accepted for the round lowers it no further (with two in the pool the lower median
    is the smaller). Not 1: where the own delta is the largest of the honest ones, the
    reference would then be the largest, not their median, and a member sending 10x its delta
    would be clipped without a strike more often (``bench attack``: 9-14 of its deltas merged
    before its quarantine against 3-5)."""
    steps_ratio: float = 2.0
    """A delta whose frame says its round lasted more steps than this peer's own round of the
    same number is clipped at bounds raised by that ratio, its steps counted up to this many
    times this peer's (weighed by the learning rate where the schedule is known: at most twice
    this much, in the warm-up); its strike threshold rises with them (2x the raised bound: at
    a ratio of 2 or more, the refusal's 16x), its refusal threshold stays where it is."""

    def __post_init__(self) -> None:
        if not 1.0 <= self.clip_ratio <= self.refuse_ratio:
            raise ValueError(
                f"need 1 <= clip_ratio <= refuse_ratio, got {self.clip_ratio}, {self.refuse_ratio}"
            )
        if self.tensor_ratio < 1.0 or self.coord_ratio < 1.0:
            raise ValueError("tensor_ratio and coord_ratio must be >= 1")
        if not 0.0 < self.strike_scale <= 1.0:
            raise ValueError(f"strike_scale must be in (0, 1], got {self.strike_scale}")
        if self.chance_z <= 0.0 or not 0.0 < self.max_chance <= 1.0:
            raise ValueError("need chance_z > 0 and 0 < max_chance <= 1")
        if not 0.0 < self.unaligned_ratio <= self.clip_ratio:
            raise ValueError("need 0 < unaligned_ratio <= clip_ratio")
        if not 0.0 <= self.own_floor <= 1.0:
            raise ValueError(f"own_floor must be in [0, 1], got {self.own_floor}")
        if self.steps_ratio < 1.0:
            raise ValueError(f"steps_ratio must be >= 1, got {self.steps_ratio}")


@dataclass(frozen=True)
class DeltaStats:
    """The norms the rule compares: overall, per tensor, and each tensor's largest |x|."""

    norm: float
    tensor_norms: dict[str, float]
    tensor_maxabs: dict[str, float]

    @classmethod
    @torch.no_grad()
    def of(cls, tensors: Mapping[str, Tensor]) -> DeltaStats:
        norms: dict[str, float] = {}
        maxabs: dict[str, float] = {}
        for name, t in tensors.items():
            flat = t.detach().reshape(-1)
            # float64 sums: 1e30-sized entries must give a finite (huge) norm, not inf.
            norms[name] = math.sqrt(float(flat.double().square().sum()))
            maxabs[name] = float(flat.abs().max()) if flat.numel() else 0.0
        return cls(math.sqrt(sum(n * n for n in norms.values())), norms, maxabs)

    def maximum(self, other: DeltaStats) -> DeltaStats:
        """The larger of the two, statistic by statistic."""
        return DeltaStats(
            max(self.norm, other.norm),
            {n: max(v, other.tensor_norms.get(n, 0.0)) for n, v in self.tensor_norms.items()},
            {n: max(v, other.tensor_maxabs.get(n, 0.0)) for n, v in self.tensor_maxabs.items()},
        )

    def unmet_by(self, other: DeltaStats) -> DeltaStats | None:
        """These statistics where ``other`` is below them, 0 where it has reached them; None
        once it has reached every one."""
        left = DeltaStats(
            self.norm if other.norm < self.norm else 0.0,
            {n: v if other.tensor_norms.get(n, 0.0) < v else 0.0
             for n, v in self.tensor_norms.items()},
            {n: v if other.tensor_maxabs.get(n, 0.0) < v else 0.0
             for n, v in self.tensor_maxabs.items()},
        )  # fmt: skip
        if left.norm or any(left.tensor_norms.values()) or any(left.tensor_maxabs.values()):
            return left
        return None

    def scaled(self, factor: float) -> DeltaStats:
        """The same statistics ``factor`` times larger."""
        return DeltaStats(
            self.norm * factor,
            {n: v * factor for n, v in self.tensor_norms.items()},
            {n: v * factor for n, v in self.tensor_maxabs.items()},
        )


@dataclass(frozen=True)
class Judgement:
    """What the rule made of one delta: ``tensors`` to merge (None: refused), and why."""

    tensors: dict[str, Tensor] | None
    reason: str | None  # why it was refused, or what was clipped (None: untouched)
    scale: float  # the overall factor applied (1: not clipped)
    strike: bool  # counts against the sender (quarantine)
    stats: DeltaStats | None = None  # of ``tensors``, as the reference now holds them
    cosine: float | None = None  # with the direction reference (None: not judged)

    @property
    def accepted(self) -> bool:
        return self.tensors is not None


def lower_median(values: list[float]) -> float:
    """The lower median: with an even count the smaller middle value (one outlier among two
    values cannot raise it)."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


@dataclass(frozen=True)
class Progress:
    """The direction reference of the rule (``toward``): where this peer sees the swarm train
    (its own progress the swarm does not hold yet, or the swarm's last committed round: rule
    4), as dense tensors, and their L2 norm (computed once for every delta judged against it)."""

    tensors: Mapping[str, Tensor]
    norm: float

    @classmethod
    @torch.no_grad()
    def of(cls, tensors: Mapping[str, Tensor]) -> Progress:
        return cls(tensors, DeltaStats.of(tensors).norm)

    def cosine(self, tensors: Mapping[str, Tensor], norm: float | None = None) -> float | None:
        """The cosine between a delta and this progress (names missing from the progress count
        as zero), or None when either is zero. ``norm``: the delta's, when known."""
        if norm is None:
            norm = DeltaStats.of(tensors).norm
        if not (0.0 < norm < math.inf and 0.0 < self.norm < math.inf):
            return None
        dot = 0.0
        for name, t in self.tensors.items():
            x = tensors.get(name)
            if x is not None:
                flat = t.detach().reshape(-1).to("cpu", torch.float64)
                dot += float(x.detach().reshape(-1).to("cpu", torch.float64).dot(flat))
        cos = dot / (norm * self.norm)
        # Never made up: max(-1, min(1, nan)) is 1.0, "aligned", which would switch rule 4 off.
        return max(-1.0, min(1.0, cos)) if math.isfinite(cos) else None


@dataclass
class _Round:
    own: DeltaStats | None = None
    accepted: list[DeltaStats] = field(default_factory=list)
    steps: float | None = None  # the steps the own delta stands for (``record_own``)
    first: int | None = None  # the step the own round started at (0-based; None: not known)


class Screen:
    """The robust-merge rule of one peer for one job: its references and its judgements.

    ``record_own`` takes this peer's own delta of each round it closes; ``judge`` then bounds
    the deltas of that round. Keeps the statistics of the last ``keep_rounds`` rounds (norms
    only, a few floats per tensor)."""

    def __init__(
        self,
        rule: RobustRule | None = None,
        *,
        keep_rounds: int = 16,
        lr: Callable[[int], float] | None = None,
    ) -> None:
        """``lr``: the job's learning rate at each (0-based) step, by which ``judge`` weighs a
        longer round (None: by its steps alone)."""
        self.rule = rule or RobustRule()
        self.keep_rounds = keep_rounds
        self.lr = lr
        self._rounds: dict[int, _Round] = {}

    def knows(self, base_version: int) -> bool:
        """Whether this peer's own delta of that round is known (the reference exists)."""
        r = self._rounds.get(base_version)
        return r is not None and r.own is not None

    def record_own(
        self,
        base_version: int,
        tensors: Mapping[str, Tensor],
        *,
        steps_short: float = 1.0,
        floor: DeltaStats | None = None,
        steps: int | None = None,
        first: int | None = None,
    ) -> DeltaStats:
        """``steps_short``: the round's steps over the steps this peer trained in it, when it
        closed the round early (a joiner catching up with the swarm closes rounds after one
        step each): its norms are scaled by that much, so that the others' deltas of whole
        rounds are not judged against a delta of a fraction of their steps (as hard clips,
        strikes: a joiner would quarantine an honest donor that way). ``floor``: statistics
        the reference is at least (a peer whose error feedback is fresh after a state transfer
        sends top-k of a near-empty accumulator, the others of theirs: the donor's newest own
        statistics stand in as the floor for a few rounds). ``steps``: the steps this peer
        trained in the round (for ``judge``'s ``every``; None: not known); ``first``: the step
        (0-based) the round started at, for the learning rate over a longer round. Returns the
        own statistics as recorded before the floor."""
        r = self._rounds.setdefault(base_version, _Round())
        own = DeltaStats.of(tensors).scaled(max(1.0, steps_short))
        r.own = own if floor is None else own.maximum(floor)
        r.steps = None if steps is None else steps * max(1.0, steps_short)
        r.first = first
        self._forget_before(base_version)
        return own

    def newest_own(self) -> DeltaStats | None:
        """The statistics of the newest round with an own delta (None if none)."""
        known = [b for b, x in self._rounds.items() if x.own is not None and x.own.norm > 0.0]
        return self._rounds[max(known)].own if known else None

    def inherit(self, stats: DeltaStats, rounds: Sequence[int]) -> None:
        """Rounds closed before this peer took another's state: ``stats`` (the donor's newest
        own statistics) are their reference (norms only: there is no own direction)."""
        for b in rounds:
            r = self._rounds.setdefault(b, _Round())
            if r.own is None:
                r.own = stats

    def record_stand_in(self, base_version: int) -> bool:
        """A round this peer closes without a delta of its own (it has finished the job and
        only follows the others' last rounds): the newest own delta's statistics stand in for
        its reference (norms only: no direction to compare with). False, and nothing recorded,
        when there is no own delta to stand in."""
        newest = self.newest_own()
        if newest is None:
            return False
        self._rounds.setdefault(base_version, _Round()).own = newest
        self._forget_before(base_version)
        return True

    def _forget_before(self, base_version: int) -> None:
        """Keep the statistics of the last ``keep_rounds`` rounds up to ``base_version``."""
        for old in [b for b in self._rounds if b <= base_version - self.keep_rounds]:
            del self._rounds[old]

    def forget(self, base_version: int, stats: DeltaStats) -> None:
        """Drop an accepted delta from its round's reference (it was retracted)."""
        r = self._rounds.get(base_version)
        if r is not None:
            r.accepted = [s for s in r.accepted if s is not stats]

    def _reference(self, base_version: int) -> tuple[DeltaStats | None, list[DeltaStats]]:
        """This peer's own statistics for the round (or, when it did not move in that round or
        is not known, of the nearest round within two in which it did), and the deltas accepted
        for the round so far."""
        r = self._rounds.get(base_version, _Round())
        own = r.own
        if own is None or own.norm <= 0.0:
            near = sorted(
                (abs(b - base_version), b)
                for b, x in self._rounds.items()
                if x.own is not None and x.own.norm > 0.0 and abs(b - base_version) <= 2
            )
            own = self._rounds[near[0][1]].own if near else None
        return own, r.accepted

    @torch.no_grad()
    def judge(
        self,
        base_version: int,
        tensors: Mapping[str, Tensor],
        *,
        toward: Progress | None = None,
        every: int | None = None,
    ) -> Judgement:
        """Bound one delta of round ``base_version`` (see the module docstring). The delta's
        tensors are not modified; a clipped delta comes back as new tensors. ``toward``: where
        this peer sees the swarm train (rule 4), for the direction check (None: no
        check, where deltas legitimately point against it: consolidation rounds, where each
        peer sends its difference from the mean, or rounds followed after the last step).
        ``every``: the steps the sender's frame says its round lasted (None: not said).

        Rounds of one number last different steps at different peers where the link spaces
        them (a peer does not close a round while its last frame is still uploading): 4 real
        daemons at 256 kbit/s can close round 2 after 4, 6, 11 and 15 steps, during the
        learning rate's warm-up, and without this rule two of them clip honest deltas of
        4.5-6 x their own (their anchors then differ from the others' by 0.3-1 % for good;
        measured, see research/). A longer round
        said by the frame raises the clip bounds by as much (``_longer``: by the learning rate
        summed over its steps, where the schedule is known), up to ``steps_ratio`` of this
        peer's steps; a member that lies about it gains that much and no more: the refusal is
        judged against the bound as it was. The strike is judged against the raised bound, as
        the clip is: an honest peer whose round was longer (the job's first peer in the
        warm-up: 10x the receivers' delta) is not struck for it up to the refusal bound,
        where three such rounds would quarantine it. What that costs: past the warm-up
        nothing a round (a liar under an unraised strike bound, 8x, would merge the clip's 8x
        unpunished; one sending 8-16x merges the same 8x, not quarantined); in the warm-up,
        where the weighing raises the bound up to 16x, a liar's unstruck room is that bound
        instead of 8x (docs/robust-merge.md)."""
        rule = self.rule
        own, accepted = self._reference(base_version)
        r = self._rounds.get(base_version)
        longer = 1.0
        if every is not None and r is not None and r.steps:
            longer = self._longer(r, every)
        stats = DeltaStats.of(tensors)
        pool = [s for s in [own, *accepted] if s is not None and s.norm > 0.0]
        if not pool:
            if stats.norm == 0.0:  # nothing moved anywhere: nothing to bound
                return self._accept(base_version, dict(tensors), stats, None, 1.0, False)
            return Judgement(
                None,
                f"no reference: this peer has no delta of its own that moved near round "
                f"{base_version} to judge it by",
                0.0,
                False,
            )
        reference = DeltaStats(
            lower_median([s.norm for s in pool]),
            {n: lower_median([s.tensor_norms.get(n, 0.0) for s in pool]) for n in tensors},
            {n: lower_median([s.tensor_maxabs.get(n, 0.0) for s in pool]) for n in tensors},
        )
        if own is not None and own.norm > 0.0 and rule.own_floor > 0.0:  # module docstring
            reference = reference.maximum(own.scaled(rule.own_floor))
        ref = reference.norm
        if stats.norm > rule.refuse_ratio * ref:
            return Judgement(
                None,
                f"outlier: norm {stats.norm:.4g} is {stats.norm / ref:.3g} x the round's "
                f"reference {ref:.4g}; at most {rule.refuse_ratio:g} x is accepted",
                0.0,
                True,
            )
        cos = None if toward is None else toward.cosine(tensors, stats.norm)
        # A strike is judged by the norm alone, as for an aligned delta: the direction below
        # bounds a delta but never strikes its sender (module docstring).
        strike = stats.norm * rule.strike_scale > rule.clip_ratio * longer * ref
        limit, notes = rule.clip_ratio, []
        chance = rule.chance_z / math.sqrt(max(1, sum(t.numel() for t in tensors.values())))
        if rule.direction and cos is not None and chance <= rule.max_chance:
            if cos < -chance:
                return Judgement(
                    None,
                    f"opposed: its cosine with where this peer sees the swarm train is "
                    f"{cos:.3g}, below -{chance:.2g} (what chance gives): it undoes what the "
                    "swarm trains",
                    0.0,
                    False,  # honest peers out of step send these too (module docstring)
                    cosine=cos,
                )
            if cos < chance:
                limit = rule.unaligned_ratio
                longer = 1.0  # a longer round earns an aligned delta more room, not noise
                if stats.norm > limit * ref:
                    notes.append(f"unaligned (cosine {cos:.2g}, within chance {chance:.2g})")
        limit *= longer
        scale = 1.0
        if stats.norm > limit * ref:
            scale = limit * ref / stats.norm
            notes.append(f"norm {stats.norm:.4g} clipped to {limit:g} x {ref:.4g}")
        out: dict[str, Tensor] = {}
        for name, t in tensors.items():
            t_ref = reference.tensor_norms[name]
            if t_ref <= 0.0:
                # A tensor nobody else moved: its share of the overall reference by size.
                share = math.sqrt(t.numel() / max(1, sum(x.numel() for x in tensors.values())))
                t_ref = ref * share
            x = t.to(torch.float32)
            t_scale = scale
            t_norm = stats.tensor_norms[name] * scale
            if t_norm > rule.tensor_ratio * longer * t_ref:
                t_scale *= rule.tensor_ratio * longer * t_ref / t_norm
                notes.append(f"tensor {name} clipped")
            if t_scale != 1.0:
                x = x * t_scale
            m_ref = reference.tensor_maxabs[name]
            bound = rule.coord_ratio * longer * (m_ref if m_ref > 0.0 else t_ref)
            if stats.tensor_maxabs[name] * t_scale > bound:
                x = x.clamp(-bound, bound)
                notes.append(f"{name} entries clipped to +-{bound:.3g}")
            out[name] = x
        reason = None
        if notes:
            shown = notes if len(notes) <= 3 else [*notes[:3], f"{len(notes) - 3} more"]
            reason = "clipped: " + "; ".join(shown)
        kept = stats if reason is None else None
        return self._accept(base_version, out, kept, reason, scale, strike, cos)

    def _longer(self, r: _Round, every: int) -> float:
        """How much more a delta of a round of ``every`` steps may move than this peer's own
        of the same number (``r``): its steps, at most ``steps_ratio`` times this peer's, each
        weighed by the learning rate where the schedule and the round's first step are known.

        A step's delta scales with its learning rate, and during the warm-up that grows with
        every step: a round of 4 steps from step 0 moves ~10 times one of 1 step (1+2+3+4
        against 1), not 4. With 4 real daemons at 256 kbit/s the job's first peer can close
        round 0 after 4 steps and the others after 1 (they started later); counting steps
        alone, they clip its honest delta (9.97x their own) to 8x, and its settled anchor ends
        1.1e-4 from theirs for good, where the others agree to 6e-8 (measured, see
        research/). Both rounds are taken to start
        at this peer's first step: exact for round 0, and where rounds close in phase nearly so.
        The weights only ever raise the steps' ratio (past the warm-up, where the rate falls,
        it is that ratio: a longer last round ends with the others' rather than starting with
        them), and at most to twice it (what a warm-up from step 0 gives)."""
        steps = r.steps or 0.0
        claimed = min(float(every), self.rule.steps_ratio * steps)
        if claimed <= steps:
            return 1.0
        by_steps = claimed / steps
        if self.lr is None or r.first is None or claimed > MASS_STEPS:
            return by_steps
        # Both rounds start at ``r.first``: this peer's rates are the first of the claimed ones.
        rates = [self.lr(r.first + i) for i in range(round(claimed))]
        own = math.fsum(rates[: round(steps)])
        if own <= 0.0:  # no learning rate to weigh by
            return by_steps
        return max(by_steps, min(math.fsum(rates) / own, 2 * by_steps))

    def _accept(
        self,
        base_version: int,
        tensors: dict[str, Tensor],
        stats: DeltaStats | None,
        reason: str | None,
        scale: float,
        strike: bool,
        cosine: float | None = None,
    ) -> Judgement:
        kept = stats if stats is not None and reason is None else DeltaStats.of(tensors)
        self._rounds.setdefault(base_version, _Round()).accepted.append(kept)
        return Judgement(tensors, reason, scale, strike, kept, cosine)
