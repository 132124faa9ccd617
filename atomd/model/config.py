"""The shape of a GPT model (no torch: importable without loading it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

ACTIVATIONS = ("gelu", "gelu_tanh")


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a GPT model."""

    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int
    """Model width (d_model)."""
    vocab_size: int = 256
    """Vocabulary size; 256 for the byte-level tokenizer."""
    block_size: int = 256
    """Longest sequence the position embedding covers."""
    dropout: float = 0.0
    """Dropout probability (0 for pre-training, as GPT-3 and nanoGPT do)."""
    bias: bool = True
    """Biases in Linear and LayerNorm layers (GPT-2 style)."""
    tie_embeddings: bool = True
    """Share the token embedding with the output projection."""
    activation: str = "gelu"
    """The MLP's activation: ``gelu`` (exact) or ``gelu_tanh`` (GPT-2's tanh approximation,
    what checkpoints imported from GPT-2 use)."""

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPTConfig:
        return cls(**data)


def num_parameters(cfg: GPTConfig) -> int:
    """Unique parameters of ``GPT(cfg)`` in closed form (a tied weight counts once): what the
    daemon needs to admit a job without importing torch. A test checks it against the model.

    Per block, width C: attention qkv 3C² + proj C², MLP fc 4C² + proj 4C² (12C²), with biases
    3C + C + 4C + C, and two LayerNorms of C weights (+ C biases each)."""
    c, bias = cfg.n_embd, cfg.bias
    block = 12 * c * c + (9 * c if bias else 0) + 2 * c * (2 if bias else 1)
    embed = (cfg.vocab_size + cfg.block_size) * c  # token + position embeddings
    head = c * (2 if bias else 1) + (0 if cfg.tie_embeddings else cfg.vocab_size * c)
    return embed + cfg.n_layer * block + head
