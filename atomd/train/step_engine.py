"""Step engines: how one optimizer step is computed.

``ResidentEngine`` keeps the model and optimizer on the device (plain training). The swap engine
(``atomd.swap``) implements the same interface with the model in host memory, so the training
loop, checkpoints and the daemon do not care which one runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Literal, Protocol

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from atomd.data.dataset import Batch
from atomd.errors import ConfigError
from atomd.model.gpt import GPT, lm_loss
from atomd.train.optim import (
    OptimConfig,
    build_adamw,
    load_optimizer_tensors,
    optimizer_tensors,
    second_moments,
)


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

    def set_peers(self, peers: int) -> None:
        """How many peers average their updates with this one's from the next step on (1:
        alone): AdamW then normalises by the swarm's second moment (``optim.AdamW``)."""
        ...

    def second_moments(self) -> dict[str, Tensor]:
        """AdamW's second moment of each parameter (``optim.second_moments``); call settled."""
        ...


Precision = Literal["bf16", "fp16", "fp32"]
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_precision(precision: str, device: torch.device) -> Precision:
    """A job spec's ``precision`` on this device: ``auto`` is bf16 where the device supports
    it, else fp16 on CUDA, fp32 on the CPU. bf16 asked of a CUDA device without it is an
    error (GPUs before Ampere: use fp16)."""
    cuda = device.type == "cuda"
    bf16_ok = not cuda or torch.cuda.is_bf16_supported(including_emulation=False)
    if precision == "auto":
        if not cuda:
            return "fp32"
        return "bf16" if bf16_ok else "fp16"
    if precision == "bf16" and not bf16_ok:
        name = torch.cuda.get_device_name(device)
        raise ConfigError(f"{name} has no bf16; use precision fp16 (with loss scaling) or fp32")
    if precision not in ("bf16", "fp16", "fp32"):
        raise ConfigError(f"precision must be auto, bf16, fp16 or fp32, not {precision!r}")
    return precision  # type: ignore[return-value]


class LossScale:
    """fp16's dynamic loss scale for engines that step without ``torch.optim`` bookkeeping
    (the swapping engine), with ``torch.amp.GradScaler``'s defaults: start at 2^16; an
    overflowing step is skipped and halves the scale; 2,000 clean steps in a row double it."""

    def __init__(self, *, enabled: bool, init: float = 2.0**16, interval: int = 2000) -> None:
        self.enabled = enabled
        self.value = init
        self.interval = interval
        self.clean = 0  # clean steps since the last change
        self.skipped = 0

    def scale(self, loss: Tensor) -> Tensor:
        return loss * self.value if self.enabled else loss

    def update(self, finite: bool) -> bool:
        """After a step's backward: whether to step (the gradients were finite)."""
        if not finite:
            self.value /= 2
            self.clean = 0
            self.skipped += 1
            return False
        self.clean += 1
        if self.clean >= self.interval:
            self.value *= 2
            self.clean = 0
        return True

    def stats(self) -> dict[str, Any] | None:
        return {"loss_scale": self.value, "skipped_steps": self.skipped} if self.enabled else None

    def tensors(self) -> dict[str, Tensor]:
        if not self.enabled:
            return {}
        return {
            "amp.scale": torch.tensor(self.value, dtype=torch.float64),
            "amp.growth_tracker": torch.tensor(self.clean),
            "amp.skipped_steps": torch.tensor(self.skipped),
        }

    def load(self, tensors: dict[str, Tensor]) -> None:
        if self.enabled and "amp.scale" in tensors:
            self.value = float(tensors["amp.scale"])
            self.clean = int(tensors["amp.growth_tracker"])
            self.skipped = int(tensors["amp.skipped_steps"])


def autocast(
    device: torch.device, precision: Precision | None = None
) -> contextlib.AbstractContextManager[object]:
    """The compute precision's autocast region. ``None``: bf16 autocast on CUDA, full fp32
    on the CPU (exact, and what the tests compare)."""
    if precision is None:
        precision = "bf16" if device.type == "cuda" else "fp32"
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=_DTYPES[precision])


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
        self,
        model: GPT,
        optim: OptimConfig,
        device: torch.device,
        *,
        recompute: bool = False,
        precision: Precision | None = None,
    ) -> None:
        self.model = model.to(device)
        self.device = device
        self.optim = optim
        self.recompute = recompute
        self.precision = precision
        """None: bf16 autocast on CUDA, fp32 on the CPU; fp16 adds dynamic loss scaling."""
        self.optimizer = build_adamw(
            self.model, optim, fused=True if device.type == "cuda" else None
        )
        # fp16's narrow range: the loss is scaled up before backward so that small gradients
        # do not flush to zero; a step whose gradients overflow is skipped and the scale
        # halved, and after 2000 clean steps the scale doubles (torch's defaults).
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
        self.skipped_steps = 0

    def _autocast(self) -> contextlib.AbstractContextManager[object]:
        # Looked up at call time (tests patch the module's autocast).
        if self.precision is None:
            return autocast(self.device)
        return autocast(self.device, self.precision)

    def precision_stats(self) -> dict[str, Any] | None:
        """fp16's loss scale and the steps skipped so far (None for other precisions)."""
        if not self.scaler.is_enabled():
            return None
        return {"loss_scale": float(self.scaler.get_scale()), "skipped_steps": self.skipped_steps}

    def _to_device(self, b: Batch) -> tuple[Tensor, Tensor]:
        return b.x.to(self.device, non_blocking=True), b.y.to(self.device, non_blocking=True)

    def train_step(self, batches: Sequence[Batch], lr: float) -> float:
        self.model.train()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = torch.zeros((), device=self.device)
        scaling = self.scaler.is_enabled()
        for b in batches:
            x, y = self._to_device(b)
            with self._autocast():
                logits = self._logits(x)
                loss = lm_loss(logits, y) / len(batches)
            (self.scaler.scale(loss) if scaling else loss).backward()
            total += loss.detach()
        if scaling:
            self.scaler.unscale_(self.optimizer)  # and notes whether any gradient overflowed
        if self.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim.grad_clip)
        if scaling:
            before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)  # skipped when a gradient is inf or NaN
            self.scaler.update()
            if self.scaler.get_scale() < before:  # the scale backs off only after a skip
                self.skipped_steps += 1
        else:
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
            with self._autocast():
                logits, _ = self.model(x)
            losses.append(lm_loss(logits, y))
        return window_mean(losses, batches)

    def model_tensors(self) -> dict[str, Tensor]:
        return model_tensors(self.model)

    def optimizer_tensors(self) -> dict[str, Tensor]:
        out = optimizer_tensors(self.optimizer, self.model)
        if self.scaler.is_enabled():  # resume continues with the same scale
            state = self.scaler.state_dict()
            out["amp.scale"] = torch.tensor(float(state["scale"]), dtype=torch.float64)
            out["amp.growth_tracker"] = torch.tensor(int(state["_growth_tracker"]))
            out["amp.skipped_steps"] = torch.tensor(self.skipped_steps)
        return out

    def load_tensors(self, model: dict[str, Tensor], optimizer: dict[str, Tensor]) -> None:
        load_model_tensors(self.model, model)
        load_optimizer_tensors(self.optimizer, self.model, optimizer)
        if self.scaler.is_enabled() and "amp.scale" in optimizer:
            state = self.scaler.state_dict()
            state["scale"] = float(optimizer["amp.scale"])
            state["_growth_tracker"] = int(optimizer["amp.growth_tracker"])
            self.scaler.load_state_dict(state)
            self.skipped_steps = int(optimizer["amp.skipped_steps"])

    def set_peers(self, peers: int) -> None:
        self.optimizer.peers = peers

    def second_moments(self) -> dict[str, Tensor]:
        return second_moments([self.optimizer], self.model)

    def settle(self) -> None:
        """Nothing is in flight: ``train_step`` returns after its optimizer step."""

    def parameters(self) -> Iterator[Tensor]:
        return iter(self.model.parameters())
