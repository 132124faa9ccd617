"""The donor's progress a peer that took another peer's state keeps and does not send.

A joiner (or a restarted peer) trains on from its donor's model: the swarm's start point plus
the donor's progress that the codec has not sent yet, which the donor sends itself over its
next rounds. The joiner keeps that progress in its replica, apart (``InheritedOffset``): its
own deltas are measured from the start point plus the offset, so no anchor counts the donor's
progress twice, and the offset gives way by what the donor's deltas carry, as the donor's own
replica does when it sends them. Where the donor sends nothing for ``max_staleness`` + 1
rounds (it left), the joiner sends the offset as its own (``fold``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

MAX_SOURCES = 16  # peers whose deltas drain an inherited offset, read back from a state

# What a drain cleared, per tensor: (flat positions, amounts), given back on a retract.
Drained = dict[str, tuple[Tensor, Tensor]]


class InheritedOffset:
    """The donor's unsent progress (``tensors``, CPU fp32, shaped like the replica), the peers
    whose deltas drain it (``sources``: the donor, and the sources of an offset it held), the
    version this peer last merged a delta of theirs at (``heard``), and the peer id the loaded
    state names as its server (``served_by``)."""

    def __init__(self, params: Mapping[str, Tensor]) -> None:
        """``params``: the replica's live tensors, which hold the offset and move with it."""
        self._params = params
        self.tensors: dict[str, Tensor] = {}
        self.sources: set[str] = set()
        self.heard = 0
        self.served_by: str | None = None

    def __bool__(self) -> bool:
        return bool(self.tensors)

    @torch.no_grad()
    def take(
        self, start: Mapping[str, Tensor], *, donor: str | None, me: str, version: int
    ) -> None:
        """The replica (the donor's model) beyond ``start`` becomes the offset; ``donor``: its
        peer id as the state transfer verified it (else the id its state names)."""
        server = donor or self.served_by
        theirs = sorted(self.sources - {server, me})[: MAX_SOURCES - 1]
        self.sources = set(theirs) | ({server} if server and server != me else set())
        self.heard = version
        self.tensors = {
            n: p.detach().to("cpu", torch.float32).reshape(start[n].shape) - start[n]
            for n, p in self._params.items()
        }

    def drains(self, sender: str) -> bool:
        """Whether ``sender``'s deltas carry the progress held here."""
        return bool(self.tensors) and sender in self.sources

    @torch.no_grad()
    def drain(self, tensors: Mapping[str, Tensor], version: int) -> Drained:
        """A delta of a source (``tensors``) is merged: the offset gives way by as much as it
        sent, entry by entry, towards zero and never past it (the replica with it), whatever
        the codec. Returns what it cleared, for ``undrain``."""
        self.heard = version
        drained = {}
        for name, x in tensors.items():
            o = self.tensors.get(name)
            if o is None:
                continue
            xs = x.to("cpu", torch.float32).reshape(-1)
            at = xs.nonzero().squeeze(1)
            ov, xv = o.view(-1)[at], xs[at]
            give = torch.where(ov * xv > 0, ov.sign() * torch.minimum(ov.abs(), xv.abs()), 0.0)
            self._move(name, at, -give)
            drained[name] = (at, give)
        return drained

    def undrain(self, drained: Drained | None) -> None:
        """Give back what ``drain`` cleared (a retracted delta of a source)."""
        for name, (at, give) in (drained or {}).items():
            if name in self.tensors:  # else folded since: the replica holds it and sends it
                self._move(name, at, give)

    @torch.no_grad()
    def _move(self, name: str, at: Tensor, by: Tensor) -> None:
        """Add ``by`` to the offset of ``name`` at flat positions ``at``, and to the replica."""
        self.tensors[name].view(-1).index_add_(0, at, by)
        p = self._params[name]
        p.view(-1).index_add_(0, at.to(p.device), by.to(p.device, p.dtype))

    def fold(self) -> None:
        """Send the offset as this peer's own progress from the next delta on: the replica
        holds it already, so it is only no longer subtracted."""
        self.tensors, self.sources = {}, set()

    def fold_if_gone(self, version: int, max_staleness: int) -> None:
        """Fold when no source has sent a delta for more than ``max_staleness`` rounds: nobody
        else will send its progress."""
        if self.tensors and version - self.heard > max_staleness:
            self.fold()
