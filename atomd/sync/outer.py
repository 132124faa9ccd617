"""The outer step of DiLoCo-style training: how merged deltas move a peer's anchor.

A round's *outer gradient* is minus the mean of its deltas, ``g = -(1/k) * sum_j delta_j``
(the peer's own included), and a delta that comes after its round was committed commits the
change of that mean (``PendingRounds.coefficients``): whoever a peer counts as training the job,
once every peer has merged the same deltas they have committed the same sums.

The anchor then takes one SGD step with Nesterov momentum. With momentum 0 and lr 1 the step is
a plain average: the anchor becomes the mean of the replicas. That is the dense codecs' (fp32,
bf16, int8) default: in ``atomd bench sync`` at H=2 momentum 0.2 changes fp32's loss by 0.2%
and momentum 0.5 overshoots (1.781 -> 1.943); only at large H does momentum pay for them
(H=50: 1.911 -> 1.883, as in DiLoCo). Top-k is different: it sends, each round, the entries
whose progress is largest (mostly consistent signal; the noise waits in the replicas), and
amplifying exactly those pays: at H=2, 1.852 with the plain average, 1.796 / 1.755 / 1.724
with momentum 0.3 / 0.5 / 0.7. It is the size of the step, not momentum as such (outer lr 2
without momentum: 1.756, as momentum 0.5, whose steady-state step is 1/(1-m) = 2), hence the
per-codec default in ``SyncSpec``. Replicas restart from ``peek``, the look-ahead of the step
the commit will take, so momentum and late commits stay consistent.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor


def staleness_weight(staleness: int) -> float:
    """Weight of a delta that lags ``staleness`` anchor versions behind the receiver's: 1.

    Every delta counts in full, however late (up to ``max_staleness``, beyond which it is
    refused), so that every peer's anchor ends up with the same sum of deltas: a delta is
    applied by some receivers in the round it was sent and by others one or more rounds later,
    and a weight that depends on the receiver's own lateness makes their sums differ for good.
    A weight of 1/staleness for a delta 2+ rounds late was measured and dropped: in ``atomd bench
    sync`` with 3 % of the deltas two rounds late (4 peers, H=2, 100 steps) the anchors ended
    6.3 % apart (0.48 % with full weights, the momentum's timing, which decays), and 4 real
    daemons ended 1.6-3.5 % apart at unlimited with ~1 % of their deltas that late (research/).
    """
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    return 1.0


class NesterovOuter:
    """SGD with Nesterov momentum over named CPU fp32 tensors (PyTorch's convention).

    ``buf = m * buf + g``; ``anchor -= lr * (g + m * buf)``. Momentum 0 is plain SGD.
    """

    def __init__(self, *, lr: float, momentum: float) -> None:
        if lr <= 0:
            raise ValueError(f"outer lr must be > 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"outer momentum must be in [0, 1), got {momentum}")
        self.lr = lr
        self.momentum = momentum
        self.buffers: dict[str, Tensor] = {}

    @torch.no_grad()
    def step(self, anchor: Mapping[str, Tensor], grads: Mapping[str, Tensor]) -> None:
        """Update ``anchor`` in place from ``grads`` (same names, shapes)."""
        for name, g in grads.items():
            if self.momentum > 0:
                buf = self.buffers.get(name)
                if buf is None:
                    buf = self.buffers[name] = torch.zeros_like(g)
                buf.mul_(self.momentum).add_(g)
                anchor[name].add_(g.add(buf, alpha=self.momentum), alpha=-self.lr)
            else:
                anchor[name].add_(g, alpha=-self.lr)

    @torch.no_grad()
    def peek(self, anchor: Mapping[str, Tensor], grads: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Where ``step(anchor, grads)`` would move the anchor, without moving it or the momentum.

        Names missing from ``grads`` come back as the anchor's own tensors (not copies).
        """
        out = dict(anchor)
        for name, g in grads.items():
            step = g
            if self.momentum > 0:
                buf = self.buffers.get(name)
                look = g if buf is None else buf.mul(self.momentum).add_(g)
                step = g.add(look, alpha=self.momentum)
            out[name] = anchor[name].add(step, alpha=-self.lr)
        return out

    @torch.no_grad()
    def settle(
        self, anchor: Mapping[str, Tensor], grads: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        """Where the anchor ends after ``step(anchor, grads)`` and every later step with no more
        gradient, the momentum run out (copies; nothing moves). A gradient ``g`` moves the
        anchor by ``lr * g / (1 - m)`` in all (``lr * (1 + m) * g`` at once, then ``m`` times
        less each step after), whenever it is taken, and the buffer ``b`` still has
        ``lr * m^2 / (1 - m) * b`` to go: so peers that took the same gradients at different
        steps settle at the same point."""
        lr, m = self.lr, self.momentum
        out = {}
        for name, a in anchor.items():
            x = a.clone()
            g = grads.get(name)
            if g is not None:
                x.add_(g, alpha=-lr / (1.0 - m))
            buf = self.buffers.get(name)
            if buf is not None and m > 0:
                x.add_(buf, alpha=-lr * m * m / (1.0 - m))
            out[name] = x
        return out

    def peek_shift(self, dg: Tensor) -> Tensor:
        """How far ``peek`` moves a tensor when its gradient changes by ``dg``.

        ``peek`` is ``anchor - lr * ((1 + m) * g + m^2 * buf)``: linear in ``g``.
        """
        return dg.mul(-self.lr * (1.0 + self.momentum))

    def state_tensors(self) -> dict[str, Tensor]:
        return {name: buf.clone() for name, buf in self.buffers.items()}

    def load_state_tensors(self, tensors: Mapping[str, Tensor]) -> None:
        self.buffers = {
            name: t.detach().to("cpu", torch.float32).clone() for name, t in tensors.items()
        }
