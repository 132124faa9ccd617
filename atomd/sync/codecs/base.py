"""The codec interface and what every codec shares.

A codec turns a float32 tensor into an :class:`Encoded` (a small JSON-able ``meta`` and a byte
payload) and back. Every codec reads what it needs to decode from ``meta`` and checks the payload
length against ``shape`` and ``meta`` (:func:`unpack_payload`), so a decoder can take anything a
peer sends: it returns a finite float32 tensor (:func:`finite_tensor`) or raises ``WireError``.

zstd (level 3) goes on top of a payload only when it shrinks it (``meta["zstd"] = 1``).

The codecs work in numpy: single-threaded and predictable next to a training process, where
torch's intra-op thread pool can cost milliseconds per small op on busy cores.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import zstandard
from torch import Tensor

from atomd.errors import WireError

ZSTD_LEVEL = 3
MAX_CHUNK = 1 << 16  # a block or chunk of values is addressed by uint16 positions


@dataclass(frozen=True)
class Encoded:
    """One tensor as it travels: codec, shape, small JSON-able parameters and the payload bytes."""

    codec: str
    shape: tuple[int, ...]
    meta: dict[str, int | float | str]
    payload: bytes  # zstd-compressed when meta["zstd"] == 1


@dataclass(frozen=True)
class Kept:
    """A share decoded (``TopKCodec.kept``): its values, which entries it kept (bool), and for
    each entry it left out the largest magnitude that entry can have had (0 where kept, never
    negative); all of the tensor's shape."""

    values: Tensor
    mask: Tensor
    bound: Tensor


class Codec(ABC):
    """Turns a float32 tensor into an :class:`Encoded` and back; deterministic, on the CPU."""

    name: str

    def __init__(self, *, zstd: bool = True) -> None:
        self.zstd = zstd

    def __repr__(self) -> str:
        return f"{type(self).__name__}(zstd={self.zstd})"

    @abstractmethod
    def encode(self, x: Tensor) -> Encoded:
        """Encode ``x`` (float32, any shape, finite; ``ValueError`` otherwise)."""

    @abstractmethod
    def decode(self, enc: Encoded) -> Tensor:
        """A finite float32 tensor of ``enc.shape``; ``WireError`` if the payload does not fit."""

    @abstractmethod
    def raw_nbytes(self, numel: int) -> int:
        """Payload bytes, before zstd, for a tensor of ``numel`` entries."""

    def raw_nbytes_for(self, shape: tuple[int, ...]) -> int:
        """Payload bytes, before zstd, for a tensor of ``shape``."""
        return self.raw_nbytes(math.prod(shape))

    def estimate_ratio(self, numel: int) -> float:
        """fp32 bytes / encoded bytes, before zstd (1.0 for an empty tensor)."""
        raw = self.raw_nbytes(numel)
        return 4 * numel / raw if raw else 1.0

    def pack(
        self, shape: tuple[int, ...], meta: dict[str, int | float | str], raw: bytes
    ) -> Encoded:
        """The :class:`Encoded` of a raw payload, zstd-compressed where that shrinks it."""
        if self.zstd and raw:
            packed = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)
            if len(packed) < len(raw):
                return Encoded(self.name, shape, {**meta, "zstd": 1}, packed)
        return Encoded(self.name, shape, meta, raw)


def flat_array(x: Tensor) -> np.ndarray:
    """``x`` as a flat float32 array (CPU, may share memory); ``ValueError`` if not finite."""
    flat = x.detach().to("cpu", torch.float32).reshape(-1).contiguous().numpy()
    if not np.isfinite(flat).all():
        raise ValueError("cannot encode a tensor holding NaN or Inf")
    return flat


def padded_rows(flat: np.ndarray, n_rows: int, width: int) -> np.ndarray:
    """``flat`` zero-padded to (n_rows, width)."""
    if flat.size == n_rows * width:
        return flat.reshape(n_rows, width)
    out = np.zeros(n_rows * width, flat.dtype)
    out[: flat.size] = flat
    return out.reshape(n_rows, width)


def quantize(x: np.ndarray, scale: np.ndarray, top: int = 127) -> np.ndarray:
    """Symmetric integers in [-top, top] (int8) of rows ``x`` (n, m) with per-row ``scale``
    (n,); round half to even."""
    divisor = np.where(scale > 0, scale, np.float32(1))  # all-zero rows stay zero
    return np.clip(np.rint(x / divisor[:, None]), -top, top).astype(np.int8)


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 ``x`` as bfloat16 bits (little-endian uint16), round to nearest, ties to even
    (as torch does). Finite inputs: no NaN to keep, and the largest round to Inf as they should."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    one, half, sixteen = np.uint32(1), np.uint32(0x7FFF), np.uint32(16)
    rounded: np.ndarray = ((bits + (half + ((bits >> sixteen) & one))) >> sixteen).astype("<u2")
    return rounded


def from_bf16(u: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) as float32."""
    out: np.ndarray = (u.astype(np.uint32) << 16).view(np.float32)
    return out


def numel_of(shape: tuple[int, ...]) -> int:
    """The entries of a tensor of ``shape``; ``WireError`` unless it is a tuple of ints >= 0."""
    if not isinstance(shape, tuple) or not all(type(d) is int and d >= 0 for d in shape):
        raise WireError("malformed", f"shape must be a tuple of ints >= 0, got {shape!r}")
    return math.prod(shape)


def meta_int(meta: Mapping[str, object], key: str, lo: int, hi: int) -> int:
    """``meta[key]``, which must be an int in [lo, hi]; ``WireError`` otherwise."""
    value = meta.get(key)
    if type(value) is not int or not lo <= value <= hi:
        raise WireError("malformed", f"meta {key!r} is {value!r}, expected an int in [{lo}, {hi}]")
    return value


def unpack_payload(enc: Encoded, raw_len: int, keys: tuple[str, ...]) -> bytes:
    """The raw payload (zstd undone), checked to be exactly ``raw_len`` bytes; ``keys``: the
    meta keys the codec reads (any other but ``zstd`` is refused)."""
    extra = set(enc.meta) - {*keys, "zstd"}
    if extra:
        raise WireError("malformed", f"unexpected meta {sorted(extra)} for codec {enc.codec!r}")
    if "zstd" not in enc.meta:
        if len(enc.payload) != raw_len:
            raise WireError(
                "malformed",
                f"{enc.codec} payload of shape {enc.shape} and meta {enc.meta} must be "
                f"{raw_len} bytes, got {len(enc.payload)}",
            )
        return enc.payload
    meta_int(enc.meta, "zstd", 1, 1)
    # The declared content size bounds the memory zstd may use (no decompression bomb).
    try:
        declared = zstandard.frame_content_size(enc.payload)
        if declared != raw_len:
            raise WireError(
                "malformed",
                f"zstd frame holds {declared} bytes, expected {raw_len} for "
                f"{enc.codec} of shape {enc.shape} and meta {enc.meta}",
            )
        reader = zstandard.ZstdDecompressor().decompressobj()
        raw = reader.decompress(enc.payload)
    except zstandard.ZstdError as e:
        raise WireError("malformed", f"bad zstd payload: {e}") from None
    if len(raw) != raw_len or not reader.eof or reader.unused_data:
        raise WireError(
            "malformed", f"zstd payload must be one frame of {raw_len} bytes, nothing after it"
        )
    return bytes(raw)


def finite_tensor(values: np.ndarray, shape: tuple[int, ...]) -> Tensor:
    """A float32 tensor of ``shape``; ``WireError("non_finite")`` if any value is NaN/Inf."""
    if not np.isfinite(values).all():
        raise WireError("non_finite", "the payload decodes to NaN or Inf")
    return torch.from_numpy(np.ascontiguousarray(values, np.float32).reshape(shape))
