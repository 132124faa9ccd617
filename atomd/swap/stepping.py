"""The end of a swapped training step: the gradient's clipping coefficient, then every step.

``LayerSteps`` takes the norm of the whole gradient when the steps must wait for it (gradient
clipping, or fp16, whose loss scale says whether a gradient overflowed: then no layer steps
and the scale halves), and runs each layer's AdamW step where it lives: the swapped layers
optimized on the device with their next load (``SlotTraffic``), the others on the host worker
(``HostOptimizer``) in forward order, the resident layers here.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from atomd.swap.hostopt import HostOptimizer
from atomd.swap.streams import Streams, label
from atomd.swap.traffic import SlotTraffic
from atomd.train.optim import AdamW, OptimConfig
from atomd.train.step_engine import LossScale


class LayerSteps:
    """Clipping, loss scaling and the AdamW steps of the resident and the swapped layers."""

    def __init__(
        self,
        *,
        optim: OptimConfig,
        scale: LossScale,
        device: torch.device,
        streams: Streams,
        swapped: list[int],
        on_device: set[int],
        resident_opt: AdamW,
        host_opt: HostOptimizer,
        traffic: SlotTraffic,
    ) -> None:
        self.optim = optim
        self.scale = scale
        self.device = device
        self.streams = streams
        self.swapped = swapped
        self.on_device = on_device
        self.resident_opt = resident_opt
        self.host_opt = host_opt
        self.traffic = traffic

    def deferred(self) -> bool:
        """Whether the steps wait for the whole backward's gradient norm: to clip, or to see
        whether an fp16 gradient overflowed."""
        return self.optim.grad_clip > 0 or self.scale.enabled

    def finish(self, lr: float, norms: list[Tensor], waves: int) -> None:
        """After the backward of every wave: clip (``norms``: the per-parameter norms the
        backward took on the device), step every layer unless fp16 overflowed, and clear the
        resident gradients."""
        clip = self.deferred()
        resident_params = [p for grp in self.resident_opt.param_groups for p in grp["params"]]
        coef: Tensor | None = None
        if clip and waves > 1:  # the swapped layers' whole gradients exist on the host only
            host_norms = [n for layer in self.swapped for n in self.host_opt.norms_of(layer)]
            norms.extend(torch.stack(host_norms).to(self.device).unbind())
        skip = False
        if clip:  # as torch.nn.utils.clip_grad_norm_: norm of per-parameter norms
            resident_grads = [p.grad for p in resident_params if p.grad is not None]
            norms.extend(torch._foreach_norm(resident_grads))
            total_norm = torch.linalg.vector_norm(torch.stack([n.to(self.device) for n in norms]))
            if self.scale.enabled:  # the gradients are scaled: unscale through the coefficient
                s = self.scale.value
                skip = not self.scale.update(math.isfinite(float(total_norm)))
                total_norm = total_norm / s
            if self.optim.grad_clip > 0:
                coef = torch.clamp(self.optim.grad_clip / (total_norm + 1e-6), max=1.0)
            else:
                coef = torch.ones((), device=self.device)
            if self.scale.enabled:
                coef = coef / s
            torch._foreach_mul_(resident_grads, coef)
        if not skip:  # (skip: an fp16 overflow; no layer steps, the masters stay as they are)
            self._step_all(lr, coef)
        self.resident_opt.zero_grad(set_to_none=True)

    def _step_all(self, lr: float, coef: Tensor | None) -> None:
        """Every layer's AdamW step of this step: on the device with the next load, on the
        host worker, and the resident layers' here."""
        st = self.streams
        if self.on_device:  # each of these layers' step comes with its next load
            self.traffic.steps_due(self.on_device, lr, coef)
        on_host = [layer for layer in self.swapped if layer not in self.on_device]
        if coef is not None and on_host:
            st.host_reads(st.compute, "clip")
            with label("atomd.clip_coef_to_host"):
                coef_host = float(coef)  # waits for the compute stream, as the loss below does
            for layer in on_host:  # forward order: the next step needs these first
                self.host_opt.submit(layer, self.traffic.grad_stored[layer], lr=lr, clip=coef_host)
        for grp in self.resident_opt.param_groups:
            grp["lr"] = lr
        self.resident_opt.step()
