"""The delta frame's header: its fields, their canonical JSON form, and the checks a received
header passes before anything else of the frame is looked at.

The header names the job, the sender, its round and base version (the anchor version the delta
is relative to), and every tensor (name, shape, codec, meta, nbytes); it may also carry the
sender's cadence (``{"period_s": its proposed round period, "every": steps in this round}``, see
``cadence.py``) and ``"final": true`` on the last delta it sends for the job; ``"average": true``
marks a frame that is not a delta at all but the sender's share of the job's final average
(``SyncPlugin.finish``: its model beyond its settled anchor, sent once after its last round;
never merged into a round). It travels in canonical form (sorted keys, no spaces, ASCII); from
version 3 on as one zstd frame of that JSON (at most MAX_HEADER_BYTES once decompressed, its size
declared in the zstd frame and checked before anything is decompressed): a header names every
tensor, ~6 KiB of repetitive JSON for the tiny model's 52 tensors, about half of a top-k frame
at 0.25% of the entries, ~0.7 KiB compressed. Version 2 (the header as plain JSON) is still read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import zstandard

from atomd.errors import WireError
from atomd.sync import codecs

VERSION = 3  # 2: the optional "cadence" and "final" header fields; 3: the header zstd-compressed
READS = frozenset({2, 3})  # frame versions this peer reads (the header's "version" is the same)
MAX_HEADER_BYTES = 1 << 20  # the header as JSON (decompressed)
HEADER_ZSTD_LEVEL = 3
MAX_COUNT = 2**62 - 1  # rounds, versions, sizes: SQLite's 64-bit integers always hold them

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


class Cadence(NamedTuple):
    """A sender's cadence: its proposed round period (s) and the steps of this round."""

    period_s: float
    every: int


class TensorEntry(NamedTuple):
    """One tensor as the header describes it; its payload is ``nbytes`` of the frame's."""

    name: str
    shape: tuple[int, ...]
    codec: str
    meta: dict[str, int | float | str]
    nbytes: int


@dataclass(frozen=True)
class Header:
    """A header whose every field has the right type and range (``validate_header``)."""

    job_id: str
    sender: str
    round: int
    base_version: int
    codec: str
    created_at: float
    tensors: list[TensorEntry]
    payload_bytes: int
    payload_sha256: str
    signature: str
    cadence: Cadence | None
    final: bool
    average: bool


def unpack_header(packed: bytes) -> bytes:
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


def canonical(obj: Mapping[str, Any]) -> bytes:
    """The header's canonical JSON: sorted keys, no spaces, ASCII, no NaN."""
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


def parse_json(raw: bytes) -> dict[str, Any]:
    """A header's JSON object: no duplicate keys, no NaN/Infinity, only finite floats."""
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


def validate_header(obj: dict[str, Any]) -> Header:
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
    return Header(
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
        cadence=check_cadence(obj["cadence"]) if "cadence" in obj else None,
        final=_flag("final", obj.get("final", False)),
        average=_flag("average", obj.get("average", False)),
    )


def _flag(key: str, value: Any) -> bool:
    _expect(value is True or value is False, key, "true or false", value)
    return bool(value)


def check_cadence(value: Any) -> Cadence:
    """A header's ``cadence`` object, checked; ``WireError("malformed")`` otherwise."""
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


def _tensor_entry(entry: Any) -> TensorEntry:
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
    return TensorEntry(name, tuple(shape), codec, meta, nbytes)


def _expect(ok: bool, what: str, expected: str, got: Any) -> None:
    if not ok:
        shown = repr(got)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise WireError("malformed", f"header {what} must be {expected}, got {shown}")


def _is_count(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_COUNT


def _is_hex(value: Any, length: int) -> bool:
    return (
        isinstance(value, str)
        and len(value) == length
        and all(c in "0123456789abcdef" for c in value)
    )
