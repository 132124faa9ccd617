"""Peer identity and signed peer-plane requests: every refusal, the replay cache, the FastAPI
dependency through ASGI (bodies bounded before they are read), and ``PeerClient`` against a
real uvicorn server on loopback."""

# No ``from __future__ import annotations``: FastAPI resolves string annotations in module
# globals only, and the routes below use a dependency alias local to ``make_peer_app``.

import asyncio
import errno
import hashlib
import os
import socket
import stat
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import httpx
import pytest
import uvicorn
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from fastapi import Depends, FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import SecretStr
from starlette.datastructures import Headers

from atomd.config import Settings
from atomd.errors import AtomdError, ConfigError, PeerAuthError, PeerRequestError
from atomd.p2p.client import PeerClient
from atomd.p2p.identity import Identity, peer_id_from_public_key, verify_signature
from atomd.p2p.messages import Message, PeerInfo
from atomd.p2p.signing import (
    MAX_BODY_S,
    MIN_BODY_S,
    NONCE,
    PEER,
    PROOF,
    SIGNATURE,
    SWARM,
    TARGET,
    TIME,
    Admission,
    ReplayCache,
    RequestVerifier,
    VerifiedPeer,
    body_deadline_s,
    canonical_request,
    sign_request,
)
from atomd_api import errors
from atomd_api.peer_auth import SignedRequest, peer_auth

NOW = 1_700_000_000.0
PATH = "/p2p/v1/ping?round=3"
BODY = b'{"incarnation":1}'
SELF = Identity.generate()  # the daemon the requests are for
ME = SELF.peer_id


def verifier_for(adm: Admission, **kw: Any) -> RequestVerifier:
    return RequestVerifier(adm, self_id=ME, **kw)


def sign(*args: Any, **kw: Any) -> dict[str, str]:
    """``sign_request`` for this daemon (``ME``) unless told another target."""
    return sign_request(*args, **{"target": ME, **kw})


def admission(
    swarm: str = "lab", secret: bytes | None = None, allowed: frozenset[str] = frozenset()
) -> Admission:
    return Admission(swarm=swarm, secret=secret, allowed_keys=allowed)


@pytest.fixture(scope="module")
def alice() -> Identity:
    return Identity.generate()


@pytest.fixture(scope="module")
def bob() -> Identity:
    return Identity.generate()


def refused(
    verifier: RequestVerifier,
    headers: dict[str, str],
    *,
    method: str = "POST",
    path: str = PATH,
    body: bytes = BODY,
    now: float = NOW,
) -> PeerAuthError:
    with pytest.raises(PeerAuthError) as info:
        verifier.verify(method, path, headers, body, now=now)
    return info.value


# Identity ------------------------------------------------------------------------------------


def test_key_file_is_created_private_and_reused(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"  # does not exist yet
    first = Identity.load_or_create(data_dir)
    key_file = data_dir / "identity.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert key_file.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    second = Identity.load_or_create(data_dir)
    assert (second.peer_id, second.public_key_hex) == (first.peer_id, first.public_key_hex)
    assert len(first.public_key_hex) == 64 and first.public_key_hex == first.public_key_hex.lower()
    digest = hashlib.sha256(bytes.fromhex(first.public_key_hex)).hexdigest()
    assert first.peer_id == peer_id_from_public_key(first.public_key_hex) == digest[:32]
    assert "PRIVATE" not in repr(first)


def test_key_file_mode_ignores_a_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        Identity.load_or_create(tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "identity.key").stat().st_mode) == 0o600


def test_a_key_appears_only_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kill while the key is written must not leave a half-written ``identity.key`` (every
    later start would refuse it): the key's name appears only once its bytes are on disk (the
    side file a kill leaves is swept: tests/unit/test_datadir.py)."""
    key_file = tmp_path / "identity.key"
    seen: list[bool] = []
    fsync = os.fsync

    def watched(fd: int) -> None:
        seen.append(key_file.exists())
        fsync(fd)

    monkeypatch.setattr(os, "fsync", watched)
    first = Identity.load_or_create(tmp_path)
    assert seen and seen[0] is False  # the bytes were synced before the name existed
    assert Identity.load_or_create(tmp_path).peer_id == first.peer_id
    assert sorted(p.name for p in tmp_path.iterdir()) == ["identity.key"]


def test_a_key_is_made_where_hard_links_are_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vfat, some network and FUSE mounts refuse link(): the key is renamed into place."""

    def no_links(src: Any, dst: Any) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    first = Identity.load_or_create(tmp_path)
    assert stat.S_IMODE((tmp_path / "identity.key").stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["identity.key"]
    assert Identity.load_or_create(tmp_path).peer_id == first.peer_id


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_readable_key_file_is_refused(tmp_path: Path, mode: int) -> None:
    Identity.load_or_create(tmp_path)
    key_file = tmp_path / "identity.key"
    key_file.chmod(mode)
    with pytest.raises(ConfigError, match=r"chmod 600") as info:
        Identity.load_or_create(tmp_path)
    assert f"{mode:04o}" in str(info.value)


def _write_key(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def test_corrupt_key_file_is_refused(tmp_path: Path) -> None:
    _write_key(tmp_path / "identity.key", b"-----BEGIN PRIVATE KEY-----\nnot base64\n")
    with pytest.raises(ConfigError, match=r"not an unencrypted PKCS8 PEM.*delete it"):
        Identity.load_or_create(tmp_path)


def test_non_ed25519_key_file_is_refused(tmp_path: Path) -> None:
    pem = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    _write_key(tmp_path / "identity.key", pem)
    with pytest.raises(ConfigError, match=r"expected an Ed25519"):
        Identity.load_or_create(tmp_path)


def test_verify_signature(alice: Identity, bob: Identity) -> None:
    sig = alice.sign(b"data")
    assert verify_signature(alice.public_key_hex, b"data", sig)
    assert not verify_signature(alice.public_key_hex, b"datA", sig)
    assert not verify_signature(bob.public_key_hex, b"data", sig)
    assert not verify_signature("zz", b"data", sig)
    assert not verify_signature(alice.public_key_hex, b"data", b"short")


# Signing and verifying -----------------------------------------------------------------------


def test_round_trip_and_canonical_string(alice: Identity) -> None:
    adm = admission(secret=b"s3cret", allowed=frozenset({alice.public_key_hex}))
    headers = sign(alice, adm, "post", PATH, BODY, now=NOW)
    assert headers[TIME] == "1700000000.000000" and len(headers[NONCE]) == 32
    peer = verifier_for(adm).verify("POST", PATH, headers, BODY, now=NOW + 1)
    assert peer == VerifiedPeer(peer_id=alice.peer_id, public_key_hex=alice.public_key_hex)
    canonical = canonical_request(
        method="post",
        path=PATH,
        swarm="lab",
        target=ME,
        time=headers[TIME],
        nonce=headers[NONCE],
        peer_id=alice.peer_id,
        public_key_hex=alice.public_key_hex,
        body_sha256=hashlib.sha256(BODY).hexdigest(),
    )
    assert canonical.split(b"\n")[:5] == [
        b"atomd-peer-v2", b"POST", PATH.encode(), b"lab", ME.encode()
    ]  # fmt: skip
    assert verify_signature(alice.public_key_hex, canonical, bytes.fromhex(headers[SIGNATURE]))
    with pytest.raises(ValueError, match="line break"):
        canonical_request(**{**_fields(), "path": "/a\nb"})


def _fields() -> dict[str, str]:
    return dict.fromkeys(
        [
            "method",
            "path",
            "swarm",
            "target",
            "time",
            "nonce",
            "peer_id",
            "public_key_hex",
            "body_sha256",
        ],
        "x",
    )


def test_header_names_are_case_insensitive(alice: Identity) -> None:
    headers = sign(alice, admission(), "GET", "/p2p/v1/info", b"", now=NOW)
    lower = {k.lower(): v for k, v in headers.items()}
    assert verifier_for(admission()).verify("GET", "/p2p/v1/info", lower, b"", now=NOW)


def test_no_proof_header_is_fine_without_a_secret(alice: Identity) -> None:
    headers = sign(alice, admission(), "POST", PATH, BODY, now=NOW)
    del headers[PROOF]
    assert verifier_for(admission()).verify("POST", PATH, headers, BODY, now=NOW)


def test_wrong_swarm_is_forbidden(alice: Identity) -> None:
    headers = sign(alice, admission(swarm="other"), "POST", PATH, BODY, now=NOW)
    err = refused(verifier_for(admission()), headers)
    assert err.status == 403
    assert str(err) == "wrong swarm: expected 'lab', got 'other'"


def test_missing_secret_proof_is_forbidden(alice: Identity) -> None:
    headers = sign(alice, admission(), "POST", PATH, BODY, now=NOW)
    err = refused(verifier_for(admission(secret=b"s3cret")), headers)
    assert err.status == 403 and "missing swarm secret proof" in str(err)


def test_wrong_secret_is_forbidden(alice: Identity) -> None:
    headers = sign(alice, admission(secret=b"guess"), "POST", PATH, BODY, now=NOW)
    err = refused(verifier_for(admission(secret=b"s3cret")), headers)
    assert err.status == 403 and "wrong swarm secret" in str(err)


def test_key_not_in_allow_list_is_forbidden(alice: Identity, bob: Identity) -> None:
    verifier = verifier_for(admission(allowed=frozenset({bob.public_key_hex})))
    err = refused(verifier, sign(alice, admission(), "POST", PATH, BODY, now=NOW))
    assert err.status == 403 and "key not allowed" in str(err) and alice.peer_id in str(err)
    assert verifier.verify(
        "POST", PATH, sign(bob, admission(), "POST", PATH, BODY, now=NOW), BODY, now=NOW
    )


def test_secret_and_allow_list_must_both_pass(alice: Identity, bob: Identity) -> None:
    verifier = verifier_for(admission(secret=b"s", allowed=frozenset({alice.public_key_hex})))
    stranger = sign(bob, admission(secret=b"s"), "GET", PATH, b"", now=NOW)
    assert "key not allowed" in str(refused(verifier, stranger, method="GET", body=b""))
    no_secret = sign(alice, admission(), "GET", PATH, b"", now=NOW)
    assert "missing swarm secret" in str(refused(verifier, no_secret, method="GET", body=b""))
    good = sign(alice, admission(secret=b"s"), "GET", PATH, b"", now=NOW)
    assert verifier.verify("GET", PATH, good, b"", now=NOW)


@pytest.mark.parametrize(
    ("change", "value"),
    [
        ("body", b'{"incarnation":2}'),
        ("path", "/p2p/v1/ping?round=4"),
        ("method", "PUT"),
        (TIME, f"{NOW + 0.5:.6f}"),
        (NONCE, "0" * 32),
        (SIGNATURE, "00" * 64),
    ],
)
def test_tampering_is_unauthorized(alice: Identity, change: str, value: Any) -> None:
    headers = sign(alice, admission(), "POST", PATH, BODY, now=NOW)
    request: dict[str, Any] = {"method": "POST", "path": PATH, "body": BODY}
    if change in request:
        request[change] = value
    else:
        headers[change] = value
    err = refused(verifier_for(admission()), headers, **request)
    assert err.status == 401 and "bad signature" in str(err)


def test_request_for_another_daemon_is_refused(alice: Identity, bob: Identity) -> None:
    """A captured request replays to no other daemon: the signature names its target."""
    headers = sign(alice, admission(), "POST", PATH, BODY, now=NOW, target=bob.peer_id)
    err = refused(verifier_for(admission()), headers)
    assert err.status == 401 and "wrong target" in str(err) and bob.peer_id in str(err)
    headers[TARGET] = ME  # re-addressed: the signature covered the original target
    assert "bad signature" in str(refused(verifier_for(admission()), headers))


def test_banned_key_is_forbidden(alice: Identity, bob: Identity) -> None:
    banned = {alice.public_key_hex: "operator's ban: flooding"}
    verifier = verifier_for(admission(), blocked=banned.get)
    err = refused(verifier, sign(alice, admission(), "POST", PATH, BODY, now=NOW))
    assert err.status == 403 and "banned here: operator's ban: flooding" in str(err)
    assert verifier.verify("POST", PATH, sign(bob, admission(), "POST", PATH, BODY, now=NOW),
                           BODY, now=NOW)  # fmt: skip


def test_tampered_swarm_header_is_refused(alice: Identity) -> None:
    # Re-labelled to this daemon's swarm: the signature covered the original one.
    headers = sign(alice, admission(swarm="other"), "POST", PATH, BODY, now=NOW)
    headers[SWARM] = "lab"
    assert refused(verifier_for(admission()), headers).status == 401


@pytest.mark.parametrize("offset", [31.0, -31.0, 3600.0])
def test_stale_and_future_requests_are_unauthorized(alice: Identity, offset: float) -> None:
    headers = sign(alice, admission(), "POST", PATH, BODY, now=NOW + offset)
    err = refused(verifier_for(admission()), headers)
    assert err.status == 401 and f"stale request: clock skew {offset:+.1f} s" in str(err)


def test_replay_is_unauthorized_only_after_the_first_passed(alice: Identity) -> None:
    verifier = verifier_for(admission())
    headers = sign(alice, admission(), "POST", PATH, BODY, now=NOW)
    # A forged attempt with the nonce fails and must not use the nonce up.
    assert refused(verifier, headers, body=b"forged").status == 401
    assert verifier.verify("POST", PATH, headers, BODY, now=NOW + 1)
    err = refused(verifier, headers, now=NOW + 2)
    assert err.status == 401 and "replayed request" in str(err)


def test_a_long_upload_is_fresh_by_its_arrival_and_its_replay_is_still_refused(
    alice: Identity,
) -> None:
    """A body that takes longer than the clock skew allowed (a job's final average at 256
    kbit/s: 30-36 s) is judged by when its headers came, not when its body ended (refused as
    "stale" before); its nonce is kept as long as a replay of it could still be accepted: one
    that arrives at the end of the window and takes the longest a body may."""
    verifier = verifier_for(admission(), max_body_s=600.0)
    headers = sign(alice, admission(), "POST", PATH, BODY, now=NOW)
    assert "stale request" in str(refused(verifier, headers, now=NOW + 35))
    assert verifier.verify("POST", PATH, headers, BODY, now=NOW + 35, arrived=NOW + 1)
    with pytest.raises(PeerAuthError, match="replayed request"):  # came in time, took 600 s
        verifier.verify("POST", PATH, headers, BODY, now=NOW + 30 + 600, arrived=NOW + 30)
    late = sign(alice, admission(), "POST", PATH, BODY, now=NOW)
    with pytest.raises(PeerAuthError, match="stale request"):  # its headers came too late
        verifier.verify("POST", PATH, late, BODY, now=NOW + 40, arrived=NOW + 31)


def test_peer_id_must_match_key(alice: Identity, bob: Identity) -> None:
    headers = sign(alice, admission(), "POST", PATH, BODY, now=NOW)
    headers[PEER] = bob.peer_id
    err = refused(verifier_for(admission()), headers)
    assert err.status == 401 and f"expected {alice.peer_id}" in str(err)


@pytest.mark.parametrize(
    ("header", "value"),
    [
        (PEER, None),
        (SIGNATURE, None),
        ("X-Atomd-Key", "AB" * 32),
        (PEER, "peer-1"),
        (TIME, "nan"),
        (TIME, "-1"),
        (TIME, "1e9"),
        (NONCE, "00"),
        (PROOF, "xyz"),
        (SIGNATURE, "zz" * 64),
        (SIGNATURE, "00" * 63),
        (SWARM, ""),
    ],
)
def test_malformed_headers_are_unauthorized(
    alice: Identity, header: str, value: str | None
) -> None:
    headers = sign(alice, admission(), "POST", PATH, BODY, now=NOW)
    if value is None:
        del headers[header]
    else:
        headers[header] = value
    err = refused(verifier_for(admission()), headers)
    assert err.status == 401
    assert header in str(err)


def test_repeated_auth_header_is_unauthorized(alice: Identity) -> None:
    signed = sign(alice, admission(), "POST", PATH, BODY, now=NOW)
    raw = [(k.lower().encode(), v.encode()) for k, v in signed.items()]
    raw.append((b"x-atomd-swarm", b"lab"))
    err = refused(verifier_for(admission()), Headers(raw=raw))  # type: ignore[arg-type]
    assert err.status == 401 and "given twice" in str(err)


def test_admission_from_settings(alice: Identity) -> None:
    settings = Settings(
        swarm="lab", swarm_secret=SecretStr("s3cret"), allowed_keys=[alice.public_key_hex.upper()]
    )
    adm = Admission.from_settings(settings)
    assert adm == Admission("lab", b"s3cret", frozenset({alice.public_key_hex}))
    assert Admission.from_settings(Settings(swarm_secret=SecretStr(""))).secret is None
    with pytest.raises(ConfigError, match="swarm name"):
        Admission.from_settings(Settings(swarm="laboratoř"))


# Replay cache --------------------------------------------------------------------------------


def test_replay_cache_evicts_old_nonces() -> None:
    cache = ReplayCache(ttl_s=60, max_entries=100)
    cache.record("a", request_time=NOW, now=NOW)
    cache.record("b", request_time=NOW + 30, now=NOW + 30)
    with pytest.raises(PeerAuthError, match="replayed"):
        cache.record("a", request_time=NOW, now=NOW + 59)
    cache.record("c", request_time=NOW + 61, now=NOW + 61)  # "a" expires
    assert "a" not in cache and "b" in cache and len(cache) == 2
    cache.record("a", request_time=NOW + 61, now=NOW + 61)


def test_replay_cache_keeps_each_nonce_its_own_time() -> None:
    """A nonce recorded with a short lifetime goes before one recorded earlier with a long one,
    which is still refused until its own time is up; stale expiry entries do not pile up."""
    cache = ReplayCache(ttl_s=1000, max_entries=100)
    cache.record("long", request_time=NOW, now=NOW, ttl_s=1000)
    cache.record("short", request_time=NOW + 1, now=NOW + 1, ttl_s=100)
    cache.record("x", request_time=NOW + 102, now=NOW + 102)  # default ttl_s: 1000
    assert "short" not in cache and "long" in cache and "x" in cache
    cache.record("short", request_time=NOW + 102, now=NOW + 102, ttl_s=100)  # free again
    with pytest.raises(PeerAuthError, match="replayed"):
        cache.record("long", request_time=NOW, now=NOW + 999, ttl_s=100)
    cache.record("y", request_time=NOW + 1001, now=NOW + 1001, ttl_s=10)
    assert "long" not in cache and "x" in cache
    with pytest.raises(ValueError, match="ttl_s > 0"):
        cache.record("z", request_time=NOW, now=NOW, ttl_s=0)
    small = ReplayCache(ttl_s=10, max_entries=3)
    for i in range(200):  # dropped by count long before they expire
        small.record(f"n{i}", request_time=NOW + i, now=NOW + i / 1000, ttl_s=10)
    assert len(small) == 3 and len(small._expiry) <= 2 * 3 + 16


def test_a_routes_body_time_sets_how_long_its_nonce_is_kept(alice: Identity) -> None:
    """``body_s`` (the route's body deadline) bounds when a replay could still be accepted:
    2 x the clock skew + body_s after the first; the nonce is kept exactly that long, and never
    longer than with the verifier's own ``max_body_s``."""
    verifier = verifier_for(admission(), max_body_s=600.0)
    first = sign(alice, admission(), "POST", PATH, BODY, now=NOW)
    verifier.verify("POST", PATH, first, BODY, now=NOW, body_s=60.0)
    with pytest.raises(PeerAuthError, match="replayed request"):  # came at +30, took 60 s
        verifier.verify("POST", PATH, first, BODY, now=NOW + 90, arrived=NOW + 30, body_s=60.0)
    later = sign(alice, admission(), "POST", PATH, BODY, now=NOW + 121)
    verifier.verify("POST", PATH, later, BODY, now=NOW + 121, body_s=60.0)
    assert first[NONCE] not in verifier.replay_cache  # 2 x 30 + 60 s: gone
    capped = sign(alice, admission(), "POST", PATH, BODY, now=NOW + 200)
    verifier.verify("POST", PATH, capped, BODY, now=NOW + 200, body_s=10_000.0)
    last = sign(alice, admission(), "POST", PATH, BODY, now=NOW + 200 + 661)
    verifier.verify("POST", PATH, last, BODY, now=NOW + 200 + 661)
    assert capped[NONCE] not in verifier.replay_cache  # kept 2 x 30 + 600 s, not 10,060


def test_body_deadlines_grow_with_the_routes_largest_body() -> None:
    assert body_deadline_s(0) == MIN_BODY_S
    assert body_deadline_s(256 << 10) == pytest.approx(MIN_BODY_S + (256 << 10) / 8_000)
    assert body_deadline_s(10**12) == MAX_BODY_S
    assert body_deadline_s(10**12, cap=60.0) == 60.0
    with pytest.raises(ValueError, match="limit >= 0"):
        body_deadline_s(-1)


def test_replay_cache_size_is_capped_and_dropped_nonces_cannot_be_replayed(
    alice: Identity,
) -> None:
    verifier = verifier_for(admission(), max_nonces=3)
    sent = [sign(alice, admission(), "GET", PATH, b"", now=NOW + i) for i in range(5)]
    for i, headers in enumerate(sent):
        verifier.verify("GET", PATH, headers, b"", now=NOW + i)
    assert len(verifier.replay_cache) == 3
    assert sent[1][NONCE] not in verifier.replay_cache
    # Request 1's nonce was dropped early: its replay (and anything signed no later) is refused.
    err = refused(verifier, sent[1], method="GET", body=b"", now=NOW + 5)
    assert err.status == 401 and "cannot rule out a replay" in str(err)
    late = sign(alice, admission(), "GET", PATH, b"", now=NOW + 5)
    assert verifier.verify("GET", PATH, late, b"", now=NOW + 5)


# The FastAPI dependency ----------------------------------------------------------------------


@dataclass
class PeerApp:
    app: FastAPI
    rejected: list[AtomdError]


LIMIT = 4 << 20  # the test app's body limit


def make_peer_app(
    adm: Admission, *, failing_on_reject: bool = False, blocked: dict[str, str] | None = None
) -> PeerApp:
    rejected: list[AtomdError] = []

    async def on_reject(request: Request, error: AtomdError) -> None:
        assert isinstance(request, Request)
        rejected.append(error)
        if failing_on_reject:
            raise RuntimeError("database is gone")

    app = FastAPI()
    errors.install(app)
    verifier = verifier_for(adm, blocked=(blocked or {}).get)
    auth = peer_auth(verifier, limit=lambda r: LIMIT, on_reject=on_reject)
    Peer = Annotated[SignedRequest, Depends(auth)]

    @app.post("/p2p/v1/echo")
    async def echo(peer: Peer) -> dict[str, Any]:
        return {"peer": peer.peer.peer_id, "size": len(peer.body), "head": peer.body[:20].decode()}

    @app.get("/p2p/v1/info")
    async def info() -> PeerInfo:
        return PeerInfo(swarm="lab", version="test", id=ME, url="http://peer")

    @app.get("/p2p/v1/files/{name}")
    async def download(peer: Peer, name: str) -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            for i in range(4):
                yield bytes([i]) * 65536

        return StreamingResponse(chunks(), media_type="application/octet-stream")

    @app.get("/p2p/v1/slow")
    async def slow(peer: Peer) -> dict[str, str]:
        await asyncio.sleep(0.5)
        return {}

    return PeerApp(app, rejected)


class Echo(Message):
    peer: str
    size: int
    head: str


async def test_dependency_accepts_signed_and_reports_refused(alice: Identity) -> None:
    adm = admission(secret=b"s3cret")
    peer_app = make_peer_app(adm)
    transport = httpx.ASGITransport(app=peer_app.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://peer") as http:
        path = "/p2p/v1/echo?round=7&who=a%20b"
        body = b'{"x":1}'
        headers = sign(alice, adm, "POST", path, body)
        answer = await http.post(path, content=body, headers=headers)
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"peer": alice.peer_id, "size": 7, "head": '{"x":1}'}
        assert peer_app.rejected == []

        unsigned = await http.post(path, content=body)
        assert unsigned.status_code == 401
        assert unsigned.json()["error"] == "unauthorized"
        assert unsigned.headers["WWW-Authenticate"] == "Atomd-Signature"

        wrong = sign(alice, admission(secret=b"guess"), "POST", path, body)
        forbidden = await http.post(path, content=body, headers=wrong)
        assert forbidden.status_code == 403
        assert forbidden.json()["error"] == "forbidden"
        assert "wrong swarm secret" in forbidden.json()["detail"]

    assert [e.status for e in peer_app.rejected] == [401, 403]
    assert str(peer_app.rejected[1]) == forbidden.json()["detail"]


async def test_failing_on_reject_still_answers_401(alice: Identity) -> None:
    peer_app = make_peer_app(admission(), failing_on_reject=True)
    transport = httpx.ASGITransport(app=peer_app.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://peer") as http:
        answer = await http.post("/p2p/v1/echo", content=b"{}")
    assert answer.status_code == 401 and len(peer_app.rejected) == 1


async def test_large_body_is_verified_off_the_loop(alice: Identity) -> None:
    adm = admission()
    peer_app = make_peer_app(adm)
    body = b'{"blob":"' + b"a" * (2 << 20) + b'"}'
    transport = httpx.ASGITransport(app=peer_app.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://peer") as http:
        headers = sign(alice, adm, "POST", "/p2p/v1/echo", body)
        answer = await http.post("/p2p/v1/echo", content=body, headers=headers)
    assert answer.status_code == 200 and answer.json()["peer"] == alice.peer_id


class Counted:
    """A request body that counts the bytes the server pulls from it."""

    def __init__(self, size: int, chunk: int = 65536) -> None:
        self.size, self.chunk, self.sent = size, chunk, 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while self.sent < self.size:
            n = min(self.chunk, self.size - self.sent)
            self.sent += n
            yield b"a" * n


async def test_bodies_are_bounded_before_they_are_read(alice: Identity) -> None:
    """Unsigned: refused before one byte of the body is read. Signed but over the limit:
    refused on its declared length, or as soon as a chunked body streams past the limit."""
    adm = admission()
    peer_app = make_peer_app(adm)
    transport = httpx.ASGITransport(app=peer_app.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://peer") as http:
        unsigned = Counted(200 << 20)
        answer = await http.post("/p2p/v1/echo", content=unsigned)
        assert answer.status_code == 401 and unsigned.sent <= 65536
        big = b"a" * (LIMIT + 1)
        headers = sign(alice, adm, "POST", "/p2p/v1/echo", big)
        answer = await http.post("/p2p/v1/echo", content=big, headers=headers)
        assert answer.status_code == 413 and answer.json()["error"] == "too_large"
        assert f"at most {LIMIT}" in answer.json()["detail"]
        streamed = Counted(200 << 20)  # no Content-Length: chunked
        headers = sign(alice, adm, "POST", "/p2p/v1/echo", b"")
        answer = await http.post("/p2p/v1/echo", content=streamed, headers=headers)
        assert answer.status_code == 413 and "streamed past" in answer.json()["detail"]
        assert streamed.sent <= LIMIT + 2 * 65536
        # Not a length: "²".isdigit() holds and int("²") raises (no 500).
        headers = {
            **sign(alice, adm, "POST", "/p2p/v1/echo", b"{}"),
            "Content-Length": "²".encode("latin-1"),
        }
        answer = await http.post("/p2p/v1/echo", content=b"{}", headers=headers)
        assert answer.status_code == 413 and "not a number" in answer.json()["detail"]
    assert [type(e).__name__ for e in peer_app.rejected] == [
        "PeerAuthError", "TooLargeError", "TooLargeError", "TooLargeError"
    ]  # fmt: skip


async def test_a_key_the_allow_list_leaves_out_or_a_ban_names_is_refused_before_its_body(
    alice: Identity, bob: Identity
) -> None:
    """The allow-list and the operator's bans need no body: a key they refuse cannot make this
    daemon read or hash one (checked after the whole body, up to the route's limit, a
    model-sized frame on the delta route would be read first)."""
    listed = make_peer_app(admission(secret=b"s3cret", allowed=frozenset({alice.public_key_hex})))
    banning = make_peer_app(admission(), blocked={bob.public_key_hex: "operator's ban: flood"})
    for peer_app in (listed, banning):
        transport = httpx.ASGITransport(app=peer_app.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://peer") as http:
            body = Counted(LIMIT)
            headers = sign(bob, admission(secret=b"guess"), "POST", "/p2p/v1/echo", b"")
            answer = await http.post("/p2p/v1/echo", content=body, headers=headers)
        assert answer.status_code == 403, answer.text
        assert body.sent <= 65536, f"{body.sent} bytes of a refused key's body were read"
    assert "key not allowed" in str(listed.rejected[0])
    assert "banned here: operator's ban: flood" in str(banning.rejected[0])


# PeerClient against a real server ------------------------------------------------------------


@pytest.fixture
async def peer_url() -> AsyncIterator[str]:
    adm = admission(secret=b"s3cret")
    server = uvicorn.Server(
        uvicorn.Config(make_peer_app(adm).app, log_level="warning", lifespan="off")
    )
    # Bind first and hand the socket over: no window for another process to take the port.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(5):
            while not server.started:  # noqa: ASYNC110 (uvicorn offers no event to wait on)
                await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 5)
        sock.close()


@pytest.fixture
def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


async def test_peer_client_signed_requests_pass(alice: Identity, peer_url: str) -> None:
    async with PeerClient(alice, admission(secret=b"s3cret"), tls=False) as client:
        # The target's id is asked of /info first (the peer id is not known here).
        answer = await client.post_bytes(peer_url, "/p2p/v1/echo?q=a b", b"[1, 2]", Echo)
        assert answer == Echo(peer=alice.peer_id, size=6, head="[1, 2]")
        async with client.stream("GET", peer_url, "/p2p/v1/files/delta%201.bin") as response:
            data = b"".join([chunk async for chunk in response.aiter_bytes()])
        assert data == b"".join(bytes([i]) * 65536 for i in range(4))
        with pytest.raises(PeerRequestError, match=r"answered 405") as info:
            await client.get(peer_url, "/p2p/v1/echo", Echo)
        assert info.value.status == 405
        with pytest.raises(PeerRequestError, match=r"timed out after 0.2 s") as info:
            await client.get(peer_url, "/p2p/v1/slow", Echo, timeout=0.2)
        assert info.value.status is None
        with pytest.raises(PeerRequestError, match=r"answered a malformed Echo: peer: Field"):
            await client.get(peer_url, "/p2p/v1/slow", Echo)


async def test_peer_client_signs_for_its_target(
    alice: Identity, bob: Identity, peer_url: str
) -> None:
    async with PeerClient(alice, admission(secret=b"s3cret"), tls=False) as client:
        with pytest.raises(PeerRequestError, match=r"answered 401: wrong target") as info:
            await client.post_bytes(peer_url, "/p2p/v1/echo", b"{}", Echo, target=bob.peer_id)
        assert info.value.status == 401
        # A remembered id that is out of date is asked again, once.
        client._remember(peer_url.rstrip("/"), bob.peer_id)
        assert (await client.post_bytes(peer_url, "/p2p/v1/echo", b"{}", Echo)).size == 2


async def test_peer_client_with_wrong_secret_is_forbidden(alice: Identity, peer_url: str) -> None:
    async with PeerClient(alice, admission(secret=b"guess"), tls=False) as client:
        with pytest.raises(PeerRequestError, match=r"answered 403: wrong swarm secret") as info:
            await client.post_bytes(peer_url, "/p2p/v1/echo", b"{}", Echo)
        assert info.value.status == 403
        with pytest.raises(PeerRequestError, match=r"answered 403") as info:
            async with client.stream("GET", peer_url, "/p2p/v1/files/x"):
                pass
        assert info.value.status == 403


async def test_peer_client_unreachable_peer(alice: Identity, closed_port: int) -> None:
    async with PeerClient(alice, admission(), timeout=2, tls=False) as client:
        with pytest.raises(PeerRequestError, match=r"failed") as info:
            await client.get(f"http://127.0.0.1:{closed_port}", "/p2p/v1/x", Echo, target=ME)
        assert info.value.status is None


async def test_a_source_refused_too_often_gets_429_before_any_check(alice: Identity) -> None:
    from atomd.rejections import Rejections

    adm = admission()
    rejections = Rejections(burst=5, rate=0.01)

    async def on_reject(request: Request, error: AtomdError) -> None:
        rejections.refused("peer", request.client.host if request.client else "?", 401, str(error))

    app = FastAPI()
    errors.install(app)
    auth = peer_auth(verifier_for(adm), limit=lambda r: LIMIT, on_reject=on_reject,
                     retry_after=rejections.retry_after)  # fmt: skip

    @app.post("/p2p/v1/echo")
    async def echo(peer: Annotated[SignedRequest, Depends(auth)]) -> dict[str, Any]:
        return {}

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://peer") as http:
        codes = [(await http.post("/p2p/v1/echo", content=b"x")).status_code for _ in range(8)]
        assert codes == [401] * 5 + [429] * 3
        headers = sign(alice, adm, "POST", "/p2p/v1/echo", b"x")
        r = await http.post("/p2p/v1/echo", content=b"x", headers=headers)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"] == "rate_limited"


async def test_a_routes_deadline_cuts_off_a_trickled_body(alice: Identity) -> None:
    """``peer_auth``'s ``deadline`` (the route's, not the verifier's 900 s) bounds how long an
    admitted sender may hold a connection with a trickled body; on time, the same body passes."""
    adm = admission()
    app = FastAPI()
    errors.install(app)
    auth = peer_auth(verifier_for(adm), limit=lambda r: LIMIT, deadline=lambda r: 0.5)

    @app.post("/p2p/v1/echo")
    async def echo(peer: Annotated[SignedRequest, Depends(auth)]) -> dict[str, Any]:
        return {"size": len(peer.body)}

    async def trickle(pause: float) -> AsyncIterator[bytes]:
        for _ in range(10):
            await asyncio.sleep(pause)
            yield b"x"

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://peer") as http:
        headers = sign(alice, adm, "POST", "/p2p/v1/echo", b"x" * 10)
        r = await http.post("/p2p/v1/echo", content=trickle(0.1), headers=headers)
        assert r.status_code == 422 and "longer than 0.5 s" in r.text, r.text
        headers = sign(alice, adm, "POST", "/p2p/v1/echo", b"x" * 10)
        r = await http.post("/p2p/v1/echo", content=trickle(0.0), headers=headers)
        assert r.status_code == 200 and r.json() == {"size": 10}


async def test_a_sender_that_disconnects_mid_body_is_a_clean_refusal() -> None:
    """Not a ClientDisconnect traceback logged as a server error (seen under load)."""
    from starlette.requests import Request as StarletteRequest

    from atomd.errors import MessageError
    from atomd_api.peer_auth import read_body

    messages: list[dict[str, Any]] = [
        {"type": "http.request", "body": b"x" * 10, "more_body": True},
        {"type": "http.disconnect"},
    ]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "query_string": b""}
    with pytest.raises(MessageError, match="disconnected after 10 bytes"):
        await read_body(StarletteRequest(scope, receive), 1000)


async def test_a_body_slower_than_its_deadline_is_refused() -> None:
    """A sender trickling its body is cut off at the verifier's ``max_body_s``: the replay
    cache keeps a nonce only that long past a request's freshness window."""
    from starlette.requests import Request as StarletteRequest

    from atomd.errors import MessageError
    from atomd_api.peer_auth import read_body

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(0.05)
        return {"type": "http.request", "body": b"x", "more_body": True}

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "query_string": b""}
    with pytest.raises(MessageError, match=r"longer than 0.3 s \(\d+ bytes had come\)"):
        await read_body(StarletteRequest(scope, receive), 1000, deadline_s=0.3)


async def test_an_answer_larger_than_its_type_takes_is_refused_unread() -> None:
    """Every answer type has its own bound (``Message.MAX_ANSWER_BYTES``): a loss curve is
    ~60 kB, so a peer answering 15 MiB of points (under a bound of 16 MiB for every answer)
    is refused before anything is parsed; pydantic holds the GIL while it parses, and such an
    answer would hold this daemon's event loop ~1 s at every dashboard refresh. An honest
    curve still passes."""
    from atomd.p2p.messages import ProgressCurve

    honest = b'{"points":[{"step":1,"loss":2.5,"tokens_per_s":10.0,"at":1.7e9}]}'
    flood = b'{"points":[' + b",".join([b"{}"] * ((15 << 20) // 3)) + b"]}"
    answers = iter([honest, flood])

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200, content=next(answers), headers={"Content-Type": "application/json"}
        )

    assert ProgressCurve.MAX_ANSWER_BYTES < len(flood) < 16 << 20
    admission = Admission(swarm="lab", secret=None, allowed_keys=frozenset())
    client = PeerClient(Identity.generate(), admission, tls=False,
                        transport=httpx.MockTransport(answer))  # fmt: skip
    target = Identity.generate().peer_id
    async with client:
        curve = await client.get("http://peer", "/p2p/v1/jobs/j/progress", ProgressCurve,
                                 target=target)  # fmt: skip
        assert [p.step for p in curve.points] == [1]
        with pytest.raises(PeerRequestError, match=f"more than {ProgressCurve.MAX_ANSWER_BYTES}"):
            await client.get("http://peer", "/p2p/v1/jobs/j/progress", ProgressCurve,
                             target=target)  # fmt: skip
