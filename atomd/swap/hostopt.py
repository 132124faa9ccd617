"""AdamW for swapped layers, on the host, one layer at a time on a worker thread.

Each swapped layer has its own ``torch.optim.AdamW`` over its host (fp32 master) parameters,
with the same decay groups as ``build_adamw`` (decay on matrices only) and torch's fused CPU
kernel (multi-threaded). A layer's step is submitted as soon as its gradient is on the host and
runs on one worker thread while the main thread keeps issuing backward for earlier layers
(torch kernels release the GIL). The next use of a layer's weights waits for its step.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor, nn

from atomd.spec import JobSpec
from atomd.swap.streams import Marker
from atomd.train.optim import build_adamw


class HostOptimizer:
    """Per-layer host AdamW steps with at most one pending step per layer."""

    def __init__(self, layers: dict[int, nn.Module], spec: JobSpec) -> None:
        # fused=True: torch's fused AdamW kernel also runs on CPU tensors (torch >= 2.4).
        self.optimizers = {i: build_adamw(m, spec, fused=True) for i, m in layers.items()}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="atomd-host-adamw")
        self._pending: dict[int, Future[None]] = {}

    def submit(self, layer: int, lr: float, grads_on_host: Marker, clip: float | None) -> None:
        """Step ``layer`` once its gradient copy (``grads_on_host``) is done; ``clip`` scales
        the gradient first (the clipping coefficient, when clipping is on)."""
        self.wait(layer)
        opt = self.optimizers[layer]
        self._pending[layer] = self._pool.submit(self._step, opt, lr, grads_on_host, clip)

    @staticmethod
    def _step(opt: torch.optim.AdamW, lr: float, ready: Marker, clip: float | None) -> None:
        ready.synchronize()  # this worker waits for the copy; the main thread does not
        for group in opt.param_groups:
            group["lr"] = lr
            if clip is not None:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(clip)
        opt.step()

    def wait(self, layer: int) -> None:
        """Block until ``layer``'s pending step (if any) is done; re-raises its error."""
        fut = self._pending.pop(layer, None)
        if fut is not None:
            fut.result()

    def drain(self) -> None:
        for layer in list(self._pending):
            self.wait(layer)

    def params(self, layer: int) -> list[Tensor]:
        return [p for g in self.optimizers[layer].param_groups for p in g["params"]]

    def each(self) -> list[tuple[int, torch.optim.AdamW]]:
        return list(self.optimizers.items())

    def close(self) -> None:
        self.drain()
        self._pool.shutdown(wait=True)
