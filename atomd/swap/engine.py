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
(one reparametrization per visit serves its M micro-batches: one per micro-batch costs a third
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

The engine orders the visits and composes the parts: ``SlotTraffic`` (``atomd.swap.traffic``)
makes the copies, ``LayerWalk`` (``atomd.swap.walk``) runs each visit's forward and backward,
``LayerSteps`` (``atomd.swap.stepping``) ends each step with clipping and the AdamW steps.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

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
from atomd.swap.stepping import LayerSteps
from atomd.swap.streams import Marker, Streams, label
from atomd.swap.traffic import SlotTraffic
from atomd.swap.walk import Graph, LayerWalk
from atomd.train.optim import (
    AdamW,
    OptimConfig,
    build_adamw,
    optimizer_state_by_param,
    optimizer_tensors,
    second_moments,
)
from atomd.train.step_engine import (
    LossScale,
    Precision,
    autocast,
    load_model_tensors,
    model_tensors,
    window_mean,
)
from atomd.units import format_bytes

log = get_logger(__name__)


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
        n_params = len(list(self.layers[self.swapped[0]].parameters()))
        layout = self.hosts[self.swapped[0]].slot_layout()
        if any(self.hosts[i].slot_layout() != layout for i in self.swapped):
            raise SwapError("swapped layers must all have the same parameter shapes")
        self.slots: list[Slot] = []
        for _ in range(plan.slots):
            weights, grads, flat_w, flat_g = slot_buffers(layout, n_params, device)
            moments = [torch.empty_like(g) for g in 2 * grads] if self.device_opt else []
            self.slots.append(Slot(weights, grads, flat_w, flat_g, moments, len(self.slots)))
        self.host_opt = HostOptimizer({i: self.layers[i] for i in self.swapped}, self.hosts, optim)
        self.traffic = SlotTraffic(
            streams=self.streams, device=device, slots=self.slots, hosts=self.hosts,
            host_params=self.host_params, host_opt=self.host_opt,
        )  # fmt: skip
        self._due = self.traffic.due  # the device steps still due (one dict, shared)
        self.host_opt.init_state(pinned=self.on_device if cuda else set())
        # The link copies follow the masters after each step; after ``settle`` the caller may
        # write the masters, so the next step or evaluation refreshes them first.
        self._refresh_links = False
        self.walk = LayerWalk(
            layers=self.layers, swapped=self.swapped, slots=self.slots, scale=self.scale,
            autocast=self._autocast,
        )  # fmt: skip
        self.steps = LayerSteps(
            optim=optim, scale=self.scale, device=device, streams=self.streams,
            swapped=self.swapped, on_device=self.on_device, resident_opt=self.resident_opt,
            host_opt=self.host_opt, traffic=self.traffic,
        )  # fmt: skip
        self._graph_bytes = self.walk.graph_bytes  # layer -> bytes its kept graph saved
        # The last graph_blocks blocks (layers n-1-g .. n-2) keep their forward graphs.
        self._graphs = set(range(n - 1 - plan.graph_blocks, n - 1))
        spillable = set(range(1, n - 2)) - self._graphs  # a kept graph holds its own input
        self._spilled_layers = spillable if plan.spill else set()
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

    @property
    def stats(self) -> SwapStats:
        """The traffic and memory of the last step or evaluation (``SlotTraffic`` counts)."""
        return self.traffic.stats

    @stats.setter
    def stats(self, stats: SwapStats) -> None:
        self.traffic.stats = stats

    def _wave(self, visits: list[int]) -> Wave:
        return Wave(self.slots, visits, self._load_weights)

    def _load_weights(self, layer: int, slot: Slot) -> None:
        """Load ``layer`` into ``slot`` (``SlotTraffic.load_weights``): every load goes here."""
        self.traffic.load_weights(layer, slot)

    def _store_grads(self, layer: int, slot: Slot) -> Marker:
        """Store the slot's gradient (``SlotTraffic.store_grads``): every store goes here."""
        return self.traffic.store_grads(layer, slot)

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
        clip = self.steps.deferred()
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
        self.steps.finish(lr, norms, waves)
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
        clip = self.steps.deferred()
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
                    graphs[i] = self.walk.forward_graph(i, acts, slot)
                    acts = [o.detach() for o in graphs[i].outs]
                else:
                    with torch.no_grad():
                        acts = self.walk.forward(i, acts, slot.weights if slot else None)
            kind = "embed" if i == 0 else "fwd"
            st.work(st.compute, kind, i, m=len(acts), kept=i in graphs, **_slot_of(slot))
            if slot is not None:
                slot.used = st.mark(st.compute)
                wave.done()
            if i + 1 in self._spilled_layers:
                spilled[i + 1] = self.traffic.spill(i + 1, acts)
            elif i + 1 not in self._graphs:
                saved[i + 1] = acts
            self._note_held(saved, acts)
        grad_outs: list[Tensor] = []
        fetched: dict[int, tuple[list[Tensor], Marker]] = {}
        for i in range(n - 1, -1, -1):
            if i - 1 in spilled:  # prefetch the next layer's inputs while this one computes
                fetched[i - 1] = self.traffic.fetch(i - 1, *spilled.pop(i - 1))
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
                    grad_outs = self.walk.backward(
                        i, inputs, grad_outs, ys, None, None, first, g_total, total
                    )
                kind = "head" if i == n - 1 else "embed_bwd" if i == 0 else "bwd"
                st.work(st.compute, kind, i, m=len(batches), kept=isinstance(inputs, Graph))
            else:
                st.wait(st.compute, slot.loaded, slot.stored)
                with label(f"atomd.bwd.{i}"):
                    # Every wave's gradient starts afresh in the slot: the host sums the waves.
                    grad_outs = self.walk.backward(
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
                acts = self.walk.forward(i, acts, slot.weights if slot else None)
                if slot is not None:
                    slot.used = st.mark(st.compute)
                    wave.done()
            for a, b in zip(acts, chunk, strict=True):  # logits one micro-batch at a time
                (logits,) = self.walk.forward(n - 1, [a], None)
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
        self.traffic.apply_due(self._load_weights)
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
