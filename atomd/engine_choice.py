"""Building a job's step engine: resident or swapped, per ``spec.swap`` and the plan.

This module stands above ``train`` (the training loop, handed its engine) and ``swap`` (the
swapping engine): the CLI and the job manager build an engine here and give it to the
``Trainer``; the engines read only the ``OptimConfig`` made here from the job spec.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from atomd.devices import resolve_device
from atomd.errors import CheckpointError, ConfigError
from atomd.logs import get_logger
from atomd.model.gpt import GPT, GPTConfig
from atomd.spec import JobSpec
from atomd.swap.plan import resident_peak_bytes
from atomd.swap.planning import device_budget, plan_for, shape_for
from atomd.train.optim import OptimConfig
from atomd.train.step_engine import (
    ResidentEngine,
    StepEngine,
    load_model_tensors,
    resolve_precision,
)
from atomd.units import format_bytes

log = get_logger(__name__)


def optim_config(spec: JobSpec) -> OptimConfig:
    return OptimConfig(
        lr=spec.effective_lr,
        betas=(spec.beta1, spec.beta2),
        weight_decay=spec.weight_decay,
        grad_clip=spec.grad_clip,
    )


def build_model(cfg: GPTConfig, seed: int) -> GPT:
    """The model's initial weights: the same for every peer of a job (same seed)."""
    torch.manual_seed(seed)
    return GPT(cfg)


def initial_model(spec: JobSpec) -> GPT:
    """The job's model before its first step: from ``spec.seed``, or the weights of the
    checkpoint ``spec.init_from`` names (its shape must be the spec's; its activation is
    kept: GPT-2 imports use the tanh GELU)."""
    cfg = spec.model_shape
    if spec.init_from is None:
        return build_model(cfg, spec.seed)
    from atomd.train.checkpoint import load_latest

    found = load_latest(Path(spec.init_from).expanduser())
    if found is None:
        raise ConfigError(f"init_from {spec.init_from}: no checkpoint there")
    saved = GPTConfig.from_dict(found.meta["model_config"])
    if dataclasses.replace(saved, activation=cfg.activation, dropout=cfg.dropout) != cfg:
        raise ConfigError(
            f"init_from {found.path} holds a model of shape {_shape(saved)}; the job's preset "
            f"{spec.preset!r} is {_shape(cfg)} (vocab_size sets the vocabulary)"
        )
    saved = dataclasses.replace(saved, dropout=cfg.dropout)
    torch.manual_seed(spec.seed)
    model = GPT(saved)
    try:
        load_model_tensors(model, found.model)
    except CheckpointError as e:
        raise ConfigError(f"init_from {found.path}: {e}") from None
    log.info("initial weights from %s (step %d)", found.path, found.step)
    return model


def _shape(cfg: GPTConfig) -> str:
    return (
        f"{cfg.n_layer} layers x {cfg.n_embd} wide, {cfg.n_head} heads, vocabulary "
        f"{cfg.vocab_size}, context {cfg.block_size}"
        + ("" if cfg.tie_embeddings else ", untied head")
        + ("" if cfg.bias else ", no biases")
    )


@dataclass(frozen=True)
class BuiltEngine:
    engine: StepEngine
    plan: dict[str, Any]
    """Resident or swapped, why, and the swap plan: recorded with the run (plan.json) and
    every checkpoint."""
    device: torch.device


def decide(spec: JobSpec, device: torch.device) -> tuple[bool, str]:
    """Whether to swap, and why (recorded in plan.json)."""
    if spec.swap == "off":
        return False, "swap off"
    if spec.swap == "on":
        return True, "swap on"
    if device.type != "cuda":
        return False, "swap auto: the device is the CPU, whose memory already holds the model"
    need = resident_peak_bytes(shape_for(spec, device))
    budget = device_budget(spec, device)
    verdict = "does not fit" if need > budget else "fits"
    return need > budget, (
        f"swap auto: resident training needs about {format_bytes(need)}, "
        f"which {verdict} the {format_bytes(budget)} budget"
    )


def build_engine(spec: JobSpec, device: str | torch.device = "auto") -> BuiltEngine:
    """The job's model from its seed, in the engine ``spec.swap`` asks for (auto: swap only
    when resident training does not fit the device-memory budget)."""
    dev = resolve_device(device) if isinstance(device, str) else device
    precision = resolve_precision(spec.precision, dev)
    model = initial_model(spec)
    optim = optim_config(spec)
    swap, reason = decide(spec, dev)
    if not swap:
        log.info("resident training (%s), %s", reason, precision)
        plan = {"engine": "ResidentEngine", "reason": reason, "precision": precision}
        return BuiltEngine(ResidentEngine(model, optim, dev, precision=precision), plan, dev)
    from atomd.swap.engine import SwapEngine

    # The swapping engine computes in bf16 on CUDA (its planner's memory model and bf16 link
    # assume 2-byte compute there) and in fp32 on the CPU, or in fp16 with loss scaling (over
    # the fp32 link: its bf16 copies are bf16's) anywhere.
    native = "bf16" if dev.type == "cuda" else "fp32"
    if precision not in (native, "fp16"):
        raise ConfigError(
            f"precision {precision} with the swapping engine: on {dev.type} it computes in "
            f"{native} or fp16; use one of those (or auto), or swap off"
        )
    if precision == "fp16":
        if spec.swap_link == "bf16":
            raise ConfigError("precision fp16 needs swap_link fp32 (or auto), not bf16")
        spec = spec.model_copy(update={"swap_link": "fp32"})
    swap_plan = plan_for(spec, dev)
    log.info(
        "swapped training (%s): K=%d, M=%d, optimizer on the %s, %s link, predicted %.3g "
        "s/step, peak %s",
        reason,
        swap_plan.slots,
        swap_plan.micro_batches,
        swap_plan.optimizer,
        swap_plan.link,
        swap_plan.step_s,
        format_bytes(swap_plan.peak_device_bytes),
    )
    engine = SwapEngine(model, optim, dev, swap_plan, precision=precision)
    plan = {"engine": "swap", "reason": reason, "precision": precision, **swap_plan.to_dict()}
    return BuiltEngine(engine, plan, dev)
