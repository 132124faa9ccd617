"""Reading a received delta frame (``wire``): incrementally, refusing it as early as it can.

:class:`FrameDecoder` takes the bytes as they arrive and refuses a frame on bad magic or
version, oversize, a header that is malformed, for another job, from an unknown sender, wrongly
signed or for tensors other than expected. Nothing is decoded into a tensor before the payload
hash is checked; :func:`decode_tensors` then refuses NaN/Inf, and :func:`check_codec` a tensor
in another codec than the job's.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping

from torch import Tensor

from atomd.errors import WireError
from atomd.p2p.identity import verify_signature
from atomd.sync import codecs
from atomd.sync.codecs import Encoded
from atomd.sync.frame_header import (
    MAX_HEADER_BYTES,
    READS,
    VERSION,
    Header,
    canonical,
    parse_json,
    unpack_header,
    validate_header,
)
from atomd.sync.replay import ReplayGuard
from atomd.sync.wire import MAGIC, MAX_AGE_S, MAX_FUTURE_S, PREFIX, DeltaFrame


class FrameDecoder:
    """Feed chunks as they arrive; memory stays bounded by max_bytes; nothing is decoded into
    tensors until everything is checked.

    ``public_key_of`` maps a peer id to its Ed25519 public key (hex), None if unknown.
    ``expected_shapes`` names every tensor a frame must hold, and its shape. ``sender``: the
    peer that signed the request carrying the frame, whose own it must be, refused before
    ``seen`` records it (were it checked after, a member forwarding another's frame would have
    the replay guard refuse the sender's own upload of it as a replay). A refusal is final:
    later calls raise the same ``WireError``."""

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
        self._header: Header | None = None
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
                raw = unpack_header(wire) if self._version >= 3 else wire
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

    def _check_header(self, raw: bytes, *, wire_len: int) -> Header:
        obj = parse_json(raw)
        header = validate_header(obj)
        if obj["version"] != self._version:
            raise WireError(
                "malformed", f"header version {obj['version']}, the frame's is {self._version}"
            )
        if canonical(obj) != raw:
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
        if not verify_signature(public_key, canonical(obj), bytes.fromhex(header.signature)):
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
