"""The same training on CUDA (bf16 autocast); skipped on machines without a GPU."""

from __future__ import annotations

from pathlib import Path

import torch

from atomd.train.trainer import Trainer, model_from_checkpoint
from tests.conftest import fast_spec


def test_cuda_training_lowers_loss_and_checkpoints_load_on_cpu(
    tmp_path: Path, text_file: Path
) -> None:
    spec = fast_spec(data=str(text_file), max_steps=30, eval_interval=10, micro_batch_size=16)
    summary = Trainer(spec, tmp_path, device="cuda").run()
    assert summary.state == "finished"
    assert summary.loss is not None and summary.loss < 3.0
    model, _ = model_from_checkpoint(tmp_path, torch.device("cpu"))
    assert all(p.device.type == "cpu" and torch.isfinite(p).all() for p in model.parameters())
