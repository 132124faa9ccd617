"""The rounds a peer's anchor has not committed for good: their pending and committed sums.

A round (its base version) counts as the mean of its deltas. ``PendingRounds`` holds, per
round, the weighted sum of the deltas merged and not committed yet, and the sum of those
committed so far (for the rounds that can still take a late delta): committing a round is
adding the change of its mean to the outer gradient, so that peers that counted the round's
peers differently still commit the same sum once they have merged the same deltas.
``RoundDirections`` holds the robust rule's direction reference of the newest rounds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor

from atomd.sync.robust import DeltaStats, Progress

# Rounds whose sums of unit deltas a peer keeps for the direction reference (codecs that send
# every entry: ``RoundDirections``): a delta is judged by the newest before its own.
DIRECTION_ROUNDS = 3

# A round's committed sum: each tensor flat, sparse where mostly zero (``compact``), and how
# many deltas it holds.
Committed = tuple[dict[str, Tensor], int]
# What joined (weight > 0) or left (weight < 0) a round: (weight, tensors).
Change = tuple[float, Mapping[str, Tensor]]


class PendingRounds:
    """Per base version: the weighted sum of the round's deltas not committed yet (``sums``),
    how many (``counts``), and the sum and count committed so far (``committed``)."""

    def __init__(self, like: Mapping[str, Tensor]) -> None:
        """``like``: the anchor, whose names and shapes every sum takes."""
        self._like = like
        self.sums: dict[int, dict[str, Tensor]] = {}
        self.counts: dict[int, int] = {}
        self.committed: dict[int, Committed] = {}

    def count(self, base_version: int) -> int:
        return self.counts.get(base_version, 0)

    def add(self, base_version: int, tensors: Mapping[str, Tensor], weight: float) -> None:
        acc = self.sums.get(base_version)
        if acc is None:
            acc = self.sums[base_version] = {n: torch.zeros_like(a) for n, a in self._like.items()}
            self.counts[base_version] = 0
        for name, t in tensors.items():
            acc[name].add_(t.to("cpu", torch.float32).reshape(acc[name].shape), alpha=weight)
        self.counts[base_version] += 1

    def remove(self, base_version: int, tensors: Mapping[str, Tensor], weight: float) -> None:
        """Take out a delta ``add`` put in (the round must still be pending)."""
        acc = self.sums[base_version]
        for name, x in tensors.items():
            acc[name].sub_(x.to("cpu", torch.float32).reshape(acc[name].shape), alpha=weight)
        self.counts[base_version] -= 1

    def drop_empty(self) -> None:
        for b in [b for b, k in self.counts.items() if k <= 0]:
            del self.sums[b], self.counts[b]

    def closed(self, version: int) -> list[int]:
        """The rounds before ``version`` that hold deltas not committed yet."""
        return [b for b, k in self.counts.items() if b < version and k > 0]

    def coefficients(self, base_version: int, count: int) -> tuple[float, float]:
        """(a, c): committing round ``base_version``'s ``count`` pending deltas (sum P) adds
        a * P + c * S to the anchor's outer gradient (negated), S the round's committed sum of
        k deltas: the round's mean (S + P) / (k + count) minus the mean committed, S / k. A
        round not committed yet (k = 0) gives the mean of its deltas; none pending, nothing."""
        if count <= 0:
            return 0.0, 0.0
        k = self.committed[base_version][1] if base_version in self.committed else 0
        return 1.0 / (k + count), (-count / (k * (k + count)) if k else 0.0)

    def outer_grad(self, rounds: Iterable[int]) -> dict[str, Tensor]:
        """The outer gradient that committing ``rounds``' pending deltas makes (see
        ``coefficients``): minus the change of each round's mean."""
        coefficients = {b: self.coefficients(b, self.counts[b]) for b in rounds}
        grads = {}
        for name, x in self._like.items():
            g = torch.zeros_like(x)
            for b, (a, c) in coefficients.items():
                g.add_(self.sums[b][name], alpha=a)
                if c:
                    g.add_(expand(self.committed[b][0][name], g), alpha=c)
            grads[name] = g.neg_()
        return grads

    def grad_change(
        self, version: int, before: Mapping[int, int], changes: Mapping[int, Sequence[Change]]
    ) -> dict[str, Tensor] | None:
        """How the outer gradient of the closed rounds (before ``version``) changed when
        ``changes`` joined or left the pending rounds, whose counts were ``before``; None when
        no closed round's estimate changed.

        The outer gradient holds -(a * P + c * S), P the pending sum and S the committed one;
        with P = P_old + A (A: the deltas added) it changes by
        (a_old - a_new) * P - a_old * A + (c_old - c_new) * S."""
        changed = {
            b: (self.coefficients(b, before.get(b, 0)), self.coefficients(b, k))
            for b, k in self.counts.items()
            if b < version and k != before.get(b, 0)
        }
        if not changed:
            return None
        out = {}
        for name, like in self._like.items():
            dg = torch.zeros_like(like)
            for b, ((a_old, c_old), (a_new, c_new)) in changed.items():
                dg.add_(self.sums[b][name], alpha=a_old - a_new)
                for w, tensors in changes.get(b, ()):
                    dg.add_(tensors[name].reshape(dg.shape), alpha=-a_old * w)
                if c_old != c_new:
                    dg.add_(expand(self.committed[b][0][name], dg), alpha=c_old - c_new)
            out[name] = dg
        return out

    def take_whole(self, base_version: int) -> dict[str, Tensor]:
        """Commit round ``base_version`` (one delta) as it is, outside the outer step; its sum."""
        whole = self.sums.pop(base_version)
        del self.counts[base_version]
        self.committed[base_version] = (compact(whole), 1)
        return whole

    def commit(self, due: Iterable[int]) -> None:
        """Move the ``due`` rounds' pending sums into their committed sums (S + P)."""
        for b in due:
            got, count = self.sums.pop(b), self.counts.pop(b)
            done = self.committed.get(b)
            if done is not None:  # in place where S is dense
                for name, x in got.items():
                    x.add_(expand(done[0][name], x))
                count += done[1]
            self.committed[b] = (compact(got), count)

    def prune(self, floor: int) -> None:
        """Forget the committed sums of rounds before ``floor``: they take no late delta."""
        self.committed = {b: c for b, c in self.committed.items() if b >= floor}


class RoundDirections:
    """Where the codec sends every entry: per round, the sum of its merged deltas (own
    included), each as a unit vector; the newest ``DIRECTION_ROUNDS``.

    The robust rule judges a dense delta's direction against the newest round before its own:
    nearly the same at every peer, so honest receivers take the same decision, and no member
    weighs more in it than one honest delta does. A one-step dense delta is mostly its sender's
    noise, so the receiver's own one-step progress is too noisy a reference, and plain sums
    let a member whose aligned delta counted more steer it (docs/robust-merge.md)."""

    def __init__(self, like: Mapping[str, Tensor]) -> None:
        self._like = like
        self._units: dict[int, dict[str, Tensor]] = {}

    def add(self, base_version: int, tensors: Mapping[str, Tensor]) -> None:
        norm = DeltaStats.of(tensors).norm
        if norm <= 0:
            return
        units = self._units.setdefault(
            base_version, {n: torch.zeros_like(a) for n, a in self._like.items()}
        )
        for name, t in tensors.items():
            # Divided in float64: 1 / norm of a delta of norm under ~3e-39 (finite, well-formed)
            # does not fit a float32 alpha.
            x = t.to("cpu", torch.float64).reshape(units[name].shape) / norm
            units[name].add_(x.to(torch.float32))
        for b in sorted(self._units)[:-DIRECTION_ROUNDS]:
            del self._units[b]

    def before(self, base_version: int) -> dict[str, Tensor] | None:
        """The newest round's sum before ``base_version``, or None when there is none."""
        rounds = [b for b in self._units if b < base_version]
        return self._units[max(rounds)] if rounds else None

    def clear(self) -> None:
        self._units = {}

    def reference(
        self, own: Callable[[], Mapping[str, Tensor]], *, dense: bool
    ) -> Callable[[int], Progress]:
        """The direction reference of each round's deltas for one inbox (rule 4 of
        ``atomd.sync.robust``): where the codec is ``dense`` the newest round before it
        (``before``), else (or before any round) this peer's own progress (``own``: what it
        trained that the swarm does not hold), made once."""
        towards: dict[int, Progress] = {}
        mine: list[Progress] = []

        def toward(base_version: int) -> Progress:
            if base_version not in towards:
                swarm = self.before(base_version) if dense else None
                if swarm is None:
                    if not mine:
                        mine.append(Progress.of(own()))
                    return mine[0]
                towards[base_version] = Progress.of(swarm)
            return towards[base_version]

        return toward


def compact(sums: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``sums`` flat, each tensor sparse (its nonzero entries) where at most a quarter of it is
    nonzero: a round of a sparse codec's deltas is kept at a fraction of its dense size."""
    out = {}
    for name, t in sums.items():
        flat = t.reshape(-1)
        nonzero = int(torch.count_nonzero(flat))
        out[name] = flat.to_sparse().coalesce() if 4 * nonzero <= flat.numel() else flat
    return out


def expand(t: Tensor, like: Tensor) -> Tensor:
    """A tensor of ``compact``'s, dense and shaped like ``like``."""
    return (t.to_dense() if t.is_sparse else t).reshape(like.shape)
