"""Rehearse a plan: run its schedule on a stand-in model on the CPU, record it, simulate it.

The work a swapped step issues depends on the plan's choices (K, M, waves, kept graphs, spill,
optimizer, clipping) and the layer count, not on the layers' width: a model with the preset's
layer count and tiny layers issues the same schedule in milliseconds. ``simulate`` then times
it with the real shape's FLOPs and bytes at the plan's rates (``atomd plan --simulate``).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from atomd.data.dataset import Batch
from atomd.model.gpt import GPT, GPTConfig
from atomd.swap.engine import SwapEngine
from atomd.swap.hardware import Hardware
from atomd.swap.plan import Shape, SwapPlan
from atomd.swap.record import Recorder
from atomd.swap.trace import Costs, Simulation, simulate
from atomd.train.optim import OptimConfig


def record_plan(
    plan: SwapPlan, shape: Shape, *, steps: int = 3, engine_cls: type[SwapEngine] = SwapEngine
) -> Recorder:
    """The work ``steps`` optimizer steps of ``plan`` issue, recorded on a stand-in model on
    the CPU (fp32: the link's dtype changes bytes, which the simulation counts, not the
    schedule)."""
    cfg = GPTConfig(n_layer=shape.cfg.n_layer, n_head=1, n_embd=8, vocab_size=16, block_size=8)
    optim = OptimConfig(
        lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, grad_clip=1.0 if shape.grad_clip else 0.0
    )
    gen = torch.Generator().manual_seed(0)

    def batch() -> Batch:
        t = torch.randint(0, cfg.vocab_size, (1, cfg.block_size + 1), generator=gen)
        return Batch(x=t[:, :-1].contiguous(), y=t[:, 1:].contiguous())

    torch.manual_seed(0)
    engine = engine_cls(GPT(cfg), optim, torch.device("cpu"), replace(plan, link="fp32"))
    try:
        with engine.recording() as recorder:
            for _ in range(steps):
                engine.train_step([batch() for _ in range(plan.grad_accum)], 1e-4)
    finally:
        engine.close()
    return recorder


def rehearse(
    plan: SwapPlan, shape: Shape, hw: Hardware, **kw: object
) -> tuple[Recorder, Simulation]:
    recorder = record_plan(plan, shape, **kw)  # type: ignore[arg-type]
    return recorder, simulate(recorder.events, Costs(shape, plan, hw))
