"""A swapped layer in host memory: its fp32 masters, what a slot loads, where its gradient lands.

A layer's parameters are split into *groups* by the dtype they travel in over the link:
- with a bf16 link (CUDA and the host optimizer: the plan's ``link``) the matrices travel as
  bf16, a pinned copy of their fp32 masters that the optimizer step refreshes, and their
  gradient comes back as bf16 (the fp32 sum over a wave's micro-batches, rounded once). Under
  bf16 autocast a matmul casts its fp32 weight to exactly that bf16 copy, so forward and
  backward are bitwise those of resident training; only the stored gradient is rounded.
  The vectors (biases, LayerNorm) travel in fp32: LayerNorm runs in fp32 under autocast;
- with an fp32 link every parameter travels as its fp32 master.
Each group keeps flat buffers, so a slot's load or store is one copy per group rather than one
per tensor, and pinned memory is not rounded up to a power of two per tensor (+8% for GPT-3
shapes): ``master`` (fp32, the parameters' ``.data`` are views of it; pinned when it is what a
slot loads), ``src`` (what a slot loads: ``master`` itself, or its pinned copy in the link
dtype) and ``staging`` (pinned, where a slot's gradient lands).

The optimizer reads fp32 ``.grad``:
- one wave per step, fp32 link: ``staging`` is ``.grad``'s own buffer;
- several waves: each wave's gradient lands in ``staging`` and the host adds it into ``.grad``
  (fp32 accumulation across waves; no partial gradient travels back to the device);
- one wave, bf16 link: no fp32 gradient is kept per layer; ``.grad`` points into a scratch
  buffer filled from ``staging`` just before the step.
So host memory per swapped parameter is 16 B with one wave (fp32 master 4, AdamW moments 8,
and 4 of gradient and bf16 copy), 20 B with several.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn


def travels_low(p: Tensor, link: torch.dtype) -> bool:
    """Whether parameter ``p`` travels in the link dtype (matrices) or in fp32 (the rest)."""
    return link != torch.float32 and p.dim() >= 2


@dataclass
class Group:
    """Parameters of one swapped layer that travel in one dtype, as flat host buffers."""

    index: list[int]
    """Positions of the group's parameters in the layer's parameter list."""
    dtype: torch.dtype
    """What travels over the link."""
    master: Tensor
    """fp32 masters, flat; the parameters' ``.data`` are views of it."""
    src: Tensor
    """What a slot loads: ``master`` itself (fp32) or its pinned copy in ``dtype``."""
    staging: Tensor
    """Where a slot's gradient is stored (pinned, ``dtype``); ``.grad``'s own buffer when
    ``grad`` is it."""
    grad: Tensor | None
    """fp32 flat gradient (``.grad`` views of it), or None: filled from ``staging`` into a
    scratch buffer at the optimizer step."""

    @property
    def numel(self) -> int:
        return self.master.numel()

    def refresh(self) -> None:
        """Make ``src`` the masters again (after an optimizer step or any write to them)."""
        if self.src is not self.master:
            self.src.copy_(self.master)


def _views(flat: Tensor, shapes: Sequence[torch.Size]) -> list[Tensor]:
    out, at = [], 0
    for s in shapes:
        n = s.numel()
        out.append(flat[at : at + n].view(s))
        at += n
    return out


class HostLayer:
    """One swapped layer's host tensors (see the module docstring)."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        *,
        link: torch.dtype,
        pin: bool,
        accumulate: bool,
        keep_grad: bool,
    ) -> None:
        """``accumulate``: several waves per step (``.grad`` sums their gradients on the host);
        ``keep_grad``: an fp32 ``.grad`` must exist between steps (the device optimizer reads
        it, pinned)."""
        self.params = list(params)
        self.link = link
        self.groups: list[Group] = []
        low = [i for i, p in enumerate(self.params) if travels_low(p, link)]
        full = [i for i, p in enumerate(self.params) if not travels_low(p, link)]
        for index, dtype in ((low, link), (full, torch.float32)):
            if index:
                self.groups.append(self._group(index, dtype, pin, accumulate, keep_grad))

    def _group(
        self, index: list[int], dtype: torch.dtype, pin: bool, accumulate: bool, keep_grad: bool
    ) -> Group:
        ps = [self.params[i] for i in index]
        shapes = [p.shape for p in ps]
        n = sum(p.numel() for p in ps)
        fp32 = dtype == torch.float32
        master = torch.empty(n, dtype=torch.float32, pin_memory=pin and fp32)
        for view, p in zip(_views(master, shapes), ps, strict=True):
            view.copy_(p.detach())
            p.data = view
        src = master if fp32 else torch.empty(n, dtype=dtype, pin_memory=pin)
        grad: Tensor | None = None
        if fp32 and not accumulate:  # the slot's gradient goes straight into .grad
            grad = staging = torch.zeros(n, dtype=torch.float32, pin_memory=pin)
        else:
            staging = torch.zeros(n, dtype=dtype, pin_memory=pin)
            if accumulate or keep_grad:
                grad = torch.zeros(n, dtype=torch.float32, pin_memory=pin and keep_grad)
        if grad is not None:
            for view, p in zip(_views(grad, shapes), ps, strict=True):
                p.grad = view
        group = Group(index=index, dtype=dtype, master=master, src=src, staging=staging, grad=grad)
        group.refresh()
        return group

    @property
    def numel(self) -> int:
        return sum(g.numel for g in self.groups)

    def host_tensors(self) -> list[Tensor]:
        """Every distinct buffer this layer holds (for memory accounting)."""
        seen: dict[int, Tensor] = {}
        for g in self.groups:
            for t in (g.master, g.src, g.staging, g.grad):
                if t is not None:
                    seen.setdefault(id(t), t)
        return list(seen.values())

    def refresh(self) -> None:
        for g in self.groups:
            g.refresh()

    def accumulate(self, first: bool, scratch: Tensor) -> None:
        """Add the wave's gradient, just stored, into ``.grad`` (the first wave copies it). A
        bf16 gradient is widened into ``scratch`` first: adding bf16 into fp32 in one op ran
        2.3-3.5x an AdamW step per element, widening then adding 1.1x."""
        for g in self.groups:
            if g.grad is None or g.grad is g.staging:
                continue
            if first:
                g.grad.copy_(g.staging)
            elif g.staging.dtype == g.grad.dtype:
                g.grad.add_(g.staging)
            else:
                wide = scratch[: g.numel]
                wide.copy_(g.staging)
                g.grad.add_(wide)

    def grads(self) -> list[Tensor]:
        """The accumulated fp32 gradient, flat per group (with several waves)."""
        return [g.grad for g in self.groups if g.grad is not None]

    def param_grads(self) -> list[Tensor]:
        """Each parameter's fp32 ``.grad`` (the sums, with several waves), in layer order: the
        norms clipping takes per parameter, as resident training's ``clip_grad_norm_`` does."""
        grads = [p.grad for p in self.params]
        if any(g is None for g in grads):
            raise RuntimeError("a parameter has no .grad: one wave over a bf16 link keeps none")
        return [g for g in grads if g is not None]

    def grads_for_step(self, scratch: Tensor) -> None:
        """Point the ``.grad`` of groups that keep none into ``scratch``, filled from their
        staging (``scratch`` holds at least ``numel`` fp32 elements)."""
        at = 0
        for g in self.groups:
            if g.grad is not None:
                continue
            flat = scratch[at : at + g.numel]
            flat.copy_(g.staging)
            ps = [self.params[i] for i in g.index]
            for view, p in zip(_views(flat, [p.shape for p in ps]), ps, strict=True):
                p.grad = view
            at += g.numel

    def release_grads(self) -> None:
        """Drop the scratch views ``grads_for_step`` made (the scratch serves the next layer)."""
        for g in self.groups:
            if g.grad is None:
                for i in g.index:
                    self.params[i].grad = None

    def slot_layout(self) -> list[tuple[torch.dtype, list[int], list[torch.Size]]]:
        """Per group: its dtype, parameter positions and shapes (what a slot mirrors)."""
        return [(g.dtype, g.index, [self.params[i].shape for i in g.index]) for g in self.groups]


def slot_buffers(
    layout: Sequence[tuple[torch.dtype, list[int], list[torch.Size]]],
    n_params: int,
    device: torch.device,
) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor]]:
    """A slot's device buffers for a layer of this layout: (weights per parameter, fp32
    gradient accumulators per parameter, flat weights per group, flat gradients per group)."""
    weights: list[Tensor | None] = [None] * n_params
    grads: list[Tensor | None] = [None] * n_params
    flat_w: list[Tensor] = []
    flat_g: list[Tensor] = []
    total = sum(s.numel() for _, _, shapes in layout for s in shapes)
    g_all = torch.empty(total, dtype=torch.float32, device=device)
    at = 0
    for dtype, index, shapes in layout:
        n = sum(s.numel() for s in shapes)
        w = torch.empty(n, dtype=dtype, device=device)
        g = g_all[at : at + n]
        at += n
        flat_w.append(w)
        flat_g.append(g)
        for i, wv, gv in zip(index, _views(w, shapes), _views(g, shapes), strict=True):
            weights[i], grads[i] = wv, gv
    ws = [t for t in weights if t is not None]
    gs = [t for t in grads if t is not None]
    assert len(ws) == len(gs) == n_params, "the layout covers every parameter once"
    return ws, gs, flat_w, flat_g
