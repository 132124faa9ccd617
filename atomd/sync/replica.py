"""The replica: the model a peer trains, and how it moves against the anchor.

``Replica`` holds the live parameter tensors (any device, any float dtype) and knows what
they hold beyond a reference (the start point, the anchor, the settled anchor): this peer's
own progress, the inherited offset of a joiner and what the codec has not sent yet.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import Tensor

from atomd.sync.codecs import ErrorFeedback
from atomd.sync.offset import InheritedOffset


class Replica:
    """The live parameters, the inherited offset they hold, the error feedback's residual."""

    def __init__(self, params: dict[str, Tensor], feedback: ErrorFeedback) -> None:
        self.params = params
        self.offset = InheritedOffset(params)
        self._feedback = feedback

    def deltas(self, start: Mapping[str, Tensor]) -> Iterator[tuple[str, Tensor]]:
        """The replica beyond ``start`` and the inherited offset, tensor by tensor (CPU fp32):
        what this peer trained itself."""
        for name, p in self.params.items():
            delta = p.detach().to("cpu", torch.float32) - start[name]
            if name in self.offset.tensors:
                delta.sub_(self.offset.tensors[name].reshape(delta.shape))
            yield name, delta

    @torch.no_grad()
    def beyond(self, reference: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The replica minus ``reference``, plus the error feedback's residual (CPU fp32)."""
        residual = self._feedback.state_tensors()
        out = {}
        for name, p in self.params.items():
            ref = reference[name]
            x = p.detach().to("cpu", torch.float32).reshape(ref.shape) - ref
            r = residual.get(name)
            out[name] = x if r is None else x + r.reshape(x.shape)
        return out

    @torch.no_grad()
    def restart(
        self, start: Mapping[str, Tensor], *, keep: Mapping[str, Tensor], offset: bool = True
    ) -> None:
        """Copy ``start`` plus ``keep`` (and the inherited offset, with ``offset``) into the
        live parameters, in place."""
        for name, p in self.params.items():
            x = start[name]
            for add in (keep.get(name), self.offset.tensors.get(name) if offset else None):
                if add is not None:
                    x = x.add(add.reshape(x.shape))
            p.copy_(x.reshape(p.shape))

    @torch.no_grad()
    def move(self, by: Mapping[str, Tensor]) -> None:
        """Add ``by`` (by name) to the live parameters, in place."""
        for name, p in self.params.items():
            p.add_(by[name].to(p.device, p.dtype).reshape(p.shape))
