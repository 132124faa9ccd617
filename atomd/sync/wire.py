"""The delta frame: versioned, length-prefixed, signed, decoded incrementally.

Layout (integers little-endian)::

    b"ATD1" | u8 version | u32 header length | header | payload

Version 3 (written since 2026-12-01) carries the header as one zstd frame of the canonical
JSON (at most 1 MiB once decompressed, its size declared in the zstd frame and checked before
anything is decompressed): a header names every tensor, ~6 KiB of repetitive JSON for the tiny
model's 52 tensors, about half of a top-k frame at 0.25% of the entries, ~0.7 KiB compressed.
Version 2 (the header as plain JSON) is still read.

The header names the job, the sender, its round and base version (the anchor version the delta is
relative to), and every tensor (name, shape, codec, meta, nbytes); since version 2 it may also
carry the sender's cadence (``{"period_s": its proposed round period, "every": steps in this
round}``, see ``cadence.py``) and ``"final": true`` on the last delta it sends for the job;
``"average": true`` marks a frame that is not a delta at all but the sender's share of the
job's final average (``SyncPlugin.finish``: its model beyond its settled anchor, sent once after its
last round; never merged into a round). The
payload is the tensors' payloads concatenated in header order. The header travels in canonical
form (sorted keys, no spaces, ASCII) and the sender signs it without its ``signature`` field
with its Ed25519 key; the signed part holds ``payload_sha256``, so the signature covers the
payload.

:class:`FrameDecoder` takes the bytes as they arrive and refuses a frame as early as it can: bad
magic or version, oversize, a header that is malformed, for another job, from an unknown sender,
wrongly signed or for tensors other than expected. Nothing is decoded into a tensor before the
payload hash is checked; :func:`decode_tensors` then refuses NaN/Inf. Staleness in rounds (versus
the receiver's round) is the caller's decision; staleness in time is checked here.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import zstandard
from torch import Tensor

from atomd.errors import WireError
from atomd.p2p.identity import Identity, verify_signature
from atomd.sync import codecs
from atomd.sync.codecs import Encoded

MAGIC = b"ATD1"
VERSION = 3  # 2: the optional "cadence" and "final" header fields; 3: the header zstd-compressed
READS = frozenset({2, 3})  # frame versions this peer reads (the header's "version" is the same)
PREFIX = struct.Struct("<4sBI")  # magic, version, header length: 9 bytes
MAX_HEADER_BYTES = 1 << 20  # the header as JSON (decompressed)
HEADER_ZSTD_LEVEL = 3
MAX_FUTURE_S = 60.0  # clock skew allowed for created_at
MAX_AGE_S = 600.0  # a frame created longer ago is refused as stale

_HEADER_KEYS = frozenset(
    {
        "version",
        "job_id",
        "sender",
        "round",
        "base_version",
        "codec",
        "created_at",
        "tensors",
        "payload_bytes",
        "payload_sha256",
        "signature",
    }
)
_OPTIONAL_KEYS = frozenset({"cadence", "final", "average"})
_TENSOR_KEYS = frozenset({"name", "shape", "codec", "meta", "nbytes"})
_CADENCE_KEYS = frozenset({"period_s", "every"})
MAX_PERIOD_S = 86_400.0
MAX_EVERY = 1_000_000


@dataclass(frozen=True)
class DeltaFrame:
    """A frame that passed every check: signed by ``sender``, payload hash verified, fresh."""

    job_id: str
    sender: str
    round: int
    base_version: int
    codec: str  # the tensors' codec, or "mixed"
    created_at: float  # unix seconds, the sender's clock
    tensors: dict[str, Encoded]  # in header order
    wire_bytes: int  # the whole frame
    cadence: Cadence | None = None  # the sender's, when it sent one
    final: bool = False  # the sender's last delta for the job
    average: bool = False  # not a delta: the sender's share of the job's final average


class Cadence(NamedTuple):
    """A sender's cadence: its proposed round period (s) and the steps of this round."""

    period_s: float
    every: int


def encode_frame(
    *,
    identity: Identity,
    job_id: str,
    round: int,
    base_version: int,
    tensors: Sequence[tuple[str, Encoded]],
    now: float | None = None,
    cadence: Mapping[str, float | int] | None = None,
    final: bool = False,
    average: bool = False,
) -> bytes:
    """One signed frame holding ``tensors`` (name, encoded), in that order, and the sender's
    ``cadence`` (``period_s``, ``every``) when given; ``final``: its last for the job;
    ``average``: its share of the job's final average, not a delta."""
    names = [name for name, _ in tensors]
    if not names or len(set(names)) != len(names):
        raise ValueError(f"a frame holds one or more tensors with distinct names, got {names}")
    if round < 0 or base_version < 0:
        raise ValueError(f"round and base_version must be >= 0, got {round}, {base_version}")
    payload = b"".join(enc.payload for _, enc in tensors)
    used = {enc.codec for _, enc in tensors}
    header: dict[str, Any] = {
        "version": VERSION,
        "job_id": job_id,
        "sender": identity.peer_id,
        "round": round,
        "base_version": base_version,
        "codec": used.pop() if len(used) == 1 else "mixed",
        "created_at": float(time.time() if now is None else now),
        "tensors": [
            {
                "name": name,
                "shape": list(enc.shape),
                "codec": enc.codec,
                "meta": dict(enc.meta),
                "nbytes": len(enc.payload),
            }
            for name, enc in tensors
        ],
        "payload_bytes": len(payload),
        "payload_sha256": hashlib.sha256(payload).hexdigest(),
    }
    if cadence is not None:
        header["cadence"] = {"period_s": float(cadence["period_s"]), "every": int(cadence["every"])}
        _cadence(header["cadence"])  # refuse here what a receiver would refuse
    if final:
        header["final"] = True
    if average:
        header["average"] = True
    header["signature"] = identity.sign(_canonical(header)).hex()
    head = _canonical(header)
    if len(head) > MAX_HEADER_BYTES:
        raise ValueError(f"frame header is {len(head)} bytes, the limit is {MAX_HEADER_BYTES}")
    packed = zstandard.ZstdCompressor(level=HEADER_ZSTD_LEVEL).compress(head)
    return PREFIX.pack(MAGIC, VERSION, len(packed)) + packed + payload


class ReplayGuard:
    """Frames accepted recently, by (job, sender, round, base_version) and by signature.

    Holds at most ``max_entries``; when full the oldest goes early, and since a replay of it could
    then pass, every frame of its sender created no later than it is refused too. Per sender:
    with one floor for all (before 2026-12-06), a member that sent ``max_entries`` frames dated
    a minute ahead had every honest frame of the next minute refused as a replay. A sender's
    floor is forgotten once it is older than ``max_age_s`` (the decoders' limit: a frame created
    before it is refused as stale anyway), so floors do not pile up."""

    def __init__(self, *, max_entries: int = 10_000, max_age_s: float = MAX_AGE_S) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        # key -> (signature, created_at); insertion order is acceptance order.
        self._frames: OrderedDict[tuple[str, str, int, int], tuple[str, float]] = OrderedDict()
        self._signatures: set[str] = set()
        self._floor: dict[str, float] = {}  # sender -> created_at of its newest forgotten early
        # Decoders may finish in worker threads; check-and-record must be atomic.
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._frames)

    def record(
        self,
        *,
        job_id: str,
        sender: str,
        round: int,
        base_version: int,
        signature: str,
        created_at: float,
        now: float | None = None,
    ) -> None:
        """Remember a frame; ``WireError("replayed")`` if it, or its key, may have been seen."""
        key = (job_id, sender, round, base_version)
        with self._lock:
            if key in self._frames or signature in self._signatures:
                raise WireError(
                    "replayed",
                    f"a frame from {sender} for round {round}, base version {base_version} "
                    "was already received; expected each (round, base version) once",
                )
            floor = self._floor.get(sender, -math.inf)
            if created_at <= floor:
                raise WireError(
                    "replayed",
                    f"cannot rule out a replay of a frame of {sender} created at "
                    f"{created_at:.6f} (too many recent frames); expected one created after "
                    f"{floor:.6f}",
                )
            self._frames[key] = (signature, created_at)
            self._signatures.add(signature)
            if len(self._frames) > self.max_entries:
                (_, old_sender, _, _), (old_sig, old_at) = self._frames.popitem(last=False)
                self._signatures.discard(old_sig)
                self._floor[old_sender] = max(self._floor.get(old_sender, -math.inf), old_at)
                if len(self._floor) > self.max_entries:
                    horizon = (time.time() if now is None else now) - self.max_age_s
                    self._floor = {p: t for p, t in self._floor.items() if t >= horizon}


class _Entry(NamedTuple):
    name: str
    shape: tuple[int, ...]
    codec: str
    meta: dict[str, int | float | str]
    nbytes: int


@dataclass(frozen=True)
class _Header:
    job_id: str
    sender: str
    round: int
    base_version: int
    codec: str
    created_at: float
    tensors: list[_Entry]
    payload_bytes: int
    payload_sha256: str
    signature: str
    cadence: Cadence | None
    final: bool
    average: bool


class FrameDecoder:
    """Feed chunks as they arrive; memory stays bounded by max_bytes; nothing is decoded into
    tensors until everything is checked.

    ``public_key_of`` maps a peer id to its Ed25519 public key (hex), None if unknown.
    ``expected_shapes`` names every tensor a frame must hold, and its shape. ``sender``: the
    peer that signed the request carrying the frame, whose own it must be, refused before
    ``seen`` records it (a member forwarding another's frame, checked after, had the replay
    guard refuse the sender's own upload of it as a replay). A refusal is final: later calls
    raise the same ``WireError``."""

    def __init__(
        self,
        *,
        job_id: str,
        public_key_of: Callable[[str], str | None],
        expected_shapes: Mapping[str, tuple[int, ...]],
        max_bytes: int,
        max_age_s: float = MAX_AGE_S,
        seen: ReplayGuard | None = None,
        sender: str | None = None,
    ) -> None:
        self.job_id = job_id
        self.sender = sender
        self.public_key_of = public_key_of
        self.expected_shapes = {name: tuple(shape) for name, shape in expected_shapes.items()}
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.seen = seen
        self._received = 0
        self._head = bytearray()  # prefix and header, until the header is parsed
        self._header_len: int | None = None
        self._version = VERSION
        self._header: _Header | None = None
        self._payload = bytearray()
        self._sha = hashlib.sha256()
        self._error: WireError | None = None
        self._done = False

    @property
    def received(self) -> int:
        """Bytes fed so far."""
        return self._received

    def feed(self, chunk: bytes) -> None:
        """Take the next bytes; ``WireError`` as soon as they show the frame must be refused."""
        if self._done:
            raise RuntimeError("the frame is finished; use a new FrameDecoder")
        if self._error is not None:
            raise self._error
        try:
            self._feed(chunk)
        except WireError as e:
            self._error = e
            self._head = self._payload = bytearray()  # drop what was buffered
            raise

    def finish(self) -> DeltaFrame:
        """The frame, once all of it is in and verified; ``WireError`` otherwise."""
        if self._done:
            raise RuntimeError("the frame is finished; use a new FrameDecoder")
        if self._error is not None:
            raise self._error
        try:
            frame = self._finish()
        except WireError as e:
            self._error = e
            self._head = self._payload = bytearray()
            raise
        self._done = True
        self._payload = bytearray()
        return frame

    def _feed(self, chunk: bytes) -> None:
        self._received += len(chunk)
        if self._received > self.max_bytes:
            raise WireError(
                "oversize", f"frame exceeds {self.max_bytes} bytes (got {self._received} so far)"
            )
        data = memoryview(chunk)
        # Buffer only the prefix and the header here; the payload goes straight to its buffer.
        while self._header is None:
            if self._header_len is None:
                need = PREFIX.size - len(self._head)
                self._head += data[:need]
                data = data[need:]
                self._check_prefix()  # sets _header_len once the 9 bytes are in
                if self._header_len is None:
                    return
            else:
                end = PREFIX.size + self._header_len
                need = end - len(self._head)
                self._head += data[:need]
                data = data[need:]
                if len(self._head) < end:
                    return
                wire = bytes(self._head[PREFIX.size :])
                raw = _unpack_header(wire) if self._version >= 3 else wire
                self._header = self._check_header(raw, wire_len=len(wire))
                self._head = bytearray()
        self._add_payload(data)

    def _check_prefix(self) -> None:
        got = bytes(self._head[: len(MAGIC)])
        if not MAGIC.startswith(got):
            raise WireError("malformed", f"frame must start with {MAGIC!r}, got {got!r}")
        if len(self._head) < PREFIX.size:
            return
        _, version, header_len = PREFIX.unpack_from(self._head)
        if version not in READS:
            raise WireError(
                "unsupported_version",
                f"frame version {version}, this peer reads {', '.join(map(str, sorted(READS)))}",
            )
        self._version = version
        if header_len > MAX_HEADER_BYTES or PREFIX.size + header_len > self.max_bytes:
            raise WireError(
                "oversize",
                f"header of {header_len} bytes; limits: {MAX_HEADER_BYTES} for the header, "
                f"{self.max_bytes} for the frame",
            )
        self._header_len = header_len

    def _check_header(self, raw: bytes, *, wire_len: int) -> _Header:
        obj = _parse_json(raw)
        header = _validate(obj)
        if obj["version"] != self._version:
            raise WireError(
                "malformed", f"header version {obj['version']}, the frame's is {self._version}"
            )
        if _canonical(obj) != raw:
            raise WireError("malformed", "header is not in canonical form")
        if header.job_id != self.job_id:
            raise WireError(
                "wrong_job", f"frame is for job {header.job_id!r}, expected {self.job_id!r}"
            )
        if self.sender is not None and header.sender != self.sender:
            raise WireError("bad_signature", f"frame of {header.sender} sent by {self.sender}")
        public_key = self.public_key_of(header.sender)
        if public_key is None:
            raise WireError("unknown_sender", f"sender {header.sender} is not a known peer")
        del obj["signature"]
        if not verify_signature(public_key, _canonical(obj), bytes.fromhex(header.signature)):
            raise WireError(
                "bad_signature", f"header signature is not {header.sender}'s (key {public_key})"
            )
        total = PREFIX.size + wire_len + header.payload_bytes
        if total > self.max_bytes:
            raise WireError("oversize", f"frame of {total} bytes, the limit is {self.max_bytes}")
        got = {entry.name: entry.shape for entry in header.tensors}
        unknown = sorted(got.keys() - self.expected_shapes.keys())
        missing = sorted(self.expected_shapes.keys() - got.keys())
        if unknown or missing:
            raise WireError(
                "wrong_shape", f"frame tensors do not match: unknown {unknown}, missing {missing}"
            )
        for name, shape in got.items():
            if shape != self.expected_shapes[name]:
                raise WireError(
                    "wrong_shape",
                    f"tensor {name!r} has shape {shape}, expected {self.expected_shapes[name]}",
                )
        return header

    def _add_payload(self, data: memoryview) -> None:
        assert self._header is not None
        if len(self._payload) + len(data) > self._header.payload_bytes:
            raise WireError(
                "malformed",
                f"payload goes beyond the declared {self._header.payload_bytes} bytes",
            )
        self._payload += data
        self._sha.update(data)

    def _finish(self) -> DeltaFrame:
        header = self._header
        if header is None or len(self._payload) < header.payload_bytes:
            expected = "the header" if header is None else f"{header.payload_bytes} payload bytes"
            raise WireError(
                "truncated", f"frame ended after {self._received} bytes, before {expected}"
            )
        digest = self._sha.hexdigest()
        if digest != header.payload_sha256:
            raise WireError(
                "bad_hash", f"payload sha256 is {digest}, the header says {header.payload_sha256}"
            )
        now = time.time()
        if header.created_at < now - self.max_age_s:
            raise WireError(
                "stale",
                f"frame created {now - header.created_at:.0f} s ago; the limit is "
                f"{self.max_age_s:.0f} s",
            )
        if header.created_at > now + MAX_FUTURE_S:
            raise WireError(
                "stale",
                f"frame created {header.created_at - now:.0f} s in the future; clocks may differ "
                f"by at most {MAX_FUTURE_S:.0f} s",
            )
        if self.seen is not None:
            self.seen.record(
                job_id=header.job_id,
                sender=header.sender,
                round=header.round,
                base_version=header.base_version,
                signature=header.signature,
                created_at=header.created_at,
            )
        view = memoryview(self._payload)
        tensors: dict[str, Encoded] = {}
        offset = 0
        for entry in header.tensors:
            payload = bytes(view[offset : offset + entry.nbytes])
            tensors[entry.name] = Encoded(entry.codec, entry.shape, entry.meta, payload)
            offset += entry.nbytes
        view.release()
        return DeltaFrame(
            job_id=header.job_id,
            sender=header.sender,
            round=header.round,
            base_version=header.base_version,
            codec=header.codec,
            created_at=header.created_at,
            tensors=tensors,
            wire_bytes=self._received,
            cadence=header.cadence,
            final=header.final,
            average=header.average,
        )


def decode_tensors(
    frame: DeltaFrame, expected_shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, Tensor]:
    """The frame's tensors, decoded (float32, CPU).

    ``WireError``: "wrong_shape" if names or shapes differ from ``expected_shapes``, "malformed"
    if a payload does not fit its shape and meta, "non_finite" if any value is NaN/Inf."""
    expected = {name: tuple(shape) for name, shape in expected_shapes.items()}
    if frame.tensors.keys() != expected.keys():
        raise WireError(
            "wrong_shape",
            f"frame tensors {sorted(frame.tensors)} do not match the expected {sorted(expected)}",
        )
    out: dict[str, Tensor] = {}
    for name, enc in frame.tensors.items():
        if enc.shape != expected[name]:
            raise WireError(
                "wrong_shape", f"tensor {name!r} has shape {enc.shape}, expected {expected[name]}"
            )
        try:
            out[name] = codecs.decode(enc)
        except WireError as e:
            detail = str(e).removeprefix(f"{e.reason}: ")
            raise WireError(e.reason, f"tensor {name!r}: {detail}") from None
    return out


def _unpack_header(packed: bytes) -> bytes:
    """A version-3 header: one zstd frame that declares its size, at most MAX_HEADER_BYTES,
    checked before a byte is decompressed (a small frame cannot expand into a large one)."""
    try:
        declared = zstandard.frame_content_size(packed)
    except zstandard.ZstdError as e:
        raise WireError("malformed", f"header is not a zstd frame: {e}") from None
    if declared < 0:
        raise WireError("malformed", "header's zstd frame does not declare its size")
    if declared > MAX_HEADER_BYTES:
        raise WireError(
            "oversize", f"header of {declared} bytes decompressed, the limit is {MAX_HEADER_BYTES}"
        )
    try:
        reader = zstandard.ZstdDecompressor().decompressobj()
        raw = reader.decompress(packed)
    except zstandard.ZstdError as e:
        raise WireError("malformed", f"bad zstd header: {e}") from None
    if len(raw) != declared or not reader.eof or reader.unused_data:
        raise WireError(
            "malformed", f"header must be one zstd frame of {declared} bytes, nothing after it"
        )
    return bytes(raw)


def _canonical(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise ValueError("duplicate key")
    return obj


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses as inf
        raise ValueError(f"{text} is out of range")
    return value


def _parse_json(raw: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(
            raw.decode("utf-8"),
            object_pairs_hook=_no_duplicates,
            parse_constant=_no_constant,
            parse_float=_finite_float,
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        # ValueError: bad JSON, a duplicate key, NaN/Infinity, an int of too many digits.
        raise WireError("malformed", f"header is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise WireError("malformed", f"header must be a JSON object, got {type(obj).__name__}")
    return obj


def _validate(obj: dict[str, Any]) -> _Header:
    """Check every header field's type and range; ``WireError("malformed")`` otherwise."""
    if not _HEADER_KEYS <= obj.keys() <= _HEADER_KEYS | _OPTIONAL_KEYS:
        raise WireError(
            "malformed",
            f"header fields differ: unknown {sorted(obj.keys() - _HEADER_KEYS - _OPTIONAL_KEYS)}"
            f", missing {sorted(_HEADER_KEYS - obj.keys())}",
        )
    if obj["version"] not in READS or type(obj["version"]) is not int:
        raise WireError(
            "malformed", f"header version {obj['version']!r}, expected one of {sorted(READS)}"
        )
    for key in ("job_id", "sender", "codec"):
        _expect(isinstance(obj[key], str), key, "a string", obj[key])
    for key in ("round", "base_version", "payload_bytes"):
        _expect(_is_count(obj[key]), key, f"an int in [0, {MAX_COUNT}]", obj[key])
    created_at = obj["created_at"]
    # An int is fine too, but not one too large for a float (math.isfinite would raise).
    _expect(
        (type(created_at) is float and math.isfinite(created_at))
        or (type(created_at) is int and abs(created_at) < 2**53),
        "created_at",
        "a finite number",
        created_at,
    )
    for key, n_hex in (("payload_sha256", 64), ("signature", 128)):
        _expect(_is_hex(obj[key], n_hex), key, f"{n_hex} lowercase hex digits", obj[key])
    entries = obj["tensors"]
    _expect(isinstance(entries, list), "tensors", "a list", entries)
    tensors = [_tensor_entry(entry) for entry in entries]
    names = [entry.name for entry in tensors]
    if len(set(names)) != len(names):
        raise WireError("malformed", f"tensor names repeat: {names}")
    total = sum(entry.nbytes for entry in tensors)
    if total != obj["payload_bytes"]:
        raise WireError(
            "malformed", f"tensors hold {total} bytes, payload_bytes says {obj['payload_bytes']}"
        )
    return _Header(
        job_id=obj["job_id"],
        sender=obj["sender"],
        round=obj["round"],
        base_version=obj["base_version"],
        codec=obj["codec"],
        created_at=float(created_at),
        tensors=tensors,
        payload_bytes=obj["payload_bytes"],
        payload_sha256=obj["payload_sha256"],
        signature=obj["signature"],
        cadence=_cadence(obj["cadence"]) if "cadence" in obj else None,
        final=_flag("final", obj.get("final", False)),
        average=_flag("average", obj.get("average", False)),
    )


def _flag(key: str, value: Any) -> bool:
    _expect(value is True or value is False, key, "true or false", value)
    return bool(value)


def _cadence(value: Any) -> Cadence:
    _expect(
        isinstance(value, dict) and value.keys() == _CADENCE_KEYS,
        "cadence",
        f"an object of exactly {sorted(_CADENCE_KEYS)}",
        value,
    )
    period, every = value["period_s"], value["every"]
    _expect(
        type(period) in (int, float) and math.isfinite(period) and 0 <= period <= MAX_PERIOD_S,
        "cadence period_s",
        f"a number in [0, {MAX_PERIOD_S:.0f}]",
        period,
    )
    _expect(
        type(every) is int and 1 <= every <= MAX_EVERY,
        "cadence every",
        f"an int in [1, {MAX_EVERY}]",
        every,
    )
    return Cadence(float(period), every)


def _tensor_entry(entry: Any) -> _Entry:
    if not isinstance(entry, dict) or entry.keys() != _TENSOR_KEYS:
        raise WireError(
            "malformed", f"a tensor entry must hold exactly {sorted(_TENSOR_KEYS)}, got {entry!r}"
        )
    name, shape, codec, meta, nbytes = (
        entry[k] for k in ("name", "shape", "codec", "meta", "nbytes")
    )
    _expect(isinstance(name, str) and name != "", "tensor name", "a non-empty string", name)
    _expect(
        isinstance(shape, list) and all(_is_count(d) for d in shape),
        f"shape of {name!r}",
        "a list of ints >= 0",
        shape,
    )
    _expect(codec in codecs.CODEC_NAMES, f"codec of {name!r}", str(codecs.CODEC_NAMES), codec)
    _expect(
        isinstance(meta, dict) and all(type(v) in (int, float, str) for v in meta.values()),
        f"meta of {name!r}",
        "an object of numbers and strings",
        meta,
    )
    _expect(_is_count(nbytes), f"nbytes of {name!r}", "an int >= 0", nbytes)
    return _Entry(name, tuple(shape), codec, meta, nbytes)


def _expect(ok: bool, what: str, expected: str, got: Any) -> None:
    if not ok:
        shown = repr(got)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise WireError("malformed", f"header {what} must be {expected}, got {shown}")


MAX_COUNT = 2**62 - 1  # rounds, versions, sizes: SQLite's 64-bit integers always hold them


def _is_count(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_COUNT


def _is_hex(value: Any, length: int) -> bool:
    return (
        isinstance(value, str)
        and len(value) == length
        and all(c in "0123456789abcdef" for c in value)
    )


def check_codec(frame: DeltaFrame, codec: str) -> None:
    """Every tensor of ``frame`` must be in the job's ``codec``: a member may not send, say,
    dense fp32 values in a top-k job (it would carry what the job's codec cannot).
    ``WireError("wrong_codec")`` otherwise."""
    bad = [(name, enc.codec) for name, enc in frame.tensors.items() if enc.codec != codec]
    if bad:
        shown = ", ".join(f"{n}: {c}" for n, c in bad[:3])
        raise WireError(
            "wrong_codec",
            f"this job's deltas are {codec}; {len(bad)} tensor(s) of the frame are not ({shown})",
        )
