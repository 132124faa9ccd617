"""A job's swap plan: its shape, device and host budgets, and the plan the engine runs."""

from __future__ import annotations

import os

import torch

from atomd.logs import get_logger
from atomd.spec import JobSpec
from atomd.swap import hardware
from atomd.swap.plan import Shape, SwapPlan, make_plan

log = get_logger(__name__)


def shape_for(spec: JobSpec, device: torch.device) -> Shape:
    return Shape(
        cfg=spec.model_shape,
        micro_batch_size=spec.micro_batch_size,
        seq_len=spec.effective_seq_len,
        grad_accum=spec.grad_accum,
        dtype_bytes=2 if device.type == "cuda" else 4,
        grad_clip=spec.grad_clip > 0,
    )


def device_budget(spec: JobSpec, device: torch.device) -> int:
    """``spec.gpu_mem``, else the device's total memory (on the CPU: the host's)."""
    if spec.gpu_mem is not None:
        return spec.gpu_mem
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


HOST_FRACTION = 0.9
"""Of the host's physical memory, what the swapped layers may hold (the rest: the OS, the
process, the dataset, the resident run a benchmark keeps)."""


def host_budget() -> int:
    return int(HOST_FRACTION * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def plan_for(spec: JobSpec, device: torch.device, hw: hardware.Hardware | None = None) -> SwapPlan:
    """The plan the engine runs: measured rates on CUDA (assumed ones on the CPU, where they
    only affect the prediction), the spec's budget and overrides."""
    if hw is None:
        hw = hardware.measure(device) if device.type == "cuda" else hardware.assumed()
    resident_blocks = spec.swap_resident_blocks
    if resident_blocks is None and device.type != "cuda" and spec.gpu_mem is None:
        # A CPU has no device memory to save: swapping there exists to exercise the engine.
        resident_blocks = 0
    return make_plan(
        shape_for(spec, device),
        budget_bytes=device_budget(spec, device),
        hardware=hw,
        slots=spec.swap_slots,
        micro_batches=spec.swap_micro_batches,
        resident_blocks=resident_blocks,
        optimizer=None if spec.swap_optimizer == "auto" else spec.swap_optimizer,
        graph_blocks=spec.swap_graph_blocks,
        link=None if spec.swap_link == "auto" else spec.swap_link,
        device_steps=spec.swap_device_steps,
        host_budget_bytes=host_budget(),
    )
