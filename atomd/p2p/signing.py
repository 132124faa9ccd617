"""Signed peer-plane requests: admission to a swarm, signing and verification.

Every request from one daemon to another's peer plane carries these headers:

- ``X-Atomd-Peer``: the sender's peer id (32 lowercase hex, derived from its key)
- ``X-Atomd-Key``: its raw Ed25519 public key (64 lowercase hex)
- ``X-Atomd-Swarm``: the swarm it belongs to
- ``X-Atomd-Target``: the peer id of the daemon the request is for, so that a captured request
  cannot be replayed to another daemon (each daemon's replay cache is its own)
- ``X-Atomd-Time``: unix seconds when signed (decimal, e.g. ``1712345678.123456``)
- ``X-Atomd-Nonce``: 16 random bytes (32 lowercase hex), never reused
- ``X-Atomd-Proof``: HMAC-SHA256 of the canonical string keyed by the swarm secret (64 hex),
  empty without a secret
- ``X-Atomd-Signature``: Ed25519 signature of the canonical string (128 hex)

The canonical string (UTF-8) is ten lines joined by ``\\n``, no trailing newline::

    atomd-peer-v2
    <METHOD, upper case>
    <request target: the path as sent on the wire, percent-encoding kept, plus ?query if any>
    <X-Atomd-Swarm>
    <X-Atomd-Target>
    <X-Atomd-Time, the header text exactly>
    <X-Atomd-Nonce>
    <X-Atomd-Peer>
    <X-Atomd-Key>
    <sha256 of the body bytes, lowercase hex (that of b"" for no body)>

No field may hold a line break (HTTP headers and request targets cannot), so the join is
unambiguous; the first line versions the format.

The checks that need no body (form, swarm, target, clock, key id, admission) run first
(``RequestVerifier.check_headers``), so an unsigned or foreign request is refused before its
body is read; the HTTP side (``atomd_api.peer_auth``) then reads the body within its route's
limit and calls ``verify``.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from atomd.config import Settings
from atomd.errors import ConfigError, PeerAuthError
from atomd.p2p.identity import Identity, peer_id_from_public_key, verify_signature

CANONICAL_VERSION = "atomd-peer-v2"

PEER = "X-Atomd-Peer"
KEY = "X-Atomd-Key"
SWARM = "X-Atomd-Swarm"
TARGET = "X-Atomd-Target"
TIME = "X-Atomd-Time"
NONCE = "X-Atomd-Nonce"
PROOF = "X-Atomd-Proof"
SIGNATURE = "X-Atomd-Signature"
_REQUIRED = (PEER, KEY, SWARM, TARGET, TIME, NONCE, SIGNATURE)  # PROOF may be absent: same as empty

_FORMATS: dict[str, tuple[re.Pattern[str], str]] = {
    PEER: (re.compile(r"[0-9a-f]{32}"), "32 lowercase hex characters"),
    KEY: (re.compile(r"[0-9a-f]{64}"), "64 lowercase hex characters"),
    SWARM: (re.compile(r"[\x21-\x7e]([\x20-\x7e]{0,198}[\x21-\x7e])?"), "1-200 printable ASCII"),
    TARGET: (re.compile(r"[0-9a-f]{32}"), "32 lowercase hex characters"),
    TIME: (re.compile(r"\d{1,12}(\.\d{1,9})?"), "unix seconds such as 1712345678.123456"),
    NONCE: (re.compile(r"[0-9a-f]{32}"), "32 lowercase hex characters"),
    PROOF: (re.compile(r"([0-9a-f]{64})?"), "empty or 64 lowercase hex characters"),
    SIGNATURE: (re.compile(r"[0-9a-f]{128}"), "128 lowercase hex characters"),
}


def _show(value: str, limit: int = 80) -> str:
    """A header value fit for a message: quoted, control characters escaped, cut short."""
    return repr(value if len(value) <= limit else value[:limit] + "...")


@dataclass(frozen=True)
class Admission:
    """Who may talk to this daemon: peers of ``swarm`` that prove ``secret`` (when set) and,
    when ``allowed_keys`` is not empty, hold one of those keys (raw Ed25519, lowercase hex)."""

    swarm: str
    secret: bytes | None
    allowed_keys: frozenset[str]

    def __post_init__(self) -> None:
        pattern, expected = _FORMATS[SWARM]
        if not pattern.fullmatch(self.swarm):
            raise ValueError(f"swarm name {_show(self.swarm)} is not {expected}")
        for key in self.allowed_keys:
            if not _FORMATS[KEY][0].fullmatch(key):
                raise ValueError(f"allowed key {_show(key)} is not 64 lowercase hex characters")

    @classmethod
    def from_settings(cls, settings: Settings) -> Admission:
        """From ``swarm``, ``swarm_secret`` (empty counts as unset) and ``allowed_keys``."""
        secret = settings.swarm_secret.get_secret_value() if settings.swarm_secret else ""
        try:
            return cls(
                swarm=settings.swarm,
                secret=secret.encode() or None,
                allowed_keys=frozenset(k.lower() for k in settings.allowed_keys),
            )
        except ValueError as e:
            raise ConfigError(f"--swarm / ATOMD_SWARM: {e}") from None


def canonical_request(
    *,
    method: str,
    path: str,
    swarm: str,
    target: str,
    time: str,
    nonce: str,
    peer_id: str,
    public_key_hex: str,
    body_sha256: str,
) -> bytes:
    """The bytes that are signed and HMAC'd (format in the module docstring)."""
    fields = [CANONICAL_VERSION, method.upper(), path, swarm, target, time, nonce, peer_id]
    fields += [public_key_hex, body_sha256]
    for field in fields:
        if "\n" in field or "\r" in field:
            raise ValueError(f"{_show(field)} holds a line break; it cannot be signed")
    return "\n".join(fields).encode()


def _proof(secret: bytes, canonical: bytes) -> str:
    return hmac.new(secret, canonical, hashlib.sha256).hexdigest()


def sign_request(
    identity: Identity,
    admission: Admission,
    method: str,
    path: str,
    body: bytes,
    *,
    target: str,
    now: float | None = None,
) -> dict[str, str]:
    """The ``X-Atomd-*`` headers that authenticate one request for the daemon whose peer id is
    ``target``. ``path`` is the request target exactly as sent (percent-encoded, with
    ``?query`` if any)."""
    headers = {
        PEER: identity.peer_id,
        KEY: identity.public_key_hex,
        SWARM: admission.swarm,
        TARGET: target,
        TIME: f"{time.time() if now is None else now:.6f}",
        NONCE: secrets.token_hex(16),
    }
    canonical = canonical_request(
        method=method,
        path=path,
        swarm=headers[SWARM],
        target=headers[TARGET],
        time=headers[TIME],
        nonce=headers[NONCE],
        peer_id=headers[PEER],
        public_key_hex=headers[KEY],
        body_sha256=hashlib.sha256(body).hexdigest(),
    )
    headers[PROOF] = _proof(admission.secret, canonical) if admission.secret else ""
    headers[SIGNATURE] = identity.sign(canonical).hex()
    return headers


@dataclass(frozen=True)
class VerifiedPeer:
    """The sender of a request that passed every check."""

    peer_id: str
    public_key_hex: str


class ReplayCache:
    """Nonces of accepted requests, each kept as long as a replay of its request could still be
    accepted (``ttl_s``, or the ``ttl_s`` given with it: longer for a route whose bodies may take
    longer to arrive).

    At most ``max_entries``: when full, the oldest nonce goes early, and since a replay of its
    request could then pass, every request signed no later than that one is refused too."""

    def __init__(self, *, ttl_s: float, max_entries: int = 100_000) -> None:
        if ttl_s <= 0 or max_entries < 1:
            raise ValueError(f"need ttl_s > 0 and max_entries >= 1, got {ttl_s}, {max_entries}")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        # nonce -> (kept until, request time); insertion order is arrival order.
        self._seen: OrderedDict[str, tuple[float, float]] = OrderedDict()
        # (kept until, nonce): what expires next. An entry whose nonce went early (or came back
        # with another expiry) is stale and skipped; rebuilt when stale ones outnumber the live.
        self._expiry: list[tuple[float, str]] = []
        self._floor = float("-inf")  # request time of the newest nonce dropped early
        # verify() may run in worker threads (large bodies); check-and-add must be atomic.
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def __contains__(self, nonce: object) -> bool:
        return nonce in self._seen

    def record(
        self, nonce: str, *, request_time: float, now: float, ttl_s: float | None = None
    ) -> None:
        """Remember ``nonce`` for ``ttl_s`` (default: the cache's); raises ``PeerAuthError``
        (401) if it may have been seen."""
        ttl = self.ttl_s if ttl_s is None else ttl_s
        if ttl <= 0:
            raise ValueError(f"need ttl_s > 0, got {ttl}")
        with self._lock:
            self._expire(now)
            if nonce in self._seen:
                raise PeerAuthError(
                    f"replayed request: nonce {nonce} was already used; expected a fresh nonce "
                    "per request",
                    status=401,
                )
            if request_time <= self._floor:
                raise PeerAuthError(
                    f"replayed request: cannot rule out a replay of a request signed at "
                    f"{request_time:.6f} (too many recent requests); expected one signed after "
                    f"{self._floor:.6f}, retry",
                    status=401,
                )
            self._seen[nonce] = (now + ttl, request_time)
            heapq.heappush(self._expiry, (now + ttl, nonce))
            if len(self._seen) > self.max_entries:
                _, (_, dropped_time) = self._seen.popitem(last=False)
                self._floor = max(self._floor, dropped_time)
            if len(self._expiry) > 2 * len(self._seen) + 16:
                self._expiry = [(until, n) for n, (until, _) in self._seen.items()]
                heapq.heapify(self._expiry)

    def _expire(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] < now:
            until, nonce = heapq.heappop(self._expiry)
            kept = self._seen.get(nonce)
            if kept is not None and kept[0] == until:
                del self._seen[nonce]


class SignedHeaders(NamedTuple):
    """The X-Atomd-* headers of a request, checked for form."""

    peer_id: str
    key: str
    swarm: str
    target: str
    time_text: str
    time: float
    nonce: str
    proof: str
    signature: bytes


def _parse_headers(headers: Mapping[str, str]) -> SignedHeaders:
    """The ``X-Atomd-*`` headers, checked for form only; raises ``PeerAuthError`` (401)."""
    ours: dict[str, str] = {}
    wanted = {name.lower(): name for name in _FORMATS}
    # items(), not get(): Starlette's Headers list a repeated header twice, and a repeated
    # auth header is refused rather than guessing which copy was meant.
    for raw_name, value in headers.items():
        name = wanted.get(raw_name.lower())
        if name is None:
            continue
        if name in ours:
            raise PeerAuthError(f"malformed request: header {name} given twice", status=401)
        ours[name] = value
    missing = [name for name in _REQUIRED if name not in ours]
    if missing:
        raise PeerAuthError(
            f"unsigned request: missing header(s) {', '.join(missing)}; expected a request "
            "signed by an atomd peer",
            status=401,
        )
    ours.setdefault(PROOF, "")
    for name, value in ours.items():
        pattern, expected = _FORMATS[name]
        if not pattern.fullmatch(value):
            raise PeerAuthError(
                f"malformed {name}: expected {expected}, got {_show(value)}", status=401
            )
    return SignedHeaders(
        peer_id=ours[PEER],
        key=ours[KEY],
        swarm=ours[SWARM],
        target=ours[TARGET],
        time_text=ours[TIME],
        time=float(ours[TIME]),
        nonce=ours[NONCE],
        proof=ours[PROOF],
        signature=bytes.fromhex(ours[SIGNATURE]),
    )


# The longest a signed request's body may take to arrive. The longest upload a peer makes is
# its share of a job's final average, sized for at most 10 minutes of its link
# (``atomd.sync.average.UPLOAD_MAX_S``); 4 real daemons at 256 kbit/s take 30-36 s for it, and
# a freshness window of 30 s counted from the body's end refuses it (measured with
# ``bench swarm``).
MAX_BODY_S = 900.0
# A route whose bodies are small gives them less: MIN_BODY_S plus its largest body at
# SLOWEST_BODY_BPS (a quarter of a 256 kbit/s uplink), at most MAX_BODY_S (``body_deadline_s``).
# A sender holding a connection with a trickled body is cut off sooner, and the replay cache
# keeps that route's nonces only as long (membership's 256 KiB messages: ~2 minutes, not 16).
MIN_BODY_S = 30.0
SLOWEST_BODY_BPS = 8_000


def body_deadline_s(limit: int, *, cap: float = MAX_BODY_S) -> float:
    """The time a body of at most ``limit`` bytes may take to arrive, at most ``cap``."""
    if limit < 0:
        raise ValueError(f"need limit >= 0, got {limit}")
    return min(cap, MIN_BODY_S + limit / SLOWEST_BODY_BPS)


class RequestVerifier:
    """Checks signed peer-plane requests for this daemon (``self_id``) against an
    ``Admission`` and refuses replays.

    Cheap checks come first (form, swarm, target, clock, key id, and the key's admission: the
    allow-list and bans; ``check_headers``, before the body is read), then the signature and
    the swarm secret. A key the allow-list leaves out or a ban names is refused before its
    body, so it cannot make this daemon read or hash one (refused after, a model-sized delta
    body would be read first); its refusal names the key the headers claim,
    not one proven to have signed, and nothing but the aggregated refusal records takes it
    from there. Nonces are
    recorded last, for accepted requests only, so garbage cannot fill the replay cache.
    ``blocked`` names why a key is refused (banned by the operator), or None."""

    def __init__(
        self,
        admission: Admission,
        *,
        self_id: str,
        max_skew_s: float = 30.0,
        max_body_s: float = MAX_BODY_S,
        max_nonces: int = 100_000,
        blocked: Callable[[str], str | None] | None = None,
    ) -> None:
        if max_skew_s <= 0 or max_body_s <= 0:
            raise ValueError(f"need max_skew_s, max_body_s > 0, got {max_skew_s}, {max_body_s}")
        self.admission = admission
        self.self_id = self_id
        self.max_skew_s = max_skew_s
        self.max_body_s = max_body_s
        self.blocked = blocked
        # A request is fresh when it *arrives* (its headers) within ±max_skew_s of its signing
        # time, and its body takes at most its route's deadline (``body_s``, at most
        # max_body_s): a replay of it (same route: the path is signed) is accepted, if at all,
        # within 2×max_skew_s + body_s of the first's acceptance. Its nonce is kept as long.
        self.replay_cache = ReplayCache(ttl_s=2 * max_skew_s + max_body_s, max_entries=max_nonces)

    def check_headers(
        self, headers: Mapping[str, str], *, now: float | None = None
    ) -> SignedHeaders:
        """The checks that need no body; raises ``PeerAuthError`` (401 or 403)."""
        now = time.time() if now is None else now
        signed = _parse_headers(headers)
        if signed.swarm != self.admission.swarm:
            raise PeerAuthError(
                f"wrong swarm: expected {self.admission.swarm!r}, got {signed.swarm!r}",
                status=403,
            )
        if signed.target != self.self_id:
            raise PeerAuthError(
                f"wrong target: the request is signed for peer {signed.target}, this is peer "
                f"{self.self_id}; expected a request signed for this daemon",
                status=401,
            )
        skew = signed.time - now
        if abs(skew) > self.max_skew_s:
            raise PeerAuthError(
                f"stale request: clock skew {skew:+.1f} s, expected within "
                f"±{self.max_skew_s:g} s (request time {signed.time_text}, ours {now:.6f}); "
                "check both peers' clocks (NTP)",
                status=401,
            )
        expected_id = peer_id_from_public_key(signed.key)
        if signed.peer_id != expected_id:
            raise PeerAuthError(
                f"peer id does not match key: expected {expected_id} (from {KEY}), "
                f"got {signed.peer_id}",
                status=401,
            )
        # The allow-list and bans need no body: refused before one is read (the key is the
        # one the headers claim, its signature not checked yet).
        allowed = self.admission.allowed_keys
        if allowed and signed.key not in allowed:
            raise PeerAuthError(
                f"key not allowed: a request in the name of peer {signed.peer_id} (key "
                f"{signed.key}), which is not among the {len(allowed)} keys of this daemon's "
                "ATOMD_ALLOWED_KEYS",
                status=403,
            )
        why = self.blocked(signed.key) if self.blocked is not None else None
        if why is not None:
            raise PeerAuthError(
                f"a request in the name of peer {signed.peer_id}, banned here: {why}", status=403
            )
        return signed

    def verify(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        body: bytes,
        *,
        now: float | None = None,
        arrived: float | None = None,
        body_s: float | None = None,
    ) -> VerifiedPeer:
        """The peer that signed this request; raises ``PeerAuthError`` (401 or 403).

        ``arrived``: when its headers came (default ``now``), what its freshness is judged by:
        a large body on a slow link takes longer than the clock skew allowed. ``body_s``: the
        longest the caller let its route's bodies take (default and at most ``max_body_s``):
        how long a replay of it could still arrive, so how long its nonce is kept."""
        body_s = self.max_body_s if body_s is None else min(body_s, self.max_body_s)
        now = time.time() if now is None else now
        signed = self.check_headers(headers, now=now if arrived is None else arrived)
        canonical = canonical_request(
            method=method,
            path=path,
            swarm=signed.swarm,
            target=signed.target,
            time=signed.time_text,
            nonce=signed.nonce,
            peer_id=signed.peer_id,
            public_key_hex=signed.key,
            body_sha256=hashlib.sha256(body).hexdigest(),
        )
        if not verify_signature(signed.key, canonical, signed.signature):
            raise PeerAuthError(
                f"bad signature from peer {signed.peer_id}: expected an Ed25519 signature of "
                f"{method.upper()} {path} with this body and these headers "
                f"({CANONICAL_VERSION}); the request was altered or signed differently",
                status=401,
            )
        secret = self.admission.secret
        if secret is not None:
            if not signed.proof:
                raise PeerAuthError(
                    f"missing swarm secret proof: swarm {signed.swarm!r} expects a secret "
                    f"(ATOMD_SWARM_SECRET), peer {signed.peer_id} sent none",
                    status=403,
                )
            # compare_digest: the time taken must not tell how much of a guess was right.
            if not hmac.compare_digest(signed.proof, _proof(secret, canonical)):
                raise PeerAuthError(
                    f"wrong swarm secret: peer {signed.peer_id}'s {PROOF} does not match; "
                    f"expected the same ATOMD_SWARM_SECRET as this daemon's",
                    status=403,
                )
        self.replay_cache.record(
            signed.nonce, request_time=signed.time, now=now, ttl_s=2 * self.max_skew_s + body_s
        )
        return VerifiedPeer(peer_id=signed.peer_id, public_key_hex=signed.key)
