"""The peer plane's messages: one pydantic model per message, used by client and server.

Every field from the network is typed and bounded before anything uses it: counters
(incarnations, steps, rounds) below 2^62 (so SQLite's 64-bit integers always hold them), ids
and keys as fixed-length lowercase hex, URLs as short http(s) URLs without credentials, lists
with a maximum length, no unknown fields. A message that does not fit is refused whole with the
field and the reason (``MessageError``, answered 422).
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal, TypeVar
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
)

from atomd.db.schemas import ProgressPoint
from atomd.errors import MessageError, PeerRequestError
from atomd.p2p.identity import Identity, peer_id_from_public_key, verify_signature
from atomd.spec import JobSpec

MAX_COUNTER = 2**62 - 1
"""Largest incarnation, step or round accepted from the network (SQLite integers are 64-bit)."""
MAX_UPDATES = 64  # gossip updates piggybacked on one message
MAX_MEMBERS = 1024  # members in a join reply
MAX_URL = 256
MAX_FILE_BYTES = 1 << 46  # one checkpoint file (64 TiB): sizes are checked against the model too

Counter = Annotated[int, Field(ge=0, le=MAX_COUNTER, strict=True)]
PeerId = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$", strict=True)]
PublicKeyHex = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$", strict=True)]
SignatureHex = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{128}$", strict=True)]
Sha256Hex = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$", strict=True)]
JobId = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$", strict=True)]
SwarmName = Annotated[
    str, StringConstraints(pattern=r"^[\x21-\x7e]([\x20-\x7e]{0,198}[\x21-\x7e])?$", strict=True)
]
ShortText = Annotated[str, StringConstraints(max_length=64, strict=True)]
MemberState = Literal["alive", "suspect", "dead", "left"]


def check_url(url: str) -> str:
    """An http(s) URL a peer can be reached at: scheme, host, optional port and path; no
    credentials, query or fragment; printable ASCII, at most ``MAX_URL`` characters. Returned
    without a trailing slash."""
    if len(url) > MAX_URL or not url.isascii() or not url.isprintable() or " " in url:
        raise ValueError(f"expected a printable ASCII URL of at most {MAX_URL} characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"not a URL: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("expected http:// or https:// and a host")
    if parts.username is not None or parts.password is not None:
        raise ValueError("a peer URL holds no credentials")
    if parts.query or parts.fragment:
        raise ValueError("a peer URL has no query or fragment")
    if port == 0:
        raise ValueError("port 0")
    return url.rstrip("/")


PeerUrl = Annotated[str, StringConstraints(strict=True), AfterValidator(check_url)]


class Message(BaseModel):
    """Base of every peer-plane message: immutable, strict, no unknown fields."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    # The largest answer of this type a peer client reads (``PeerClient``): refused unread
    # beyond. pydantic parses with the GIL held, so a peer answering 16 MiB (one bound for
    # every answer) would stall this daemon's event loop ~1 s an answer, off the loop or
    # not. The largest honest one is a join reply of 1,024 members (~0.4 MiB).
    MAX_ANSWER_BYTES: ClassVar[int] = 1 << 20

    def to_bytes(self) -> bytes:
        """Compact JSON, field aliases as on the wire."""
        return self.model_dump_json(by_alias=True).encode()


M = TypeVar("M", bound=Message)


def parse(model: type[M], data: bytes | str | Any) -> M:
    """``data`` (JSON bytes or text, or already decoded) as a ``model``; ``MessageError``
    otherwise, naming at most three offending fields."""
    try:
        if isinstance(data, bytes | str):
            return model.model_validate_json(data)
        return model.model_validate(data)
    except ValidationError as e:
        raise MessageError(f"malformed {model.__name__}: {_errors(e)}") from None


def parse_answer(model: type[M], data: bytes, url: str, path: str) -> M:
    """A peer's answer as ``model``; ``PeerRequestError`` when it does not fit."""
    try:
        return parse(model, data)
    except MessageError as e:
        raise PeerRequestError(f"peer {url}: {path} answered a {e}") from None


def _errors(e: ValidationError) -> str:
    parts = []
    for err in e.errors()[:3]:
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{loc}: {err['msg']}")
    more = e.error_count() - len(parts)
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


# -- membership ---------------------------------------------------------------------------------


class MemberRecord(Message):
    """What a member is, as of an incarnation: one piece of gossip.

    An ``alive`` or ``left`` record is the member's own word: ``signature`` is its Ed25519
    signature of ``record_payload`` (swarm, id, url, key, state, incarnation), checked on
    receipt (``record_problem``), so nobody else can say that it left, nor give it another URL.
    ``suspect`` and ``dead`` records are others' opinions, unsigned: a receiver takes them only
    as a reason to probe the member itself."""

    id: PeerId
    url: PeerUrl
    public_key: PublicKeyHex
    state: MemberState
    incarnation: Counter
    signature: SignatureHex | None = None


RECORD_VERSION = "atomd-member-v1"


def record_payload(r: MemberRecord, swarm: str) -> bytes:
    """What a member signs of its own record (no field can hold a line break)."""
    fields = (RECORD_VERSION, swarm, r.id, r.url, r.public_key, r.state, str(r.incarnation))
    return "\n".join(fields).encode()


def sign_record(r: MemberRecord, identity: Identity, swarm: str) -> MemberRecord:
    """``r`` signed by ``identity`` (which must be the member's own)."""
    if identity.peer_id != r.id or identity.public_key_hex != r.public_key:
        raise ValueError(f"peer {identity.peer_id} cannot sign the record of {r.id}")
    unsigned = r.model_copy(update={"signature": None})
    sig = identity.sign(record_payload(unsigned, swarm)).hex()
    return r.model_copy(update={"signature": sig})


def record_problem(r: MemberRecord, swarm: str) -> str | None:
    """Why ``r`` cannot be believed, or None: its id must be its key's, and an ``alive`` or
    ``left`` record must be signed by that key."""
    if peer_id_from_public_key(r.public_key) != r.id:
        return f"peer id {r.id} is not that of key {r.public_key}"
    if r.state in ("alive", "left"):
        if r.signature is None:
            return f"an unsigned {r.state} record of {r.id}: only the member itself says so"
        payload = record_payload(r.model_copy(update={"signature": None}), swarm)
        if not verify_signature(r.public_key, payload, bytes.fromhex(r.signature)):
            return f"the {r.state} record of {r.id} is not signed by its key"
    return None


class JobAdvert(Message):
    """The swarm job a member trains, carried on its messages so that free peers join it.

    Signed by the job's ``origin`` (the daemon that started it) over the job id and the spec
    every peer trains alike (``advert_payload``); every member that trains the job carries that
    signature on, so a joiner believes the origin and the spec it records, whoever told it.
    ``run``: how many times the origin resumed the job by request (signed with it), so that a
    stop of an earlier run (``StopNotice.run``) ends no copy of a later one.
    """

    id: JobId
    spec: JobSpec
    origin: PeerId | None = None
    origin_key: PublicKeyHex | None = None
    signature: SignatureHex | None = None
    run: Counter = Field(0, exclude_if=lambda r: r == 0)  # 0: not on the wire, as before runs


ADVERT_VERSION = "atomd-job-v1"
JOB_NONCE_HEX = 12  # a job id's random head; the other 20 hex digits name its origin


def job_id_for(origin: str, nonce: str | None = None) -> str:
    """A job id of ``origin``'s: a random head (``nonce``), then 80 bits of sha256 over the
    origin and that head. The id names who started the job: no other key can claim it
    (``advert_forgery``), short of 2^80 tries."""
    head = secrets.token_hex(JOB_NONCE_HEX // 2) if nonce is None else nonce
    tail = hashlib.sha256(f"{ADVERT_VERSION}\n{origin}\n{head}".encode()).hexdigest()
    return head + tail[: 32 - JOB_NONCE_HEX]


def shared_spec(spec: JobSpec) -> JobSpec:
    """What every peer of a swarm job trains alike: the spec without this peer's data shard."""
    return spec.model_copy(update={"shard_index": 0})


def _with_run(fields: tuple[str, ...], run: int) -> bytes:
    """``fields`` to sign, and the run after them from the first resume on: the first run's
    payload is the one daemons signed before runs were (they still verify it)."""
    return "\n".join(fields + ((str(run),) if run else ())).encode()


def advert_payload(a: JobAdvert, swarm: str) -> bytes:
    """What a job's origin signs of its advert (its signature aside): the swarm, the job id,
    the origin and its key, the digest of the shared spec (canonical JSON), and the run."""
    spec = json.dumps(shared_spec(a.spec).model_dump(mode="json"), sort_keys=True,
                      separators=(",", ":"))  # fmt: skip
    digest = hashlib.sha256(spec.encode()).hexdigest()
    fields = (ADVERT_VERSION, swarm, a.id, a.origin or "", a.origin_key or "", digest)
    return _with_run(fields, a.run)


def sign_advert(a: JobAdvert, identity: Identity, swarm: str) -> JobAdvert:
    """``a`` signed by ``identity``, which becomes its origin."""
    unsigned = a.model_copy(
        update={"origin": identity.peer_id, "origin_key": identity.public_key_hex,
                "signature": None}
    )  # fmt: skip
    sig = identity.sign(advert_payload(unsigned, swarm)).hex()
    return unsigned.model_copy(update={"signature": sig})


def advert_forgery(a: JobAdvert, swarm: str) -> str | None:
    """Why ``a`` is not its origin's own advert, or None: it names its origin and the origin's
    key, the job id is one the origin made (``job_id_for``), and the origin signed the id and
    the shared spec. A member could otherwise record itself as the origin of another's job (and
    stop every joiner's copy), or change the spec it passes on."""
    if a.origin is None or a.origin_key is None or a.signature is None:
        return f"the advert of job {a.id} is not signed by its origin"
    if peer_id_from_public_key(a.origin_key) != a.origin:
        return f"the advert of job {a.id}: peer id {a.origin} is not that of key {a.origin_key}"
    if a.id != job_id_for(a.origin, a.id[:JOB_NONCE_HEX]):
        return f"job id {a.id} is not one its named origin {a.origin} made"
    if not verify_signature(a.origin_key, advert_payload(a, swarm), bytes.fromhex(a.signature)):
        return f"the advert of job {a.id} is not signed by its origin {a.origin}"
    return None


class Gossip(Message):
    """Every SWIM message: its sender's own record, piggybacked updates, the sender's job."""

    sender: MemberRecord = Field(alias="from")
    updates: list[MemberRecord] = Field(default_factory=list, max_length=MAX_UPDATES)
    job: JobAdvert | None = None


class PingReq(Gossip):
    """Asks the receiver to ping ``target`` for the sender."""

    target: PeerId


class PingReqReply(Gossip):
    ok: bool


class JoinReply(Gossip):
    """The answer to a join: every member the receiver knows."""

    members: list[MemberRecord] = Field(default_factory=list, max_length=MAX_MEMBERS)


class Announce(Gossip):
    """A new swarm job, told to every live member at once."""

    job: JobAdvert


STOP_VERSION = "atomd-stop-v1"


class StopNotice(Message):
    """A job's origin's word that it stopped the job on every peer, signed, so that any member
    that heard it can tell a peer that missed it (asleep, cut off, down while it went out)
    when the origin cannot: gone, cut off itself, or stopped for good.

    ``run``: the run of the job it ends (``JobAdvert.run``), and every run before it. After the
    origin resumes the job, a member that kept the stop cannot end the new run's copies with
    it: a peer takes a stop of no earlier run than the one it trains."""

    job_id: JobId
    origin: PeerId
    origin_key: PublicKeyHex
    signature: SignatureHex
    run: Counter = Field(0, exclude_if=lambda r: r == 0)  # 0: not on the wire, as before runs


def stop_payload(job_id: str, origin: str, origin_key: str, swarm: str, run: int) -> bytes:
    """What an origin signs to stop a job: the swarm, the job, itself and its key, the run."""
    return _with_run((STOP_VERSION, swarm, job_id, origin, origin_key), run)


def sign_stop(job_id: str, identity: Identity, swarm: str, run: int = 0) -> StopNotice:
    """The stop of run ``run`` (and those before) of ``job_id`` by ``identity``, its origin."""
    payload = stop_payload(job_id, identity.peer_id, identity.public_key_hex, swarm, run)
    return StopNotice(
        job_id=job_id,
        origin=identity.peer_id,
        origin_key=identity.public_key_hex,
        signature=identity.sign(payload).hex(),
        run=run,
    )


def stop_forgery(n: StopNotice, job_id: str, swarm: str) -> str | None:
    """Why ``n`` is not the origin's own stop of ``job_id``, or None: the job's, its origin's
    key, a job id the origin made (``job_id_for``: no key but the origin's can stop a job),
    and the origin's signature (not one of another swarm's, nor another job's)."""
    if n.job_id != job_id:
        return f"a stop of job {n.job_id} sent to stop job {job_id}"
    if peer_id_from_public_key(n.origin_key) != n.origin:
        return f"the stop of job {job_id}: peer id {n.origin} is not that of key {n.origin_key}"
    if job_id != job_id_for(n.origin, job_id[:JOB_NONCE_HEX]):
        return f"job id {job_id} is not one the stop's origin {n.origin} made"
    payload = stop_payload(job_id, n.origin, n.origin_key, swarm, n.run)
    if not verify_signature(n.origin_key, payload, bytes.fromhex(n.signature)):
        return f"the stop of job {job_id} is not signed by its origin {n.origin}"
    return None


class StopJob(Message):
    """Stop a job swarm-wide: from its origin, or from a member passing on the origin's signed
    ``notice`` (a daemon of before sent none: its stop counts from the origin only)."""

    sender: MemberRecord = Field(alias="from")
    notice: StopNotice | None = None


class Ack(Message):
    """An empty answer."""


class DeltaAccepted(Message):
    """The answer to a delta upload: queued for the next round boundary."""

    accepted: bool
    bytes: Counter


class PeerInfo(Message):
    """``GET /p2p/v1/info``: who answers at this URL (not signed)."""

    swarm: SwarmName
    version: ShortText
    id: PeerId
    url: PeerUrl


# -- state transfer -----------------------------------------------------------------------------


class FileEntry(Message):
    bytes: Annotated[int, Field(ge=0, le=MAX_FILE_BYTES, strict=True)]
    sha256: Sha256Hex


class StateFiles(Message):
    model: FileEntry = Field(alias="model.safetensors")
    state: FileEntry = Field(alias="state.safetensors")
    # A run with a BPE tokenizer keeps its tokenizer.json beside the tensors.
    tokenizer: FileEntry | None = Field(None, alias="tokenizer.json")

    def entries(self) -> dict[str, FileEntry]:
        """File name -> entry, for the files this checkpoint has."""
        named = {"model.safetensors": self.model, "state.safetensors": self.state}
        return named | ({"tokenizer.json": self.tokenizer} if self.tokenizer else {})


class StateManifest(Message):
    """A donor's newest checkpoint: its ``meta.json`` (step, file sizes and sha256, and the
    training metadata the joiner's checkpoint keeps)."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, populate_by_name=True, protected_namespaces=()
    )

    format_version: Literal[1]
    step: Counter
    files: StateFiles
    atomd_version: ShortText | None = None
    arch: dict[str, int | float | str | bool | None] | None = Field(
        None, alias="model_config", max_length=64
    )
    spec: JobSpec | None = None
    data_position: dict[str, int] | None = Field(None, max_length=8)
    tokens: Counter | None = None
    plan: dict[str, Any] | None = Field(None, max_length=64)
    # The job spec's tokenizer name (Trainer.save writes it into every checkpoint's meta.json).
    tokenizer: Annotated[str, StringConstraints(max_length=4096, strict=True)] | None = None
    signer: PeerId | None = None
    """The donor that signed the step and the files' sizes and sha256 (``sign_manifest``)."""
    signature: SignatureHex | None = None


MANIFEST_VERSION = "atomd-manifest-v1"


def manifest_payload(m: StateManifest, swarm: str, job_id: str, signer: str) -> bytes:
    """What a donor signs of its manifest: the job, the step, and each file's size and sha256
    (what the joiner checks the downloaded bytes against), the tokenizer's when it has one."""
    f = m.files
    fields = [MANIFEST_VERSION, swarm, job_id, signer, str(m.step),
              str(f.model.bytes), f.model.sha256, str(f.state.bytes), f.state.sha256]  # fmt: skip
    if f.tokenizer is not None:  # a run with a BPE tokenizer sends its tokenizer.json too
        fields += [str(f.tokenizer.bytes), f.tokenizer.sha256]
    return "\n".join(fields).encode()


def sign_manifest(m: StateManifest, identity: Identity, swarm: str, job_id: str) -> StateManifest:
    sig = identity.sign(manifest_payload(m, swarm, job_id, identity.peer_id)).hex()
    return m.model_copy(update={"signer": identity.peer_id, "signature": sig})


def manifest_problem(
    m: StateManifest, swarm: str, job_id: str, signer: str, public_key: str
) -> str | None:
    """Why ``m`` is not the signed word of peer ``signer`` (key ``public_key``), or None."""
    if m.signer != signer or m.signature is None:
        return f"the manifest is not signed by the donor {signer} (signer: {m.signer})"
    payload = manifest_payload(m, swarm, job_id, signer)
    if not verify_signature(public_key, payload, bytes.fromhex(m.signature)):
        return f"the manifest's signature is not {signer}'s"
    return None


# -- progress, for the dashboard ----------------------------------------------------------------

MAX_CURVE_POINTS = 200
"""Steps of one loss curve a peer sends (``atomd.db.repo.progress_curve`` of this many points:
at most ``2 * MAX_CURVE_POINTS + 2``)."""

Loss = Annotated[float, Field(ge=0, le=1e6, allow_inf_nan=False)]


class CurvePoint(Message):
    step: Counter
    loss: Loss | None = None
    val_loss: Loss | None = None
    tokens_per_s: Annotated[float, Field(ge=0, le=1e15, allow_inf_nan=False)]
    at: Annotated[float, Field(ge=0, le=1e11, allow_inf_nan=False)]  # Unix seconds


class ProgressCurve(Message):
    """``GET /p2p/v1/jobs/{job_id}/progress``: the answering peer's loss curve of a job."""

    # 402 points of ~150 bytes; every dashboard refresh asks every peer for one.
    MAX_ANSWER_BYTES: ClassVar[int] = 256 << 10

    points: list[CurvePoint] = Field(max_length=2 * MAX_CURVE_POINTS + 2)


def _loss(x: float | None) -> float | None:
    """A loss as sent: a non-finite or absurd value (an fp16 overflow) as None."""
    return x if x is not None and math.isfinite(x) and 0 <= x <= 1e6 else None


def curve_of(points: Sequence[ProgressPoint]) -> ProgressCurve:
    """Logged steps as a ``ProgressCurve`` (the first ``2 * MAX_CURVE_POINTS + 2``)."""
    return ProgressCurve(
        points=[
            CurvePoint(
                step=p.step, loss=_loss(p.loss), val_loss=_loss(p.val_loss),
                tokens_per_s=min(max(p.tokens_per_s, 0.0), 1e15)
                if math.isfinite(p.tokens_per_s) else 0.0,
                at=p.at.timestamp(),
            )
            for p in points[: 2 * MAX_CURVE_POINTS + 2]
        ]
    )  # fmt: skip
