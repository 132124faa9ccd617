"""Byte-level tokenizer: the 256 byte values are the vocabulary. Works offline, never fails."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray


class ByteTokenizer:
    """UTF-8 bytes in, UTF-8 bytes out (undecodable bytes become U+FFFD)."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, data: bytes) -> NDArray[np.uint16]:
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: list[int]) -> str:
        return bytes(i & 0xFF for i in ids).decode("utf-8", errors="replace")
