"""A GPT decoder (pre-LayerNorm, causal attention) written as plain modules.

The model is a sequence of *layers*: ``Embedding``, ``n_layer`` ``Block``s and a ``Head``.
``GPT.layers()`` returns them in order, each mapping ``x -> x``, so a swap engine can drive them
one at a time without knowing anything else about the model. Shapes use B (batch), T (time),
C (n_embd), nh (heads), hs (head size).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from atomd.model.config import GPTConfig

__all__ = ["GPT", "Block", "Embedding", "GPTConfig", "Head", "lm_loss"]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        out: Tensor = self.resid_drop(self.proj(y))
        return out


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.drop(self.proj(F.gelu(self.fc(x), approximate=self.approximate)))
        return out


class Block(nn.Module):
    """One pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        out: Tensor = x + self.mlp(self.ln_2(x))
        return out


class Embedding(nn.Module):
    """Token + learned position embedding: (B, T) int64 -> (B, T, C)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.block_size = cfg.block_size
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx: Tensor) -> Tensor:
        T = idx.shape[1]
        if self.block_size < T:
            raise ValueError(f"sequence length {T} exceeds block_size {self.block_size}")
        pos = torch.arange(T, device=idx.device)
        out: Tensor = self.drop(self.wte(idx) + self.wpe(pos))
        return out


class Head(nn.Module):
    """Final LayerNorm and projection to the vocabulary: (B, T, C) -> (B, T, vocab)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.lm_head(self.ln_f(x))
        return out


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy in nats; logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


class GPT(nn.Module):
    """GPT decoder. ``forward(idx, targets)`` returns ``(logits, loss)``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.head = Head(cfg)
        if cfg.tie_embeddings:
            self.head.lm_head.weight = self.embed.wte.weight
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def layers(self) -> list[nn.Module]:
        """The model as an ordered list of ``x -> x`` layers: embedding, blocks, head."""
        return [self.embed, *self.blocks, self.head]

    def tied_parameter_names(self) -> dict[str, str]:
        """Alias name -> canonical name for parameters shared between layers."""
        if self.config.tie_embeddings:
            return {"head.lm_head.weight": "embed.wte.weight"}
        return {}

    def num_parameters(self, *, exclude_embeddings: bool = False) -> int:
        """Unique parameters (a tied weight counts once)."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.embed.wpe.weight.numel()
        return n

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        x = idx
        for layer in self.layers():
            x = layer(x)
        loss = lm_loss(x, targets) if targets is not None else None
        return x, loss
