"""Token datasets: sources, the train/validation split, per-peer shards and batch sampling.

A dataset is one stream of tokens (uint16; uint32 for vocabularies over 65,536). The last
``val_fraction`` of it is the validation split. The training part is cut into chunks of
``chunk_tokens`` tokens and dealt to ``num_shards`` shards, either ``interleaved`` (chunk i
goes to shard i mod n, so each shard is a fair sample of the text) or ``contiguous`` (shard k
holds the k-th contiguous 1/n).

Sampling is *stateless*: the batch for a step is a pure function of (seed, shard, step, micro
index), so a resumed run sees exactly the batches it would have seen, and the "data position" a
checkpoint needs is the step counter.

Sources (the ``data`` string):
- ``shakespeare`` (default): the bundled corpus of Shakespeare's plays.
- a ``.txt`` file or a folder of ``.txt``/``.md`` files (read in sorted order), tokenized by
  the job's tokenizer (bytes by default).
- a ``.bin`` file of uint16 tokens (nanoGPT's format), or a folder holding ``train.bin`` and
  optionally ``val.bin`` (then ``val.bin`` is the validation split).
- documents: a JSON lines file (``.jsonl``), Parquet file(s), or a folder a ``datasets``
  ``save_to_disk`` wrote (its train split), read through a memory-mapped token cache
  (``atomd.data.readers``).

Every dataset has a content hash, the sha256 of its token stream (``TokenDataset.sha256``): a job
spec's ``data_sha256`` pins it, and a peer whose tokens differ refuses to train the job.
"""

from __future__ import annotations

import lzma
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from atomd.data.readers import document_source, token_cache, tokens_sha256
from atomd.data.sources import BUNDLED, check_source, shard_for_peer
from atomd.data.tokenizer import ByteTokenizer, TokenArray, Tokenizer
from atomd.errors import ConfigError, DataError

__all__ = [
    "BUNDLED",
    "VAL_BATCH",
    "Batch",
    "TokenDataset",
    "check_source",
    "load_dataset",
    "shard_for_peer",
]

ShardMode = Literal["interleaved", "contiguous"]
_TEXT_SUFFIXES = {".txt", ".md"}
# Windows per validation batch. The validation set is a number of such batches (the job spec's
# ``eval_batches``), never a function of the training batch size, so every run's validation loss
# is measured on the same windows and compares with every other's.
VAL_BATCH = 16


@dataclass(frozen=True)
class Batch:
    """Inputs and next-token targets, both (B, T) int64."""

    x: Tensor
    y: Tensor


def bundled_text() -> bytes:
    """The bundled corpus: 38 plays as Markdown, about 5 MB of UTF-8, in a fixed order."""
    blob = resources.files("atomd.data").joinpath("shakespeare.md.xz").read_bytes()
    return lzma.decompress(blob)


def _read_text_tokens(paths: list[Path], tok: Tokenizer) -> TokenArray:
    parts = [tok.encode_array(p.read_bytes()) for p in paths]
    out: TokenArray = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)
    return out


def _read_bin(path: Path) -> TokenArray:
    size = path.stat().st_size
    if size % 2:
        raise DataError(f"{path}: size {size} is odd; a .bin file holds uint16 tokens")
    return np.memmap(path, dtype=np.uint16, mode="r")


def load_source(
    data: str, tok: Tokenizer, text_field: str = "text"
) -> tuple[TokenArray, TokenArray | None, str | None]:
    """Token stream(s) of a source: (all or train, explicit validation or None, the content
    hash when the token cache knows it)."""
    if data == BUNDLED:
        return tok.encode_array(bundled_text()), None, None
    check_source(data)
    path = Path(data).expanduser()
    docs = document_source(path)
    if docs is not None:
        cache = token_cache(docs, tok, text_field)
        return cache.array(), None, cache.sha256
    if path.is_dir():
        if (path / "train.bin").is_file():
            val = path / "val.bin"
            train = _read_bin(path / "train.bin")
            return train, (_read_bin(val) if val.is_file() else None), None
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _TEXT_SUFFIXES)
        if not files:
            raise DataError(
                f"folder {path} holds no .txt/.md files, no train.bin, no .jsonl or .parquet "
                "files and no saved dataset"
            )
        return _read_text_tokens(files, tok), None, None
    if path.suffix == ".bin":
        return _read_bin(path), None, None
    return _read_text_tokens([path], tok), None, None


def check_vocab(tokens: TokenArray, vocab_size: int, *, what: str, fix: str = "") -> None:
    """Refuse token ids the model's embedding has no row for (an IndexError deep in training
    otherwise), naming the largest."""
    if len(tokens) and int(tokens.max()) >= vocab_size:
        raise ConfigError(
            f"{what} holds token id {int(tokens.max()):,}, but the model's vocabulary has "
            f"{vocab_size:,} entries (ids 0..{vocab_size - 1:,}){fix}"
        )


class TokenDataset:
    """The training shard and validation split of one token stream, with batch sampling."""

    def __init__(
        self,
        train: TokenArray,
        val: TokenArray,
        *,
        seq_len: int,
        shard_index: int = 0,
        num_shards: int = 1,
        shard_mode: ShardMode = "interleaved",
        chunk_tokens: int = 16384,
        name: str = "",
        sha256: str | None = None,
    ) -> None:
        if not 0 <= shard_index < num_shards:
            raise DataError(f"shard_index {shard_index} out of range for {num_shards} shards")
        if chunk_tokens <= seq_len:
            raise DataError(f"chunk_tokens ({chunk_tokens}) must exceed seq_len ({seq_len})")
        self.name = name
        self._sha256 = sha256
        self.seq_len = seq_len
        self.train = train
        self.val = val
        self.shard_index = shard_index
        self.num_shards = num_shards
        n = len(train)
        if shard_mode == "contiguous":
            lo, hi = n * shard_index // num_shards, n * (shard_index + 1) // num_shards
            ranges = [(lo, hi)]
        elif shard_mode == "interleaved":
            starts = range(shard_index * chunk_tokens, n, num_shards * chunk_tokens)
            ranges = [(s, min(s + chunk_tokens, n)) for s in starts]
        else:
            raise DataError(f"unknown shard_mode {shard_mode!r}")
        # Windows need seq_len + 1 tokens (inputs and shifted targets).
        self.ranges = [(a, b) for a, b in ranges if b - a > seq_len]
        if not self.ranges:
            raise DataError(
                f"shard {shard_index}/{num_shards} of {name or 'the dataset'} has no window of "
                f"{seq_len + 1} tokens ({n} training tokens in all)"
            )
        if len(val) <= seq_len:
            raise DataError(f"validation split has {len(val)} tokens; needs more than {seq_len}")
        # Window start counts per range, for uniform sampling over all windows of the shard.
        self._counts = torch.tensor([b - a - seq_len for a, b in self.ranges], dtype=torch.float64)
        self._offsets = torch.cumsum(self._counts, 0) - self._counts

    @property
    def sha256(self) -> str:
        """The content hash of the whole token stream (training then validation tokens)."""
        if self._sha256 is None:
            self._sha256 = tokens_sha256(self.train, self.val)
        return self._sha256

    @property
    def train_tokens(self) -> int:
        """Tokens in this peer's training shard."""
        return sum(b - a for a, b in self.ranges)

    def _windows(self, data: TokenArray, starts: list[int]) -> Batch:
        rows = np.stack(
            [np.asarray(data[s : s + self.seq_len + 1], dtype=np.int64) for s in starts]
        )
        t = torch.from_numpy(rows)
        return Batch(x=t[:, :-1].contiguous(), y=t[:, 1:].contiguous())

    def train_batch(self, *, seed: int, step: int, micro: int, batch_size: int) -> Batch:
        """Micro-batch ``micro`` of optimizer step ``step``: a pure function of the arguments."""
        g = torch.Generator().manual_seed(
            (seed * 1_000_003 + self.shard_index * 7919 + step * 131 + micro) % (2**63)
        )
        total = float(self._counts.sum())
        picks = (torch.rand(batch_size, generator=g, dtype=torch.float64) * total).floor()
        idx = torch.searchsorted(self._offsets + self._counts, picks, right=True)
        starts = [
            self.ranges[int(i)][0] + int(p - self._offsets[int(i)])
            for i, p in zip(idx.tolist(), picks.tolist(), strict=True)
        ]
        return self._windows(self.train, starts)

    def val_batches(
        self, *, count: int, batch_size: int = VAL_BATCH, seed: int = 1234
    ) -> list[Batch]:
        """The validation set: ``count`` x ``VAL_BATCH`` fixed windows of the validation split,
        the same for every peer, every run and every call whatever the run's batch size, served
        in batches of at most ``batch_size`` windows (to bound memory; the loss over them is the
        same up to rounding)."""
        if count < 1 or batch_size < 1:
            raise ValueError(f"count and batch_size must be >= 1, got {count}, {batch_size}")
        g = torch.Generator().manual_seed(seed)
        hi = len(self.val) - self.seq_len
        # Drawn VAL_BATCH at a time, as when the windows were drawn per batch of 16.
        starts = [
            s
            for _ in range(count)
            for s in torch.randint(0, hi, (VAL_BATCH,), generator=g).tolist()
        ]
        return [
            self._windows(self.val, starts[i : i + batch_size])
            for i in range(0, len(starts), batch_size)
        ]


def stream_sha256(tokens: TokenArray, val: TokenArray | None, sha256: str | None) -> str:
    """The content hash of what ``load_source`` returned, as every trainer computes it
    (``TokenDataset.sha256``: the whole token stream, training then validation tokens)."""
    return sha256 or tokens_sha256(*([tokens] if val is None else [tokens, val]))


def source_sha256(data: str, tokenizer: Tokenizer, text_field: str = "text") -> str:
    """The content hash a job's ``data_sha256`` pins for ``data`` read with ``tokenizer``."""
    return stream_sha256(*load_source(data, tokenizer, text_field))


def load_dataset(
    data: str = BUNDLED,
    *,
    seq_len: int,
    val_fraction: float = 0.05,
    shard_index: int = 0,
    num_shards: int = 1,
    shard_mode: ShardMode = "interleaved",
    chunk_tokens: int = 16384,
    tokenizer: Tokenizer | None = None,
    vocab_size: int | None = None,
    text_field: str = "text",
) -> TokenDataset:
    """Load a source (text through ``tokenizer``, bytes by default), split off validation (its
    last ``val_fraction``) and pick one shard. With ``vocab_size``, every token id is checked
    against it (``ConfigError`` naming the largest id otherwise)."""
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
    tokens, val, sha256 = load_source(data, tokenizer or ByteTokenizer(), text_field)
    if vocab_size is not None:
        fix = "; set the job's vocab_size to at least the largest id + 1, or use other data"
        check_vocab(tokens, vocab_size, what=f"data {data!r}", fix=fix)
        if val is not None:
            check_vocab(val, vocab_size, what=f"data {data!r} (val.bin)", fix=fix)
    if val is None:
        cut = int(len(tokens) * (1.0 - val_fraction))
        tokens, val = tokens[:cut], tokens[cut:]
    else:
        sha256 = None  # a hash of train and val together, computed when asked for
    return TokenDataset(
        tokens,
        val,
        seq_len=seq_len,
        shard_index=shard_index,
        num_shards=num_shards,
        shard_mode=shard_mode,
        chunk_tokens=chunk_tokens,
        name=data,
        sha256=sha256,
    )
