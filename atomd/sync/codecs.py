"""Delta codecs and error feedback.

A codec turns a float32 tensor into an :class:`Encoded` (a small JSON-able ``meta`` and a byte
payload) and back. Every codec reads what it needs to decode from ``meta`` and checks the payload
length against ``shape`` and ``meta``, so :func:`decode` can take anything a peer sends: it
returns a finite float32 tensor or raises ``WireError``.

- ``fp32``: raw little-endian floats (ratio 1).
- ``bf16``: round-to-nearest-even bfloat16 (ratio 2, relative error ≤ 2^-8).
- ``int8``: blocks of 256 values, symmetric round-to-nearest with an fp32 absmax scale per block
  (ratio 1024/260 ≈ 3.94, error ≤ absmax/254 per block).
- ``topk`` (the default): the flat tensor is cut into equal chunks of at most 4096 entries; each
  chunk keeps its ``fraction`` largest-magnitude entries as uint16 gaps between positions and
  4-bit values with a bf16 scale per chunk (at 1 %: 41 of 4096 kept in 104.5 bytes before zstd,
  ratio ≈ 157, ~1.9 bytes an entry after it, the gaps' high bytes being mostly zeros; with
  ``value_bits`` 8, int8 values and fp32 scales: 127 bytes, ratio ≈ 129).
- ``rice2``: the ``fraction`` largest-magnitude entries of the whole tensor, their positions
  Golomb-Rice coded (~ log2(1/fraction) + 1.5 bits each) and their values in 2 bits (sign, and
  which half of the magnitudes: each half decodes to its mean): at 2.5 %, ~9 bits an entry,
  2.7x the entries of ``topk`` for the same bytes (ratio ≈ 140).
- ``lowrank``: each matrix's best rank-r approximation as its two factors (rows x r and
  columns x r, 4-bit or int8 values, a scale per factor column), r spending ``fraction`` of the
  matrix's entries; no positions travel. Flat tensors go in top-k's layout.

zstd (level 3) goes on top of a payload only when it shrinks it (``meta["zstd"] = 1``).
:class:`ErrorFeedback` adds what a round's compression dropped to the next round's delta, so over
rounds the sum of what was sent tracks the sum of the true deltas.
"""

from __future__ import annotations

import dataclasses
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
INT8_BLOCK = 256
TOPK_CHUNK = 4096
MAX_CHUNK = 1 << 16  # topk indices are uint16 within a chunk
VALUE_BITS = (4, 8)  # what a topk value may take
TOPK_BITS = 4
MAX_RANK = 64  # bounds the work a lowrank frame asks of its receiver
EXACT_SVD = 512  # lowrank: an exact SVD up to this many rows and columns


@dataclass(frozen=True)
class Encoded:
    """One tensor as it travels: codec, shape, small JSON-able parameters and the payload bytes."""

    codec: str
    shape: tuple[int, ...]
    meta: dict[str, int | float | str]
    payload: bytes  # zstd-compressed when meta["zstd"] == 1


_F32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class Kept:
    """A sparse share decoded (``TopKCodec.kept``): its values, which entries it kept (bool),
    and for each entry it left out the largest magnitude that entry can have had (0 where
    kept, never negative); all of the tensor's shape."""

    values: Tensor
    mask: Tensor
    bound: Tensor


class Codec(ABC):
    """Turns a float32 tensor into an :class:`Encoded` and back; deterministic, on the CPU."""

    name: str
    exact_size = True  # raw_nbytes is the payload's size (not an estimate)
    takes_zstd = True  # zstd may shrink its payloads

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
        """Payload bytes, before zstd, for a tensor of ``shape`` (codecs whose size depends on
        more than the entries' count override this)."""
        return self.raw_nbytes(math.prod(shape))

    def estimate_ratio(self, numel: int) -> float:
        """fp32 bytes / encoded bytes, before zstd (1.0 for an empty tensor)."""
        raw = self.raw_nbytes(numel)
        return 4 * numel / raw if raw else 1.0

    def _pack(
        self, shape: tuple[int, ...], meta: dict[str, int | float | str], raw: bytes
    ) -> Encoded:
        if self.zstd and raw:
            packed = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)
            if len(packed) < len(raw):
                return Encoded(self.name, shape, {**meta, "zstd": 1}, packed)
        return Encoded(self.name, shape, meta, raw)


class Fp32Codec(Codec):
    """Raw little-endian float32: exact."""

    name = "fp32"

    def raw_nbytes(self, numel: int) -> int:
        return 4 * numel

    def encode(self, x: Tensor) -> Encoded:
        return self._pack(tuple(x.shape), {}, _flat(x).astype("<f4", copy=False).tobytes())

    def decode(self, enc: Encoded) -> Tensor:
        numel = _numel(enc.shape)
        raw = _unpack(enc, 4 * numel, ())
        return _tensor(np.frombuffer(raw, "<f4").astype(np.float32), enc.shape)


class Bf16Codec(Codec):
    """bfloat16 (the top 16 bits of a float32), round-to-nearest-even: relative error ≤ 2^-8."""

    name = "bf16"

    def raw_nbytes(self, numel: int) -> int:
        return 2 * numel

    def encode(self, x: Tensor) -> Encoded:
        return self._pack(tuple(x.shape), {}, _to_bf16(_flat(x)).tobytes())

    def decode(self, enc: Encoded) -> Tensor:
        numel = _numel(enc.shape)
        raw = _unpack(enc, 2 * numel, ())
        return _tensor(_from_bf16(np.frombuffer(raw, "<u2")), enc.shape)


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
        flat = _flat(x)
        numel, block = flat.size, self.block
        blocks = _rows(flat, math.ceil(numel / block), block)
        scale = np.abs(blocks).max(axis=1, initial=0) / np.float32(127)  # (n_blocks,)
        q = _quantize(blocks, scale).reshape(-1)[:numel]
        raw = q.tobytes() + scale.astype("<f4", copy=False).tobytes()
        return self._pack(tuple(x.shape), {"block": block}, raw)

    def decode(self, enc: Encoded) -> Tensor:
        numel = _numel(enc.shape)
        block = _meta_int(enc.meta, "block", 1, MAX_CHUNK)
        n_blocks = math.ceil(numel / block)
        raw = _unpack(enc, numel + 4 * n_blocks, ("block",))
        q = np.frombuffer(raw, np.int8, count=numel).astype(np.float32)
        scale = np.frombuffer(raw, "<f4", offset=numel)
        with np.errstate(over="ignore", invalid="ignore"):  # a huge scale: refused as non-finite
            out = (_rows(q, n_blocks, block) * scale[:, None]).reshape(-1)[:numel]
        return _tensor(out, enc.shape)


RANK_MIN_K = 8  # the fewest entries a chunk keeps for ``TopKCodec.encode`` to rank by weight


class TopKCodec(Codec):
    """Chunked top-k by magnitude with 4-bit (or int8) values.

    The flat tensor is cut into ``ceil(numel / chunk)`` equal chunks (the last padded by fewer
    entries than there are chunks), and each keeps its k = round(fraction * chunk) (≥ 1) largest
    |x|, so the budget is spread over the whole tensor. Payload: the positions, ascending within
    each chunk, as (n_chunks, k) uint16 gaps (entries skipped before each kept one, counted from
    the chunk's start) in two byte planes, all low bytes then all high bytes; the (n_chunks, k)
    values, symmetric integers of ``bits`` bits (meta ``bits``: 4, levels -7..7 packed two to a
    byte, low nibble first; or 8, int8 -127..127); (n_chunks,) scales, absmax / 7 as bfloat16
    with 4-bit values, absmax / 127 as fp32 with int8.
    Gaps are small (a density p gives gaps of ~1/p) so the high plane is mostly zeros and zstd
    takes the positions to ~1.1 bytes at 1 % and ~1.45 at 0.25 %, against ~1.7 for plain uint16
    indices. Layouts of before still decode: without meta ``bits``, int8 values and fp32
    scales; without ``gaps``, plain indices (before 2026-12-02).

    Why 4 bits by default: with the positions at ~1.1-1.45 bytes and the values zstd cannot
    shrink, int8 values and fp32 scales were ~40 % of a frame; at 4 bits a signed frame of the
    tiny model is 19-23 % smaller at 0.25-1 % of the entries (~1.27x the entries in the same
    bytes). The rounding (at most absmax / 14 per entry, against absmax / 254) is not lost:
    like the entries a frame leaves out, it stays in the replica (or the error feedback) and
    goes out with the next rounds. Four real daemons on a free link ended as before with
    frames of 15.2 KB instead of 19.5 (bench/results-swarm-2026-12-02y.json: 1.733 against
    1.732). 8 bits remain (``sync.value_bits``) for measurements and for peers of before.
    """

    name = "topk"

    def __init__(
        self,
        *,
        fraction: float = 0.01,
        chunk: int = TOPK_CHUNK,
        bits: int = TOPK_BITS,
        zstd: bool = True,
    ) -> None:
        super().__init__(zstd=zstd)
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        if not 1 <= chunk <= MAX_CHUNK:
            raise ValueError(f"chunk must be in [1, {MAX_CHUNK}], got {chunk}")
        if bits not in VALUE_BITS:
            raise ValueError(f"bits must be one of {VALUE_BITS}, got {bits}")
        self.fraction = fraction
        self.chunk = chunk
        self.bits = bits

    def __repr__(self) -> str:
        return (
            f"TopKCodec(fraction={self.fraction}, chunk={self.chunk}, bits={self.bits}, "
            f"zstd={self.zstd})"
        )

    def _layout(self, numel: int) -> tuple[int, int, int]:
        """(chunk, k, n_chunks) for a tensor of ``numel`` entries."""
        if numel == 0:
            return 1, 1, 0
        n_chunks = math.ceil(numel / self.chunk)
        chunk = math.ceil(numel / n_chunks)
        return chunk, max(1, min(chunk, round(self.fraction * chunk))), n_chunks

    def raw_nbytes(self, numel: int) -> int:
        _, k, n_chunks = self._layout(numel)
        return _topk_raw_len(n_chunks * k, n_chunks, self.bits)

    def encode(self, x: Tensor, weight: Tensor | None = None) -> Encoded:
        """``weight`` (x's shape, ≥ 0): keep the largest |x| x weight instead of |x| (the
        sender's choice; receivers read the positions it sends, whatever chose them), where a
        chunk keeps at least RANK_MIN_K entries. Fewer (a LayerNorm's or a bias's 1-5 at 1 %)
        are ranked by |x|: a frame's tensor is then one or a few entries, whose norm, chosen by
        weight, differs between honest peers beyond the robust rule's per-tensor bound
        (``RobustRule.tensor_ratio``), and receivers would clip it where its sender does not."""
        flat = _flat(x)
        chunk, k, n_chunks = self._layout(flat.size)
        chunks = _rows(flat, n_chunks, chunk)  # (n_chunks, chunk)
        score = np.abs(chunks)
        if weight is not None and k >= RANK_MIN_K:
            if weight.shape != x.shape:
                raise ValueError(f"weight of shape {tuple(weight.shape)} for x of {x.shape}")
            score *= _rows(_flat(weight), n_chunks, chunk)
        # argpartition puts the k largest scores last; ascending indices make the payload
        # canonical (decode insists on it) and a little more compressible.
        idx = np.sort(np.argpartition(score, chunk - k, axis=1)[:, chunk - k :], axis=1)
        values = np.take_along_axis(chunks, idx, axis=1)  # (n_chunks, k)
        gaps = (np.diff(idx, axis=1, prepend=-1) - 1).astype("<u2")
        q, wire_scale = _quantized(values, self.bits)
        raw = (
            gaps.view(np.uint8).reshape(-1, 2).T.tobytes()  # the low plane, then the high one
            + _codes(q, self.bits)
            + wire_scale.tobytes()
        )
        meta: dict[str, int | float | str] = {"chunk": chunk, "k": k, "gaps": 1, "bits": self.bits}
        return self._pack(tuple(x.shape), meta, raw)

    def decode(self, enc: Encoded) -> Tensor:
        return self._dense(enc, *self._entries(enc))

    def kept(self, enc: Encoded) -> Kept:
        """``enc`` decoded, with which entries it kept and, for each entry it left out, the
        largest magnitude that entry can have had: below its chunk's smallest kept one, which
        the rounding to ``bits`` bits knows to within half a step: (smallest |level| + 1/2) x
        the chunk's scale. What a receiver needs to estimate the entries a share left out
        (``atomd.sync.average.combine``)."""
        numel, chunk, idx, q, scale = self._entries(enc)
        values = self._dense(enc, numel, chunk, idx, q, scale)  # finite, or refused
        n_chunks = idx.shape[0]
        mask = np.zeros((n_chunks, chunk), bool)
        np.put_along_axis(mask, idx, True, axis=1)
        smallest = np.abs(q).min(axis=1, initial=np.inf) if q.size else np.zeros(n_chunks)
        # The sender chooses its scales: of either sign (a negative one decodes finite, and a
        # negative bound would clamp every left-out entry to a value of the sender's choosing),
        # and near float32's largest (the bound, half a level more, must not overflow): the
        # magnitude, in float64, within [0, float32's largest].
        per_chunk = np.minimum((smallest + 0.5) * np.abs(scale.astype(np.float64)), _F32_MAX)
        bound = np.repeat(per_chunk.astype(np.float32), chunk)
        bound[mask.reshape(-1)] = 0.0
        kept = torch.from_numpy(mask.reshape(-1)[:numel]).reshape(enc.shape)
        return Kept(values, kept, torch.from_numpy(bound[:numel]).reshape(enc.shape))

    @staticmethod
    def _dense(
        enc: Encoded, numel: int, chunk: int, idx: np.ndarray, q: np.ndarray, scale: np.ndarray
    ) -> Tensor:
        dense = np.zeros((idx.shape[0], chunk), np.float32)
        with np.errstate(over="ignore", invalid="ignore"):  # a huge scale: refused as non-finite
            np.put_along_axis(dense, idx, q * scale[:, None], axis=1)
        return _tensor(dense.reshape(-1)[:numel], enc.shape)

    def _entries(self, enc: Encoded) -> tuple[int, int, np.ndarray, np.ndarray, np.ndarray]:
        """(numel, chunk, positions (n_chunks, k), levels (n_chunks, k), scales (n_chunks,))."""
        numel = _numel(enc.shape)
        chunk = _meta_int(enc.meta, "chunk", 1, MAX_CHUNK)
        k = _meta_int(enc.meta, "k", 1, chunk)
        n_chunks = math.ceil(numel / chunk)
        n = n_chunks * k
        bits = _meta_bits(enc, default=8)
        raw = _unpack(enc, _topk_raw_len(n, n_chunks, bits), ("chunk", "k", "gaps", "bits"))
        if "gaps" in enc.meta:  # two byte planes of gaps: positions ascend by construction
            _meta_int(enc.meta, "gaps", 1, 1)  # the one gap layout there is
            planes = np.frombuffer(raw, np.uint8, count=2 * n).astype(np.intp)
            gaps = (planes[:n] | (planes[n:] << 8)).reshape(n_chunks, k)
            idx = np.cumsum(gaps + 1, axis=1) - 1
            if n and idx[:, -1].max() >= chunk:
                raise WireError("malformed", f"topk positions beyond the chunk of {chunk}")
        else:
            idx = np.frombuffer(raw, "<u2", count=n).astype(np.intp).reshape(n_chunks, k)
            if n and (idx.max() >= chunk or (np.diff(idx, axis=1) <= 0).any()):
                raise WireError(
                    "malformed", f"topk indices must ascend strictly within each chunk of {chunk}"
                )
        q, scale = _read_values(raw, 2 * n, n, n_chunks, bits)
        return numel, chunk, idx, q.reshape(n_chunks, k), scale


class Rice2Codec(Codec):
    """Top-k by magnitude over the whole tensor, positions Golomb-Rice coded, values in 2 bits.

    The k = round(fraction * numel) largest |x| are kept. Their positions ascend; the gaps
    between them (a run of skipped entries each) are Rice-coded with the parameter b that
    makes the stream shortest: each gap's quotient (gap >> b) in unary, its remainder in b
    bits. At a density p that costs about log2(1/p) + 1.5 bits per entry (~6.5 at 3%) against
    16 for a uint16 index. Each value keeps its sign and whether its magnitude is above the
    median of the kept ones, and is decoded as the mean magnitude of its half: 2 bits.

    Payload: two float32 scales (the halves' mean magnitudes: large, small), the unary stream
    (``ubytes`` bytes, zero bits end each quotient), the remainders (k x b bits), the 2-bit
    codes (sign, large); bit streams packed most significant bit first."""

    name = "rice2"
    exact_size = False  # the positions' bits depend on the gaps
    takes_zstd = False  # near their entropy already

    def __init__(self, *, fraction: float = 0.025, zstd: bool = False) -> None:
        super().__init__(zstd=zstd)
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        self.fraction = fraction

    def __repr__(self) -> str:
        return f"Rice2Codec(fraction={self.fraction}, zstd={self.zstd})"

    def _k(self, numel: int) -> int:
        return 0 if numel == 0 else max(1, min(numel, round(self.fraction * numel)))

    def raw_nbytes(self, numel: int) -> int:
        """An estimate (the exact size depends on the gaps): ~ log2(1/p) + 3.5 bits an entry."""
        k = self._k(numel)
        if k == 0:
            return 8
        bits_per_index = math.log2(max(1.0, numel / k)) + 1.5
        return 8 + math.ceil(k * (bits_per_index + 2) / 8)

    def encode(self, x: Tensor) -> Encoded:
        flat = _flat(x)
        numel = flat.size
        k = self._k(numel)
        idx = np.sort(np.argpartition(np.abs(flat), numel - k)[numel - k :]) if k else np.zeros(0)
        idx = idx.astype(np.int64)
        values = flat[idx]
        gaps = np.diff(idx, prepend=-1) - 1  # entries skipped before each kept one
        b = _rice_parameter(gaps)
        q = gaps >> b
        unary = np.ones(int(q.sum()) + k, np.uint8)
        unary[np.cumsum(q + 1) - 1] = 0  # each quotient's ones end with a zero
        remainders = _bits(gaps & ((1 << b) - 1), b)
        mag = np.abs(values)
        large = mag >= np.median(mag) if k else np.zeros(0, bool)
        scales = np.array(
            [
                mag[large].mean() if large.any() else 0.0,
                mag[~large].mean() if (~large).any() else 0.0,
            ],
            "<f4",
        )
        codes = _bits((values < 0).astype(np.int64) * 2 + large, 2)
        packed_unary = np.packbits(unary).tobytes()
        raw = scales.tobytes() + packed_unary + np.packbits(remainders).tobytes()
        raw += np.packbits(codes).tobytes()
        meta: dict[str, int | float | str] = {"k": k, "b": b, "ubytes": len(packed_unary)}
        return self._pack(tuple(x.shape), meta, raw)

    def decode(self, enc: Encoded) -> Tensor:
        numel = _numel(enc.shape)
        k = _meta_int(enc.meta, "k", 0 if numel == 0 else 1, numel)
        b = _meta_int(enc.meta, "b", 0, 31)
        ubytes = _meta_int(enc.meta, "ubytes", math.ceil(k / 8), math.ceil((numel + k) / 8))
        rbytes, cbytes = math.ceil(k * b / 8), math.ceil(2 * k / 8)
        raw = _unpack(enc, 8 + ubytes + rbytes + cbytes, ("k", "b", "ubytes"))
        scales = np.frombuffer(raw, "<f4", count=2)
        if not np.isfinite(scales).all() or (scales < 0).any():
            raise WireError("malformed", f"rice2 scales must be finite and >= 0, got {scales}")
        unary = np.unpackbits(np.frombuffer(raw, np.uint8, count=ubytes, offset=8))
        ends = np.flatnonzero(unary == 0)
        if len(ends) < k or (k and math.ceil((ends[k - 1] + 1) / 8) != ubytes):
            raise WireError("malformed", f"rice2 unary stream does not hold {k} quotients")
        if unary[ends[k - 1] + 1 :].any() if k else unary.any():
            raise WireError("malformed", "rice2 unary stream has bits after its last quotient")
        q = np.diff(ends[:k], prepend=-1) - 1
        offset = 8 + ubytes
        r = _from_bits(np.frombuffer(raw, np.uint8, count=rbytes, offset=offset), k, b)
        codes = _from_bits(np.frombuffer(raw, np.uint8, count=cbytes, offset=offset + rbytes), k, 2)
        idx = np.cumsum((q.astype(np.int64) << b) + r + 1) - 1
        if k and idx[-1] >= numel:
            raise WireError("malformed", f"rice2 position {idx[-1]} beyond {numel} entries")
        dense = np.zeros(numel, np.float32)
        sign = np.where(codes >= 2, np.float32(-1), np.float32(1))
        dense[idx] = sign * np.where(codes & 1, scales[0], scales[1])
        return _tensor(dense, enc.shape)


class LowRankCodec(Codec):
    """A matrix's best rank-r approximation, sent as its two factors (PowerSGD-like, no positions).

    A tensor of two or more dimensions is the matrix A of (shape[0], the rest) rows and columns.
    Its r largest singular triplets make ``P = U sqrt(S)`` (rows x r) and ``Q = V sqrt(S)``
    (columns x r), with ``P @ Q.T`` the nearest rank-r matrix to A. r spends ``fraction`` of the
    matrix's entries on the factors' numbers: r = round(fraction * rows * cols / (rows + cols)),
    at least 1 and at most ``min(rows, cols, MAX_RANK)``. A tensor of fewer dimensions (norms,
    biases) or no entries goes out in ``topk``'s layout at the same fraction.

    Payload: P's columns then Q's columns (each column one after the other), symmetric integers
    of ``bits`` bits (4: levels -7..7, two a byte, low nibble first; 8: int8), then one scale per
    column, P's then Q's (absmax / 7 as bfloat16 with 4 bits, absmax / 127 as fp32 with 8).
    Meta: ``rank``, ``bits``. No positions travel, so a number costs its bits and no more: at
    the same bytes a frame carries several times the numbers of ``topk``.

    Why it carries more per byte: a round's delta of a weight matrix is mostly a few directions
    (what the steps agreed on), which the factors capture whole, where top-k keeps the largest
    entries of every direction at once. What the approximation leaves out stays in the replica
    (or the error feedback) and goes out in the next rounds, as with top-k.

    Decoding costs rows x cols x rank multiply-adds; ``MAX_RANK`` bounds what a frame can ask.
    Above ``EXACT_SVD`` rows and columns, the factors come from a randomized SVD (seeded: the
    same delta gives the same frame). What a receiver decodes is the quantized factors'
    product, which the sender decodes too: every peer merges the same delta."""

    name = "lowrank"

    def __init__(self, *, fraction: float = 0.02, bits: int = 8, zstd: bool = True) -> None:
        super().__init__(zstd=zstd)
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        if bits not in VALUE_BITS:
            raise ValueError(f"bits must be one of {VALUE_BITS}, got {bits}")
        self.fraction = fraction
        self.bits = bits
        self._flat = TopKCodec(fraction=fraction, bits=bits, zstd=zstd)

    def __repr__(self) -> str:
        return f"LowRankCodec(fraction={self.fraction}, bits={self.bits}, zstd={self.zstd})"

    def rank(self, shape: tuple[int, ...]) -> int | None:
        """The rank a tensor of ``shape`` is sent at; None: it goes out in top-k's layout."""
        if len(shape) < 2 or math.prod(shape) == 0:
            return None
        rows, cols = _matrix(shape)
        r = round(self.fraction * rows * cols / (rows + cols))
        return max(1, min(r, rows, cols, MAX_RANK))

    def raw_nbytes(self, numel: int) -> int:
        """As a flat tensor of ``numel`` entries (``raw_nbytes_for`` knows matrices)."""
        return self._flat.raw_nbytes(numel)

    def raw_nbytes_for(self, shape: tuple[int, ...]) -> int:
        r = self.rank(shape)
        if r is None:
            return self._flat.raw_nbytes(math.prod(shape))
        rows, cols = _matrix(shape)
        return _lowrank_raw_len(rows, cols, r, self.bits)

    def encode(self, x: Tensor) -> Encoded:
        shape = tuple(x.shape)
        r = self.rank(shape)
        if r is None:  # top-k's layout, under this codec's name: a job has one codec
            return dataclasses.replace(self._flat.encode(x), codec=self.name)
        rows, cols = _matrix(shape)
        a = _flat(x).reshape(rows, cols)
        u, s, vt = _top_singular(a, r)
        root = np.sqrt(s)
        # (r, rows) and (r, cols): the columns of P and Q, one scale each.
        p, q = (
            _quantized(f.astype(np.float32), self.bits) for f in ((u * root).T, (vt.T * root).T)
        )
        raw = _codes(np.concatenate([p[0], q[0]]), self.bits) + p[1].tobytes() + q[1].tobytes()
        meta: dict[str, int | float | str] = {"rank": r, "bits": self.bits}
        return self._pack(shape, meta, raw)

    def decode(self, enc: Encoded) -> Tensor:
        numel = _numel(enc.shape)
        if len(enc.shape) < 2 or numel == 0:  # sent in top-k's layout (encode says why)
            return self._flat.decode(enc)
        rows, cols = _matrix(enc.shape)
        r = _meta_int(enc.meta, "rank", 1, min(rows, cols, MAX_RANK))
        bits = _meta_bits(enc)
        raw = _unpack(enc, _lowrank_raw_len(rows, cols, r, bits), ("rank", "bits"))
        q, scale = _read_values(raw, 0, r * (rows + cols), 2 * r, bits)
        with np.errstate(over="ignore", invalid="ignore"):  # huge scales: refused as non-finite
            p = q[: r * rows].reshape(r, rows) * scale[:r, None]
            qq = q[r * rows :].reshape(r, cols) * scale[r:, None]
            dense = p.T @ qq
        return _tensor(dense, enc.shape)


def _matrix(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, columns) of a tensor of two or more dimensions seen as a matrix: its first
    dimension, and the rest."""
    return shape[0], math.prod(shape[1:])


def _lowrank_raw_len(rows: int, cols: int, r: int, bits: int) -> int:
    """A lowrank payload: r * (rows + cols) values, then 2 * r scales."""
    return _values_len(r * (rows + cols), 2 * r, bits)


def _top_singular(a: np.ndarray, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(U, S, Vt) of the ``r`` largest singular values of ``a`` (float64). Up to ``EXACT_SVD``
    rows or columns, from the eigenvectors of the smaller Gram matrix (exact, and ~10x faster
    than an SVD of the matrix at these sizes); above, from a randomized range finder (Halko et
    al.: a seeded Gaussian sketch of r + 8 columns, two power iterations)."""
    a64 = a.astype(np.float64)
    rows, cols = a64.shape
    if min(rows, cols) <= EXACT_SVD:
        if rows > cols:  # the same, transposed: U and V swap
            v, s, ut = _top_singular(a64.T, r)
            return ut.T, s, v.T
        w, vecs = np.linalg.eigh(a64 @ a64.T)  # ascending
        u = vecs[:, ::-1][:, :r]
        s = np.sqrt(np.maximum(w[::-1][:r], 0.0))
    else:
        sketch = np.random.default_rng(rows * 1_000_003 + cols).standard_normal(
            (cols, min(cols, r + 8))
        )
        basis, _ = np.linalg.qr(a64 @ sketch)
        for _ in range(2):
            basis, _ = np.linalg.qr(a64 @ (a64.T @ basis))
        ub, s_all, _ = np.linalg.svd(basis.T @ a64, full_matrices=False)
        u, s = (basis @ ub)[:, :r], s_all[:r]
    # Vt = U^T A / S; a direction without energy (S ~ 0) contributes nothing.
    live = s > s.max(initial=0.0) * 1e-7
    vt = np.zeros((len(s), cols))
    vt[live] = (u[:, live].T @ a64) / s[live, None]
    return u, s, vt


def _rice_parameter(gaps: np.ndarray) -> int:
    """The b in [0, 31] giving the shortest stream: sum(gap >> b) + len(gaps) * (1 + b) bits."""
    if gaps.size == 0:
        return 0
    guess = int(math.log2(max(1.0, float(gaps.mean()) * math.log(2))))
    candidates = range(max(0, guess - 1), min(31, guess + 2) + 1)
    return min(candidates, key=lambda b: int((gaps >> b).sum()) + gaps.size * (1 + b))


def _bits(values: np.ndarray, width: int) -> np.ndarray:
    """Each value's low ``width`` bits, most significant first, as one flat 0/1 uint8 array."""
    if width == 0:
        return np.zeros(0, np.uint8)
    shifts = np.arange(width - 1, -1, -1, dtype=np.int64)
    return ((values.astype(np.int64)[:, None] >> shifts) & 1).astype(np.uint8).reshape(-1)


def _from_bits(packed: np.ndarray, n: int, width: int) -> np.ndarray:
    """Inverse of ``_bits`` after ``np.packbits``: ``n`` values of ``width`` bits, in slices
    of BITS_SLICE values: one int64 a bit for all n at once took ~130x the tensor's fp32 size
    for a rice2 frame of k = numel, b = 31 (a review of 2026-12-06)."""
    out = np.zeros(n, np.int64)
    if width == 0:
        return out
    shifts = np.arange(width - 1, -1, -1, dtype=np.int64)
    for lo in range(0, n, BITS_SLICE):
        hi = min(n, lo + BITS_SLICE)
        part = packed[lo * width // 8 : (hi * width + 7) // 8 + 1]
        skip = lo * width % 8
        bits = np.unpackbits(part)[skip : skip + (hi - lo) * width].reshape(hi - lo, width)
        out[lo:hi] = (bits.astype(np.int64) << shifts).sum(axis=1)
    return out


BITS_SLICE = 1 << 15


_CODECS: dict[str, type[Codec]] = {
    c.name: c for c in (Fp32Codec, Bf16Codec, Int8Codec, TopKCodec, Rice2Codec, LowRankCodec)
}
# Decoding reads every parameter from meta, so one instance of each codec decodes anything.
_DECODERS: dict[str, Codec] = {name: cls() for name, cls in _CODECS.items()}
CODEC_NAMES: tuple[str, ...] = tuple(_CODECS)


def make_codec(
    name: str, *, topk_fraction: float = 0.01, value_bits: int = TOPK_BITS, zstd: bool = True
) -> Codec:
    """The codec called ``name`` (fp32, bf16, int8, topk or rice2); ``ValueError`` if unknown.
    ``topk_fraction`` is the share of entries kept by the sparse codecs, ``value_bits`` the
    bits of each value topk sends."""
    if name == "topk":
        return TopKCodec(fraction=topk_fraction, bits=value_bits, zstd=zstd)
    if name == "lowrank":
        return LowRankCodec(fraction=topk_fraction, bits=value_bits, zstd=zstd)
    if name == "rice2":  # its streams are near their entropy already: zstd would not shrink them
        return Rice2Codec(fraction=topk_fraction, zstd=False)
    if name not in _CODECS:
        raise ValueError(f"unknown codec {name!r}; expected one of {', '.join(CODEC_NAMES)}")
    return _CODECS[name](zstd=zstd)


def decode(enc: Encoded) -> Tensor:
    """Decode with the codec ``enc`` names: a finite float32 tensor of ``enc.shape``.

    Raises ``WireError("malformed")`` for an unknown codec or a payload that does not fit its
    shape and meta, ``WireError("non_finite")`` if it would decode to NaN/Inf."""
    codec = _DECODERS.get(enc.codec)
    if codec is None:
        raise WireError(
            "malformed", f"unknown codec {enc.codec!r}; expected one of {', '.join(CODEC_NAMES)}"
        )
    return codec.decode(enc)


def kept(enc: Encoded) -> Kept:
    """``enc`` decoded (as :func:`decode`), with which entries it kept and how large each entry
    it left out can have been: ``TopKCodec.kept`` for a top-k share; every entry kept for the
    other codecs (a dense codec sends them all; rice2 and lowrank say no bound)."""
    codec = _DECODERS.get(enc.codec)
    if isinstance(codec, TopKCodec):
        return codec.kept(enc)
    values = decode(enc)
    return Kept(values, torch.ones(values.shape, dtype=torch.bool), torch.zeros_like(values))


class ErrorFeedback:
    """Per-tensor residuals: what a round's compression dropped is added to the next round's delta.

    With ``decay`` = 1, after any number of rounds the sum of what was sent equals the sum of the
    true deltas minus the current residual, which stays bounded. ``decay`` < 1 forgets a part of
    old residuals each round (useful when deltas from long ago no longer fit the anchor)."""

    def __init__(self, codec: Codec, *, decay: float = 1.0) -> None:
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.codec = codec
        self.decay = decay
        # name -> residual (float32, CPU); replaced, never modified in place.
        self._residual: dict[str, Tensor] = {}

    def compress(
        self, name: str, delta: Tensor, weight: Tensor | None = None
    ) -> tuple[Encoded, Tensor]:
        """(encoded, sent): ``sent`` is exactly what receivers will decode (float32, CPU).
        ``weight``: how a top-k codec ranks the entries (``TopKCodec.encode``); others send
        what they send whatever it is."""
        delta = delta.detach().to("cpu", torch.float32)
        residual = self._residual.get(name)
        if residual is None:
            acc = delta
        elif residual.shape != delta.shape:
            raise ValueError(
                f"delta {name!r} has shape {tuple(delta.shape)}, its residual "
                f"{tuple(residual.shape)}; reset the error feedback when the model changes"
            )
        else:
            acc = torch.add(delta, residual, alpha=self.decay)
        if weight is not None and isinstance(self.codec, TopKCodec):
            enc = self.codec.encode(acc, weight.detach().to("cpu", torch.float32))
        else:
            enc = self.codec.encode(acc)
        sent = self.codec.decode(enc)
        self._residual[name] = acc - sent
        return enc, sent

    def split(self, name: str, fraction: float) -> Tensor:
        """Take ``fraction`` of ``name``'s residual out (returned); the rest stays for the next
        round. ``fraction`` 1 hands all of it over (zeros when there is none yet)."""
        if not 0 <= fraction <= 1:
            raise ValueError(f"fraction must be in [0, 1], got {fraction}")
        residual = self._residual[name]
        self._residual[name] = residual * (1.0 - fraction)
        return residual * fraction

    def state_tensors(self) -> dict[str, Tensor]:
        """Residuals by tensor name, for a checkpoint (which stores them as ``"ef.<name>"``).

        The tensors are never modified in place afterwards, so no copy is made."""
        return dict(self._residual)

    def load_state_tensors(self, tensors: Mapping[str, Tensor]) -> None:
        """Replace the residuals with ``tensors``, keyed by tensor name as :meth:`state_tensors`
        gives them."""
        self._residual = {
            name: t.detach().to("cpu", torch.float32).clone() for name, t in tensors.items()
        }


def _flat(x: Tensor) -> np.ndarray:
    """``x`` as a flat float32 array (CPU, may share memory); ``ValueError`` if not finite.

    The codecs work in numpy: single-threaded and predictable next to a training process, where
    torch's intra-op thread pool can cost milliseconds per small op on busy cores."""
    flat = x.detach().to("cpu", torch.float32).reshape(-1).contiguous().numpy()
    if not np.isfinite(flat).all():
        raise ValueError("cannot encode a tensor holding NaN or Inf")
    return flat


def _rows(flat: np.ndarray, n_rows: int, width: int) -> np.ndarray:
    """``flat`` zero-padded to (n_rows, width)."""
    if flat.size == n_rows * width:
        return flat.reshape(n_rows, width)
    out = np.zeros(n_rows * width, flat.dtype)
    out[: flat.size] = flat
    return out.reshape(n_rows, width)


def _quantize(x: np.ndarray, scale: np.ndarray, top: int = 127) -> np.ndarray:
    """Symmetric integers in [-top, top] (int8) of rows ``x`` (n, m) with per-row ``scale``
    (n,); round half to even."""
    divisor = np.where(scale > 0, scale, np.float32(1))  # all-zero rows stay zero
    return np.clip(np.rint(x / divisor[:, None]), -top, top).astype(np.int8)


def _top_level(bits: int) -> int:
    """The largest level of symmetric ``bits``-bit values: 7 for 4 bits, 127 for 8."""
    return (1 << (bits - 1)) - 1


def _value_bytes(n: int, bits: int) -> int:
    return (n * bits + 7) // 8


def _values_len(n: int, n_scales: int, bits: int) -> int:
    """``n`` values of ``bits`` bits and their ``n_scales`` scales (bf16 at 4 bits, fp32 at 8)."""
    return _value_bytes(n, bits) + (2 if bits == 4 else 4) * n_scales


def _quantized(rows: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Float32 ``rows`` (n, m) as flat symmetric ``bits``-bit integers, one scale a row, and
    the scales as they travel: absmax / 7 as bfloat16 at 4 bits (2^-8 of relative error, far
    below a 4-bit step; the values are rounded with the scale the receiver reads), absmax / 127
    as fp32 at 8."""
    top = np.float32(_top_level(bits))
    scale = np.abs(rows).max(axis=1, initial=0) / top
    if bits == 4:
        wire = _to_bf16(scale)
        scale = _from_bf16(wire)
    else:
        wire = scale.astype("<f4", copy=False)
    return _quantize(rows, scale, int(top)).reshape(-1), wire


def _codes(q: np.ndarray, bits: int) -> bytes:
    """Flat integers of ``_quantized`` as they travel: nibbles at 4 bits, int8 at 8."""
    return _nibbles(q) if bits == 4 else q.tobytes()


def _read_values(
    raw: bytes, offset: int, n: int, n_scales: int, bits: int
) -> tuple[np.ndarray, np.ndarray]:
    """The ``n`` codes (as float32) and ``n_scales`` scales that ``_codes`` and ``_quantized``
    wrote at ``offset`` of ``raw``, one after the other."""
    value_bytes = _value_bytes(n, bits)
    packed = np.frombuffer(raw, np.int8, count=value_bytes, offset=offset)
    q = (_from_nibbles(packed, n) if bits == 4 else packed).astype(np.float32)
    at = offset + value_bytes
    if bits == 4:
        return q, _from_bf16(np.frombuffer(raw, "<u2", count=n_scales, offset=at))
    return q, np.frombuffer(raw, "<f4", count=n_scales, offset=at)


def _meta_bits(enc: Encoded, default: int | None = None) -> int:
    """The bits of ``enc``'s values (meta ``bits``; ``default`` where a layout of before has
    none), one of ``VALUE_BITS``."""
    if default is not None and "bits" not in enc.meta:
        return default
    bits = _meta_int(enc.meta, "bits", 4, 8)
    if bits not in VALUE_BITS:
        raise WireError(
            "malformed", f"{enc.codec} values of {bits} bits; expected one of {VALUE_BITS}"
        )
    return bits


def _topk_raw_len(n: int, n_chunks: int, bits: int) -> int:
    """A topk payload of ``n`` entries in ``n_chunks`` chunks: gaps, values, scales (bf16 with
    4-bit values, fp32 with int8)."""
    return 2 * n + _values_len(n, n_chunks, bits)


def _to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 ``x`` as bfloat16 bits (little-endian uint16), round to nearest, ties to even
    (as torch does). Finite inputs: no NaN to keep, and the largest round to Inf as they should."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    one, half, sixteen = np.uint32(1), np.uint32(0x7FFF), np.uint32(16)
    rounded: np.ndarray = ((bits + (half + ((bits >> sixteen) & one))) >> sixteen).astype("<u2")
    return rounded


def _from_bf16(u: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) as float32."""
    out: np.ndarray = (u.astype(np.uint32) << 16).view(np.float32)
    return out


def _nibbles(q: np.ndarray) -> bytes:
    """Flat int8 values in [-8, 7] as two's-complement nibbles, two a byte, low nibble first
    (an odd count ends with a zero nibble)."""
    u = (q.astype(np.uint8) & 0x0F).astype(np.uint8)
    if u.size % 2:
        u = np.append(u, np.uint8(0))
    return (u[0::2] | (u[1::2] << 4)).astype(np.uint8).tobytes()


def _from_nibbles(packed: np.ndarray, n: int) -> np.ndarray:
    """Inverse of ``_nibbles``: ``n`` int8 values in [-8, 7]."""
    u = packed.view(np.uint8)
    both = np.empty(2 * u.size, np.int8)
    both[0::2] = (u & 0x0F).astype(np.int8)
    both[1::2] = (u >> 4).astype(np.int8)
    out: np.ndarray = np.where(both >= 8, both - 16, both).astype(np.int8)[:n]
    return out


def _numel(shape: tuple[int, ...]) -> int:
    if not isinstance(shape, tuple) or not all(type(d) is int and d >= 0 for d in shape):
        raise WireError("malformed", f"shape must be a tuple of ints >= 0, got {shape!r}")
    return math.prod(shape)


def _meta_int(meta: Mapping[str, object], key: str, lo: int, hi: int) -> int:
    value = meta.get(key)
    if type(value) is not int or not lo <= value <= hi:
        raise WireError("malformed", f"meta {key!r} is {value!r}, expected an int in [{lo}, {hi}]")
    return value


def _unpack(enc: Encoded, raw_len: int, keys: tuple[str, ...]) -> bytes:
    """The raw payload (zstd undone), checked to be exactly ``raw_len`` bytes."""
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
    _meta_int(enc.meta, "zstd", 1, 1)
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


def _tensor(values: np.ndarray, shape: tuple[int, ...]) -> Tensor:
    """A float32 tensor of ``shape``; ``WireError("non_finite")`` if any value is NaN/Inf."""
    if not np.isfinite(values).all():
        raise WireError("non_finite", "the payload decodes to NaN or Inf")
    return torch.from_numpy(np.ascontiguousarray(values, np.float32).reshape(shape))
