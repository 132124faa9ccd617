"""``SwapEngine``: training with the whole model in host memory and K layer slots on the device.

It wraps a ``GPT`` without changing it: ``GPT.layers()`` is [embedding, blocks..., head]. The
embedding and head (tied: one parameter, gradients from both uses) and the first
``plan.resident_blocks`` blocks are *resident*: they live on the device with their AdamW state,
as in ``ResidentEngine``. Every other block is *swapped*: its fp32 master weights, gradient and
AdamW state stay in host memory (``host``: 16 B/parameter with one wave per step) and a slot
receives a copy of its weights when a visit needs it: with a bf16 link (the plan's ``link``,
CUDA's default with the host optimizer) a bf16 copy of the matrices, which is exactly what
autocast would make of the fp32 masters, so half the bytes cross the link for the same
arithmetic. A block runs on a slot's tensors via
``torch.func.functional_call`` on the host module, so the model code knows nothing of slots
(one reparametrization per visit serves its M micro-batches: per micro-batch it was a third
of the engine's Python time on a small model).

One optimizer step of G micro-batches is G / M *waves*; in a wave, all M micro-batches pass
through a layer before the next layer is needed (layer-major), so one load serves M.
- Forward (no autograd graph): each layer's input is kept (activation checkpointing; spilled to
  host memory when the plan says so); the load of a later layer is issued as soon as its slot's
  previous visit has been issued (``schedule``), on the load stream.
- The turn: the head's forward and backward run together; the last K swapped layers are still
  in their slots and serve the first backward visits without a reload.
- Kept graphs: the last ``plan.graph_blocks`` blocks run their forward with autograd and keep
  the graph until backward (no recompute: a quarter of a block's compute saved, for memory
  the planner has room for). A swapped block's slot is reused before its backward, so any
  slot tensor autograd saves is copied as it is saved (a saved-tensors hook): under bf16
  autocast only the LayerNorm weights, since matmuls save the bf16 copy autocast made (one
  for the M micro-batches: they run in one autocast region).
- Backward: each other layer's forward is recomputed from its saved input, and its gradient
  summed over the wave's micro-batches in the slot's fp32 buffer; the buffer is copied to the
  host (in the link dtype) on the store stream and the host worker (``hostopt``) adds it into
  the layer's fp32 ``.grad`` when a step has several waves, and in the last wave runs the
  layer's AdamW step right away (overlapping the backward of earlier layers).
- Gradient clipping (``grad_clip > 0``) needs the global norm, known only after the whole
  backward: per-parameter norms are taken on the device as each gradient completes (on the
  host, from the sums, when a step has several waves), and the host steps are submitted after
  the backward, in forward order, with the clipping coefficient; the next step's forward waits
  for each layer's update just before loading it. With ``grad_clip = 0`` each layer steps as
  soon as its gradient is complete.
- With the optimizer on the device (``plan.optimizer == "device"``, for hosts whose CPU cannot
  keep up) a layer's step waits for its next load: the load stream brings its gradient and
  AdamW moments along with its weights, runs torch's fused AdamW on them in the slot (the
  swarm's AdamW, ``atomd.train.optim.swarm_adamw_step``, while peers average the steps;
  clipping coefficient and learning rate of the step that made the gradient: exact) and the store
  stream copies the updated master weights and moments back. ``settle`` applies the steps still
  waiting (before a checkpoint, an evaluation's end, or sync touching the parameters).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.optim.adam import adam

from atomd.data.dataset import Batch
from atomd.errors import CheckpointError, SwapError
from atomd.logs import get_logger
from atomd.model.gpt import GPT, lm_loss
from atomd.swap.host import HostLayer, slot_buffers
from atomd.swap.hostopt import HostOptimizer
from atomd.swap.plan import SwapPlan
from atomd.swap.record import Recorder
from atomd.swap.schedule import training_visits
from atomd.swap.slots import Slot, SwapStats, Wave, nbytes
from atomd.swap.streams import DONE, Marker, Streams, label
from atomd.train.engine import (
    LossScale,
    Precision,
    autocast,
    load_model_tensors,
    model_tensors,
    window_mean,
)
from atomd.train.optim import (
    AdamW,
    OptimConfig,
    build_adamw,
    optimizer_state_by_param,
    optimizer_tensors,
    second_moments,
)
from atomd.units import format_bytes

log = get_logger(__name__)
_T = TypeVar("_T")


class _Scope(nn.Module):
    """The way into ``functional_call`` for a whole layer visit: ``forward(fn)`` runs
    ``fn(block)`` while the block's parameters are a slot's tensors, so the M micro-batches of
    a visit (their forward, or their recompute and backward) share one reparametrization."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, fn: Callable[[nn.Module], _T]) -> _T:
        return fn(self.block)


@dataclass
class Graph:
    """A layer's forward kept with autograd: its M inputs (leaves), weights (leaves), outputs."""

    inputs: list[Tensor]
    leaves: list[Tensor]
    outs: list[Tensor]


def _slot_of(slot: Slot | None) -> dict[str, int]:
    return {} if slot is None else {"slot": slot.index}


class SwapEngine:
    """A ``StepEngine`` that streams blocks through K device slots (see the module docstring)."""

    def __init__(
        self,
        model: GPT,
        optim: OptimConfig,
        device: torch.device,
        plan: SwapPlan,
        *,
        precision: Precision | None = None,
    ) -> None:
        cfg = model.config
        # None: bf16 autocast on CUDA, fp32 on the CPU. fp16 scales the loss (LossScale): the
        # steps then wait for the whole backward, whose gradient norm says whether one
        # overflowed (skip the step, halve the scale), as with gradient clipping.
        self.precision = precision
        self.scale = LossScale(enabled=precision == "fp16")
        if self.scale.enabled and plan.link != "fp32":
            raise SwapError("fp16 compute needs the fp32 link (bf16 copies are bf16's)")
        if cfg.dropout:
            raise SwapError("the swap engine recomputes layers in backward and needs dropout 0")
        if plan.n_layer != cfg.n_layer or plan.swapped_blocks < 2:
            raise SwapError(
                f"plan for {plan.n_layer} blocks does not fit a {cfg.n_layer}-block model"
            )
        self.model, self.optim, self.device, self.plan = model, optim, device, plan
        self.streams = Streams(device)
        self.layers: list[nn.Module] = model.layers()
        n = len(self.layers)
        self.swapped = list(range(1 + plan.resident_blocks, n - 1))
        self._swapped_set = set(self.swapped)
        self.resident = [i for i in range(n) if i not in self._swapped_set]
        cuda = device.type == "cuda"
        for i in self.resident:  # Module.to moves each Parameter in place: the tie survives
            self.layers[i].to(device)
        self.resident_opt = build_adamw(
            nn.ModuleList(self.layers[i] for i in self.resident),
            optim,
            fused=True if cuda else None,
        )
        # The swapped layers whose AdamW step runs on the device ('device': all; 'split': the
        # first ones, needed first by the next forward); the others step on the host.
        self.on_device = set(self.swapped[: plan.steps_on_device])
        self.device_opt = bool(self.on_device)  # slots then carry fp32 weights and moments
        self.link = torch.bfloat16 if plan.link == "bf16" else torch.float32
        if self.device_opt and self.link != torch.float32:
            raise SwapError("the device optimizer steps fp32 masters: it needs an fp32 link")
        self.host_params: dict[int, list[nn.Parameter]] = {}
        self.hosts: dict[int, HostLayer] = {}
        t0 = time.perf_counter()
        for i in self.swapped:
            params = list(self.layers[i].parameters())
            self.hosts[i] = HostLayer(
                params,
                link=self.link,
                pin=cuda,
                accumulate=plan.waves > 1,
                keep_grad=i in self.on_device,
            )
            self.host_params[i] = params
        host = [t for h in self.hosts.values() for t in h.host_tensors()]
        log.info(
            "host masters, link copies and gradients: %s (%s pinned) in %.1f s",
            format_bytes(nbytes(host)),
            format_bytes(nbytes([t for t in host if t.is_pinned()])),
            time.perf_counter() - t0,
        )
        first = self.layers[self.swapped[0]]
        self._names = [name for name, _ in first.named_parameters()]
        self._scopes = {i: _Scope(self.layers[i]) for i in self.swapped}
        layout = self.hosts[self.swapped[0]].slot_layout()
        if any(self.hosts[i].slot_layout() != layout for i in self.swapped):
            raise SwapError("swapped layers must all have the same parameter shapes")
        self.slots: list[Slot] = []
        for _ in range(plan.slots):
            weights, grads, flat_w, flat_g = slot_buffers(layout, len(self._names), device)
            moments = [torch.empty_like(g) for g in 2 * grads] if self.device_opt else []
            self.slots.append(Slot(weights, grads, flat_w, flat_g, moments, len(self.slots)))
        self.host_opt = HostOptimizer({i: self.layers[i] for i in self.swapped}, self.hosts, optim)
        # With the optimizer on the device: layer -> (lr, clipping coefficient) of the step its
        # next load applies, and the marker of its last copy back to the host.
        self._due: dict[int, tuple[float, Tensor | None]] = {}
        self._written: dict[int, Marker] = {}
        self._coef: Marker = DONE  # the clipping coefficient the due steps use is computed
        self.host_opt.init_state(pinned=self.on_device if cuda else set())
        # The link copies follow the masters after each step; after ``settle`` the caller may
        # write the masters, so the next step or evaluation refreshes them first.
        self._refresh_links = False
        self._grad_stored: dict[int, Marker] = {}
        self._spill_pool: dict[tuple[int, int], Tensor] = {}
        self._spill_free: dict[int, Marker] = {}  # layer -> its spill buffers were read back
        # The last graph_blocks blocks (layers n-1-g .. n-2) keep their forward graphs.
        self._graphs = set(range(n - 1 - plan.graph_blocks, n - 1))
        self._graph_bytes: dict[int, int] = {}  # layer -> bytes its kept graph saved
        self._slot_storage = {w.untyped_storage().data_ptr() for s in self.slots for w in s.weights}
        spillable = set(range(1, n - 2)) - self._graphs  # a kept graph holds its own input
        self._spilled_layers = spillable if plan.spill else set()
        self.stats = SwapStats()
        log.info(
            "swap engine: %d swapped blocks, %d slots, M=%d, resident: embedding, head and %d "
            "blocks, spill %s, optimizer on the %s",
            len(self.swapped),
            plan.slots,
            plan.micro_batches,
            plan.resident_blocks,
            "on" if plan.spill else "off",
            plan.optimizer,
        )

    def _wave(self, visits: list[int]) -> Wave:
        return Wave(self.slots, visits, self._load_weights)

    # -- copies ---------------------------------------------------------------------------------

    def _load_weights(self, layer: int, slot: Slot) -> None:
        st = self.streams
        with label(f"atomd.wait_host_step.{layer}"):
            self.host_opt.wait(layer)  # its update must be in the host master before we copy it
        due = self._due.pop(layer, None)
        st.wait(st.load, slot.used, slot.saved, self._written.get(layer, DONE))
        with st.on(st.load), torch.no_grad(), label(f"atomd.load.{layer}"):
            for w, g in zip(slot.flat_weights, self.hosts[layer].groups, strict=True):
                w.copy_(g.src, non_blocking=True)
            st.work(st.load, "weights", layer, slot=slot.index)
            if due is not None:
                # After the weights: the step overwrites the slot's gradient buffer (stored
                # out?), reads the layer's .grad (stored?) and the clipping coefficient.
                st.wait(st.load, slot.stored, self._grad_stored.get(layer, DONE), self._coef)
                self._device_step(layer, slot, *due)
                st.work(st.load, "device_step", layer, slot=slot.index)
        slot.loaded, slot.layer = st.mark(st.load), layer
        self.stats.layer_loads += 1
        self.stats.bytes_loaded += nbytes(slot.flat_weights)
        if due is not None:
            self._save_step(layer, slot)

    def _device_step(self, layer: int, slot: Slot, lr: float, coef: Tensor | None) -> None:
        """On the load stream, after the weights: bring the gradient and moments in and run the
        layer's AdamW step in the slot, with the hyperparameters of its host optimizer."""
        host, opt = self.host_params[layer], self.host_opt.optimizers[layer]
        n = len(host)
        states = [opt.state[p] for p in host]
        for j, p in enumerate(host):
            assert p.grad is not None
            slot.grads[j].copy_(p.grad, non_blocking=True)
            slot.moments[j].copy_(states[j]["exp_avg"], non_blocking=True)
            slot.moments[n + j].copy_(states[j]["exp_avg_sq"], non_blocking=True)
        if coef is not None:
            torch._foreach_mul_(slot.grads, coef)
        index = {id(p): j for j, p in enumerate(host)}
        for group in opt.param_groups:
            js = [index[id(p)] for p in group["params"]]
            if not js:
                continue
            if opt.peers > 1:  # the swarm's second moment (atomd.train.optim.AdamW)
                opt.swarm_step(
                    group,
                    [slot.weights[j] for j in js],
                    [slot.grads[j] for j in js],
                    [slot.moments[j] for j in js],
                    [slot.moments[n + j] for j in js],
                    step=int(states[js[0]]["step"]) + 1,
                    lr=lr,
                )
                continue
            beta1, beta2 = group["betas"]
            # The step counter lives on the host; the fused kernel counts its own copy.
            steps = [torch.full((), float(states[j]["step"]), device=self.device) for j in js]
            adam(
                [slot.weights[j] for j in js],
                [slot.grads[j] for j in js],
                [slot.moments[j] for j in js],
                [slot.moments[n + j] for j in js],
                [],
                steps,
                fused=True,
                decoupled_weight_decay=True,  # AdamW
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=lr,
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
            )
        for st in states:
            st["step"] += 1
        self.stats.bytes_loaded += nbytes(slot.grads) + nbytes(slot.moments)

    def _save_step(self, layer: int, slot: Slot) -> None:
        """Copy a device step's updated master weights and moments back, on the store stream."""
        st = self.streams
        host, opt = self.host_params[layer], self.host_opt.optimizers[layer]
        n = len(host)
        st.wait(st.store, slot.loaded)
        with st.on(st.store), torch.no_grad():
            for j, p in enumerate(host):
                p.copy_(slot.weights[j], non_blocking=True)
                opt.state[p]["exp_avg"].copy_(slot.moments[j], non_blocking=True)
                opt.state[p]["exp_avg_sq"].copy_(slot.moments[n + j], non_blocking=True)
            st.work(st.store, "device_state", layer, slot=slot.index)
        slot.saved = self._written[layer] = st.mark(st.store)
        self.stats.bytes_stored += nbytes(slot.weights) + nbytes(slot.moments)

    def _store_grads(self, layer: int, slot: Slot) -> Marker:
        """Copy the slot's gradient (this wave's sum) to the layer's host staging, in the link
        dtype, on the store stream."""
        st = self.streams
        host = self.hosts[layer]
        # The staging buffer is free once the host has used the previous wave's (or step's)
        # gradient: long done by now, as a whole wave lies between.
        self.host_opt.wait(layer)
        st.wait(st.store, slot.used)
        with st.on(st.store), torch.no_grad(), label(f"atomd.store.{layer}"):
            for acc, g in zip(slot.flat_grads, host.groups, strict=True):
                g.staging.copy_(acc, non_blocking=True)  # a bf16 link rounds here, once
            st.work(st.store, "grads", layer, slot=slot.index)
        slot.stored = self._grad_stored[layer] = st.mark(st.store)
        self.stats.bytes_stored += nbytes([g.staging for g in host.groups])
        return slot.stored

    def _spill(self, layer: int, acts: list[Tensor]) -> tuple[list[Tensor], Marker]:
        """Copy ``layer``'s inputs to pinned host buffers (reused), on the store stream."""
        st = self.streams
        st.wait(st.store, st.mark(st.compute), self._spill_free.pop(layer, DONE))
        hosts = []
        with st.on(st.store):
            for mi, a in enumerate(acts):
                buf = self._spill_pool.get((layer, mi))
                if buf is None or buf.shape != a.shape or buf.dtype != a.dtype:
                    buf = torch.empty(a.shape, dtype=a.dtype, pin_memory=self.streams.cuda)
                    self._spill_pool[(layer, mi)] = buf
                buf.copy_(a, non_blocking=True)
                st.hand_over(a, st.store)
                hosts.append(buf)
            st.work(st.store, "spill", layer, m=len(acts))
        self.stats.bytes_stored += nbytes(acts)
        return hosts, st.mark(st.store)

    def _fetch(self, layer: int, hosts: list[Tensor], ready: Marker) -> tuple[list[Tensor], Marker]:
        """Bring spilled inputs back on the load stream (issued one layer ahead of their use)."""
        st = self.streams
        st.wait(st.load, ready)
        with st.on(st.load):
            devs = [h.to(self.device, non_blocking=True) for h in hosts]
            st.work(st.load, "spill", layer, m=len(devs))
        for d in devs:
            st.hand_over(d, st.compute)
        self._spill_free[layer] = st.mark(st.load)
        self.stats.bytes_loaded += nbytes(devs)
        return devs, self._spill_free[layer]

    # -- compute --------------------------------------------------------------------------------

    def _run(self, i: int, weights: Sequence[Tensor] | None, fn: Callable[[nn.Module], _T]) -> _T:
        """``fn(layer i)`` under autocast, the layer's parameters being ``weights`` (a slot's
        tensors, or autograd leaves made from them) unless None (a resident layer)."""
        with self._autocast():
            if weights is None:
                return fn(self.layers[i])
            params = {f"block.{n}": w for n, w in zip(self._names, weights, strict=True)}
            out: _T = functional_call(self._scopes[i], params, (fn,))
            return out

    def _forward(
        self, i: int, acts: list[Tensor], weights: Sequence[Tensor] | None
    ) -> list[Tensor]:
        """Layer i's forward of every micro-batch in ``acts``."""
        return self._run(i, weights, lambda layer: [layer(a) for a in acts])

    def _forward_graph(self, i: int, acts: list[Tensor], slot: Slot | None) -> Graph:
        """Layer i's forward with autograd, the graph kept for backward (a block's only).
        Slot tensors that autograd saves are copied: the slot is reused before backward."""
        leaves: list[Tensor] = (
            [w.detach().requires_grad_() for w in slot.weights]
            if slot is not None
            else list(self.layers[i].parameters())
        )
        held = 0
        copies: dict[tuple[int, tuple[int, ...], tuple[int, ...]], Tensor] = {}

        def pack(t: Tensor) -> Tensor:
            nonlocal held
            if t.untyped_storage().data_ptr() in self._slot_storage:
                key = (t.data_ptr(), tuple(t.shape), t.stride())
                if key in copies:  # the M micro-batches share one copy
                    return copies[key]
                t = copies[key] = t.detach().clone()
            held += t.numel() * t.element_size()
            return t

        xs = [a.detach().requires_grad_() for a in acts]
        # One autocast region around the M micro-batches: its weight cache makes one bf16 copy
        # of the weights for all of them (each _call's own region would make, and keep, M).
        with (
            torch.enable_grad(),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            self._autocast(),
        ):
            outs = self._forward(i, xs, leaves if slot is not None else None)
        self._graph_bytes[i] = held
        return Graph(xs, leaves, outs)

    def _backward_layer(
        self,
        i: int,
        inputs: list[Tensor] | Graph,
        grad_outs: list[Tensor],
        targets: list[Tensor],
        weights: list[Tensor] | None,
        accs: list[Tensor] | None,
        fresh: bool,
        g_total: int,
        total: Tensor,
    ) -> list[Tensor]:
        """Backpropagate every micro-batch through layer i: through its kept graph, or by
        recomputing it from its inputs. Parameter gradients go to ``accs`` (a slot) or to
        ``.grad`` (resident layers)."""
        if isinstance(inputs, Graph):
            return self._backward_graph(i, inputs, grad_outs, accs, fresh)
        leaves: list[Tensor] = (
            [w.detach().requires_grad_() for w in weights]
            if weights is not None
            else list(self.layers[i].parameters())
        )
        grad_ins: list[Tensor] = []

        def recompute_and_backward(layer: nn.Module) -> None:
            # One micro-batch's graph at a time: recompute, backward, free.
            for mi, a in enumerate(inputs):
                floating = a.is_floating_point()  # the embedding's input is token ids
                x = a.detach().requires_grad_() if floating else a
                with torch.enable_grad():
                    out = layer(x)
                    if i == len(self.layers) - 1:  # the head: the loss, scaled as resident
                        loss = lm_loss(out, targets[mi]) / g_total
                        total.add_(loss.detach())
                        grads = torch.autograd.grad(self.scale.scale(loss), [x, *leaves])
                    else:
                        wrt = [x, *leaves] if floating else leaves
                        grads = torch.autograd.grad(out, wrt, grad_outs[mi])
                if floating:
                    grad_ins.append(grads[0])
                    grads = grads[1:]
                self._accumulate(leaves, grads, accs, fresh and mi == 0)

        self._run(i, leaves if weights is not None else None, recompute_and_backward)
        return grad_ins

    def _backward_graph(
        self,
        i: int,
        graph: Graph,
        grad_outs: list[Tensor],
        accs: list[Tensor] | None,
        fresh: bool,
    ) -> list[Tensor]:
        """Backpropagate every micro-batch through block i's kept graph (no recompute)."""
        # One backward per micro-batch, summed here in fp32: a single backward through the M
        # graphs would sum the gradients of autocast's one shared bf16 weight copy in bf16
        # (measured: 8% parameter difference after 3 steps, test_under_bf16_autocast_as_on_cuda).
        grad_ins: list[Tensor] = []
        for mi, (x, out) in enumerate(zip(graph.inputs, graph.outs, strict=True)):
            grads = torch.autograd.grad(out, [x, *graph.leaves], grad_outs[mi])
            grad_ins.append(grads[0])
            self._accumulate(graph.leaves, grads[1:], accs, fresh and mi == 0)
        self._graph_bytes.pop(i, None)
        return grad_ins

    @staticmethod
    @torch.no_grad()
    def _accumulate(
        leaves: list[Tensor], grads: Sequence[Tensor], accs: list[Tensor] | None, first: bool
    ) -> None:
        """Add one micro-batch's parameter gradients to a slot's accumulator (``first``:
        overwrite it) or to resident parameters' ``.grad``."""
        if accs is not None:
            for acc, g in zip(accs, grads, strict=True):
                if first:
                    acc.copy_(g)
                else:
                    acc.add_(g)
        else:
            for p, g in zip(leaves, grads, strict=True):
                p.grad = g if p.grad is None else p.grad.add_(g)

    def train_step(self, batches: Sequence[Batch], lr: float) -> float:
        g_total, m = len(batches), self.plan.micro_batches
        if g_total % m:
            raise SwapError(f"{g_total} micro-batches per step do not divide into waves of M={m}")
        if (g_total // m > 1) != (self.plan.waves > 1):
            raise SwapError(
                f"{g_total} micro-batches make {g_total // m} wave(s) of M={m}; the engine was "
                f"built for {self.plan.waves} (host gradient sums are allocated for it)"
            )
        self._refresh_if_written()
        self.model.train()
        self.stats = SwapStats()
        st = self.streams
        clip = self._deferred()
        total = torch.zeros((), device=self.device)
        norms: list[Tensor] = []
        waves = g_total // m
        for w in range(waves):
            self._train_wave(
                batches[w * m : (w + 1) * m],
                g_total=g_total,
                first=w == 0,
                last=w == waves - 1,
                lr=None if clip else lr,
                norms=norms,
                total=total,
            )
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
        st.work(st.compute, "optimizer", -1)
        for slot in self.slots:
            slot.layer = None  # stale: the host masters change
        st.host_reads(st.compute, "loss")
        if st.recorder is not None:
            st.recorder.end_step()
        with label("atomd.loss_to_host"):
            return float(total)

    def _train_wave(
        self,
        batches: Sequence[Batch],
        *,
        g_total: int,
        first: bool,
        last: bool,
        lr: float | None,
        norms: list[Tensor],
        total: Tensor,
    ) -> None:
        st, n = self.streams, len(self.layers)
        single = first and last  # one wave per step: no sum of waves on the host
        clip = self._deferred()
        xs = [b.x.to(self.device, non_blocking=True) for b in batches]
        ys = [b.y.to(self.device, non_blocking=True) for b in batches]
        wave = self._wave(training_visits(self.swapped))
        # saved[i]: layer i's inputs on the device, or spilled[i]: on the host (+ its marker)
        saved: dict[int, list[Tensor]] = {0: xs}
        spilled: dict[int, tuple[list[Tensor], Marker]] = {}
        graphs: dict[int, Graph] = {}
        acts = xs
        for i in range(n - 1):  # forward up to the head; the head runs at the turn
            slot = wave.next(i) if i in self._swapped_set else None
            if slot is not None:
                st.wait(st.compute, slot.loaded)
            with label(f"atomd.fwd.{i}"):
                if i in self._graphs:
                    graphs[i] = self._forward_graph(i, acts, slot)
                    acts = [o.detach() for o in graphs[i].outs]
                else:
                    with torch.no_grad():
                        acts = self._forward(i, acts, slot.weights if slot else None)
            kind = "embed" if i == 0 else "fwd"
            st.work(st.compute, kind, i, m=len(acts), kept=i in graphs, **_slot_of(slot))
            if slot is not None:
                slot.used = st.mark(st.compute)
                wave.done()
            if i + 1 in self._spilled_layers:
                spilled[i + 1] = self._spill(i + 1, acts)
            elif i + 1 not in self._graphs:
                saved[i + 1] = acts
            self._note_held(saved, acts)
        grad_outs: list[Tensor] = []
        fetched: dict[int, tuple[list[Tensor], Marker]] = {}
        for i in range(n - 1, -1, -1):
            if i - 1 in spilled:  # prefetch the next layer's inputs while this one computes
                fetched[i - 1] = self._fetch(i - 1, *spilled.pop(i - 1))
            inputs: list[Tensor] | Graph
            if i in graphs:
                inputs = graphs.pop(i)
            elif i in fetched:
                inputs, ready = fetched.pop(i)
                st.wait(st.compute, ready)
            else:
                inputs = saved.pop(i)
            slot = wave.next(i) if i in self._swapped_set else None
            if slot is None:
                with label(f"atomd.bwd.{i}"):
                    grad_outs = self._backward_layer(
                        i, inputs, grad_outs, ys, None, None, first, g_total, total
                    )
                kind = "head" if i == n - 1 else "embed_bwd" if i == 0 else "bwd"
                st.work(st.compute, kind, i, m=len(batches), kept=isinstance(inputs, Graph))
            else:
                st.wait(st.compute, slot.loaded, slot.stored)
                with label(f"atomd.bwd.{i}"):
                    # Every wave's gradient starts afresh in the slot: the host sums the waves.
                    grad_outs = self._backward_layer(
                        i, inputs, grad_outs, ys, slot.weights, slot.grads, True, g_total, total
                    )
                kept = isinstance(inputs, Graph)
                st.work(st.compute, "bwd", i, m=len(batches), kept=kept, slot=slot.index)
                if clip and single:  # the slot holds the layer's whole gradient
                    norms.extend(torch._foreach_norm(slot.grads))
                slot.used = st.mark(st.compute)
                stored = self._store_grads(i, slot)
                step_lr = lr if last and i not in self.on_device else None
                if not single or step_lr is not None:
                    self.host_opt.submit(
                        i,
                        stored,
                        accumulate=not single,
                        first=first,
                        norms=last and clip,
                        lr=step_lr,
                    )
                wave.done()
            del inputs
            self._note_held(saved, grad_outs)

    def _step_all(self, lr: float, coef: Tensor | None) -> None:
        """Every layer's AdamW step of this step: on the device with the next load, on the
        host worker, and the resident layers' here."""
        st = self.streams
        if self.on_device:  # each of these layers' step comes with its next load
            if coef is not None:  # computed on the compute stream, read on the load stream
                self._coef = st.mark(st.compute)
                st.hand_over(coef, st.load)
            self._due.update((layer, (lr, coef)) for layer in self.on_device)
        on_host = [layer for layer in self.swapped if layer not in self.on_device]
        if coef is not None and on_host:
            st.host_reads(st.compute, "clip")
            with label("atomd.clip_coef_to_host"):
                coef_host = float(coef)  # waits for the compute stream, as the loss below does
            for layer in on_host:  # forward order: the next step needs these first
                self.host_opt.submit(layer, self._grad_stored[layer], lr=lr, clip=coef_host)
        for grp in self.resident_opt.param_groups:
            grp["lr"] = lr
        self.resident_opt.step()

    def _deferred(self) -> bool:
        """Whether the steps wait for the whole backward's gradient norm: to clip, or to see
        whether an fp16 gradient overflowed."""
        return self.optim.grad_clip > 0 or self.scale.enabled

    def _autocast(self) -> contextlib.AbstractContextManager[object]:
        # Looked up at call time (tests patch the module's autocast).
        if self.precision is None:
            return autocast(self.device)
        return autocast(self.device, self.precision)

    def precision_stats(self) -> dict[str, Any] | None:
        """fp16's loss scale and the steps skipped so far (None for other precisions)."""
        return self.scale.stats()

    def _note_held(self, saved: dict[int, list[Tensor]], current: list[Tensor]) -> None:
        held = sum(nbytes(ts) for ts in saved.values()) + nbytes(current)
        held += sum(self._graph_bytes.values())
        self.stats.peak_held_bytes = max(self.stats.peak_held_bytes, held)

    @torch.no_grad()
    def evaluate(self, batches: Sequence[Batch]) -> float:
        self._refresh_if_written()
        self.model.eval()
        self.stats = SwapStats()
        st, m, n = self.streams, self.plan.micro_batches, len(self.layers)
        losses: list[Tensor] = []
        for c in range(0, len(batches), m):
            chunk = batches[c : c + m]
            acts = [b.x.to(self.device, non_blocking=True) for b in chunk]
            wave = self._wave(list(self.swapped))
            for i in range(n - 1):
                slot = wave.next(i) if i in self._swapped_set else None
                if slot is not None:
                    st.wait(st.compute, slot.loaded)
                acts = self._forward(i, acts, slot.weights if slot else None)
                if slot is not None:
                    slot.used = st.mark(st.compute)
                    wave.done()
            for a, b in zip(acts, chunk, strict=True):  # logits one micro-batch at a time
                (logits,) = self._forward(n - 1, [a], None)
                losses.append(lm_loss(logits, b.y.to(self.device, non_blocking=True)))
        return window_mean(losses, batches)

    # -- state ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def recording(self) -> Iterator[Recorder]:
        """Record the work the engine issues meanwhile (``atomd.swap.trace``)."""
        recorder = Recorder()
        self.streams.recorder = self.host_opt.recorder = recorder
        try:
            yield recorder
        finally:
            self.streams.recorder = self.host_opt.recorder = None

    def _refresh_if_written(self) -> None:
        """After ``settle`` the masters may have been written (sync, a checkpoint load): the
        link copies a slot loads are made again from them, on the worker, in forward order
        (each load waits for its layer's)."""
        if self._refresh_links:
            self._refresh_links = False
            if self.link != torch.float32:
                for layer in self.swapped:
                    self.host_opt.refresh(layer)

    def _optimizers(self) -> list[AdamW]:
        return [self.resident_opt, *(opt for _, opt in self.host_opt.each())]

    def set_peers(self, peers: int) -> None:
        """For the steps after ``settle`` (a device step still due would take the new count:
        the sync plugin settles first); a device step reads its host optimizer's."""
        for opt in self._optimizers():
            opt.peers = peers

    def second_moments(self) -> dict[str, Tensor]:
        """Of the host masters' AdamW state (settled: the device steps' are copied back)."""
        return second_moments(self._optimizers(), self.model)

    def settle(self) -> None:
        """Finish the host optimizer's steps and apply the device steps still due (through the
        first slot), then wait for their copies back: the host masters and AdamW state are
        the model after the last step. Slots count as empty afterwards: the caller may change
        the masters in place."""
        self.host_opt.drain()
        stats, self.stats = self.stats, SwapStats()  # the flush is no step's traffic
        for n, layer in enumerate(list(self._due)):  # round-robin: loads overlap copies back
            self._load_weights(layer, self.slots[n % len(self.slots)])
        self.stats = stats
        for marker in self._written.values():
            marker.synchronize()
        self._written.clear()
        for slot in self.slots:
            slot.layer = None
        self._refresh_links = True

    def model_tensors(self) -> dict[str, Tensor]:
        self.settle()
        return model_tensors(self.model)

    def optimizer_tensors(self) -> dict[str, Tensor]:
        self.settle()
        out: dict[str, Tensor] = {}
        for opt in self._optimizers():
            out.update(optimizer_tensors(opt, self.model))
        out.update(self.scale.tensors())
        return out

    def load_tensors(self, model: dict[str, Tensor], optimizer: dict[str, Tensor]) -> None:
        """Load ``model_tensors``/``optimizer_tensors`` of a swapped or a resident run."""
        self.settle()
        load_model_tensors(self.model, model)
        self.scale.load(optimizer)
        for slot in self.slots:
            slot.layer = None
        params = dict(self.model.named_parameters())
        owner = {id(p): o for o in self._optimizers() for g in o.param_groups for p in g["params"]}
        per_param = optimizer_state_by_param(optimizer, params)
        for name, state in per_param.items():
            p = params[name]
            opt = owner[id(p)]
            on_device = bool(opt.defaults.get("fused") or opt.defaults.get("capturable"))
            for key, t in state.items():
                if t.dim() > 0 and t.shape != p.shape:
                    raise CheckpointError(
                        f"optimizer state {name}.{key} has shape {tuple(t.shape)}, "
                        f"parameter has {tuple(p.shape)}"
                    )
                # Moments live with the parameter; a fused/capturable AdamW keeps 'step' there too.
                if t.dim() > 0 or on_device:  # a copy: the caller's tensors stay its own
                    state[key] = t.to(p.device, torch.float32, copy=True)
            opt.state[p] = state
        # A state the checkpoint lacks starts as AdamW's first step would make it.
        self.host_opt.init_state(pinned=self.on_device if self.streams.cuda else set())

    def device_state_bytes(self) -> int:
        """Bytes the engine keeps on the device between steps: slots and resident layers'
        weights, gradients and AdamW moments."""
        slots = sum(nbytes(s.weights) + nbytes(s.grads) + nbytes(s.moments) for s in self.slots)
        params = [p for g in self.resident_opt.param_groups for p in g["params"]]
        moments = [t for st in self.resident_opt.state.values() for t in st.values() if t.dim() > 0]
        return slots + 2 * nbytes(params) + nbytes(moments)

    def close(self) -> None:
        """Apply the steps still pending and stop the optimizer's worker thread."""
        self.settle()
        self.host_opt.close()
