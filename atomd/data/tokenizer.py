"""Tokenizers: bytes (256 symbols, the default) and byte-level BPE from Hugging Face's
``tokenizers`` library (works offline).

A job names its tokenizer (job spec ``tokenizer``): ``"bytes"``, ``"default"`` (a byte-level
BPE of 4,096 tokens fitted on the bundled corpus, shipped with the package:
``atomd/data/tokenizer-shakespeare-4096.json``, made by ``scripts/build_tokenizer.py``) or the
path of a ``tokenizer.json`` (or of a folder holding one: a checkpoint, an export, a Hugging Face
model folder). Every checkpoint carries its ``tokenizer.json``; for bytes it is a BPE without
merges whose ids are the byte values, so that the tools that read that format decode it too.

``tokenizers`` loads only when a BPE is used: the byte tokenizer needs numpy alone.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from numpy.typing import NDArray

from atomd.data.sources import BYTES, DEFAULT, TOKENIZER_FILE, tokenizer_path
from atomd.errors import ConfigError

__all__ = [
    "BYTES",
    "DEFAULT",
    "TOKENIZER_FILE",
    "BPETokenizer",
    "ByteTokenizer",
    "TokenArray",
    "Tokenizer",
    "load_tokenizer",
    "tokenizer_from_json",
    "train_bpe",
]

if TYPE_CHECKING:
    import tokenizers

DEFAULT_FILE = "tokenizer-shakespeare-4096.json"
END_OF_TEXT = "<|endoftext|>"
# Token arrays are uint16 for vocabularies up to 65,536 entries, uint32 above.
UINT16_VOCAB = 1 << 16
MAX_VOCAB = 1 << 32
TokenArray = NDArray[np.unsignedinteger[Any]]


def token_dtype(vocab_size: int) -> type[np.unsignedinteger[Any]]:
    """uint16 while every id fits, else uint32."""
    return np.uint16 if vocab_size <= UINT16_VOCAB else np.uint32


# Pre-tokens never cross a lone newline between two non-space characters (GPT-2's pattern
# makes it a pre-token of its own), so text cut after one encodes exactly as the whole does.
# (After a longer whitespace run the cut would not be neutral: "  \n" at the end of a piece
# is one pre-token, inside the whole text "  " and "\n".)
_CUT = re.compile(r"(?<=\S\n)(?=\S)")
_BATCH_CHARS = 1 << 18


class Tokenizer(Protocol):
    """What training, sampling and export need of a tokenizer."""

    name: str
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...
    def encode_array(self, data: bytes) -> TokenArray: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def to_json(self) -> str:
        """The tokenizer as a Hugging Face ``tokenizer.json``."""
        ...


class ByteTokenizer:
    """UTF-8 bytes in, UTF-8 bytes out (undecodable bytes become U+FFFD)."""

    name = BYTES
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, data: bytes) -> TokenArray:
        out: TokenArray = np.frombuffer(data, dtype=np.uint8).astype(np.uint16)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i & 0xFF for i in ids).decode("utf-8", errors="replace")

    def to_json(self) -> str:
        return bytes_tokenizer_json()


@cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 byte values to printable characters (what byte-level BPE
    vocabularies are written in)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += list(range(ord("®"), ord("ÿ") + 1))
    chars = list(keep)
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


@cache
def bytes_tokenizer_json() -> str:
    """The byte tokenizer as a ``tokenizer.json``: byte-level BPE without merges, id = byte."""
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    level = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    doc: dict[str, Any] = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **level},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }
    return json.dumps(doc, ensure_ascii=False)


class BPETokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` (byte-level BPE, as GPT-2's)."""

    def __init__(self, tok: tokenizers.Tokenizer, *, name: str) -> None:
        self.tok = tok
        self.name = name
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
        self.dtype = token_dtype(self.vocab_size)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def encode_array(self, data: bytes) -> TokenArray:
        text = data.decode("utf-8", errors="replace")
        pieces = _CUT.split(text)
        groups, current, size = [], [], 0
        for p in pieces:
            current.append(p)
            size += len(p)
            if size >= _BATCH_CHARS:
                groups.append("".join(current))
                current, size = [], 0
        if current:
            groups.append("".join(current))
        encoded = self.tok.encode_batch(groups, add_special_tokens=False)
        arrays = [np.asarray(e.ids, dtype=self.dtype) for e in encoded]
        return np.concatenate(arrays) if arrays else np.zeros(0, dtype=self.dtype)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tok.decode(list(ids), skip_special_tokens=False))

    def to_json(self) -> str:
        return str(self.tok.to_str())


def _bpe_from_json(text: str, name: str) -> BPETokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    try:
        return BPETokenizer(HFTokenizer.from_str(text), name=name)
    except Exception as e:  # tokenizers raises its own Exception subclasses
        raise ConfigError(f"tokenizer {name} cannot be read: {e}") from None


def default_tokenizer_json() -> str:
    return resources.files("atomd.data").joinpath(DEFAULT_FILE).read_text(encoding="utf-8")


def load_tokenizer(name: str) -> Tokenizer:
    """The tokenizer a job spec names: ``bytes``, ``default`` or a path."""
    if name == BYTES:
        return ByteTokenizer()
    if name == DEFAULT:
        return _bpe_from_json(default_tokenizer_json(), DEFAULT)
    path = tokenizer_path(name)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"tokenizer {path} cannot be read: {e}") from None
    return tokenizer_from_json(text, name=str(path))


def tokenizer_from_json(text: str, *, name: str) -> Tokenizer:
    """A tokenizer from a ``tokenizer.json``; the bytes tokenizer's own JSON gives bytes back."""
    if text == bytes_tokenizer_json():
        return ByteTokenizer()
    return _bpe_from_json(text, name)


def train_bpe(
    files: Iterable[Path], *, vocab_size: int, min_frequency: int = 2
) -> tokenizers.Tokenizer:
    """Fit a byte-level BPE (GPT-2's pre-tokenizer, ``<|endoftext|>`` as id 0... then the 256
    bytes, then merges) on text files; deterministic for the same files and settings."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if not 257 <= vocab_size <= UINT16_VOCAB:
        raise ConfigError(f"vocab size must be in [257, {UINT16_VOCAB}], got {vocab_size}")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts() -> Iterable[str]:
        for f in files:
            data = f.read_bytes().decode("utf-8", errors="replace")
            yield from (p for p in _CUT.split(data) if p)

    tok.train_from_iterator(texts(), trainer=trainer)
    return tok
