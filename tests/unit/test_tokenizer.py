"""Tokenizers: bytes, the packaged BPE, fitting one, and their checks against the model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from atomd.data.dataset import bundled_text, load_dataset
from atomd.data.tokenizer import (
    BPETokenizer,
    ByteTokenizer,
    load_tokenizer,
    tokenizer_from_json,
    train_bpe,
)
from atomd.errors import ConfigError
from atomd.train import checkpoint as ckpt
from atomd.train.trainer import model_from_checkpoint, tokenizer_of
from tests.conftest import fast_spec, trainer_for

TEXTS = ["", "hello world\n", "ROMEO:\n  But soft! what light?\n\n\tx", "naïve café — ü 日本"]
TEXTS += ["a\n\n  b"]


def test_the_bytes_tokenizer_json_encodes_as_bytes() -> None:
    """The tokenizer.json a bytes run's checkpoints carry is exactly the byte tokenizer."""
    from tokenizers import Tokenizer

    hf = Tokenizer.from_str(ByteTokenizer().to_json())
    assert hf.get_vocab_size() == 256
    for text in TEXTS:
        ids = hf.encode(text).ids
        assert ids == list(text.encode("utf-8")), text
        assert hf.decode(ids) == text
    assert isinstance(tokenizer_from_json(ByteTokenizer().to_json(), name="x"), ByteTokenizer)


def test_the_default_tokenizer_round_trips_and_compresses() -> None:
    tok = load_tokenizer("default")
    assert tok.vocab_size == 4096
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    sample = bundled_text()[:200_000]
    ids = tok.encode_array(sample)
    assert ids.dtype == np.uint16 and int(ids.max()) < 4096
    assert len(sample) / len(ids) > 2.5  # 2.99 bytes per token on the whole corpus
    assert tok.decode(ids.tolist()) == sample.decode("utf-8")


def test_encoding_in_pieces_equals_encoding_the_whole() -> None:
    tok = load_tokenizer("default")
    assert isinstance(tok, BPETokenizer)
    text = bundled_text()[:600_000]  # several batches of pieces
    whole = tok.tok.encode(text.decode("utf-8"), add_special_tokens=False).ids
    assert tok.encode_array(text).tolist() == whole


def test_train_a_bpe_and_use_it(tmp_path: Path, text_file: Path) -> None:
    tok = train_bpe([text_file], vocab_size=300)
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert loaded.vocab_size == 300
    line = "line 3: the quick brown fox jumps over the lazy dog.\n"
    assert len(loaded.encode(line)) < len(line) / 2
    assert loaded.decode(loaded.encode(line)) == line
    again = train_bpe([text_file], vocab_size=300)
    assert again.to_str() == tok.to_str()  # deterministic
    # A folder that holds one names it too.
    assert load_tokenizer(str(tmp_path)).vocab_size == 300


def test_unknown_tokenizers_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_tokenizer(str(tmp_path / "nope.json"))
    with pytest.raises(ConfigError, match=r"holds no tokenizer\.json"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot be read"):
        load_tokenizer(str(tmp_path / "bad.json"))


def test_a_tokenizer_larger_than_the_model_is_a_config_error(tmp_path: Path) -> None:
    spec = fast_spec(tokenizer="default")  # tiny: 256 entries
    with pytest.raises(ConfigError, match=r"has 4,096 tokens.*set the job's vocab_size to 4096"):
        trainer_for(spec, tmp_path)


def test_bin_tokens_beyond_the_vocabulary_are_a_config_error(tmp_path: Path) -> None:
    """GPT-2-tokenized data on the tiny preset: a clear error at start, not an IndexError."""
    ids = np.random.default_rng(0).integers(0, 50257, size=20_000).astype(np.uint16)
    ids.tofile(tmp_path / "train.bin")
    spec = fast_spec(data=str(tmp_path / "train.bin"))
    with pytest.raises(ConfigError, match=r"holds token id 50,25\d.*256 entries"):
        trainer_for(spec, tmp_path / "run")
    # With a vocabulary that holds them it trains.
    ok = fast_spec(data=str(tmp_path / "train.bin"), vocab_size=50257, max_steps=2)
    assert trainer_for(ok, tmp_path / "ok").run().step == 2
    with pytest.raises(ConfigError, match="token id"):
        load_dataset(str(tmp_path / "train.bin"), seq_len=16, vocab_size=1000)


def test_checkpoints_carry_the_tokenizer_and_sampling_uses_it(tmp_path: Path) -> None:
    spec = fast_spec(tokenizer="default", vocab_size=4096, max_steps=3)
    summary = trainer_for(spec, tmp_path).run()
    assert summary.checkpoint is not None
    saved = summary.checkpoint / ckpt.TOKENIZER_FILE
    assert saved.read_text(encoding="utf-8") == load_tokenizer("default").to_json()
    model, found = model_from_checkpoint(tmp_path, torch.device("cpu"))
    assert found.meta["tokenizer"] == "default" and model.config.vocab_size == 4096
    assert "tokenizer.json" in found.meta["files"]  # hashed like the tensors
    tok = tokenizer_of(found)
    assert tok.vocab_size == 4096 and tok.decode(tok.encode("JULIET:")) == "JULIET:"
    # A corrupted tokenizer.json makes the checkpoint bad, like a corrupted tensor file.
    saved.write_text("{}")
    with pytest.raises(Exception, match=r"tokenizer\.json"):
        ckpt.load_checkpoint(summary.checkpoint)


def test_bytes_runs_carry_the_bytes_tokenizer(tmp_path: Path, text_file: Path) -> None:
    summary = trainer_for(fast_spec(data=str(text_file), max_steps=2), tmp_path).run()
    assert summary.checkpoint is not None
    _, found = model_from_checkpoint(tmp_path, torch.device("cpu"))
    assert isinstance(tokenizer_of(found), ByteTokenizer)


@pytest.mark.parametrize("name", ["/nope/tokenizer.json", "x" * 5000, "~no-such-user-here/t.json"])
def test_the_daemon_refuses_a_missing_tokenizer_or_init_from_before_queueing(name: str) -> None:
    from atomd.errors import SpecError
    from atomd.jobs.admission import admit
    from atomd.spec import JobSpec

    with pytest.raises(SpecError, match="not found") as e:
        admit(JobSpec(tokenizer=name))
    assert e.value.field == "tokenizer"
    with pytest.raises(SpecError, match="does not exist") as e:
        admit(JobSpec(init_from=name))
    assert e.value.field == "init_from"
    admit(JobSpec(tokenizer="default"))  # the packaged ones need no file
