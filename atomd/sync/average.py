"""The job's final average: after the last round, each peer's model beyond the anchor, once.

Where rounds are rare (a slow link), every replica ends holding several steps of progress the
codec has not sent, and the peers end far apart: 4 real daemons at 256 kbit/s ended at
1.795-1.825 (run an) and 1.813-1.875 (run ak), each on its own replica or the swarm's model,
while the exact average of their four final models reached 1.796 and 1.814 (gain 0.46 -> 0.54
and 0.35 -> 0.46; ``bench/results-swarm-2026-12-03an.json``, ``-ak.json``, the final
checkpoints evaluated on the same validation windows). In the in-process harness the mean model
beats the replicas by 0.010 at a round every 6 steps and by 0.007 at every 2.

So after its last round (and the rounds of the others it follows) each peer sends every other
peer one *average frame*: its model beyond its *settled anchor* (``SyncState.settled``: the
anchor with every pending delta committed and the outer momentum run out; the share is
``SyncState.unsent_from`` it: the replica minus it, or with ``sync.final_tail`` (off by
default) the mean of its models over the job's last steps minus it: ``TailMean``), in the job's
codec, with as many of the entries as the measured link carries in ``upload_budget_s`` (all of
them on a free link: the job's sparse codec at a share of 1 is dense at 4 bits a value). Once
the others' frames are in (or the wait is over), the candidate final model is the settled
anchor plus the mean of every share: the average of the peers' models (exactly, up to the
codec's rounding, when all shares are whole and the settled anchors agree, which they do at
every peer that merged the same deltas, whenever each committed them; the anchors themselves
differ by that timing under outer momentum, and by a late delta still pending at one peer).
Where a slow link cut the shares, an entry a share left out is not taken as 0 (the settled
anchor, far behind every model there: probe 2.03 against the models' 1.76-1.79 in run bs) but
as this peer's own value of it, clamped to half the most it can have been (``FILL``): the
share kept larger entries of that chunk, so it was smaller than those. Each peer's candidate
then differs a little from the others' (by its own values of the entries left out); with
whole shares there is nothing to fill and it is the same at every peer.
The loss guard's probe then picks the final model among this peer's own replica, the swarm's
model and the average, as it picks between the first two without it.

Why not the swarm's model (the start point): the start points also hold each peer's estimate
of the deltas it still misses, amplified by the outer step's look-ahead. Made
relative to them, the first real-daemon run at 256 kbit/s (run ar: 4 peers, 6-12 % of the
entries sent) gave candidates worse than every peer's own model (probes 1.767-1.826 against
1.744-1.786). The anchors agree only where every delta was merged alike (until 2026-12-03 a
delta 2+ rounds late counted 1/staleness, on each receiver's own count): in that run's final
checkpoints they were
4-7 % apart (the replicas 11-13 %), so the candidate is the mean model only approximately. On
those checkpoints: the exact mean of the four models 1.7915, the anchor-relative candidates
(dense shares) 1.797-1.834, the models themselves 1.803-1.842. The probe keeps the better.

Why it is safe. An average frame is never a delta: it is kept apart from the round inbox
(``Averages``) and only ever enters the candidate, which the probe judges against the two
models the peer had anyway. Its round is one the sender never sends a delta of and its base
version the sender's anchor version after its last round: a share made on another version (a
peer that stopped following early, or one still training) is heard but not used, since the
anchors it is relative to differ. A share more than ``MAX_RATIO`` times the lower median
of the shares' norms (this peer's own included) is left out, so one member cannot swamp the
mean; what it sends within that bound moves the candidate by at most that bound over the
number of peers, and the probe refuses a candidate worse than the swarm's model or the replica.
The entries it leaves out count as this peer's own values, each clamped to the bound the share
declares for its chunk (taken as a magnitude, whatever sign the share gave its scale): however
it declares it, a share can only choose how much of this peer's own value (none of it to all
of it, with its sign) stands for it there, never a value of its own.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from atomd.sync.codecs import Codec, Encoded, decode, kept
from atomd.sync.robust import lower_median

# The longest the average frame's uploads (to every other peer, one after another) may take at
# the rate measured for the job's rounds: UPLOAD_S, or WALL_SHARE of the job's time here if
# longer, at most UPLOAD_MAX_S (an 8-hour job would otherwise spend 48 minutes at its end). On a
# free link all of this peer's model beyond the anchor goes (the tiny model at 4 bits a value:
# ~0.4 MB, under a second); at 256 kbit/s, after a job of ~6 minutes, most of it.
UPLOAD_S = 20.0
WALL_SHARE = 0.1
UPLOAD_MAX_S = 600.0
# A share more than this many times the lower median of the shares' norms is left out.
MAX_RATIO = 4.0
# The shares of entries a sparse codec's average frame chooses from: all of them, then from half
# down by a third of a halving (RUNG) a rung. Halvings (1, 1/2, 1/4) lost most of the average's
# gain at 256 kbit/s: 4 real daemons' final models of run bs, on the benchmark's validation
# windows (exact mean 1.8073, the peers' own 1.810-1.844), the candidate at 1/4 of the entries
# 1.8242 (a frame of 176-190 kB, what the budget took), at 0.397 1.8112 (258-260 kB), at 1/2
# 1.808 (294-309 kB), all of them 1.810 (270-299 kB). Between 1/2 and 1 a sparse frame is no
# smaller than the whole one (its positions cost most at half the entries), so those are skipped.
RUNG = 2 ** (-1 / 3)
LADDER = (1.0, *(0.5 * RUNG**i for i in range(31)))  # 1, 0.5, 0.397, ... 0.5 / 2^10
# An entry a top-k share left out was smaller than every entry of its chunk that the share
# kept: the candidate counts it as this peer's own value of that entry, clamped to FILL times
# that bound (the mean magnitude below it, were they spread evenly), not as 0 (the settled
# anchor's value, far behind every model where rounds are rare). Run bs's kept final models
# (256 kbit/s), the candidate with every share at 1/4 of the entries: 1.8242 -> 1.8037-1.8135
# (the exact mean 1.8073); one share at 1/8: 1.8896 -> 1.822-1.846; all at 1/8: 1.9415 ->
# 1.822-1.848; at 0.397: 1.8113 -> 1.806-1.812. FILL 0.3 / 0.7 / 1 gave 1.804-1.814 /
# 1.806-1.817 / 1.809-1.824 at 1/4 and 1.842-1.872 / 1.813-1.839 / 1.810-1.836 at 1/8. Filled
# from the others' mean instead, a member alone in sending an entry would steer every peer's
# estimate of it; this peer's own value steers nothing but its own candidate.
FILL = 0.5
# Senders whose share is kept (each as it travelled: at most a model's size at 4 bits a value
# with a sparse codec, its codec's size with a dense one).
MAX_SENDERS = 64


def _decoded(tensors: Mapping[str, Encoded]) -> dict[str, Tensor]:
    return {name: decode(enc) for name, enc in tensors.items()}


@dataclass
class Share:
    """One peer's share of the average: its model beyond its settled anchor on ``base_version``,
    encoded as it travelled (checked already: shapes, finite values), decoded one share at a
    time when the candidate is made."""

    sender: str
    base_version: int
    tensors: Mapping[str, Encoded]

    def decoded(self) -> dict[str, Tensor]:
        return _decoded(self.tensors)


class Averages:
    """The average frames received for one job (loop puts, trainer takes): the newest of each
    sender, at most ``max_senders`` senders."""

    def __init__(self, max_senders: int = MAX_SENDERS) -> None:
        self.max_senders = max_senders
        self._shares: dict[str, Share] = {}
        self._lock = threading.Lock()

    def put(self, share: Share) -> bool:
        """Keep ``share`` (replacing its sender's older one); False if refused (full)."""
        with self._lock:
            if share.sender not in self._shares and len(self._shares) >= self.max_senders:
                return False
            self._shares[share.sender] = share
            return True

    def senders(self) -> set[str]:
        """Every sender heard from, whatever its base version."""
        with self._lock:
            return set(self._shares)

    def on(self, base_version: int) -> list[Share]:
        """The shares made on ``base_version``."""
        with self._lock:
            return [s for s in self._shares.values() if s.base_version == base_version]


class TailMean:
    """The running mean of a peer's model over the job's last steps (``sync.final_tail``):
    what it shares in the final average instead of its last model.

    At the end of a job the replicas still carry each peer's latest steps and its share of
    the rounds' top-k noise; averaging them over the peers removes part of that, averaging
    them over the last steps too removes more, in process: ``atomd bench sync`` (4 peers,
    top-k 1 %, H=2, 600 steps), the mean of the four final models 1.7227, of their means over
    the last 30 steps 1.7146, over 10 1.7180, 60 1.7186, 120 1.7296 (a window reaching back to
    where the model was still improving fast costs more than it removes); at H=6 nothing
    (1.7849 against 1.7843). On 4 real daemons no gain showed (run bh), hence off by default.
    Float32 on the CPU, like the anchor: one more model-sized buffer, only over those steps.
    It averages the replicas; the share adds the error feedback's residual of the end, which
    is zero with ``residual: "replica"`` (the default: the replica keeps it) and otherwise
    not averaged over the steps."""

    def __init__(self, total_steps: int, share: float) -> None:
        """The mean is over the last ``share`` of ``total_steps`` (at least one step)."""
        if not 0 <= share <= 1:
            raise ValueError(f"share must be in [0, 1], got {share}")
        self.first = total_steps - max(1, round(share * total_steps)) + 1 if share > 0 else None
        self.count = 0
        self._mean: dict[str, Tensor] = {}

    def due(self, step: int) -> bool:
        """Whether the model after ``step`` (1-based) joins the mean."""
        return self.first is not None and step >= self.first

    @torch.no_grad()
    def add(self, params: Mapping[str, Tensor]) -> None:
        """The model now (live parameters, any device) joins the mean."""
        self.count += 1
        for name, p in params.items():
            x = p.detach().to("cpu", torch.float32)
            mean = self._mean.get(name)
            if mean is None:
                self._mean[name] = x.clone()
            else:
                mean.add_(x.reshape(mean.shape) - mean, alpha=1.0 / self.count)

    def mean(self) -> dict[str, Tensor] | None:
        """The mean of the models added (by name), None before two: nothing to average."""
        return self._mean if self.count >= 2 else None


def upload_budget_s(wall_s: float) -> float:
    """Seconds the average frame's uploads may take after a job of ``wall_s`` seconds here."""
    return min(UPLOAD_MAX_S, max(UPLOAD_S, WALL_SHARE * wall_s))


@dataclass
class Sized:
    """This peer's share, encoded as it travels, and the codec that encoded it."""

    tensors: dict[str, Encoded]
    codec: Codec

    def decoded(self) -> dict[str, Tensor]:
        """The share as the others decode it (the candidate counts this peer's own share so)."""
        return _decoded(self.tensors)


def encode_share(
    tensors: Mapping[str, Tensor],
    codec_at: Callable[[float], Codec] | None,
    codec: Codec,
    *,
    floor: float,
    budget_bytes: float | None,
    overhead: int = 0,
) -> Sized:
    """Encode this peer's share: with ``codec_at`` (a sparse codec at a share of the entries),
    at the largest share of ``LADDER`` (1, 1/2, 0.397, ...) whose encoding, plus ``overhead``
    bytes of framing, fits ``budget_bytes``, never below ``floor`` (the job's own share), and
    at ``floor`` when nothing is measured; else with ``codec`` (a dense one). Below half the
    entries the search takes a frame's size to grow with its share (the positions and the
    values both do); where zstd made two neighbouring rungs' sizes cross, it may end a rung
    lower than the largest that fits, never on one that does not fit."""

    def at(c: Codec) -> Sized:
        return Sized({name: c.encode(t) for name, t in tensors.items()}, c)

    def fits(sized: Sized) -> bool:
        assert budget_bytes is not None
        return overhead + sum(len(e.payload) for e in sized.tensors.values()) <= budget_bytes

    if codec_at is None:
        return at(codec)
    if budget_bytes is not None and LADDER[0] > floor:
        whole = at(codec_at(LADDER[0]))
        if fits(whole):
            return whole
        # Below half the entries a frame grows with its share: the largest rung that fits is
        # found in a binary search (a few encodings of the model, not one per rung).
        rungs = [f for f in LADDER[1:] if f > floor]
        best: Sized | None = None
        lo, hi = 0, len(rungs) - 1  # rungs[lo] is the largest share still in question
        while lo <= hi:
            mid = (lo + hi) // 2
            sized = at(codec_at(rungs[mid]))
            if fits(sized):
                best, hi = sized, mid - 1
            else:
                lo = mid + 1
        if best is not None:
            return best
    return at(codec_at(floor))


@dataclass
class Combined:
    """The average candidate, and which shares went into it."""

    model: dict[str, Tensor]
    used: list[str] = field(default_factory=list)  # senders, this peer's own share excluded
    left_out: list[tuple[str, str]] = field(default_factory=list)  # (sender, why)


def norm(tensors: Mapping[str, Tensor]) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors.values()))


@torch.no_grad()
def combine(
    start: Mapping[str, Tensor],
    own: Mapping[str, Tensor],
    shares: Sequence[Share],
    fill_from: Mapping[str, Tensor] | None = None,
) -> Combined:
    """``start`` plus the mean of ``own`` (this peer's share as it sent it) and every share not
    left out (``MAX_RATIO``). With ``fill_from`` (this peer's whole share), each entry a top-k
    share left out counts as this peer's own value of it, clamped to ``FILL`` times the most
    that entry can have been (``codecs.kept``), instead of as 0. The shares are decoded one at
    a time (twice: for their norms, then for the sum)."""
    norms = {s.sender: norm(s.decoded()) for s in shares}
    reference = lower_median([norm(own), *norms.values()])
    used: list[Share] = []
    left_out: list[tuple[str, str]] = []
    for s in shares:
        if norms[s.sender] > MAX_RATIO * reference:
            why = (
                f"its share's norm {norms[s.sender]:.3g} is over {MAX_RATIO:g}x the lower "
                f"median of the shares' ({reference:.3g})"
            )
            left_out.append((s.sender, why))
        else:
            used.append(s)
    n = 1 + len(used)
    model = {name: own[name].reshape(x.shape).clone() for name, x in start.items()}
    for s in used:
        for name, enc in s.tensors.items():
            x = model[name]
            if fill_from is None:
                x.add_(decode(enc).reshape(x.shape))
                continue
            k = kept(enc)
            bound = k.bound.reshape(x.shape).abs().mul_(FILL)  # never negative, whoever sent it
            guess = torch.clamp(fill_from[name].reshape(x.shape), min=bound.neg(), max=bound)
            mask = k.mask.reshape(x.shape)
            guess[mask] = k.values.reshape(x.shape)[mask]
            x.add_(guess)
    for name, x in start.items():
        model[name] = x.add(model[name], alpha=1.0 / n)
    return Combined(model, [s.sender for s in used], left_out)
