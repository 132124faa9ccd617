"""Signed peer-plane requests: admission to a swarm, signing, verification and a signing client.

Every request from one daemon to another's peer plane carries these headers:

- ``X-Atomd-Peer``: the sender's peer id (32 lowercase hex, derived from its key)
- ``X-Atomd-Key``: its raw Ed25519 public key (64 lowercase hex)
- ``X-Atomd-Swarm``: the swarm it belongs to
- ``X-Atomd-Time``: unix seconds when signed (decimal, e.g. ``1712345678.123456``)
- ``X-Atomd-Nonce``: 16 random bytes (32 lowercase hex), never reused
- ``X-Atomd-Proof``: HMAC-SHA256 of the canonical string keyed by the swarm secret (64 hex),
  empty without a secret
- ``X-Atomd-Signature``: Ed25519 signature of the canonical string (128 hex)

The canonical string (UTF-8) is nine lines joined by ``\\n``, no trailing newline::

    atomd-peer-v1
    <METHOD, upper case>
    <request target: the path as sent on the wire, percent-encoding kept, plus ?query if any>
    <X-Atomd-Swarm>
    <X-Atomd-Time, the header text exactly>
    <X-Atomd-Nonce>
    <X-Atomd-Peer>
    <X-Atomd-Key>
    <sha256 of the body bytes, lowercase hex (that of b"" for no body)>

No field may hold a line break (HTTP headers and request targets cannot), so the join is
unambiguous; the first line versions the format.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NamedTuple

import httpx
from fastapi import Request

from atomd.config import Settings
from atomd.errors import ConfigError, PeerAuthError, PeerRequestError
from atomd.logs import get_logger
from atomd.p2p.identity import Identity, peer_id_from_public_key, verify_signature

log = get_logger(__name__)

CANONICAL_VERSION = "atomd-peer-v1"

PEER = "X-Atomd-Peer"
KEY = "X-Atomd-Key"
SWARM = "X-Atomd-Swarm"
TIME = "X-Atomd-Time"
NONCE = "X-Atomd-Nonce"
PROOF = "X-Atomd-Proof"
SIGNATURE = "X-Atomd-Signature"
_REQUIRED = (PEER, KEY, SWARM, TIME, NONCE, SIGNATURE)  # PROOF may be absent: same as empty

_FORMATS: dict[str, tuple[re.Pattern[str], str]] = {
    PEER: (re.compile(r"[0-9a-f]{32}"), "32 lowercase hex characters"),
    KEY: (re.compile(r"[0-9a-f]{64}"), "64 lowercase hex characters"),
    SWARM: (re.compile(r"[\x21-\x7e]([\x20-\x7e]{0,198}[\x21-\x7e])?"), "1-200 printable ASCII"),
    TIME: (re.compile(r"\d{1,12}(\.\d{1,9})?"), "unix seconds such as 1712345678.123456"),
    NONCE: (re.compile(r"[0-9a-f]{32}"), "32 lowercase hex characters"),
    PROOF: (re.compile(r"([0-9a-f]{64})?"), "empty or 64 lowercase hex characters"),
    SIGNATURE: (re.compile(r"[0-9a-f]{128}"), "128 lowercase hex characters"),
}

# Bodies above this are hashed off the event loop (a 100 MB delta takes ~0.1 s to hash).
_INLINE_BODY_BYTES = 1 << 20
# A JSON answer larger than this is refused rather than held in memory; files go by stream().
_MAX_JSON_BYTES = 16 << 20
# Enough of an error answer to show its detail.
_MAX_ERROR_BYTES = 64 << 10


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
    time: str,
    nonce: str,
    peer_id: str,
    public_key_hex: str,
    body_sha256: str,
) -> bytes:
    """The bytes that are signed and HMAC'd (format in the module docstring)."""
    fields = [CANONICAL_VERSION, method.upper(), path, swarm, time, nonce, peer_id]
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
    now: float | None = None,
) -> dict[str, str]:
    """The ``X-Atomd-*`` headers that authenticate one request. ``path`` is the request target
    exactly as sent (percent-encoded, with ``?query`` if any)."""
    headers = {
        PEER: identity.peer_id,
        KEY: identity.public_key_hex,
        SWARM: admission.swarm,
        TIME: f"{time.time() if now is None else now:.6f}",
        NONCE: secrets.token_hex(16),
    }
    canonical = canonical_request(
        method=method,
        path=path,
        swarm=headers[SWARM],
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
    """Nonces of accepted requests, kept ``ttl_s`` (longer than any request stays fresh).

    At most ``max_entries``: when full, the oldest nonce goes early, and since a replay of its
    request could then pass, every request signed no later than that one is refused too."""

    def __init__(self, *, ttl_s: float, max_entries: int = 100_000) -> None:
        if ttl_s <= 0 or max_entries < 1:
            raise ValueError(f"need ttl_s > 0 and max_entries >= 1, got {ttl_s}, {max_entries}")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        # nonce -> (seen at, request time); insertion order is arrival order.
        self._seen: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._floor = float("-inf")  # request time of the newest nonce dropped early
        # verify() may run in worker threads (large bodies); check-and-add must be atomic.
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def __contains__(self, nonce: object) -> bool:
        return nonce in self._seen

    def record(self, nonce: str, *, request_time: float, now: float) -> None:
        """Remember ``nonce``; raises ``PeerAuthError`` (401) if it may have been seen."""
        with self._lock:
            while self._seen:
                seen_at, _ = next(iter(self._seen.values()))
                if seen_at >= now - self.ttl_s:
                    break
                self._seen.popitem(last=False)
            if nonce in self._seen:
                seen_at, _ = self._seen[nonce]
                raise PeerAuthError(
                    f"replayed request: nonce {nonce} was already used {now - seen_at:.1f} s ago; "
                    "expected a fresh nonce per request",
                    status=401,
                )
            if request_time <= self._floor:
                raise PeerAuthError(
                    f"replayed request: cannot rule out a replay of a request signed at "
                    f"{request_time:.6f} (too many recent requests); expected one signed after "
                    f"{self._floor:.6f}, retry",
                    status=401,
                )
            self._seen[nonce] = (now, request_time)
            if len(self._seen) > self.max_entries:
                _, (_, dropped_time) = self._seen.popitem(last=False)
                self._floor = max(self._floor, dropped_time)


class _Signed(NamedTuple):
    peer_id: str
    key: str
    swarm: str
    time_text: str
    time: float
    nonce: str
    proof: str
    signature: bytes


def _parse_headers(headers: Mapping[str, str]) -> _Signed:
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
    return _Signed(
        peer_id=ours[PEER],
        key=ours[KEY],
        swarm=ours[SWARM],
        time_text=ours[TIME],
        time=float(ours[TIME]),
        nonce=ours[NONCE],
        proof=ours[PROOF],
        signature=bytes.fromhex(ours[SIGNATURE]),
    )


class RequestVerifier:
    """Checks signed peer-plane requests against an ``Admission`` and refuses replays.

    Cheap checks come first (form, swarm, clock, key id), then the signature, then admission:
    a 403 is only given to a request proven to come from that key, so a refusal recorded
    against a peer id is never forged. Nonces are recorded last, for accepted requests only,
    so garbage cannot fill the replay cache."""

    def __init__(
        self, admission: Admission, *, max_skew_s: float = 30.0, max_nonces: int = 100_000
    ) -> None:
        if max_skew_s <= 0:
            raise ValueError(f"max_skew_s must be > 0, got {max_skew_s}")
        self.admission = admission
        self.max_skew_s = max_skew_s
        # A request is fresh for ±max_skew_s around its signing time, so a nonce seen within
        # 2×max_skew_s of arrival outlives every window in which its request could be replayed.
        self.replay_cache = ReplayCache(ttl_s=2 * max_skew_s, max_entries=max_nonces)

    def verify(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        body: bytes,
        *,
        now: float | None = None,
    ) -> VerifiedPeer:
        """The peer that signed this request; raises ``PeerAuthError`` (401 or 403)."""
        now = time.time() if now is None else now
        signed = _parse_headers(headers)
        if signed.swarm != self.admission.swarm:
            raise PeerAuthError(
                f"wrong swarm: expected {self.admission.swarm!r}, got {signed.swarm!r}",
                status=403,
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
        canonical = canonical_request(
            method=method,
            path=path,
            swarm=signed.swarm,
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
        allowed = self.admission.allowed_keys
        if allowed and signed.key not in allowed:
            raise PeerAuthError(
                f"key not allowed: peer {signed.peer_id} (key {signed.key}) is not among the "
                f"{len(allowed)} keys of this daemon's ATOMD_ALLOWED_KEYS",
                status=403,
            )
        self.replay_cache.record(signed.nonce, request_time=signed.time, now=now)
        return VerifiedPeer(peer_id=signed.peer_id, public_key_hex=signed.key)


def _request_target(request: Request) -> str:
    """The path as it came over the wire, plus ``?query``: what the sender signed.

    ``request.url.path`` is percent-decoded, so ``/a%2Fb`` and ``/a/b`` would read the same;
    the ASGI ``raw_path`` keeps the bytes (the decoded path is the fallback for servers
    without it)."""
    raw = request.scope.get("raw_path")
    path = raw.decode("latin-1") if isinstance(raw, bytes) else request.url.path
    query = request.scope.get("query_string", b"").decode("latin-1")
    return f"{path}?{query}" if query else path


def peer_auth(
    verifier: RequestVerifier,
    on_reject: Callable[[Request, PeerAuthError], Awaitable[None]] | None = None,
) -> Callable[..., Awaitable[VerifiedPeer]]:
    """A FastAPI dependency giving the ``VerifiedPeer`` of a signed request.

    On refusal it awaits ``on_reject(request, error)`` (the daemon records an event there),
    then raises the ``PeerAuthError``, which ``api/errors`` answers with 401 or 403."""

    async def dependency(request: Request) -> VerifiedPeer:
        body = await request.body()
        args = (request.method, _request_target(request), request.headers, body)
        try:
            if len(body) > _INLINE_BODY_BYTES:
                return await asyncio.to_thread(verifier.verify, *args)
            return verifier.verify(*args)
        except PeerAuthError as e:
            client = request.client.host if request.client else "?"
            log.debug("refused %s %s from %s: %s", request.method, request.url.path, client, e)
            if on_reject is not None:
                try:
                    await on_reject(request, e)
                except Exception:
                    # Recording the refusal must not turn a 401/403 into a 500.
                    log.exception("on_reject failed for a refused peer request")
            raise

    return dependency


async def _read_capped(response: httpx.Response, limit: int) -> bytes | None:
    """The body, or None if it is longer than ``limit`` bytes."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _detail(body: bytes | None) -> str:
    """The ``detail`` of an atomd error answer, else the start of the body."""
    if body is None:
        return "(error body too large)"
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("detail"), str):
        return str(parsed["detail"])
    text = body.decode("utf-8", "replace").strip()
    return (text[:200] + "...") if len(text) > 200 else text or "(empty body)"


_JSON = "application/json"
_OCTETS = "application/octet-stream"


class PeerClient:
    """Calls other daemons' peer planes, signing every request. One pooled HTTP client.

    Every call has a timeout (``timeout`` seconds unless given): the whole call for the JSON
    methods, each connect/read/write for ``stream`` (so large downloads may take longer).
    Failures raise ``PeerRequestError``."""

    def __init__(self, identity: Identity, admission: Admission, *, timeout: float = 5.0) -> None:
        self._identity = identity
        self._admission = admission
        self._timeout = timeout
        # No redirects: the signature covers one path; another would go unsigned.
        self._client = httpx.AsyncClient(timeout=timeout, follow_redirects=False)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> PeerClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def post_json(
        self, base_url: str, path: str, payload: Any, *, timeout: float | None = None
    ) -> Any:
        """POST ``payload`` as compact JSON to ``base_url + path``; the decoded JSON answer."""
        body = json.dumps(payload, separators=(",", ":")).encode()
        return await self._json("POST", base_url, path, body, timeout)

    async def post_bytes(
        self, base_url: str, path: str, body: bytes, *, timeout: float | None = None
    ) -> Any:
        """POST raw bytes (a delta frame) to ``base_url + path``; the decoded JSON answer."""
        return await self._json("POST", base_url, path, body, timeout, _OCTETS)

    async def get_json(self, base_url: str, path: str, *, timeout: float | None = None) -> Any:
        """GET ``base_url + path``; the decoded JSON answer."""
        return await self._json("GET", base_url, path, b"", timeout)

    def stream(
        self, method: str, base_url: str, path: str, *, timeout: float | None = None
    ) -> AbstractAsyncContextManager[httpx.Response]:
        """A signed request without body whose answer is read in chunks (``aiter_bytes``);
        raises ``PeerRequestError`` on a non-2xx answer or a transfer that fails midway."""
        return self._open(method, base_url, path, b"", timeout)

    async def _json(
        self,
        method: str,
        base_url: str,
        path: str,
        body: bytes,
        timeout: float | None,
        content_type: str = _JSON,
    ) -> Any:
        limit = self._timeout if timeout is None else timeout
        try:
            async with (
                asyncio.timeout(limit),
                self._open(method, base_url, path, body, limit, content_type) as response,
            ):
                data = await _read_capped(response, _MAX_JSON_BYTES)
                status = response.status_code
        except TimeoutError:
            raise PeerRequestError(
                f"peer {base_url}: {method} {path} timed out after {limit:g} s"
            ) from None
        if data is None:
            raise PeerRequestError(
                f"peer {base_url}: {method} {path} answered more than {_MAX_JSON_BYTES} bytes",
                status=status,
            )
        if not data:
            return None
        try:
            return json.loads(data)
        except ValueError:
            raise PeerRequestError(
                f"peer {base_url}: {method} {path} answered {status} with a body that is not "
                f"JSON: {_detail(data)}",
                status=status,
            ) from None

    @asynccontextmanager
    async def _open(
        self,
        method: str,
        base_url: str,
        path: str,
        body: bytes,
        timeout: float | None,
        content_type: str = _JSON,
    ) -> AsyncIterator[httpx.Response]:
        method = method.upper()
        if not path.startswith("/"):
            raise ValueError(f"path {path!r} must start with /")
        try:
            url = httpx.URL(base_url.rstrip("/") + path)
        except httpx.InvalidURL as e:
            raise PeerRequestError(f"peer {base_url}: invalid URL ({e})") from None
        # Sign the target exactly as it goes on the wire (httpx percent-encodes the path).
        target = url.raw_path.decode("ascii")
        headers = sign_request(self._identity, self._admission, method, target, body)
        if body:
            headers["Content-Type"] = content_type
        limit = self._timeout if timeout is None else timeout
        try:
            async with self._client.stream(
                method, url, content=body, headers=headers, timeout=httpx.Timeout(limit)
            ) as response:
                if not response.is_success:
                    detail = _detail(await _read_capped(response, _MAX_ERROR_BYTES))
                    raise PeerRequestError(
                        f"peer {base_url}: {method} {path} answered {response.status_code}: "
                        f"{detail}",
                        status=response.status_code,
                    )
                yield response
        except httpx.TimeoutException as e:
            raise PeerRequestError(
                f"peer {base_url}: {method} {path} timed out after {limit:g} s ({type(e).__name__})"
            ) from e
        except httpx.RequestError as e:
            # Also reached when a chunked read fails inside the caller's ``async with``.
            reason = str(e) or type(e).__name__
            raise PeerRequestError(f"peer {base_url}: {method} {path} failed: {reason}") from e
