"""Named model shapes.

The GPT-3 family follows Table 2.1 of Brown et al. (2020): layers, d_model, heads, a 2048-token
context and GPT-2's 50257-entry vocabulary with tied embeddings. Their byte-level training here
uses token ids 0..255 of that vocabulary.
"""

from __future__ import annotations

from atomd.model.config import GPTConfig

PRESETS: dict[str, GPTConfig] = {
    # ~0.84M parameters, 128-token context: the CPU preset for tests, the demo and the
    # sync benchmark (the task in the swarm issue: 4 layers, width 128, 4 heads, seq 128).
    "tiny": GPTConfig(n_layer=4, n_head=4, n_embd=128, vocab_size=256, block_size=128),
    # GPT-2 small (124M), 1024-token context.
    "small": GPTConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, block_size=1024),
    # Table 2.1 lists 24 heads of 128 for XL, which cannot tile d_model 2048; we keep d_head 128.
    "gpt3-xl": GPTConfig(
        n_layer=24, n_head=16, n_embd=2048, vocab_size=50257, block_size=2048
    ),  # 1.3B
    "gpt3-2.7b": GPTConfig(n_layer=32, n_head=32, n_embd=2560, vocab_size=50257, block_size=2048),
    "gpt3-6.7b": GPTConfig(n_layer=32, n_head=32, n_embd=4096, vocab_size=50257, block_size=2048),
    # Table 2.1 prints d_model 5140 for 13B; 40 heads x 128 = 5120 is the model that was trained.
    "gpt3-13b": GPTConfig(n_layer=40, n_head=40, n_embd=5120, vocab_size=50257, block_size=2048),
}

# The parameter counts the papers report (GPT-2 small: 124M; GPT-3: Table 2.1).
PAPER_PARAMETERS: dict[str, float] = {
    "small": 124e6,
    "gpt3-xl": 1.3e9,
    "gpt3-2.7b": 2.7e9,
    "gpt3-6.7b": 6.7e9,
    "gpt3-13b": 13.0e9,
}


def preset_names() -> list[str]:
    return list(PRESETS)


def get_preset(name: str) -> GPTConfig:
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(PRESETS)
        raise ValueError(f"unknown preset {name!r}; known presets: {known}") from None
