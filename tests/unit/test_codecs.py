"""Delta codecs: one round-trip suite over every codec, error bounds, refusals of bad payloads,
error feedback, compression ratios, and property tests on random tensors and random payloads."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays
from torch import Tensor

from atomd.errors import WireError
from atomd.sync.codecs import (
    CODEC_NAMES,
    Encoded,
    ErrorFeedback,
    Int8Codec,
    TopKCodec,
    decode,
    kept,
    make_codec,
)

SHAPES = [(), (1,), (0,), (3, 0), (7,), (255,), (257,), (4097,), (3, 5, 7), (300, 1001)]
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def randn(shape: tuple[int, ...], seed: int = 0) -> Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def rows(flat: np.ndarray, width: int) -> np.ndarray:
    """``flat`` zero-padded to rows of ``width`` (the codecs' blocks and chunks)."""
    n_rows = math.ceil(flat.size / width)
    return np.pad(flat, (0, n_rows * width - flat.size)).reshape(n_rows, width)


def check_bounds(name: str, x: Tensor, enc: Encoded, y: Tensor) -> None:
    """Each codec's promised error bound, entry by entry (in numpy float64: exact here)."""
    xs, ys = x.numpy().reshape(-1).astype(np.float64), y.numpy().reshape(-1).astype(np.float64)
    err = np.abs(ys - xs)
    if name == "fp32":
        assert (err == 0).all()
    elif name == "bf16":
        # Round to nearest with 8 significant bits; the absolute term covers subnormals.
        assert (err <= 2.0**-8 * np.abs(xs) + 2.0**-126).all()
    elif name == "int8":
        block = int(enc.meta["block"])
        absmax = np.repeat(np.abs(rows(xs, block)).max(axis=1, initial=0), block)[: xs.size]
        # Half a step of absmax/127 (the promise is one step); the slack covers fp32 rounding.
        assert (err <= absmax / 254 * 1.001 + 1e-38).all()
    else:
        check_topk(xs, enc, ys)


def check_topk(x: np.ndarray, enc: Encoded, y: np.ndarray) -> None:
    """Per chunk: at most k entries survive, only among the k largest |x|, each within half a
    4-bit step (absmax / 7); an entry that reads 0 was dropped (no larger than the k-th) or
    rounded to 0."""
    chunk, k = int(enc.meta["chunk"]), int(enc.meta["k"])
    top = 7
    if x.size == 0:
        return
    xs, ys = np.abs(rows(x, chunk)), rows(y, chunk)
    err = np.abs(rows(y - x, chunk))
    kth = np.sort(xs, axis=1)[:, chunk - k : chunk - k + 1]  # (n_chunks, 1)
    # The slack covers fp32 rounding and the scale's bf16 rounding (2^-9 of it).
    half_step = xs.max(axis=1, keepdims=True) / (2 * top) * 1.003 + 1e-38
    kept = ys != 0
    assert (kept.sum(axis=1) <= k).all()
    assert (~kept | (xs >= kth)).all()
    assert (~kept | (err <= half_step)).all()
    assert (kept | (xs <= np.maximum(kth, half_step))).all()


@pytest.mark.parametrize("zstd", [True, False], ids=["zstd", "raw"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", CODEC_NAMES)
def test_round_trip(name: str, shape: tuple[int, ...], zstd: bool) -> None:
    codec = make_codec(name, zstd=zstd)
    x = randn(shape)
    enc = codec.encode(x)
    assert (enc.codec, enc.shape) == (name, shape)
    assert codec.encode(x.clone()) == enc  # deterministic, byte for byte
    y = decode(enc)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert torch.equal(y, codec.decode(enc))
    check_bounds(name, x, enc, y)
    raw = codec.raw_nbytes_for(shape)
    if zstd and enc.meta.get("zstd") == 1:
        assert len(enc.payload) < raw
    else:
        assert "zstd" not in enc.meta and len(enc.payload) == raw
    # zstd changes the bytes, never the values.
    assert torch.equal(decode(make_codec(name, zstd=not zstd).encode(x)), y)


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_zstd_only_when_it_shrinks(name: str) -> None:
    zeros = make_codec(name).encode(torch.zeros(1 << 16))
    assert zeros.meta.get("zstd") == 1
    assert len(zeros.payload) < make_codec(name).raw_nbytes(1 << 16) / 4
    tiny = make_codec(name).encode(torch.tensor([0.3]))
    assert "zstd" not in tiny.meta


def test_topk_keeps_exactly_the_largest_per_chunk() -> None:
    # 16389 entries: 5 chunks of 3278 (one padding entry), k = round(0.01 * 3278) = 33.
    n = 4 * 4096 + 5
    gen = torch.Generator().manual_seed(3)
    magnitude = 1 + torch.randperm(n, generator=gen).float() / n  # distinct, in [1, 2)
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    x = sign * magnitude
    enc = TopKCodec(fraction=0.01).encode(x)
    meta = {k: v for k, v in enc.meta.items() if k != "zstd"}
    assert meta == {"chunk": 3278, "k": 33, "gaps": 1, "bits": 4}
    y = decode(enc)
    chunks = torch.nn.functional.pad(x, (0, 1)).view(5, 3278)
    expected = torch.zeros(5, 3278, dtype=torch.bool)
    expected.scatter_(1, chunks.abs().topk(33, dim=1).indices, True)
    kept = torch.nn.functional.pad(y, (0, 1)).view(5, 3278) != 0
    assert torch.equal(kept, expected)
    # Values within half a 4-bit step of their chunk's absmax (< 2), bf16 scale included.
    assert float((y - x)[y != 0].abs().max()) <= 2 / 14 * 1.003


def test_topk_ranks_by_a_weight_when_given() -> None:
    """``weight`` ranks the entries by |x| x weight (``SyncSpec.topk_rank``): the values sent
    are x's, at the positions the weight chose, and any decoder reads them; the error
    feedback passes it to top-k only."""
    n = 4 * 4096 + 5
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(n, generator=gen)
    weight = torch.rand(n, generator=gen) ** 4
    codec = TopKCodec(fraction=0.01)
    enc = codec.encode(x, weight)
    y = decode(enc)
    chunks = torch.nn.functional.pad(x * weight, (0, 1)).view(5, 3278)
    expected = torch.zeros(5, 3278, dtype=torch.bool)
    expected.scatter_(1, chunks.abs().topk(33, dim=1).indices, True)
    chosen = torch.nn.functional.pad(kept(enc).mask, (0, 1)).view(5, 3278)
    assert torch.equal(chosen, expected)
    assert not torch.equal(kept(enc).mask, kept(codec.encode(x)).mask)
    assert float((y - x)[y != 0].abs().max()) <= float(x.abs().max()) / 14 * 1.003
    with pytest.raises(ValueError, match="weight of shape"):
        codec.encode(x, weight[:-1])
    fb = ErrorFeedback(codec)
    _, sent = fb.compress("w", x, weight)
    assert torch.equal(sent, y)
    _, sent = ErrorFeedback(Int8Codec()).compress("w", x, weight)  # dense: whatever weight
    assert torch.equal(sent, ErrorFeedback(Int8Codec()).compress("w", x)[1])


@pytest.mark.parametrize("fraction", [0.01, 0.25, 0.5])
def test_topk_kept_bounds_every_entry_it_left_out(fraction: float) -> None:
    """What a receiver knows of a share's left-out entries (the final average fills them):
    which they are, and that each was at most its chunk's bound, rounding included."""
    x = randn((3, 5000), seed=4) * torch.linspace(0.1, 3, 5000)  # heavy and light chunks
    enc = TopKCodec(fraction=fraction).encode(x)
    k = kept(enc)
    assert torch.equal(k.values, decode(enc))
    chunk, per_chunk = int(enc.meta["chunk"]), int(enc.meta["k"])
    assert int(k.mask.sum()) == math.ceil(x.numel() / chunk) * per_chunk  # no padding kept here
    left = ~k.mask
    assert bool((k.bound[k.mask] == 0).all()) and bool((k.bound[left] > 0).all())
    assert bool((x.abs()[left] <= k.bound[left]).all())
    # The bound is the chunk's smallest kept |x| to within a rounding step, no looser.
    flat, bound = x.reshape(-1), k.bound.reshape(-1)
    for c in range(math.ceil(x.numel() / chunk)):
        sl = slice(c * chunk, (c + 1) * chunk)
        smallest = float(flat[sl][k.mask.reshape(-1)[sl]].abs().min())
        step = float(flat[sl].abs().max()) / 7
        b = float(bound[sl][left.reshape(-1)[sl]][0])
        assert smallest <= b <= smallest + 1.01 * step
    # A dense codec keeps every entry: nothing to bound.
    dense = kept(make_codec("int8").encode(x))
    assert bool(dense.mask.all()) and float(dense.bound.abs().max()) == 0.0


BF16_MAX = float(np.array([0x7F7F0000], np.uint32).view(np.float32)[0])  # the largest finite


def bf16_bytes(value: float) -> bytes:
    """``value`` (exact in bfloat16) as the two bytes of a bf16 scale."""
    return (np.array([value], np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()


def test_topk_kept_bound_never_overflows_nor_turns_negative() -> None:
    """A sender chooses its scales: one near float32's largest, with a level that still decodes
    finite, must not make the bound of what it left out overflow (an error the decoder's checks
    had let through would end the receiver's job)."""
    x = torch.zeros(4096)
    x[0] = 1.0
    enc = TopKCodec(fraction=1 / 4096, zstd=False).encode(x)
    payload = bytearray(enc.payload)  # gaps (2 B), one 4-bit level (1 B), one bf16 scale
    assert len(payload) == 5
    payload[2] = 1
    payload[3:5] = bf16_bytes(BF16_MAX)
    hostile = dataclasses.replace(enc, payload=bytes(payload))
    assert float(decode(hostile)[0]) == BF16_MAX
    k = kept(hostile)
    assert bool(torch.isfinite(k.bound).all()) and float(k.bound[1]) > 1e38
    # A negative scale decodes finite too, and so does -max at level 1: the bound is a
    # magnitude, never negative (a negative one would clamp every left-out entry to it).
    for scale in (-3.0, -BF16_MAX):
        payload[3:5] = bf16_bytes(scale)
        k = kept(dataclasses.replace(enc, payload=bytes(payload)))
        assert float(k.values[0]) == pytest.approx(scale)
        assert bool(torch.isfinite(k.bound).all()) and float(k.bound[1:].min()) > 0


def test_topk_layout() -> None:
    codec = TopKCodec(fraction=0.01)
    assert codec.encode(torch.ones(128)).meta["k"] == 1  # at least one per chunk
    big = codec.encode(randn((1 << 20,)))
    assert (big.meta["chunk"], big.meta["k"]) == (4096, 41)
    full = TopKCodec(fraction=1.0, zstd=False).encode(randn((5000,)))
    assert full.meta == {"chunk": 2500, "k": 2500, "gaps": 1, "bits": 4}


def test_compression_ratios() -> None:
    """fp32 bytes / payload bytes on 2^20 Gaussian entries, without zstd: fp32 1, bf16 2,
    int8 1024/260 ≈ 3.94, topk at 1 % with 4-bit values 16384/104.5 ≈ 157 (≥ 100 as
    required)."""
    x = randn((1024, 1024))
    ratios = {}
    for name in CODEC_NAMES:
        codec = make_codec(name, zstd=False)
        ratios[name] = 4 * x.numel() / len(codec.encode(x).payload)
        estimate = 4 * x.numel() / codec.raw_nbytes_for(tuple(x.shape))
        assert ratios[name] == pytest.approx(estimate)
    assert ratios["fp32"] == 1.0
    assert ratios["bf16"] == 2.0
    assert ratios["int8"] == pytest.approx(1024 / 260)
    assert ratios["topk"] == pytest.approx(16384 / 104.5)
    assert ratios["topk"] >= 100
    assert make_codec("fp32").estimate_ratio(0) == 1.0
    # zstd only ever helps (and it is what decides the bytes on the wire).
    for name in CODEC_NAMES:
        assert len(make_codec(name).encode(x).payload) <= 4 * x.numel() / ratios[name]


def test_bf16_rounds_like_torch() -> None:
    x = torch.cat(
        [
            randn((10_000,)),
            torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.3895e38, 1e-40, -0.0, 0.0]),
        ]
    )
    # Ties to even, the largest finite bf16, a subnormal and signed zeros, bit for bit.
    got = decode(make_codec("bf16").encode(x))
    assert torch.equal(got.view(torch.int32), x.to(torch.bfloat16).float().view(torch.int32))


def test_make_codec() -> None:
    assert make_codec("topk", topk_fraction=0.1).fraction == 0.1  # type: ignore[attr-defined]
    assert make_codec("int8", zstd=False).zstd is False
    for name in ("fp8", "rice2", "lowrank"):
        with pytest.raises(ValueError, match=f"unknown codec '{name}'; expected one of fp32"):
            make_codec(name)
    with pytest.raises(ValueError, match="fraction"):
        TopKCodec(fraction=0)
    with pytest.raises(ValueError, match="NaN"):
        make_codec("topk").encode(torch.tensor([1.0, float("nan")]))


# --- refusals of payloads that do not fit ---------------------------------------------------


def replace(enc: Encoded, **changes: Any) -> Encoded:
    return dataclasses.replace(enc, **changes)


@pytest.mark.parametrize("zstd", [True, False], ids=["zstd", "raw"])
@pytest.mark.parametrize("name", CODEC_NAMES)
def test_malformed_payloads_are_refused(name: str, zstd: bool) -> None:
    enc = make_codec(name, zstd=zstd).encode(torch.zeros(5000) if zstd else randn((5000,)))
    assert enc.meta.get("zstd", 0) == int(zstd)
    bad = [
        replace(enc, payload=enc.payload + b"\0"),
        replace(enc, payload=enc.payload[:-1]),
        replace(enc, payload=b""),
        replace(enc, shape=(5001,)),
        replace(enc, shape=(-1,)),
        replace(enc, meta={**enc.meta, "extra": 1}),
        replace(enc, codec="fp8"),
    ]
    if zstd:
        bad.append(replace(enc, meta={**enc.meta, "zstd": 2}))
        bad.append(replace(enc, payload=enc.payload[:4] + b"\xff" * (len(enc.payload) - 4)))
    else:
        bad.append(replace(enc, meta={**enc.meta, "zstd": 1}))
    for key in {
        "int8": ["block"],
        "topk": ["chunk", "k", "gaps", "bits"],
    }.get(name, []):
        for value in (0, -1, 1.5, "3", True, 1 << 17, None):
            meta = (
                {**enc.meta, key: value}
                if value is not None
                else {k: v for k, v in enc.meta.items() if k != key}
            )
            bad.append(replace(enc, meta=meta))
    for b in bad:
        with pytest.raises(WireError) as e:
            decode(b)
        assert e.value.reason == "malformed", b.meta


def test_topk_positions_must_stay_within_their_chunk() -> None:
    """Gaps that add up beyond the chunk are refused; any gaps within it decode."""
    enc = TopKCodec(fraction=0.01, zstd=False).encode(randn((4096,)))
    k = int(enc.meta["k"])
    lo, hi = bytearray(enc.payload[:k]), bytearray(enc.payload[k : 2 * k])
    hi[0] = 0x10  # the first gap alone is 4096 or more
    with pytest.raises(WireError, match="beyond the chunk") as e:
        decode(replace(enc, payload=bytes(lo + hi) + enc.payload[2 * k :]))
    assert e.value.reason == "malformed"
    for value in (0, 2, True, "1"):
        with pytest.raises(WireError, match="gaps"):
            decode(replace(enc, meta={**enc.meta, "gaps": value}))
    zeros = bytes(2 * k) + enc.payload[2 * k :]  # the k first entries of the chunk
    assert (decode(replace(enc, payload=zeros))[k:] == 0).all()


def test_topk_gaps_shrink_its_frames() -> None:
    """The positions as gaps in byte planes: zstd takes a 1 % delta to under 2.3 bytes an entry,
    its positions to under 1.2 bytes an entry, where plain uint16 indices take more than 1.6."""
    x = torch.distributions.StudentT(3.0).sample((206 * 4096,)).float()
    enc = TopKCodec(fraction=0.01).encode(x)
    entries = 206 * 41
    assert enc.meta.get("zstd") == 1
    assert len(enc.payload) / entries < 2.3
    raw = TopKCodec(fraction=0.01, zstd=False).encode(x).payload
    n = entries
    planes = np.frombuffer(raw, np.uint8, count=2 * n).astype(np.int64)
    gaps = planes[:n] | (planes[n:] << 8)
    idx = np.cumsum(gaps.reshape(-1, 41) + 1, axis=1) - 1
    zstd = zstandard.ZstdCompressor(level=3)
    assert len(zstd.compress(raw[: 2 * n])) / entries < 1.2
    assert len(zstd.compress(idx.astype("<u2").tobytes())) / entries > 1.6


def test_topk_refuses_other_layouts() -> None:
    """4-bit values with gaps are the one layout: other value widths, or a frame without
    ``gaps`` or ``bits`` (plain indices, int8 values), are refused."""
    enc = TopKCodec(fraction=0.01, zstd=False).encode(randn((4096,)))
    for key, value in (("bits", 6), ("bits", 8), ("gaps", 0)):
        with pytest.raises(WireError, match=key):
            decode(replace(enc, meta={**enc.meta, key: value}))
    for key in ("bits", "gaps"):
        with pytest.raises(WireError, match=key) as e:
            decode(replace(enc, meta={k: v for k, v in enc.meta.items() if k != key}))
        assert e.value.reason == "malformed"


def test_topk_nibbles_round_trip() -> None:
    """Every 4-bit level packs and unpacks, an odd count included (its last nibble zero)."""
    from atomd.sync.codecs.topk import from_nibbles, nibbles

    q = np.arange(-8, 8, dtype=np.int8)
    for n in (16, 15, 1):
        packed = nibbles(q[:n])
        assert len(packed) == (n + 1) // 2
        assert np.array_equal(from_nibbles(np.frombuffer(packed, np.int8), n), q[:n])
    assert nibbles(np.array([-1], np.int8)) == bytes([0x0F])


def test_non_finite_payloads_are_refused() -> None:
    nan = np.array([1.0, np.nan, 2.0], "<f4").tobytes()
    with pytest.raises(WireError) as e:
        decode(Encoded("fp32", (3,), {}, nan))
    assert e.value.reason == "non_finite"
    inf_bf16 = torch.tensor([float("inf")]).to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    with pytest.raises(WireError, match="NaN or Inf"):
        decode(Encoded("bf16", (1,), {}, inf_bf16))
    # A finite but huge int8 scale overflows to Inf when dequantized.
    payload = np.array([127], "i1").tobytes() + np.array([3e38], "<f4").tobytes()
    with pytest.raises(WireError) as e:
        decode(Encoded("int8", (1,), {"block": 256}, payload))
    assert e.value.reason == "non_finite"


def test_zstd_frame_must_declare_its_size() -> None:
    raw = np.zeros(1000, "<f4").tobytes()
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(raw)
    with pytest.raises(WireError, match="zstd") as e:
        decode(Encoded("fp32", (1000,), {"zstd": 1}, unsized))
    assert e.value.reason == "malformed"
    sized = zstandard.ZstdCompressor().compress(raw)
    assert torch.equal(decode(Encoded("fp32", (1000,), {"zstd": 1}, sized)), torch.zeros(1000))
    with pytest.raises(WireError, match="nothing after it"):
        decode(Encoded("fp32", (1000,), {"zstd": 1}, sized + sized))


# --- error feedback ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_error_feedback_sends_the_true_sum(name: str) -> None:
    """Sending the same delta every round: what was sent in total equals the true total minus
    the residual (exactly, up to float rounding), and the residual stays bounded, so the
    relative gap shrinks like 1/rounds."""
    ef = ErrorFeedback(make_codec(name, topk_fraction=0.05))
    delta = randn((64, 130), seed=1) * 1e-3
    true = np.zeros(delta.shape)  # float64
    sent_sum = np.zeros(delta.shape)
    peaks = []
    rounds = 400
    for _ in range(rounds):
        _, sent = ef.compress("w", delta)
        true += delta.numpy()
        sent_sum += sent.numpy()
        residual = ef.state_tensors()["w"].numpy()
        assert np.abs(true - sent_sum - residual).max() <= 1e-6
        peaks.append(float(np.abs(residual).max()))
    # Bounded: no larger in the second half than in the first (topk reaches its cycle after
    # about 1/fraction rounds).
    assert max(peaks[rounds // 2 :]) <= max(peaks[: rounds // 2]) * 1.05 + 1e-12
    gap = float(np.linalg.norm(true - sent_sum) / np.linalg.norm(true))
    bound = {"fp32": 1e-12, "bf16": 1e-4, "int8": 1e-4, "topk": 0.1}
    assert gap < bound[name]


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_error_feedback_with_decay(name: str) -> None:
    """decay < 1: r_n = decay * r_{n-1} + delta - sent_n, so the true total minus the sent
    total is r_n + (1 - decay) * sum of earlier residuals, and |r| <= |delta| / (1 - decay)."""
    decay = 0.8
    ef = ErrorFeedback(make_codec(name, topk_fraction=0.01), decay=decay)
    delta = randn((5000,), seed=2)
    true, sent_sum, forgotten = np.zeros(5000), np.zeros(5000), np.zeros(5000)  # float64
    previous = np.zeros(5000)
    for _ in range(60):
        forgotten += (1 - decay) * previous
        _, sent = ef.compress("d", delta)
        true += delta.numpy()
        sent_sum += sent.numpy()
        residual = ef.state_tensors()["d"].numpy().astype(np.float64)
        assert np.abs(true - sent_sum - residual - forgotten).max() <= 1e-4
        assert np.abs(residual).max() <= float(delta.abs().max()) / (1 - decay) * 1.001
        previous = residual


def test_error_feedback_state_round_trip() -> None:
    a = ErrorFeedback(make_codec("topk"))
    for seed in range(3):
        a.compress("w", randn((300, 20), seed=seed))
        a.compress("b", randn((20,), seed=seed))
    state = a.state_tensors()
    assert set(state) == {"w", "b"}
    b = ErrorFeedback(make_codec("topk"))
    b.load_state_tensors(state)
    nxt = randn((300, 20), seed=9)
    enc_a, sent_a = a.compress("w", nxt)
    enc_b, sent_b = b.compress("w", nxt)
    assert enc_a == enc_b and torch.equal(sent_a, sent_b)


def test_error_feedback_refuses_bad_input() -> None:
    ef = ErrorFeedback(make_codec("int8"))
    ef.compress("w", torch.ones(4))
    before = ef.state_tensors()["w"]
    with pytest.raises(ValueError, match="NaN"):
        ef.compress("w", torch.tensor([1.0, float("inf"), 0.0, 0.0]))
    assert torch.equal(ef.state_tensors()["w"], before)  # the residual is not poisoned
    with pytest.raises(ValueError, match="shape"):
        ef.compress("w", torch.ones(5))
    with pytest.raises(ValueError, match="decay"):
        ErrorFeedback(make_codec("fp32"), decay=0)


# --- properties -------------------------------------------------------------------------------

finite32 = st.floats(-(2.0**100), 2.0**100, width=32, allow_nan=False, allow_infinity=False)


@settings(FUZZ, max_examples=100)
@given(
    x=arrays(
        np.float32, array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=50), elements=finite32
    ),
    name=st.sampled_from(CODEC_NAMES),
    fraction=st.sampled_from([0.01, 0.1, 0.5, 1.0]),
    zstd=st.booleans(),
)
def test_random_tensors_round_trip(name: str, x: np.ndarray, fraction: float, zstd: bool) -> None:
    t = torch.from_numpy(x.copy())
    codec = make_codec(name, topk_fraction=fraction, zstd=zstd)
    enc = codec.encode(t)
    assert codec.encode(t) == enc
    y = decode(enc)
    assert y.shape == t.shape and bool(torch.isfinite(y).all())
    check_bounds(name, t, enc, y)


meta_values = st.one_of(
    st.integers(-3, 70_000), st.floats(allow_nan=True), st.text(max_size=3), st.booleans()
)


@FUZZ
@given(
    codec=st.sampled_from([*CODEC_NAMES, "fp8"]),
    shape=st.lists(st.integers(0, 40), max_size=3).map(tuple),
    meta=st.dictionaries(
        st.sampled_from(["chunk", "k", "gaps", "block", "zstd", "bits", "x"]),
        meta_values,
    ),
    payload=st.binary(max_size=600),
)
def test_arbitrary_payloads_decode_or_refuse(
    codec: str, shape: tuple[int, ...], meta: dict[str, int | float | str], payload: bytes
) -> None:
    try:
        y = decode(Encoded(codec, shape, meta, payload))
    except WireError:
        return
    assert y.shape == shape and y.dtype == torch.float32 and bool(torch.isfinite(y).all())


VALID = [
    make_codec(name, zstd=zstd).encode(x)
    for name in CODEC_NAMES
    for zstd in (True, False)
    for x in (randn((40, 50)), torch.zeros(3000))
]


@FUZZ
@given(
    enc=st.sampled_from(VALID),
    flips=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(1, 255)), max_size=4),
    cut=st.integers(0, 1 << 16),
)
def test_mutated_payloads_decode_or_refuse(
    enc: Encoded, flips: list[tuple[int, int]], cut: int
) -> None:
    payload = bytearray(enc.payload)
    for pos, xor in flips:
        if payload:
            payload[pos % len(payload)] ^= xor
    if cut % 3 == 0 and payload:
        del payload[cut % len(payload) :]
    try:
        y = decode(replace(enc, payload=bytes(payload)))
    except WireError:
        return
    assert y.shape == enc.shape and bool(torch.isfinite(y).all())


def test_one_decoder_reads_every_fraction() -> None:
    """Under the automatic cadence each peer picks its sparse codec's fraction for its link,
    so a receiver must decode a frame of any fraction without knowing it."""
    x = torch.randn(3, 5000, generator=torch.Generator().manual_seed(0))
    kept = []
    for fraction in (0.01, 0.005, 0.0025, 0.001):
        codec = make_codec("topk", topk_fraction=fraction)
        enc = codec.encode(x)
        y = decode(enc)
        torch.testing.assert_close(y, codec.decode(enc), rtol=0, atol=0)
        kept.append(int((y != 0).sum()))
    assert kept == sorted(kept, reverse=True) and kept[0] > 4 * kept[-1]
