"""The simulated peers' engines: each built from the same initial weights, and the distances
and losses of their models (shared by the simulated benchmarks: sync, join, robust_sim)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from atomd.data.dataset import Batch
from atomd.engine_choice import optim_config
from atomd.model.gpt import GPT
from atomd.model.presets import get_preset
from atomd.spec import JobSpec
from atomd.train.step_engine import ResidentEngine


def build_engine(spec: JobSpec) -> ResidentEngine:
    """A CPU engine of ``spec``'s model, its initial weights drawn from ``spec.seed``."""
    torch.manual_seed(spec.seed)  # every peer starts from the same weights
    return ResidentEngine(GPT(get_preset(spec.preset)), optim_config(spec), torch.device("cpu"))


def rel_l2(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """|a - b| / |a| over all tensors (float64)."""
    num = sum(float((a[k] - b[k]).double().square().sum()) for k in a)
    den = sum(float(a[k].double().square().sum()) for k in a)
    return math.sqrt(num / max(den, 1e-30))


def max_divergence(points: Sequence[dict[str, torch.Tensor]]) -> float:
    """Largest relative L2 distance between two peers' tensors."""
    return max(
        (rel_l2(a, b) for i, a in enumerate(points) for b in points[i + 1 :]),
        default=0.0,
    )


def mean_model(engines: Sequence[ResidentEngine]) -> dict[str, torch.Tensor]:
    """The exact average of the peers' live models (CPU float32)."""
    models = [dict(e.model.named_parameters()) for e in engines]
    return {
        n: torch.stack([m[n].detach().float().cpu() for m in models]).mean(0) for n in models[0]
    }


def loss_of(engine: ResidentEngine, tensors: dict[str, torch.Tensor], val: list[Batch]) -> float:
    """Validation loss of other parameters in ``engine``'s model (its own are put back)."""
    params = dict(engine.model.named_parameters())
    saved = {n: p.detach().clone() for n, p in params.items()}
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(tensors[n])
        loss = engine.evaluate(val)
        for n, p in params.items():
            p.copy_(saved[n])
    return loss
