"""Pure GPT modules and named presets: no I/O, no devices, no swapping.

The torch-bound names load on first use, so configs and presets import without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from atomd.model.config import GPTConfig
from atomd.model.presets import PRESETS, get_preset, preset_names

if TYPE_CHECKING:
    from atomd.model.gpt import GPT, Block, Embedding, Head, lm_loss

_LAZY = {"GPT", "Block", "Embedding", "Head", "lm_loss"}

__all__ = [
    "GPT",
    "PRESETS",
    "Block",
    "Embedding",
    "GPTConfig",
    "Head",
    "get_preset",
    "lm_loss",
    "preset_names",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from atomd.model import gpt

        return getattr(gpt, name)
    raise AttributeError(f"module 'atomd.model' has no attribute {name!r}")
