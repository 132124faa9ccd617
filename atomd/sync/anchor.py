"""The anchor: the swarm's model as one peer commits it, round by round.

``AnchorState`` holds the anchor's tensors (CPU fp32), the outer optimizer that steps it
(Nesterov momentum, or the plain average during consolidation) and the rounds not committed
for good (``rounds.PendingRounds``). A round's deltas commit as one outer step; until then the
replica restarts from the *start point*, where the anchor will be once they commit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor

from atomd.spec import SyncSpec
from atomd.sync.outer import NesterovOuter
from atomd.sync.rounds import Change, PendingRounds


class AnchorState:
    """The anchor's tensors, its outer optimizer and its pending rounds."""

    def __init__(self, params: Mapping[str, Tensor], spec: SyncSpec) -> None:
        with torch.no_grad():
            self.tensors = {
                n: p.detach().to("cpu", torch.float32, copy=True) for n, p in params.items()
            }
        self.outer = NesterovOuter(lr=spec.outer_lr, momentum=spec.outer_momentum)
        self.rounds = PendingRounds(self.tensors)

    def start_point(self, version: int) -> dict[str, Tensor]:
        """Where the anchor will be once the rounds before ``version`` commit: each round's
        missing deltas count as the mean of those in, and the outer step (momentum included)
        is the one the commit will take. Unless more deltas come, this is exactly the anchor
        after the commit."""
        closed = self.rounds.closed(version)
        if not closed:
            return self.tensors
        return self.outer.peek(self.tensors, self.rounds.outer_grad(closed))

    @torch.no_grad()
    def settled(self, version: int) -> dict[str, Tensor]:
        """Where the anchor ends once every round before ``version`` is committed and the outer
        momentum has run out with no more: the same at peers that have merged the same deltas,
        whenever each committed them (``NesterovOuter.settle``)."""
        closed = self.rounds.closed(version)
        return self.outer.settle(self.tensors, self.rounds.outer_grad(closed) if closed else {})

    def commit(self, due: Iterable[int]) -> None:
        """Commit the ``due`` rounds' pending deltas in one outer step."""
        due = list(due)
        if due:
            self.outer.step(self.tensors, self.rounds.outer_grad(due))
            self.rounds.commit(due)  # kept until they can take no late delta (``prune``)

    @torch.no_grad()
    def commit_whole(self, base_version: int) -> None:
        """Add round ``base_version``'s one delta as it is, no outer step (a peer alone: its
        momentum would carry the model past where it trained)."""
        for name, x in self.rounds.take_whole(base_version).items():
            self.tensors[name].add_(x)

    def shift(
        self, version: int, before: Mapping[int, int], changes: Mapping[int, Sequence[Change]]
    ) -> dict[str, Tensor] | None:
        """How far the start point moved when ``changes`` joined or left the pending rounds
        (``PendingRounds.grad_change``); None when it did not."""
        change = self.rounds.grad_change(version, before, changes)
        if change is None:
            return None
        return {name: self.outer.peek_shift(dg) for name, dg in change.items()}

    def average_from_now(self) -> None:
        """Every later commit is the plain average: outer lr 1, no momentum."""
        self.outer = NesterovOuter(lr=1.0, momentum=0.0)

    def divergence(self, other: Mapping[str, Tensor]) -> float:
        """Relative L2 distance ``|a - b| / |a|`` between this anchor and another, all tensors."""
        diff = norm = 0.0
        for name, a in self.tensors.items():
            b = other[name].to("cpu", torch.float32)
            diff += float((a - b).double().square().sum())
            norm += float(a.double().square().sum())
        return math.sqrt(diff) / max(math.sqrt(norm), 1e-30)
