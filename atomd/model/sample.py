"""Autoregressive sampling (pure compute on whatever device the model is on)."""

from __future__ import annotations

import torch
from torch import Tensor

from atomd.model.gpt import GPT


@torch.no_grad()
def generate(
    model: GPT,
    idx: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int | None = 40,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Extend ``idx`` (B, T) by ``max_new_tokens`` sampled tokens; returns (B, T + new)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    model.eval()
    block = model.config.block_size
    for _ in range(max_new_tokens):
        context = idx[:, -block:]
        logits, _ = model(context)
        logits = logits[:, -1, :] / temperature  # (B, V)
        if top_k is not None and top_k < logits.size(-1):
            kth = torch.topk(logits, top_k).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits.float(), dim=-1)
        nxt = torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)
        idx = torch.cat([idx, nxt], dim=1)
    return idx
