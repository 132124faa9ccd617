"""The delta frame: versioned, length-prefixed, signed; what a sender writes.

Layout (integers little-endian)::

    b"ATD1" | u8 version | u32 header length | header | payload

The header (``frame_header``) names the job, the sender, its round and base version and every
tensor. The payload is the tensors' payloads concatenated in header order. The sender signs the
canonical header without its ``signature`` field with its Ed25519 key; the signed part holds
``payload_sha256``, so the signature covers the payload.

A receiver reads a frame with ``frame_decoder.FrameDecoder``, which refuses it as early as it
can, and ``frame_decoder.decode_tensors``; ``replay.ReplayGuard`` refuses a frame seen before.
Staleness in rounds (versus the receiver's round) is the caller's decision; staleness in time is
checked by the decoder (MAX_AGE_S, MAX_FUTURE_S).
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import zstandard

from atomd.p2p.identity import Identity
from atomd.sync.codecs import Encoded
from atomd.sync.frame_header import (
    HEADER_ZSTD_LEVEL,
    MAX_HEADER_BYTES,
    VERSION,
    Cadence,
    canonical,
    check_cadence,
)

MAGIC = b"ATD1"
PREFIX = struct.Struct("<4sBI")  # magic, version, header length: 9 bytes
MAX_FUTURE_S = 60.0  # clock skew allowed for created_at
MAX_AGE_S = 600.0  # a frame created longer ago is refused as stale


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
        check_cadence(header["cadence"])  # refuse here what a receiver would refuse
    if final:
        header["final"] = True
    if average:
        header["average"] = True
    header["signature"] = identity.sign(canonical(header)).hex()
    head = canonical(header)
    if len(head) > MAX_HEADER_BYTES:
        raise ValueError(f"frame header is {len(head)} bytes, the limit is {MAX_HEADER_BYTES}")
    packed = zstandard.ZstdCompressor(level=HEADER_ZSTD_LEVEL).compress(head)
    return PREFIX.pack(MAGIC, VERSION, len(packed)) + packed + payload
