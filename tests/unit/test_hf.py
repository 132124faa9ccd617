"""Hugging Face interop: atomd checkpoints to GPT-2 folders that transformers loads, and GPT-2
folders (as save_pretrained writes them) to atomd checkpoints a job starts from. Tiny models
made here; nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from atomd.engine_choice import build_engine
from atomd.errors import ConfigError
from atomd.hf import export_checkpoint, import_pretrained
from atomd.model.config import GPTConfig
from atomd.model.gpt import GPT
from atomd.train import checkpoint as ckpt
from atomd.train.step_engine import model_tensors
from atomd.train.trainer import model_from_checkpoint
from tests.conftest import fast_spec, trainer_for

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
TOL = 1e-4  # the bound on the CPU; measured differences are printed by the tests


def _ids(vocab: int, t: int = 48) -> torch.Tensor:
    return torch.randint(0, vocab, (3, t), generator=torch.Generator().manual_seed(7))


def _hf_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.GPT2LMHeadModel.from_pretrained(folder)
    model.eval()
    with torch.no_grad():
        out: torch.Tensor = model(ids).logits
    return out


def _atomd_logits(model: GPT, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(ids)[0]


def _save(model: GPT, root: Path, tokenizer: bytes | None = None) -> Path:
    extra = {ckpt.TOKENIZER_FILE: tokenizer} if tokenizer else None
    return ckpt.save_checkpoint(
        ckpt.checkpoint_root(root),
        step=3,
        model=model_tensors(model),
        state={},
        meta={"model_config": model.config.to_dict()},
        extra=extra,
    )


def test_a_trained_run_exports_to_gpt2_with_its_tokenizer(tmp_path: Path) -> None:
    spec = fast_spec(max_steps=4, tokenizer="default", vocab_size=4096)
    trainer_for(spec, tmp_path / "run").run()
    export_checkpoint(tmp_path / "run", tmp_path / "hf")
    assert {p.name for p in (tmp_path / "hf").iterdir()} == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    model, _ = model_from_checkpoint(tmp_path / "run", CPU)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "ROMEO: But soft, what light through yonder window breaks?"
    ids = torch.tensor([tok.encode(text)])
    assert tok.decode(ids[0].tolist()) == text
    diff = (_hf_logits(tmp_path / "hf", ids) - _atomd_logits(model, ids)).abs().max().item()
    print(f"atomd -> transformers, trained tiny run (BPE 4096): max |logit diff| {diff:.2e}")
    assert diff < TOL


@pytest.mark.parametrize(
    "cfg",
    [
        GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=300, block_size=64),
        GPTConfig(
            n_layer=2, n_head=2, n_embd=32, vocab_size=256, block_size=32, tie_embeddings=False
        ),
        GPTConfig(n_layer=3, n_head=4, n_embd=32, vocab_size=256, block_size=32, bias=False),
        GPTConfig(
            n_layer=2, n_head=4, n_embd=64, vocab_size=300, block_size=64, activation="gelu_tanh"
        ),
    ],
    ids=["tied", "untied", "no-bias", "gelu-tanh"],
)
def test_export_matches_logits_for_every_variant(tmp_path: Path, cfg: GPTConfig) -> None:
    torch.manual_seed(0)
    model = GPT(cfg)
    with torch.no_grad():  # biases and LayerNorms away from their 0/1 init: test the layout
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    _save(model, tmp_path / "run")
    export_checkpoint(tmp_path / "run", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["tie_word_embeddings"] == cfg.tie_embeddings
    ids = _ids(cfg.vocab_size, cfg.block_size)
    diff = (_hf_logits(tmp_path / "hf", ids) - _atomd_logits(model, ids)).abs().max().item()
    print(f"atomd -> transformers ({cfg}): max |logit diff| {diff:.2e}")
    assert diff < TOL


def test_gpt2_imports_and_a_job_starts_from_it(tmp_path: Path, text_file: Path) -> None:
    """A GPT-2 of the tiny preset's shape (vocabulary 300, GPT-2's tanh GELU), saved as
    save_pretrained saves it, imports with the same logits; a job starts from its weights and
    trains; the trained model exports back with logits transformers reproduces."""
    hf_cfg = transformers.GPT2Config(
        n_layer=4, n_head=4, n_embd=128, vocab_size=300, n_positions=128
    )
    torch.manual_seed(1)
    hf_model = transformers.GPT2LMHeadModel(hf_cfg)
    hf_model.save_pretrained(tmp_path / "gpt2")
    assert (tmp_path / "gpt2" / "model.safetensors").is_file()

    import_pretrained(tmp_path / "gpt2", tmp_path / "imported")
    model, found = model_from_checkpoint(tmp_path / "imported", CPU)
    assert found.step == 0 and model.config.activation == "gelu_tanh"
    ids = _ids(300, 64)
    diff = (_hf_logits(tmp_path / "gpt2", ids) - _atomd_logits(model, ids)).abs().max().item()
    print(f"transformers -> atomd (GPT-2 of the tiny shape): max |logit diff| {diff:.2e}")
    assert diff < TOL

    spec = fast_spec(data=str(text_file), vocab_size=300, init_from=str(tmp_path / "imported"))
    built = build_engine(spec, "cpu")
    start = built.engine.model_tensors()
    for name, t in model_tensors(model).items():
        assert torch.equal(start[name], t), name
    trainer_for(spec, tmp_path / "run").run()
    trained, _ = model_from_checkpoint(tmp_path / "run", CPU)
    assert trained.config.activation == "gelu_tanh"
    export_checkpoint(tmp_path / "run", tmp_path / "back")
    back = (_hf_logits(tmp_path / "back", ids) - _atomd_logits(trained, ids)).abs().max().item()
    print(f"trained from the import, back to transformers: max |logit diff| {back:.2e}")
    assert back < TOL


def test_import_of_an_export_gives_the_same_tensors(tmp_path: Path) -> None:
    torch.manual_seed(2)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=64))
    _save(model, tmp_path / "run")
    export_checkpoint(tmp_path / "run", tmp_path / "hf")
    import_pretrained(tmp_path / "hf", tmp_path / "again")
    again, _ = model_from_checkpoint(tmp_path / "again", CPU)
    assert again.config == model.config
    theirs = model_tensors(again)
    for name, a in model_tensors(model).items():
        assert torch.equal(a, theirs[name]), name


def test_a_swapped_run_exports_too(tmp_path: Path, text_file: Path) -> None:
    """Swapped checkpoints hold the resident tensor names: they export the same way."""
    spec = fast_spec(data=str(text_file), max_steps=3, swap="on", grad_accum=2)
    trainer = trainer_for(spec, tmp_path / "run")
    assert trainer.plan["engine"] == "swap"
    try:
        trainer.run()
    finally:
        close = getattr(trainer.engine, "close", None)
        if callable(close):
            close()
    export_checkpoint(tmp_path / "run", tmp_path / "hf")
    model, _ = model_from_checkpoint(tmp_path / "run", CPU)
    ids = _ids(256, 32)
    diff = (_hf_logits(tmp_path / "hf", ids) - _atomd_logits(model, ids)).abs().max().item()
    print(f"swapped run -> transformers: max |logit diff| {diff:.2e}")
    assert diff < TOL


def test_import_refuses_what_atomd_does_not_model(tmp_path: Path) -> None:
    hf_cfg = transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=32, activation_function="relu"
    )
    transformers.GPT2LMHeadModel(hf_cfg).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ConfigError, match="activation_function 'relu'"):
        import_pretrained(tmp_path / "gpt2", tmp_path / "out")
    with pytest.raises(ConfigError, match=r"config\.json is missing"):
        import_pretrained(tmp_path / "nothing", tmp_path / "out")


def test_init_from_a_model_of_another_shape_is_refused(tmp_path: Path) -> None:
    torch.manual_seed(3)
    _save(GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64)), tmp_path / "other")
    spec = fast_spec(init_from=str(tmp_path / "other"))
    with pytest.raises(ConfigError, match="holds a model of shape 2 layers x 64 wide"):
        build_engine(spec, "cpu")


def test_export_refuses_a_folder_in_use(tmp_path: Path) -> None:
    torch.manual_seed(4)
    _save(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=32)), tmp_path / "run")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty"):
        export_checkpoint(tmp_path / "run", tmp_path / "hf")
