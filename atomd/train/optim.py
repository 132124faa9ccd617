"""AdamW construction and its state as named tensors (for safetensors checkpoints)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from atomd.errors import CheckpointError


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """What the step engines read of a job's optimization settings (``engines.optim_config``
    makes one from a ``JobSpec``)."""

    lr: float
    """The base learning rate (each step passes its scheduled one)."""
    betas: tuple[float, float]
    weight_decay: float
    """AdamW's decoupled weight decay, on matrices only."""
    grad_clip: float
    """Clip the gradients' global norm to this (0: no clipping)."""


def named_unique_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters by name, a tied one once under its first name (``named_parameters`` order)."""
    return list(model.named_parameters())


def build_adamw(
    model: nn.Module, cfg: OptimConfig, *, fused: bool | None = None
) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases, LayerNorms)."""
    decay = [p for _, p in named_unique_parameters(model) if p.dim() >= 2]
    no_decay = [p for _, p in named_unique_parameters(model) if p.dim() < 2]
    groups: list[dict[str, Any]] = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    kwargs: dict[str, Any] = {"lr": cfg.lr, "betas": cfg.betas}
    if fused is not None:
        kwargs["fused"] = fused
    return torch.optim.AdamW(groups, **kwargs)


def optimizer_tensors(opt: torch.optim.Optimizer, model: nn.Module) -> dict[str, Tensor]:
    """Optimizer state as ``optim.<param name>.<key>`` tensors."""
    names = {id(p): n for n, p in named_unique_parameters(model)}
    out: dict[str, Tensor] = {}
    for p, st in opt.state.items():
        for key, value in st.items():
            t = value if isinstance(value, Tensor) else torch.tensor(value)
            out[f"optim.{names[id(p)]}.{key}"] = t.detach().cpu()
    return out


def optimizer_state_by_param(
    tensors: Mapping[str, Tensor], params: Mapping[str, object]
) -> dict[str, dict[str, Tensor]]:
    """``optim.<param name>.<key>`` tensors grouped by parameter; an unknown name is an error."""
    per_param: dict[str, dict[str, Tensor]] = {}
    for full, t in tensors.items():
        if not full.startswith("optim."):
            continue
        name, _, key = full[len("optim.") :].rpartition(".")
        if name not in params:
            raise CheckpointError(f"optimizer state names unknown parameter {name!r}")
        per_param.setdefault(name, {})[key] = t
    return per_param


def load_optimizer_tensors(
    opt: torch.optim.Optimizer, model: nn.Module, tensors: dict[str, Tensor]
) -> None:
    """Restore what ``optimizer_tensors`` produced, checking names and shapes."""
    params = dict(named_unique_parameters(model))
    per_param = optimizer_state_by_param(tensors, params)
    for name, st in per_param.items():
        p = params[name]
        for key, t in st.items():
            if t.dim() > 0 and t.shape != p.shape:
                raise CheckpointError(
                    f"optimizer state {name}.{key} has shape {tuple(t.shape)}, "
                    f"parameter has {tuple(p.shape)}"
                )
            # AdamW keeps 'step' on the CPU unless fused/capturable; moments live with the param.
            on_device = bool(opt.defaults.get("fused") or opt.defaults.get("capturable"))
            st[key] = t.to(p.device) if t.dim() > 0 or on_device else t
        opt.state[p] = st
