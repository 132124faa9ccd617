from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from atomd.data.dataset import VAL_BATCH, TokenDataset, bundled_text, load_dataset, shard_for_peer
from atomd.data.tokenizer import ByteTokenizer
from atomd.errors import DataError


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "O Romeo, Romeo! wherefore art thou Romeo? — ¿é?"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode([0xFF]) == "\ufffd"  # never raises


def test_bundled_corpus_is_shakespeare() -> None:
    text = bundled_text().decode("utf-8")
    assert len(text) > 4_000_000
    for needle in ("**ROMEO**", "**HAMLET**", "To be, or not to be"):
        assert needle in text


def test_split_holds_out_the_tail(text_file: Path) -> None:
    raw = np.frombuffer(text_file.read_bytes(), dtype=np.uint8)
    ds = load_dataset(str(text_file), seq_len=16, val_fraction=0.1, chunk_tokens=1024)
    cut = int(len(raw) * 0.9)
    assert len(ds.train) == cut
    np.testing.assert_array_equal(ds.val, raw[cut:])


@pytest.mark.parametrize("mode", ["interleaved", "contiguous"])
def test_shards_are_disjoint_and_cover_the_training_split(text_file: Path, mode: str) -> None:
    n = 4
    shards = [
        load_dataset(
            str(text_file),
            seq_len=16,
            shard_index=i,
            num_shards=n,
            shard_mode=mode,
            chunk_tokens=1024,
        )  # type: ignore[arg-type]
        for i in range(n)
    ]
    covered = np.zeros(len(shards[0].train), dtype=np.int32)
    for s in shards:
        for a, b in s.ranges:
            covered[a:b] += 1
    assert covered.max() == 1
    assert covered.sum() > 0.95 * len(covered)
    if mode == "contiguous":
        assert all(len(s.ranges) == 1 for s in shards)
    else:
        assert all(len(s.ranges) > 1 for s in shards)


def test_batches_are_deterministic_and_inside_the_shard(text_file: Path) -> None:
    ds = load_dataset(str(text_file), seq_len=16, shard_index=1, num_shards=3, chunk_tokens=1024)
    a = ds.train_batch(seed=3, step=7, micro=1, batch_size=8)
    b = ds.train_batch(seed=3, step=7, micro=1, batch_size=8)
    c = ds.train_batch(seed=3, step=8, micro=1, batch_size=8)
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert not torch.equal(a.x, c.x)
    assert a.x.shape == (8, 16) and a.x.dtype == torch.int64
    torch.testing.assert_close(a.x[:, 1:], a.y[:, :-1])  # targets are inputs shifted by one
    # every window lies inside one of the shard's ranges
    train = torch.from_numpy(np.asarray(ds.train, dtype=np.int64))
    for row in a.x:
        hits = [
            s
            for s, e in ds.ranges
            if any(torch.equal(train[p : p + 16], row) for p in range(s, e - 16))
        ]
        assert hits


def test_validation_batches_are_fixed(text_file: Path) -> None:
    ds = load_dataset(str(text_file), seq_len=16, chunk_tokens=1024)
    v1 = ds.val_batches(count=3, batch_size=4)
    v2 = ds.val_batches(count=3, batch_size=4)
    assert all(torch.equal(a.x, b.x) for a, b in zip(v1, v2, strict=True))


def test_validation_windows_do_not_depend_on_the_batch_size(text_file: Path) -> None:
    ds = load_dataset(str(text_file), seq_len=16, chunk_tokens=1024)
    windows = {
        b: torch.cat([v.x for v in ds.val_batches(count=3, batch_size=b)]) for b in (1, 5, 16)
    }
    assert windows[16].shape == (3 * VAL_BATCH, 16)
    assert torch.equal(windows[1], windows[16]) and torch.equal(windows[5], windows[16])
    assert [v.x.shape[0] for v in ds.val_batches(count=1, batch_size=5)] == [5, 5, 5, 1]


def test_folder_of_text_files(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("b" * 3000)
    (tmp_path / "a.txt").write_text("a" * 3000)
    (tmp_path / "skip.json").write_text("{}")
    ds = load_dataset(str(tmp_path), seq_len=16, val_fraction=0.5, chunk_tokens=1024)
    assert bytes(np.asarray(ds.train[:3], dtype=np.uint8)) == b"aaa"  # sorted order
    assert bytes(np.asarray(ds.val[-3:], dtype=np.uint8)) == b"bbb"


def test_nanogpt_bin_folder(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    rng.integers(0, 50000, 5000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    val = rng.integers(0, 50000, 600, dtype=np.uint16)
    val.tofile(tmp_path / "val.bin")
    ds = load_dataset(str(tmp_path), seq_len=16, chunk_tokens=1024)
    assert len(ds.train) == 5000
    np.testing.assert_array_equal(ds.val, val)
    assert int(ds.train_batch(seed=0, step=0, micro=0, batch_size=2).x.max()) > 255


def test_single_bin_file_is_split(tmp_path: Path) -> None:
    np.arange(4000, dtype=np.uint16).tofile(tmp_path / "tokens.bin")
    ds = load_dataset(str(tmp_path / "tokens.bin"), seq_len=16, val_fraction=0.25, chunk_tokens=512)
    assert len(ds.train) == 3000 and int(ds.val[0]) == 3000


@pytest.mark.parametrize(
    ("setup", "match"),
    [
        ("missing", "not found"),
        ("odd_bin", "odd"),
        ("empty_dir", "no .txt/.md files"),
        ("too_small", "no window"),
    ],
)
def test_bad_sources_get_clear_errors(tmp_path: Path, setup: str, match: str) -> None:
    path = tmp_path / "x"
    if setup == "odd_bin":
        path = tmp_path / "x.bin"
        path.write_bytes(b"abc")
    elif setup == "empty_dir":
        path.mkdir()
    elif setup == "too_small":
        path = tmp_path / "x.txt"
        path.write_text("tiny" * 6)
    with pytest.raises(DataError, match=match):
        load_dataset(str(path), seq_len=16, val_fraction=0.5, chunk_tokens=1024)


def test_shard_index_out_of_range() -> None:
    with pytest.raises(DataError, match="out of range"):
        TokenDataset(
            np.zeros(100, np.uint16),
            np.zeros(50, np.uint16),
            seq_len=8,
            shard_index=2,
            num_shards=2,
            chunk_tokens=16,
        )


def test_shard_for_peer_is_stable_and_spread() -> None:
    assert shard_for_peer("peer-a", 4) == shard_for_peer("peer-a", 4)
    assert len({shard_for_peer(f"peer-{i}", 4) for i in range(64)}) == 4
