"""Pure GPT modules and named presets: no I/O, no devices, no swapping."""

from atomd.model.gpt import GPT, Block, Embedding, GPTConfig, Head, lm_loss
from atomd.model.presets import PRESETS, get_preset, preset_names

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
