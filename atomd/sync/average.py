"""The job's final average: after the last round, each peer's model beyond the anchor, once.

Where rounds are rare (a slow link), every replica ends holding several steps of progress the
codec has not sent, and the peers end far apart, while the average of their final models is
better than each (measured in research/ on real daemons and with ``atomd bench sync``).

So after its last round (and the rounds of the others it follows) each peer sends every other
peer one *average frame*: its model beyond its *settled anchor* (``SyncState.settled``: the
anchor with every pending delta committed and the outer momentum run out; the share is
``SyncState.unsent_from`` it: the replica minus it), in the job's codec, with as many of the
entries as the measured link carries in ``upload_budget_s`` (all of them on a free link: the
job's sparse codec at a share of 1 is dense at 4 bits a value). Once the others' frames are in
(or the wait is over), the candidate final model is the settled anchor plus the mean of every
share: the average of the peers' models (exactly, up to the codec's rounding, when all shares
are whole and the settled anchors agree, which they do at every peer that merged the same
deltas, whenever each committed them). Where a slow link cut the shares, an entry a share left
out is not taken as 0 (the settled anchor, far behind every model) but as this peer's own value
of it, clamped to half the most it can have been (``FILL``): the share kept larger entries of
that chunk, so it was smaller than those. With whole shares there is nothing to fill and the
candidate is the same at every peer. The loss guard's probe then picks the final model among
this peer's own replica, the swarm's model and the average.

The shares are relative to the settled anchor, not to the swarm's model (the start point): the
start points also hold each peer's estimate of the deltas it still misses, amplified by the
outer step's look-ahead, and candidates made relative to them were worse than every peer's own
model.

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
# down by a third of a halving (RUNG) a rung; halvings lost most of the average's gain on a slow
# link (measured in research/). Between 1/2 and 1 a sparse frame is no smaller than the whole one
# (its positions cost most at half the entries), so those are skipped.
RUNG = 2 ** (-1 / 3)
LADDER = (1.0, *(0.5 * RUNG**i for i in range(31)))  # 1, 0.5, 0.397, ... 0.5 / 2^10
# An entry a top-k share left out was smaller than every entry of its chunk that the share
# kept: the candidate counts it as this peer's own value of that entry, clamped to FILL times
# that bound (the mean magnitude below it, were they spread evenly), not as 0 (the settled
# anchor's value, far behind every model where rounds are rare); 0.5 measured best in research/.
# Filled from the others' mean instead, a member alone in sending an entry would steer every
# peer's estimate of it; this peer's own value steers nothing but its own candidate.
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
