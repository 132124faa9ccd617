from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from atomd.spec import JobSpec

# Tests are small; two threads match CI and keep runs reproducible.
torch.set_num_threads(min(2, os.cpu_count() or 1))


def fast_spec(**overrides: Any) -> JobSpec:
    """A spec that trains the tiny model in well under a second per step on a CPU."""
    base: dict[str, Any] = {
        "preset": "tiny",
        "seq_len": 32,
        "micro_batch_size": 4,
        "max_steps": 12,
        "warmup_steps": 2,
        "eval_interval": 6,
        "eval_batches": 2,
        "log_interval": 1,
        "checkpoint_interval": 5,
    }
    base.update(overrides)
    return JobSpec(**base)


@pytest.fixture
def text_file(tmp_path: Any) -> Any:
    """A small text corpus with learnable structure."""
    p = tmp_path / "corpus.txt"
    lines = [f"line {i % 17}: the quick brown fox jumps over the lazy dog.\n" for i in range(3000)]
    p.write_text("".join(lines))
    return p
