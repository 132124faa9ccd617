"""The copies between host memory and the device's layer slots, on the load and store streams.

``SlotTraffic`` brings a swapped layer's weights into a slot (and, with the optimizer on the
device, its gradient and AdamW moments, runs the layer's step there and copies the result
back), copies a wave's gradient sum out to the layer's host staging, and spills layer inputs
to pinned host buffers and fetches them back. It counts the bytes each way (``SwapStats``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.optim.adam import adam

from atomd.swap.host import HostLayer
from atomd.swap.hostopt import HostOptimizer
from atomd.swap.slots import Slot, SwapStats, nbytes
from atomd.swap.streams import DONE, Marker, Streams, label


class SlotTraffic:
    """What crosses the link for the swapped layers, and when each copy is done."""

    def __init__(
        self,
        *,
        streams: Streams,
        device: torch.device,
        slots: list[Slot],
        hosts: dict[int, HostLayer],
        host_params: dict[int, list[nn.Parameter]],
        host_opt: HostOptimizer,
    ) -> None:
        self.streams = streams
        self.device = device
        self.slots = slots
        self.hosts = hosts
        self.host_params = host_params
        self.host_opt = host_opt
        self.stats = SwapStats()
        # With the optimizer on the device: layer -> (lr, clipping coefficient) of the step its
        # next load applies, and the marker of its last copy back to the host.
        self.due: dict[int, tuple[float, Tensor | None]] = {}
        self.written: dict[int, Marker] = {}
        self.coef: Marker = DONE  # the clipping coefficient the due steps use is computed
        self.grad_stored: dict[int, Marker] = {}
        self._spill_pool: dict[tuple[int, int], Tensor] = {}
        self._spill_free: dict[int, Marker] = {}  # layer -> its spill buffers were read back

    def steps_due(self, layers: set[int], lr: float, coef: Tensor | None) -> None:
        """Each of ``layers`` steps with its next load, with ``lr`` and the clipping
        coefficient ``coef`` (computed on the compute stream, read on the load stream)."""
        st = self.streams
        if coef is not None:
            self.coef = st.mark(st.compute)
            st.hand_over(coef, st.load)
        self.due.update((layer, (lr, coef)) for layer in layers)

    def apply_due(self, load: Callable[[int, Slot], None]) -> None:
        """Apply the device steps still due, each by its ``load`` into a slot (round-robin:
        loads overlap copies back), then wait for their copies back. Not counted as any
        step's traffic."""
        stats, self.stats = self.stats, SwapStats()
        for n, layer in enumerate(list(self.due)):
            load(layer, self.slots[n % len(self.slots)])
        self.stats = stats
        for marker in self.written.values():
            marker.synchronize()
        self.written.clear()

    def load_weights(self, layer: int, slot: Slot) -> None:
        st = self.streams
        with label(f"atomd.wait_host_step.{layer}"):
            self.host_opt.wait(layer)  # its update must be in the host master before we copy it
        due = self.due.pop(layer, None)
        st.wait(st.load, slot.used, slot.saved, self.written.get(layer, DONE))
        with st.on(st.load), torch.no_grad(), label(f"atomd.load.{layer}"):
            for w, g in zip(slot.flat_weights, self.hosts[layer].groups, strict=True):
                w.copy_(g.src, non_blocking=True)
            st.work(st.load, "weights", layer, slot=slot.index)
            if due is not None:
                # After the weights: the step overwrites the slot's gradient buffer (stored
                # out?), reads the layer's .grad (stored?) and the clipping coefficient.
                st.wait(st.load, slot.stored, self.grad_stored.get(layer, DONE), self.coef)
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
        slot.saved = self.written[layer] = st.mark(st.store)
        self.stats.bytes_stored += nbytes(slot.weights) + nbytes(slot.moments)

    def store_grads(self, layer: int, slot: Slot) -> Marker:
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
        slot.stored = self.grad_stored[layer] = st.mark(st.store)
        self.stats.bytes_stored += nbytes([g.staging for g in host.groups])
        return slot.stored

    def spill(self, layer: int, acts: list[Tensor]) -> tuple[list[Tensor], Marker]:
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

    def fetch(self, layer: int, hosts: list[Tensor], ready: Marker) -> tuple[list[Tensor], Marker]:
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
