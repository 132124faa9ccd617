"""Tokenizers, Hugging Face export and import, and plots through the real ``atomd`` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.test_cli import run

SMALL = ["--seq-len", "32", "--micro-batch-size", "4", "--eval-interval", "3", "--quiet"]


def test_tokenizer_train_then_train_sample_export_and_plot(tmp_path: Path, text_file: Path) -> None:
    tok = tmp_path / "tok" / "tokenizer.json"
    proc = run("tokenizer", "train", "--vocab-size", "300", str(text_file), "--out", str(tok))
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {tok}: 300 tokens, fitted on 1 file(s)" in proc.stdout

    out = tmp_path / "run"
    args = ["--data", str(text_file), "--tokenizer", str(tok), "--out", str(out), *SMALL]
    proc = run("train", "--max-steps", "3", "--device", "cpu", *args)
    assert proc.returncode == 2  # tiny's 256 entries cannot hold 300 tokens
    assert "set the job's vocab_size to 300" in proc.stderr and "Traceback" not in proc.stderr
    proc = run("train", "--max-steps", "6", "--device", "cpu", "--vocab-size", "300", *args)
    assert proc.returncode == 0, proc.stderr
    saved = out / "checkpoints" / "step-00000006" / "tokenizer.json"
    assert json.loads(saved.read_text()) == json.loads(tok.read_text())
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))

    proc = run("sample", "--checkpoint", str(out), "--prompt", "line 3:", "--max-new-tokens",
               "10", "--device", "cpu")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("line 3:")

    proc = run("export", str(out), str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr
    assert "model.safetensors (52 tensors) and tokenizer.json" in proc.stdout
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["vocab_size"] == 300

    proc = run("plot", str(out), "--out", str(tmp_path / "loss.png"))
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout and "to step 6, last validation loss" in proc.stdout
    assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG")

    proc = run("plot", str(tmp_path / "hf"), "--out", str(tmp_path / "none.png"))
    assert proc.returncode == 2 and "holds no metrics.jsonl" in proc.stderr


def test_import_a_gpt2_folder_and_train_from_it(tmp_path: Path, text_file: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=4, n_head=4, n_embd=128, vocab_size=256, n_positions=128)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2")
    proc = run("import", str(tmp_path / "gpt2"), str(tmp_path / "imported"))
    assert proc.returncode == 0, proc.stderr
    assert "activation gelu_tanh" in proc.stdout
    assert f"atomd train --preset tiny --init-from {tmp_path / 'imported'}" in proc.stdout

    out = tmp_path / "run"
    proc = run("train", "--max-steps", "3", "--device", "cpu", "--data", str(text_file),
               "--init-from", str(tmp_path / "imported"), "--out", str(out), *SMALL)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "initial weights from" in proc.stderr
    meta = json.loads((out / "checkpoints" / "step-00000003" / "meta.json").read_text())
    assert meta["model_config"]["activation"] == "gelu_tanh"

    proc = run("import", str(tmp_path / "gpt2"), str(tmp_path / "imported"))
    assert proc.returncode == 2 and "already holds checkpoints" in proc.stderr
