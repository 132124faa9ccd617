"""The delta frame: round trip, chunked feeding, every refusal, and fuzzing of the decoder."""

from __future__ import annotations

import json
import random
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atomd.errors import WireError
from atomd.p2p.identity import Identity
from atomd.sync import codecs
from atomd.sync.codecs import Encoded, make_codec
from atomd.sync.frame_decoder import FrameDecoder, decode_tensors
from atomd.sync.frame_header import MAX_HEADER_BYTES, VERSION
from atomd.sync.replay import ReplayGuard
from atomd.sync.wire import PREFIX, DeltaFrame, encode_frame

JOB = "job-1"
SHAPES = {"wte": (64, 32), "h.0.attn.w": (32, 96), "ln_f.b": (32,)}
ME = Identity.generate()
OTHER = Identity.generate()
KEYS = {ME.peer_id: ME.public_key_hex, OTHER.peer_id: OTHER.public_key_hex}
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def encoded(codec: str = "topk", seed: int = 0) -> list[tuple[str, Encoded]]:
    gen = torch.Generator().manual_seed(seed)
    c = make_codec(codec, topk_fraction=0.05)
    return [(name, c.encode(torch.randn(shape, generator=gen))) for name, shape in SHAPES.items()]


def frame(
    *,
    identity: Identity = ME,
    job_id: str = JOB,
    round: int = 3,
    base_version: int = 2,
    tensors: Sequence[tuple[str, Encoded]] | None = None,
    now: float | None = None,
    cadence: dict[str, float | int] | None = None,
) -> bytes:
    return encode_frame(
        cadence=cadence,
        identity=identity,
        job_id=job_id,
        round=round,
        base_version=base_version,
        tensors=encoded() if tensors is None else tensors,
        now=now,
    )


def decoder(
    *,
    shapes: dict[str, tuple[int, ...]] | None = None,
    max_bytes: int = 1 << 20,
    seen: ReplayGuard | None = None,
    keys: Callable[[str], str | None] = KEYS.get,
    sender: str | None = None,
) -> FrameDecoder:
    return FrameDecoder(
        job_id=JOB,
        public_key_of=keys,
        expected_shapes=SHAPES if shapes is None else shapes,
        max_bytes=max_bytes,
        seen=seen,
        sender=sender,
    )


def receive(data: bytes, chunk: int | None = None, **kw: Any) -> DeltaFrame:
    dec = decoder(**kw)
    step = chunk or max(1, len(data))
    for i in range(0, len(data), step):
        dec.feed(data[i : i + step])
    return dec.finish()


def refused(data: bytes, reason: str, **kw: Any) -> WireError:
    with pytest.raises(WireError) as e:
        receive(data, **kw)
    assert e.value.reason == reason, str(e.value)
    return e.value


def split(data: bytes) -> tuple[bytes, dict[str, object], bytes]:
    """(prefix, header, payload) of a frame (version 2: plain JSON; 3: zstd)."""
    _, version, header_len = PREFIX.unpack_from(data)
    end = PREFIX.size + header_len
    head = data[PREFIX.size : end]
    if version >= 3:
        head = zstandard.ZstdDecompressor().decompress(head)
    return data[: PREFIX.size], json.loads(head), data[end:]


def join(header: dict[str, object], payload: bytes, version: int = VERSION) -> bytes:
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    if version >= 3:
        head = zstandard.ZstdCompressor().compress(head)
    return PREFIX.pack(b"ATD1", version, len(head)) + head + payload


def resign(header: dict[str, object], identity: Identity = ME) -> dict[str, object]:
    """``header`` signed again (a peer that holds the key sends what it likes)."""
    body = {k: v for k, v in header.items() if k != "signature"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return {**body, "signature": identity.sign(canonical).hex()}


# --- round trip -------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", codecs.CODEC_NAMES)
def test_round_trip(codec: str) -> None:
    tensors = encoded(codec)
    data = frame(tensors=tensors)
    got = receive(data)
    assert (got.job_id, got.sender, got.round, got.base_version) == (JOB, ME.peer_id, 3, 2)
    assert got.codec == codec and got.wire_bytes == len(data)
    assert list(got.tensors.items()) == tensors
    decoded = decode_tensors(got, SHAPES)
    for name, enc in tensors:
        assert torch.equal(decoded[name], codecs.decode(enc))


def test_mixed_codecs_and_chunked_feeding() -> None:
    tensors = [encoded("fp32")[0], encoded("int8")[1], encoded("topk")[2]]
    data = frame(tensors=tensors)
    whole = receive(data)
    assert whole.codec == "mixed"
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(data)), rng.randint(1, 40)))
        dec = decoder()
        for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True):
            dec.feed(data[a:b])
        assert dec.finish() == whole
    assert receive(data, chunk=1) == whole
    dec = decoder()
    dec.feed(b"")
    dec.feed(data)
    dec.feed(b"")
    assert dec.finish() == whole


def test_encode_frame_checks_its_input() -> None:
    with pytest.raises(ValueError, match="one or more"):
        frame(tensors=[])
    with pytest.raises(ValueError, match="distinct"):
        frame(tensors=[encoded()[0], encoded()[0]])
    with pytest.raises(ValueError, match=">= 0"):
        frame(round=-1)


# --- refusals ---------------------------------------------------------------------------------


def test_oversize_is_refused_before_the_payload() -> None:
    data = frame(tensors=encoded("fp32"))
    _, header, _ = split(data)
    head_end = len(data) - int(header["payload_bytes"])  # type: ignore[call-overload]
    dec = decoder(max_bytes=len(data) - 1)
    with pytest.raises(WireError) as e:
        dec.feed(data[:head_end])  # the header says how large the frame is
    assert e.value.reason == "oversize"
    with pytest.raises(WireError) as again:  # a refusal is final
        dec.feed(data[head_end:])
    assert again.value is e.value
    # Too small even for the header: refused on the 9-byte prefix.
    dec = decoder(max_bytes=100)
    with pytest.raises(WireError, match="header of"):
        dec.feed(data[: PREFIX.size])
    # A header length over the 1 MiB limit.
    refused(PREFIX.pack(b"ATD1", VERSION, MAX_HEADER_BYTES + 1), "oversize", max_bytes=1 << 30)
    # Bytes beyond max_bytes, whatever the header says.
    refused(b"ATD1" + b"\0" * 200, "oversize", max_bytes=100)


def test_truncated() -> None:
    data = frame()
    for cut in (0, 3, PREFIX.size, PREFIX.size + 10, len(data) - 1):
        refused(data[:cut], "truncated")


def test_payload_beyond_its_declared_length() -> None:
    refused(frame() + b"\0", "malformed")


def test_flipped_payload_byte_is_a_bad_hash() -> None:
    data = bytearray(frame())
    data[-5] ^= 0x40
    refused(bytes(data), "bad_hash")


def test_flipped_header_bytes() -> None:
    data = frame()
    _, header, payload = split(data)
    rng = random.Random(1)
    for pos in rng.sample(range(PREFIX.size, len(data) - len(payload)), 60):
        bad = bytearray(data)
        bad[pos] ^= 1 << rng.randrange(8)
        with pytest.raises(WireError) as e:
            receive(bytes(bad))
        assert e.value.reason in {"malformed", "bad_signature", "wrong_job", "unknown_sender"}
    # A changed field in canonical form: only the signature tells.
    refused(join({**header, "round": 4}, payload), "bad_signature")
    refused(join({**header, "payload_sha256": "0" * 64}, payload), "bad_signature")
    # Signed by another key than the sender's.
    refused(join(resign(header, OTHER), payload), "bad_signature")
    # Not canonical (a space), even with the right signature.
    head = json.dumps(header, sort_keys=True, separators=(", ", ":")).encode()
    refused(PREFIX.pack(b"ATD1", VERSION, len(head)) + head + payload, "malformed")


def test_prefix() -> None:
    data = frame()
    refused(b"ATDX" + data[4:], "malformed")
    refused(b"X", "malformed")  # refused on the first wrong byte
    refused(data[:4] + bytes([1]) + data[5:], "unsupported_version")  # before the cadence
    _, header, payload = split(data)
    refused(join(resign({**header, "version": 1}), payload), "malformed")


def test_the_senders_cadence_travels_signed() -> None:
    got = receive(frame(cadence={"period_s": 1.25, "every": 3}))
    assert got.cadence == (1.25, 3)
    assert receive(frame(round=4)).cadence is None  # optional
    with pytest.raises(WireError, match="cadence"):
        frame(cadence={"period_s": -1.0, "every": 3})  # refused when made, too
    _, header, payload = split(frame(round=5, cadence={"period_s": 1.0, "every": 2}))
    header["cadence"] = {"period_s": 9.0, "every": 2}  # changed without the key: not signed
    refused(join(header, payload), "bad_signature")


def test_an_average_frame_says_so_signed() -> None:
    """The job's final average (``atomd.sync.average``) travels as a frame that says it is
    not a delta; the flag is signed like the rest of the header."""
    data = encode_frame(
        identity=ME, job_id=JOB, round=7, base_version=6, tensors=encoded(), average=True
    )
    got = receive(data)
    assert got.average and not got.final and got.base_version == 6
    assert not receive(frame(round=8)).average  # optional
    _, header, payload = split(data)
    del header["average"]  # taken away without the key: not signed
    refused(join(header, payload), "bad_signature")


def test_unknown_sender() -> None:
    e = refused(frame(), "unknown_sender", keys={OTHER.peer_id: OTHER.public_key_hex}.get)
    assert ME.peer_id in str(e)


def test_wrong_job() -> None:
    e = refused(frame(job_id="job-2"), "wrong_job")
    assert "'job-2'" in str(e) and repr(JOB) in str(e)


def test_replay() -> None:
    seen = ReplayGuard()
    data = frame()
    receive(data, seen=seen)
    refused(data, "replayed", seen=seen)
    # Same (sender, round, base version), made anew.
    refused(frame(now=time.time() + 1), "replayed", seen=seen)
    receive(frame(round=4), seen=seen)
    receive(frame(base_version=3), seen=seen)
    receive(frame(identity=OTHER), seen=seen)
    assert len(seen) == 4
    # A refused frame is not remembered: once whole, it is accepted.
    fresh = frame(round=9)
    refused(fresh[:-1], "truncated", seen=seen)
    receive(fresh, seen=seen)


def test_replay_guard_is_bounded() -> None:
    seen = ReplayGuard(max_entries=2)
    t = time.time()
    first = frame(round=1, now=t - 3)
    for i, data in enumerate([first, frame(round=2, now=t - 2), frame(round=3, now=t - 1)]):
        receive(data, seen=seen)
        assert len(seen) == min(i + 1, 2)
    # The first was forgotten, so anything created no later than it is refused.
    refused(first, "replayed", seen=seen)
    refused(frame(round=7, now=t - 4), "replayed", seen=seen)
    receive(frame(round=8, now=t), seen=seen)


def test_replay_guard_floors_are_per_sender() -> None:
    """One member's frames filling the guard raise its own floor only: with one floor for all,
    frames dated a minute ahead (allowed: clocks differ) would have every honest frame of the
    next minute refused as a replay."""
    seen = ReplayGuard(max_entries=2)
    ahead = time.time() + 59
    for r in range(3):
        receive(frame(identity=OTHER, round=r, now=ahead), seen=seen)
    receive(frame(round=3), seen=seen)  # made now, by another sender: accepted
    refused(frame(identity=OTHER, round=9, now=ahead - 1), "replayed", seen=seen)


def test_replay_guard_forgets_floors_older_than_any_frame_it_takes() -> None:
    """A sender's floor goes once older than the decoders' age limit (frames before it are
    refused as stale anyway), so fresh keys cannot pile floors up."""
    seen = ReplayGuard(max_entries=2, max_age_s=600)
    t = 1_000_000.0
    for at, sender in ((t, "a"), (t + 1, "b"), (t + 2, "c"), (t + 601, "d")):
        seen.record(job_id=JOB, sender=sender, round=0, base_version=0, signature=sender,
                    created_at=at, now=at)  # fmt: skip
    assert set(seen._floor) == {"a", "b"}  # their frames forgotten, their floors kept
    seen.record(job_id=JOB, sender="e", round=0, base_version=0, signature="e",
                created_at=t + 602, now=t + 602)  # fmt: skip
    assert set(seen._floor) == {"c"}  # a's and b's: older than 600 s


def test_a_frame_is_its_signers_own_before_it_is_recorded() -> None:
    """A member re-posting another's frame (it receives them all) is refused before the replay
    guard records the frame: checked after, the sender's own upload of it, a moment later,
    would be refused as a replay and its delta lost there."""
    seen = ReplayGuard()
    data = frame()  # ME's
    refused(data, "bad_signature", seen=seen, sender=OTHER.peer_id)
    assert len(seen) == 0
    receive(data, seen=seen, sender=ME.peer_id)


def test_a_refusal_that_quotes_the_frame_is_bounded() -> None:
    """A refusal's message goes into the rounds' records and the answer: one that lists what
    the frame named is cut, so a frame of a few hundred bytes (a thousand 900-character names,
    zstd-compressed) cannot write a megabyte."""
    data = frame()
    _, header, payload = split(data)
    entry = {"name": "n" * 900, "shape": [1], "codec": "fp32", "meta": {}, "nbytes": 4}
    big = join(resign({**header, "tensors": [entry] * 1000}), payload)
    assert len(big) < 2000
    err = refused(big, "malformed")
    assert len(str(err)) <= WireError.MAX_MESSAGE + len("malformed: ")


def test_stale_and_future() -> None:
    refused(frame(now=time.time() - 601), "stale")
    refused(frame(now=time.time() + 120), "stale")
    receive(frame(now=time.time() - 500))
    receive(frame(now=time.time() + 30))  # clock skew


@pytest.mark.parametrize(
    ("shapes", "match"),
    [
        ({**SHAPES, "extra": (3,)}, r"missing \['extra'\]"),
        ({k: v for k, v in SHAPES.items() if k != "wte"}, r"unknown \['wte'\]"),
        ({**SHAPES, "ln_f.b": (33,)}, "expected"),
    ],
    ids=["missing", "unknown", "shape"],
)
def test_tensors_must_match_the_model(shapes: dict[str, tuple[int, ...]], match: str) -> None:
    data = frame()
    payload = split(data)[2]
    dec = decoder(shapes=shapes)
    with pytest.raises(WireError, match=match) as e:
        dec.feed(data[: len(data) - len(payload)])  # refused on the header alone
    assert e.value.reason == "wrong_shape"


def test_non_finite_values_in_a_signed_frame() -> None:
    tensors = encoded("fp32")
    values = np.zeros(32, "<f4")
    for bad in (np.nan, np.inf, -np.inf):
        values[7] = bad
        data = frame(
            tensors=[*tensors[:2], ("ln_f.b", Encoded("fp32", (32,), {}, values.tobytes()))]
        )
        got = receive(data)  # the frame itself is fine: signed, hash right
        with pytest.raises(WireError, match=r"ln_f\.b") as e:
            decode_tensors(got, SHAPES)
        assert e.value.reason == "non_finite"


def test_malformed_payload_in_a_signed_frame() -> None:
    tensors = encoded("int8")
    name, enc = tensors[2]
    short = Encoded(enc.codec, enc.shape, {**enc.meta, "block": 7}, enc.payload)
    got = receive(frame(tensors=[*tensors[:2], (name, short)]))
    with pytest.raises(WireError) as e:
        decode_tensors(got, SHAPES)
    assert e.value.reason == "malformed"
    assert str(e.value).count("malformed") == 1


def test_decode_tensors_checks_shapes() -> None:
    got = receive(frame())
    with pytest.raises(WireError) as e:
        decode_tensors(got, {**SHAPES, "wte": (32, 64)})
    assert e.value.reason == "wrong_shape"
    with pytest.raises(WireError) as e:
        decode_tensors(got, {"wte": (64, 32)})
    assert e.value.reason == "wrong_shape"


@pytest.mark.parametrize(
    "change",
    [
        {"extra": 1},
        {"round": -1},
        {"round": True},
        {"round": 1.0},
        {"created_at": "now"},
        {"created_at": 10**400},
        {"job_id": 5},
        {"payload_bytes": 1},
        {"payload_sha256": "XYZ"},
        {"tensors": {}},
        {"tensors": [{"name": "wte"}]},
        {"cadence": 1.0},
        {"cadence": {"period_s": 1.0}},
        {"cadence": {"period_s": 1.0, "every": 0}},
        {"cadence": {"period_s": 1.0, "every": 2.0}},
        {"cadence": {"period_s": 1e9, "every": 2}},
        {"cadence": {"period_s": "1", "every": 2}},
        {"cadence": {"period_s": 1.0, "every": 2, "x": 1}},
        {"final": 1},
        {"average": "yes"},
        {"average": None},
    ],
    ids=str,
)
def test_malformed_header_fields(change: dict[str, object]) -> None:
    data = frame()
    _, header, payload = split(data)
    refused(join(resign({**header, **change}), payload), "malformed")


@pytest.mark.parametrize(
    "change",
    [
        {"codec": "fp8"},
        {"shape": [64, -32]},
        {"shape": "64x32"},
        {"meta": {"k": [1]}},
        {"meta": {"k": True}},
        {"nbytes": -1},
        {"name": ""},
    ],
    ids=str,
)
def test_malformed_tensor_entries(change: dict[str, object]) -> None:
    data = frame()
    _, header, payload = split(data)
    entries = list(header["tensors"])  # type: ignore[call-overload]
    entries[0] = {**entries[0], **change}
    refused(join(resign({**header, "tensors": entries}), payload), "malformed")


@pytest.mark.parametrize(
    "head",
    [
        b"[1,2]",
        b"{",
        b"\xff\xfe",
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a":1,"a":1}',
        b'{"a":NaN}',
        b'{"a":1e999}',
        b'{"a":' + b"9" * 5000 + b"}",
    ],
    ids=["list", "eof", "utf8", "deep", "dup", "nan", "inf", "bigint"],
)
def test_header_json_that_is_not_a_header(head: bytes) -> None:
    refused(PREFIX.pack(b"ATD1", VERSION, len(head)) + head, "malformed")


def test_decoder_lifecycle() -> None:
    dec = decoder()
    dec.feed(frame())
    dec.finish()
    with pytest.raises(RuntimeError):
        dec.feed(b"x")
    with pytest.raises(RuntimeError):
        dec.finish()
    dec = decoder()
    with pytest.raises(WireError) as e:
        dec.finish()
    with pytest.raises(WireError) as again:
        dec.finish()
    assert again.value is e.value


# --- fuzzing ----------------------------------------------------------------------------------

VALID = {
    codec: frame(tensors=encoded(codec), round=i) for i, codec in enumerate(codecs.CODEC_NAMES)
}


def feed_in_pieces(data: bytes, cuts: list[int]) -> DeltaFrame:
    """Decode ``data`` fed in pieces at ``cuts``; WireError is the only exception allowed."""
    dec = decoder()
    bounds = sorted({c % (len(data) + 1) for c in cuts})
    for a, b in zip([0, *bounds], [*bounds, len(data)], strict=True):
        dec.feed(data[a:b])
    return dec.finish()


@FUZZ
@given(data=st.binary(max_size=3000), cuts=st.lists(st.integers(0, 3000), max_size=6))
def test_fuzz_arbitrary_bytes(data: bytes, cuts: list[int]) -> None:
    with pytest.raises(WireError):
        feed_in_pieces(data, cuts)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=10,
)


@settings(FUZZ, max_examples=100)
@given(
    fields=st.dictionaries(
        st.sampled_from(sorted(split(VALID["topk"])[1])), json_values, max_size=11
    ),
    payload=st.binary(max_size=100),
)
def test_fuzz_arbitrary_headers(fields: dict[str, object], payload: bytes) -> None:
    _, header, _ = split(VALID["topk"])
    bad = {**header, **fields}
    head = json.dumps(bad, sort_keys=True, separators=(",", ":")).encode()
    data = PREFIX.pack(b"ATD1", VERSION, len(head)) + head + payload
    try:
        feed_in_pieces(data, [])
    except WireError:
        return
    assert bad == header and payload == split(VALID["topk"])[2]


@FUZZ
@given(
    codec=st.sampled_from(codecs.CODEC_NAMES),
    flips=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(1, 255)), max_size=3),
    inserts=st.lists(
        st.tuples(st.integers(0, 1 << 20), st.binary(min_size=1, max_size=4)), max_size=2
    ),
    cut=st.one_of(st.none(), st.integers(0, 1 << 20)),
    cuts=st.lists(st.integers(0, 1 << 20), max_size=8),
)
def test_fuzz_mutated_frames(
    codec: str,
    flips: list[tuple[int, int]],
    inserts: list[tuple[int, bytes]],
    cut: int | None,
    cuts: list[int],
) -> None:
    """Any change to a valid frame is refused with a WireError, however it is fed."""
    original = VALID[codec]
    data = bytearray(original)
    for pos, xor in flips:
        data[pos % len(data)] ^= xor
    for pos, extra in inserts:
        data[pos % (len(data) + 1) : pos % (len(data) + 1)] = extra
    if cut is not None:
        del data[cut % len(data) :]
    try:
        got = feed_in_pieces(bytes(data), cuts)
    except WireError:
        return
    assert bytes(data) == original  # only an unchanged frame is accepted
    assert got == receive(original)
    decode_tensors(got, SHAPES)


def test_prefix_layout() -> None:
    # Pinned: peers of other builds must agree on it.
    assert PREFIX.format == "<4sBI" and PREFIX.size == 9
    assert struct.unpack_from("<4sBI", frame())[:2] == (b"ATD1", 3)


def test_a_version_2_frame_with_a_plain_header_is_still_read() -> None:
    data = frame()
    _, header, payload = split(data)
    header["version"] = 2
    old = join(resign(header), payload, version=2)
    assert receive(old).round == receive(data).round
    # The frame's version and its header's must agree.
    refused(join(resign(header), payload, version=3), "malformed")


def test_the_header_travels_compressed_and_is_bounded_before_it_is_decompressed() -> None:
    data = frame()
    _, header, payload = split(data)
    plain = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    assert len(data) - len(payload) - PREFIX.size < len(plain)  # compressed on the wire
    # A zstd frame that would decompress past the limit is refused by its declared size.
    bomb = zstandard.ZstdCompressor().compress(b" " * (MAX_HEADER_BYTES + 1))
    refused(PREFIX.pack(b"ATD1", 3, len(bomb)) + bomb + payload, "oversize", max_bytes=1 << 30)
    # One that does not declare its size, or is not zstd at all, is malformed.
    obj = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    undeclared = obj.compress(plain) + obj.flush()
    refused(PREFIX.pack(b"ATD1", 3, len(undeclared)) + undeclared + payload, "malformed")
    refused(PREFIX.pack(b"ATD1", 3, len(plain)) + plain + payload, "malformed")
