"""How far apart two runs' parameters are (swapped vs resident), for tests and the benchmark."""

from __future__ import annotations

import torch
from torch import Tensor


def _determined(name: str, t: Tensor) -> Tensor:
    """``t`` without the entries the loss does not determine.

    The key third of ``attn.qkv.bias`` (qkv is [q | k | v] along the output) has an exact
    gradient of zero: adding one vector to every key shifts all of a query's scores equally,
    and softmax ignores that. The computed gradient is rounding noise (~1e-12) that AdamW
    divides by its own magnitude into a step of random sign, so those entries differ between
    any two summation orders (here: the tied embedding's gradient, added per use instead of
    per micro-batch) without saying anything about correctness.
    """
    if name.endswith("attn.qkv.bias"):
        c = t.numel() // 3
        return torch.cat([t[:c], t[2 * c :]])
    return t


def max_rel_param_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    """max over parameters of ||a - b|| / ||b|| (L2, fp64), over the determined entries.
    Computed one tensor at a time on ``b``'s device: next to a swapped 6.7B model's 120 GB of
    host state, fp64 host copies of both were more than the host had left."""
    if set(a) != set(b):
        raise ValueError(f"different parameter names: {sorted(set(a) ^ set(b))}")
    worst = 0.0
    for name in a:
        y = _determined(name, b[name].detach().double())
        x = _determined(name, a[name].detach().to(y.device, torch.float64))
        scale = float(y.norm())
        diff = float((x - y).norm())
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst
