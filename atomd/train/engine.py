"""Step engines: how one optimizer step is computed.

``ResidentEngine`` keeps the model and optimizer on the device (plain training). The swap engine
(``atomd.swap``) implements the same interface with the model in host memory, so the training
loop, checkpoints and the daemon do not care which one runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from atomd.data.dataset import Batch
from atomd.model.gpt import GPT, lm_loss
from atomd.train.optim import OptimConfig, build_adamw, load_optimizer_tensors, optimizer_tensors


class StepEngine(Protocol):
    """One optimizer step over micro-batches, evaluation, and state as named host tensors."""

    model: GPT

    def train_step(self, batches: Sequence[Batch], lr: float) -> float: ...
    def evaluate(self, batches: Sequence[Batch]) -> float: ...
    def model_tensors(self) -> dict[str, Tensor]: ...
    def optimizer_tensors(self) -> dict[str, Tensor]: ...
    def load_tensors(self, model: dict[str, Tensor], optimizer: dict[str, Tensor]) -> None: ...
    def settle(self) -> None:
        """Finish every update still in flight, so that ``model.parameters()`` hold the model
        after the last step and may be read or written in place (sync does both)."""
        ...


def autocast(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """bf16 autocast on CUDA; full fp32 on the CPU (exact, and what the tests compare)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def window_mean(losses: Sequence[Tensor], batches: Sequence[Batch]) -> float:
    """The mean loss per window of batches of any sizes (each loss: one batch's mean)."""
    rows = [b.x.shape[0] for b in batches]
    total = sum(float(loss) * n for loss, n in zip(losses, rows, strict=True))
    return total / max(1, sum(rows))


def model_tensors(model: GPT) -> dict[str, Tensor]:
    """Parameters and persistent buffers by name; a tied weight appears once."""
    out = {n: p.detach() for n, p in model.named_parameters()}
    out.update({n: b.detach() for n, b in model.named_buffers()})
    return out


def load_model_tensors(model: GPT, tensors: dict[str, Tensor]) -> None:
    """Load tensors saved by ``model_tensors``; a missing, extra or misshapen one is an error."""
    from atomd.errors import CheckpointError

    own = model_tensors(model)
    missing = sorted(set(own) - set(tensors))
    extra = sorted(set(tensors) - set(own))
    if missing or extra:
        raise CheckpointError(
            f"checkpoint does not fit the model: missing {missing}, unexpected {extra}"
        )
    for name, t in tensors.items():
        if t.shape != own[name].shape:
            raise CheckpointError(
                f"checkpoint tensor {name} has shape {tuple(t.shape)}, "
                f"model has {tuple(own[name].shape)}"
            )
    with torch.no_grad():
        for name, t in tensors.items():
            own[name].copy_(t)


class ResidentEngine:
    """The whole model, its gradients and AdamW state on one device. With ``recompute`` every
    block's forward is recomputed in backward instead of keeping its activations (activation
    checkpointing: a quarter more compute for a block's input instead of its whole graph): the
    reference a swapped run that recomputes is measured against."""

    def __init__(
        self, model: GPT, optim: OptimConfig, device: torch.device, *, recompute: bool = False
    ) -> None:
        self.model = model.to(device)
        self.device = device
        self.optim = optim
        self.recompute = recompute
        self.optimizer = build_adamw(
            self.model, optim, fused=True if device.type == "cuda" else None
        )

    def _to_device(self, b: Batch) -> tuple[Tensor, Tensor]:
        return b.x.to(self.device, non_blocking=True), b.y.to(self.device, non_blocking=True)

    def train_step(self, batches: Sequence[Batch], lr: float) -> float:
        self.model.train()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = torch.zeros((), device=self.device)
        for b in batches:
            x, y = self._to_device(b)
            with autocast(self.device):
                logits = self._logits(x)
                loss = lm_loss(logits, y) / len(batches)
            loss.backward()
            total += loss.detach()
        if self.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(total)

    def _logits(self, x: Tensor) -> Tensor:
        if not self.recompute:
            out: Tensor = self.model(x)[0]
            return out
        layers = self.model.layers()
        h: Tensor = layers[0](x)
        for block in layers[1:-1]:
            h = checkpoint(block, h, use_reentrant=False)
        logits: Tensor = layers[-1](h)
        return logits

    @torch.no_grad()
    def evaluate(self, batches: Sequence[Batch]) -> float:
        self.model.eval()
        losses = []
        for b in batches:
            x, y = self._to_device(b)
            with autocast(self.device):
                logits, _ = self.model(x)
            losses.append(lm_loss(logits, y))
        return window_mean(losses, batches)

    def model_tensors(self) -> dict[str, Tensor]:
        return model_tensors(self.model)

    def optimizer_tensors(self) -> dict[str, Tensor]:
        return optimizer_tensors(self.optimizer, self.model)

    def load_tensors(self, model: dict[str, Tensor], optimizer: dict[str, Tensor]) -> None:
        load_model_tensors(self.model, model)
        load_optimizer_tensors(self.optimizer, self.model, optimizer)

    def settle(self) -> None:
        """Nothing is in flight: ``train_step`` returns after its optimizer step."""

    def parameters(self) -> Iterator[Tensor]:
        return iter(self.model.parameters())
