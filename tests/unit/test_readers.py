"""Document datasets (JSON lines, Parquet, datasets' save_to_disk) through the token cache, and
the content hash a job spec pins."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from atomd.data.dataset import load_dataset
from atomd.data.readers import document_source, token_cache
from atomd.data.tokenizer import ByteTokenizer, load_tokenizer
from atomd.errors import ConfigError, DataError
from tests.conftest import fast_spec, trainer_for

DOCS = [f"Document {i}: the quick brown fox jumps over the lazy dog, {i % 7} times.\n" * 20
        for i in range(60)]  # fmt: skip


def _jsonl(path: Path, docs: list[str] = DOCS, field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def _expected(tok_name: str) -> np.ndarray:
    tok = load_tokenizer(tok_name)
    sep = [0] if tok_name == "default" else list(b"\n\n")  # <|endoftext|> is id 0 in BPEs here
    ids: list[int] = []
    for i, d in enumerate(DOCS):
        ids += (sep if i else []) + tok.encode(d)
    return np.asarray(ids, dtype=np.uint16)


@pytest.mark.parametrize("tok_name", ["bytes", "default"])
def test_jsonl_is_tokenized_once_into_a_memory_mapped_cache(tmp_path: Path, tok_name: str) -> None:
    data = _jsonl(tmp_path / "docs.jsonl")
    tok = load_tokenizer(tok_name)
    ds = load_dataset(str(data), seq_len=32, tokenizer=tok)
    whole = np.concatenate([ds.train, ds.val])
    assert np.array_equal(whole, _expected(tok_name))
    assert isinstance(ds.train, np.memmap)  # read from the cache file, not held in memory
    caches = list((tmp_path / "docs.jsonl.atomd-cache").glob("tokens-*.bin"))
    assert len(caches) == 1
    meta = json.loads(caches[0].with_suffix(".json").read_text())
    assert meta["documents"] == len(DOCS) and meta["tokens"] == len(whole)
    assert ds.sha256 == meta["sha256"]
    # The second load reads the cache (its file is not rewritten).
    before = caches[0].stat().st_mtime_ns
    again = load_dataset(str(data), seq_len=32, tokenizer=tok)
    assert again.sha256 == ds.sha256 and caches[0].stat().st_mtime_ns == before
    # A changed file makes a new cache.
    _jsonl(data, DOCS[:-1])
    changed = load_dataset(str(data), seq_len=32, tokenizer=tok)
    assert changed.sha256 != ds.sha256
    assert len(list((tmp_path / "docs.jsonl.atomd-cache").glob("tokens-*.bin"))) == 2


def test_parquet_and_save_to_disk_give_the_same_tokens_and_hash(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    tok = ByteTokenizer()
    ref = load_dataset(str(_jsonl(tmp_path / "docs.jsonl")), seq_len=32, tokenizer=tok)

    pq.write_table(pa.table({"id": list(range(60)), "text": DOCS}), tmp_path / "docs.parquet",
                   row_group_size=16)  # fmt: skip
    parquet = load_dataset(str(tmp_path / "docs.parquet"), seq_len=32, tokenizer=tok)
    assert parquet.sha256 == ref.sha256

    folder = tmp_path / "parts"
    folder.mkdir()
    for k in range(3):  # a folder of Parquet files, read in sorted order
        table = pa.table({"text": DOCS[k * 20 : (k + 1) * 20]})
        pq.write_table(table, folder / f"part-{k}.parquet")
    assert load_dataset(str(folder), seq_len=32, tokenizer=tok).sha256 == ref.sha256

    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "saved"))
    saved = load_dataset(str(tmp_path / "saved"), seq_len=32, tokenizer=tok)
    assert saved.sha256 == ref.sha256
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS})})
    dd.save_to_disk(str(tmp_path / "dict"))
    assert load_dataset(str(tmp_path / "dict"), seq_len=32, tokenizer=tok).sha256 == ref.sha256


def test_a_missing_text_field_is_named(tmp_path: Path) -> None:
    data = _jsonl(tmp_path / "docs.jsonl", field="content")
    with pytest.raises(DataError, match=r"docs\.jsonl:1: no 'text' field"):
        load_dataset(str(data), seq_len=32)
    ds = load_dataset(str(data), seq_len=32, text_field="content")
    assert ds.train_tokens > 0
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: not JSON"):
        load_dataset(str(tmp_path / "bad.jsonl"), seq_len=4)


def test_a_read_only_data_folder_caches_in_the_home_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    ro = tmp_path / "ro"
    ro.mkdir()
    data = _jsonl(ro / "docs.jsonl")
    ro.chmod(0o555)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    try:
        source = document_source(data)
        assert source is not None
        cache = token_cache(source, ByteTokenizer())
        assert cache.path.is_relative_to(tmp_path / "cache")
    finally:
        ro.chmod(0o755)


def test_the_data_hash_in_the_spec_is_checked(tmp_path: Path) -> None:
    data = _jsonl(tmp_path / "docs.jsonl")
    sha = load_dataset(str(data), seq_len=32).sha256
    ok = fast_spec(data=str(data), data_sha256=sha, max_steps=2)
    assert trainer_for(ok, tmp_path / "ok").run().step == 2
    _jsonl(data, DOCS[1:])  # this peer's copy differs
    with pytest.raises(ConfigError, match=f"the job's data_sha256 is {sha}: this peer's copy"):
        trainer_for(ok, tmp_path / "other")


def test_vocabularies_over_65536_cache_uint32(tmp_path: Path) -> None:
    """A tokenizer of 70,001 entries: its ids do not fit uint16, the cache holds uint32."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from atomd.data.tokenizer import BPETokenizer

    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000}
    hf = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = BPETokenizer(hf, name="words")
    docs = [" ".join(f"w{(i * 7919 + j) % 70_000}" for j in range(50)) for i in range(40)]
    data = _jsonl(tmp_path / "words.jsonl", docs)
    ds = load_dataset(str(data), seq_len=16, tokenizer=tok, vocab_size=70_001)
    whole = np.concatenate([ds.train, ds.val])
    assert ds.train.dtype == np.uint32 and isinstance(ds.train, np.memmap)
    sep = tok.encode("\n\n")  # WordLevel has no <|endoftext|>: documents end with a blank line
    want: list[int] = []
    for i, d in enumerate(docs):
        want += (sep if i else []) + tok.encode(d)
    assert whole.tolist() == want and max(want) > 65_535
    with pytest.raises(
        ConfigError, match=r"holds token id 6\d,\d{3}, but the model.s vocabulary has 50,257"
    ):
        load_dataset(str(data), seq_len=16, tokenizer=tok, vocab_size=50_257)
