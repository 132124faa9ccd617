"""How a peer encodes its delta: the job's codec, its error feedback and top-k's ranking.

``DeltaEncoder`` holds the codec at the share of entries it sends now (the automatic cadence
fits the share to the link), the error feedback that keeps what the codec drops, and the
weights top-k ranks entries by (``SyncSpec.topk_rank``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from atomd.spec import SyncSpec
from atomd.sync.codecs import Codec, Encoded, ErrorFeedback, make_codec

# AdamW's eps squared: a weight no gradient has reached yet (v = 0) ranks as one whose v is
# this, as AdamW's own step divides by sqrt(v) + eps.
RANK_EPS = 1e-16
# Top-k ranks by |delta| x (v + RANK_EPS) ** power (``SyncSpec.topk_rank`` 'moment'), the power
# by how often rounds come (``SyncSpec.frequent``), as measured in research/ with `atomd bench
# sync`: rare rounds gain most from the weights the other peers' data rarely move (small v),
# what a peer knows alone; frequent rounds rank by |delta| (power 0), since ranked by v their
# anchor fell far behind the replicas.
RANK_POWER = {"frequent": 0.0, "rare": -2.0}


@dataclass
class Encoding:
    """One round's delta, encoded: the frames, what is committed of it (``sent``: what
    receivers decode, plus the residual when the delta is whole), what receivers decode
    (``framed``), and what the replica keeps for the next round (``kept``)."""

    tensors: list[tuple[str, Encoded]] = field(default_factory=list)
    sent: dict[str, Tensor] = field(default_factory=dict)
    framed: dict[str, Tensor] = field(default_factory=dict)
    kept: dict[str, Tensor] = field(default_factory=dict)
    raw_bytes: int = 0  # the delta's size as fp32


class DeltaEncoder:
    """The job's codec (``codec``), its error feedback (``feedback``) and top-k's ranking."""

    def __init__(self, spec: SyncSpec) -> None:
        self.spec = spec
        self.codec = self.at(spec.topk_fraction)
        self.feedback = ErrorFeedback(self.codec)
        # How top-k ranks each tensor's entries at the next ``encode`` (name -> weight of
        # |delta|), read once a round; None: by |delta| alone.
        self.rank_weights: Callable[[], Mapping[str, Tensor]] | None = None
        self._draining = False  # past the last training round before consolidation rounds

    def rank_by(self, second_moments: Callable[[], Mapping[str, Tensor]]) -> None:
        """Rank top-k's entries by |delta| x v ** power (``SyncSpec.topk_rank`` 'moment',
        ``RANK_POWER`` by the cadence; power 0 ranks by |delta| and reads nothing), v read
        from ``second_moments`` (the engine's AdamW state, settled) at each ``encode``."""
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
        frame says how many entries each tensor holds and any count decodes, so peers need not
        agree on it."""
        if self.fraction is None:
            raise ValueError(f"codec {self.spec.codec} sends every entry: no fraction to set")
        if fraction != self.fraction:
            self.use(self.at(fraction))

    def use(self, codec: Codec) -> None:
        """Encode with ``codec`` from the next round on, its error feedback included."""
        self.codec = self.feedback.codec = codec

    def at(self, fraction: float, *, zstd: bool | None = None) -> Codec:
        """The job's codec sending ``fraction`` of the entries (a sparse codec's)."""
        zstd = self.spec.zstd if zstd is None else zstd
        return make_codec(self.spec.codec, topk_fraction=fraction, zstd=zstd)

    @torch.no_grad()
    def encode(
        self, deltas: Iterable[tuple[str, Tensor]], *, whole: bool, draining: bool
    ) -> Encoding:
        """Encode ``deltas`` ((name, CPU fp32 tensor), made one at a time). ``whole``: the
        residual is committed too, nothing waits; else the replica keeps it. ``draining``:
        the rounds after this one rank by |delta| alone (consolidation drains what is left
        largest first)."""
        out = Encoding()
        weights = {} if self.rank_weights is None or self._draining else self.rank_weights()
        self._draining = draining
        for name, delta in deltas:
            enc, reconstructed = self.feedback.compress(name, delta, weights.get(name))
            framed = reconstructed.to("cpu", torch.float32).reshape(delta.shape).clone()
            out.framed[name] = framed
            if whole:
                out.sent[name] = framed + self.feedback.split(name, 1.0).reshape(delta.shape)
            else:  # what is committed is what is sent (one tensor for both)
                out.sent[name] = framed
                out.kept[name] = self.feedback.split(name, 1.0)
            out.tensors.append((name, enc))
            out.raw_bytes += delta.numel() * 4
        return out
