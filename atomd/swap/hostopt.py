"""AdamW for swapped layers on the host, and the host's other per-layer work, on one worker.

Each swapped layer has its own ``atomd.train.optim.AdamW`` over its host (fp32 master) parameters,
with the same decay groups as ``build_adamw`` (decay on matrices only) and torch's fused CPU
kernel (multi-threaded; while peers average the steps, the swarm's second moment, one
compiled loop per large tensor: ``atomd.train.optim.FUSED_MIN_NUMEL``). Its state exists
from the start (zeros, step 0, as AdamW would create it at its first step): creating 12
B/parameter lazily inside the first step made that step take 2.5 s instead of 0.9 (gpt3-xl on
an H200).

One worker thread runs, first in first out, a layer's tasks as the engine submits them (torch
kernels release the GIL, so the main thread keeps issuing device work):
- once a wave's gradient copy to the host is done: with several waves per step, its sum into
  ``.grad`` (and, in the last wave with clipping, the norms of the whole gradient, which then
  exists only on the host); then, when due, the AdamW step (clipping coefficient first) and
  the refresh of the bf16 copy the next load reads from the new masters;
- ``refresh``: that copy refreshed after something else wrote the masters (sync, a checkpoint).
At most one task per layer is pending: submitting waits for the previous one, and the next use
of a layer's host tensors (its load, the next store into its staging) waits for it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor, nn

from atomd.swap.host import HostLayer
from atomd.swap.record import Recorder, Work
from atomd.swap.streams import Marker
from atomd.train.optim import AdamW, OptimConfig, build_adamw


class HostOptimizer:
    """Per-layer host AdamW steps and gradient sums, with at most one pending task per layer."""

    def __init__(
        self, layers: dict[int, nn.Module], hosts: dict[int, HostLayer], optim: OptimConfig
    ) -> None:
        # fused=True: torch's fused AdamW kernel also runs on CPU tensors (torch >= 2.4).
        self.optimizers = {i: build_adamw(m, optim, fused=True) for i, m in layers.items()}
        self.hosts = hosts
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="atomd-host-adamw")
        self._pending: dict[int, Future[None]] = {}
        self._scratch = torch.empty(0)  # fp32 .grad of the layer being stepped (bf16 link)
        self._norms: dict[int, list[Tensor]] = {}
        self.recorder: Recorder | None = None  # set while the engine records its schedule
        self._recorded: dict[int, Work] = {}
        self.init_state(pinned=set())

    def init_state(self, *, pinned: set[int]) -> None:
        """Give every parameter the AdamW state its first step would create (zeros, step 0);
        the moments of the ``pinned`` layers in pinned memory (stepped on the device: their
        moments are copied)."""
        for layer, opt in self.optimizers.items():
            pin = layer in pinned
            for group in opt.param_groups:
                for p in group["params"]:
                    state = opt.state[p]
                    state.setdefault("step", torch.tensor(0.0, dtype=torch.float32))
                    for key in ("exp_avg", "exp_avg_sq"):
                        t = state.get(key)
                        if t is None:
                            state[key] = torch.zeros(p.shape, dtype=torch.float32, pin_memory=pin)
                        elif pin and not t.is_pinned():
                            state[key] = t.pin_memory()

    def _submit(
        self,
        layer: int,
        fn: Callable[[], None],
        kind: str,
        ready: Marker | None = None,
        **what: bool,
    ) -> None:
        self.wait(layer)
        if self.recorder is not None:
            self.recorder.wait("host", [ready.at] if ready is not None else [])
            self._recorded[layer] = self.recorder.work("host", kind, layer, dict(what))
        self._pending[layer] = self._pool.submit(fn)

    def submit(
        self,
        layer: int,
        ready: Marker,
        *,
        accumulate: bool = False,
        first: bool = False,
        norms: bool = False,
        lr: float | None = None,
        clip: float | None = None,
    ) -> None:
        """One task for ``layer``, run once its gradient copy to the host (``ready``) is done:
        with ``accumulate``, add the wave's gradient into ``.grad`` (``first``: copy it) and,
        with ``norms``, take the per-parameter norms of the sum (``norms_of``); with ``lr``,
        then step (``clip`` scales the gradient first: the clipping coefficient)."""
        opt, host = self.optimizers[layer], self.hosts[layer]

        def run() -> None:
            ready.synchronize()  # this worker waits for the copy; the main thread does not
            if self._scratch.numel() < host.numel:
                self._scratch = torch.empty(host.numel, dtype=torch.float32)
            if accumulate:
                host.accumulate(first, self._scratch)
                if norms:
                    self._norms[layer] = list(torch._foreach_norm(host.param_grads()))
            if lr is None:
                return
            host.grads_for_step(self._scratch)
            for group in opt.param_groups:
                group["lr"] = lr
                if clip is not None:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.grad.mul_(clip)
            opt.step()
            host.release_grads()
            host.refresh()

        self._submit(
            layer,
            run,
            "step" if lr is not None else "sum",
            ready,
            accumulate=accumulate,
            norms=norms,
            step=lr is not None,
        )

    def norms_of(self, layer: int) -> list[Tensor]:
        """The per-parameter gradient norms a ``norms`` task took (waits for it)."""
        self.wait(layer)
        return self._norms.pop(layer)

    def refresh(self, layer: int) -> None:
        """Refresh ``layer``'s link copy from its masters (they were written from outside)."""
        self._submit(layer, self.hosts[layer].refresh, "refresh")

    def wait(self, layer: int) -> None:
        """Block until ``layer``'s pending task (if any) is done; re-raises its error."""
        fut = self._pending.pop(layer, None)
        if fut is not None:
            if self.recorder is not None:
                self.recorder.block(self._recorded.pop(layer, None), f"host task of {layer}")
            fut.result()

    def drain(self) -> None:
        for layer in list(self._pending):
            self.wait(layer)

    def params(self, layer: int) -> list[Tensor]:
        return [p for g in self.optimizers[layer].param_groups for p in g["params"]]

    def each(self) -> list[tuple[int, AdamW]]:
        return list(self.optimizers.items())

    def close(self) -> None:
        self.drain()
        self._pool.shutdown(wait=True)
