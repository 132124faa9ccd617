"""Error feedback: what a round's compression dropped goes out with the next rounds.

Over rounds the sum of what was sent tracks the sum of the true deltas.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from atomd.sync.codecs.base import Codec, Encoded
from atomd.sync.codecs.topk import TopKCodec


class ErrorFeedback:
    """Per-tensor residuals: what a round's compression dropped is added to the next round's delta.

    With ``decay`` = 1, after any number of rounds the sum of what was sent equals the sum of the
    true deltas minus the current residual, which stays bounded. ``decay`` < 1 forgets a part of
    old residuals each round (useful when deltas from long ago no longer fit the anchor)."""

    def __init__(self, codec: Codec, *, decay: float = 1.0) -> None:
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.codec = codec
        self.decay = decay
        # name -> residual (float32, CPU); replaced, never modified in place.
        self._residual: dict[str, Tensor] = {}

    def compress(
        self, name: str, delta: Tensor, weight: Tensor | None = None
    ) -> tuple[Encoded, Tensor]:
        """(encoded, sent): ``sent`` is exactly what receivers will decode (float32, CPU).
        ``weight``: how a top-k codec ranks the entries (``TopKCodec.encode``); others send
        what they send whatever it is."""
        delta = delta.detach().to("cpu", torch.float32)
        residual = self._residual.get(name)
        if residual is None:
            acc = delta
        elif residual.shape != delta.shape:
            raise ValueError(
                f"delta {name!r} has shape {tuple(delta.shape)}, its residual "
                f"{tuple(residual.shape)}; reset the error feedback when the model changes"
            )
        else:
            acc = torch.add(delta, residual, alpha=self.decay)
        if weight is not None and isinstance(self.codec, TopKCodec):
            enc = self.codec.encode(acc, weight.detach().to("cpu", torch.float32))
        else:
            enc = self.codec.encode(acc)
        sent = self.codec.decode(enc)
        self._residual[name] = acc - sent
        return enc, sent

    def split(self, name: str, fraction: float) -> Tensor:
        """Take ``fraction`` of ``name``'s residual out (returned); the rest stays for the next
        round. ``fraction`` 1 hands all of it over (zeros when there is none yet)."""
        if not 0 <= fraction <= 1:
            raise ValueError(f"fraction must be in [0, 1], got {fraction}")
        residual = self._residual[name]
        self._residual[name] = residual * (1.0 - fraction)
        return residual * fraction

    def state_tensors(self) -> dict[str, Tensor]:
        """Residuals by tensor name, for a checkpoint (which stores them as ``"ef.<name>"``).

        The tensors are never modified in place afterwards, so no copy is made."""
        return dict(self._residual)

    def load_state_tensors(self, tensors: Mapping[str, Tensor]) -> None:
        """Replace the residuals with ``tensors``, keyed by tensor name as :meth:`state_tensors`
        gives them."""
        self._residual = {
            name: t.detach().to("cpu", torch.float32).clone() for name, t in tensors.items()
        }
