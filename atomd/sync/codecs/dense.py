"""Dense codecs: every entry travels.

- ``fp32``: raw little-endian floats (ratio 1).
- ``bf16``: round-to-nearest-even bfloat16 (ratio 2, relative error ≤ 2^-8).
- ``int8``: blocks of 256 values, symmetric round-to-nearest with an fp32 absmax scale per block
  (ratio 1024/260 ≈ 3.94, error ≤ absmax/254 per block).
"""

from __future__ import annotations

import math

import numpy as np
from torch import Tensor

from atomd.sync.codecs.base import (
    MAX_CHUNK,
    Codec,
    Encoded,
    finite_tensor,
    flat_array,
    from_bf16,
    meta_int,
    numel_of,
    padded_rows,
    quantize,
    to_bf16,
    unpack_payload,
)

INT8_BLOCK = 256


class Fp32Codec(Codec):
    """Raw little-endian float32: exact."""

    name = "fp32"

    def raw_nbytes(self, numel: int) -> int:
        return 4 * numel

    def encode(self, x: Tensor) -> Encoded:
        return self.pack(tuple(x.shape), {}, flat_array(x).astype("<f4", copy=False).tobytes())

    def decode(self, enc: Encoded) -> Tensor:
        numel = numel_of(enc.shape)
        raw = unpack_payload(enc, 4 * numel, ())
        return finite_tensor(np.frombuffer(raw, "<f4").astype(np.float32), enc.shape)


class Bf16Codec(Codec):
    """bfloat16 (the top 16 bits of a float32), round-to-nearest-even: relative error ≤ 2^-8."""

    name = "bf16"

    def raw_nbytes(self, numel: int) -> int:
        return 2 * numel

    def encode(self, x: Tensor) -> Encoded:
        return self.pack(tuple(x.shape), {}, to_bf16(flat_array(x)).tobytes())

    def decode(self, enc: Encoded) -> Tensor:
        numel = numel_of(enc.shape)
        raw = unpack_payload(enc, 2 * numel, ())
        return finite_tensor(from_bf16(np.frombuffer(raw, "<u2")), enc.shape)


class Int8Codec(Codec):
    """Block-wise symmetric int8: per block of ``block`` values, q = round(x / s), s = absmax/127.

    Payload: numel int8 values, then one fp32 scale per block. fp32 scales, not fp16: weight
    deltas are often below fp16's normal range (6e-5), and a scale is 4 bytes per 256 values."""

    name = "int8"

    def __init__(self, *, block: int = INT8_BLOCK, zstd: bool = True) -> None:
        super().__init__(zstd=zstd)
        if not 1 <= block <= MAX_CHUNK:
            raise ValueError(f"block must be in [1, {MAX_CHUNK}], got {block}")
        self.block = block

    def raw_nbytes(self, numel: int) -> int:
        return numel + 4 * math.ceil(numel / self.block)

    def encode(self, x: Tensor) -> Encoded:
        flat = flat_array(x)
        numel, block = flat.size, self.block
        blocks = padded_rows(flat, math.ceil(numel / block), block)
        scale = np.abs(blocks).max(axis=1, initial=0) / np.float32(127)  # (n_blocks,)
        q = quantize(blocks, scale).reshape(-1)[:numel]
        raw = q.tobytes() + scale.astype("<f4", copy=False).tobytes()
        return self.pack(tuple(x.shape), {"block": block}, raw)

    def decode(self, enc: Encoded) -> Tensor:
        numel = numel_of(enc.shape)
        block = meta_int(enc.meta, "block", 1, MAX_CHUNK)
        n_blocks = math.ceil(numel / block)
        raw = unpack_payload(enc, numel + 4 * n_blocks, ("block",))
        q = np.frombuffer(raw, np.int8, count=numel).astype(np.float32)
        scale = np.frombuffer(raw, "<f4", offset=numel)
        with np.errstate(over="ignore", invalid="ignore"):  # a huge scale: refused as non-finite
            out = (padded_rows(q, n_blocks, block) * scale[:, None]).reshape(-1)[:numel]
        return finite_tensor(out, enc.shape)
