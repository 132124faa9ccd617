"""Building a job's step engine: resident or swapped, per ``spec.swap`` and the plan.

This module stands above ``train`` (the training loop, handed its engine) and ``swap`` (the
swapping engine): the CLI and the job manager build an engine here and give it to the
``Trainer``; the engines read only the ``OptimConfig`` made here from the job spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from atomd.devices import resolve_device
from atomd.logs import get_logger
from atomd.model.gpt import GPT, GPTConfig
from atomd.model.presets import get_preset
from atomd.spec import JobSpec
from atomd.swap.plan import resident_peak_bytes
from atomd.swap.planning import device_budget, plan_for, shape_for
from atomd.train.engine import ResidentEngine, StepEngine
from atomd.train.optim import OptimConfig
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
    model = build_model(get_preset(spec.preset), spec.seed)
    optim = optim_config(spec)
    swap, reason = decide(spec, dev)
    if not swap:
        log.info("resident training (%s)", reason)
        plan = {"engine": "ResidentEngine", "reason": reason}
        return BuiltEngine(ResidentEngine(model, optim, dev), plan, dev)
    from atomd.swap.engine import SwapEngine

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
    engine = SwapEngine(model, optim, dev, swap_plan)
    return BuiltEngine(engine, {"engine": "swap", "reason": reason, **swap_plan.to_dict()}, dev)
