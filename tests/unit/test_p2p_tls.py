"""TLS on the peer plane, bound to the Ed25519 identity: real uvicorn servers with TLS on
loopback, ``PeerClient`` pinning the certificate's key to the peer id it expects.

A man in the middle (a server at the URL with another key, even one that claims the expected
peer id in its answers) never receives a request and its answers are never read; a plain-HTTP
peer is refused; a connection kept alive answers only for the key it was pinned to."""

# No ``from __future__ import annotations``: FastAPI resolves the routes' annotations.

import asyncio
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

import pytest
import uvicorn
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from fastapi import Depends, FastAPI, Request
from pydantic import ValidationError

from atomd.config import Settings
from atomd.errors import PeerAuthError, PeerRequestError
from atomd.p2p import congestion, tls
from atomd.p2p.client import PeerClient
from atomd.p2p.identity import Identity
from atomd.p2p.messages import MemberRecord, Message, PeerInfo, sign_record
from atomd.p2p.signing import Admission, RequestVerifier, VerifiedPeer
from atomd_api import errors
from atomd_api.peer import _check_sender
from atomd_api.peer_auth import SignedRequest, peer_auth
from tests.conftest import another_congestion

ADMISSION = Admission(swarm="lab", secret=b"s3cret", allowed_keys=frozenset())


class Echo(Message):
    peer: str
    size: int


def peer_app(me: Identity, *, claims: str | None = None, seen: list[str] | None = None) -> FastAPI:
    """A peer plane of ``me``: /info names ``claims`` (default: ``me``'s own id), /echo takes
    requests signed for ``claims``. ``seen`` collects every request that reached it."""
    said = claims or me.peer_id
    app = FastAPI()
    errors.install(app)
    auth = peer_auth(RequestVerifier(ADMISSION, self_id=said), limit=lambda r: 1 << 20)
    log = seen if seen is not None else []

    @app.get("/p2p/v1/info")
    async def info() -> PeerInfo:
        log.append("info")
        return PeerInfo(swarm="lab", version="test", id=said, url="https://peer")

    @app.post("/p2p/v1/echo")
    async def echo(peer: Annotated[SignedRequest, Depends(auth)]) -> dict[str, Any]:
        log.append("echo")
        return {"peer": peer.peer.peer_id, "size": len(peer.body)}

    return app


Serve = Callable[..., Awaitable[str]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """``await serve(app, identity)``: a real uvicorn server on loopback, TLS with that
    identity's certificate (plain HTTP when ``identity`` is None); its https:// URL."""
    running: list[tuple[uvicorn.Server, asyncio.Task[None], socket.socket]] = []

    async def start(app: FastAPI, identity: Identity | None) -> str:
        ctx = tls.server_context(identity) if identity is not None else None
        config = uvicorn.Config(
            app, log_level="critical", lifespan="off",
            ssl_context_factory=None if ctx is None else (lambda _c, _d: ctx),
        )  # fmt: skip
        server = uvicorn.Server(config)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        running.append((server, task, sock))
        async with asyncio.timeout(10):
            while not server.started:  # noqa: ASYNC110 (uvicorn offers only a flag)
                await asyncio.sleep(0.01)
        return f"https://127.0.0.1:{sock.getsockname()[1]}"

    yield start
    for server, task, sock in running:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        sock.close()


def test_the_certificate_carries_the_identity_key() -> None:
    me = Identity.generate()
    cert = x509.load_pem_x509_certificate(tls.certificate_pem(me))
    key = cert.public_key()
    assert isinstance(key, Ed25519PublicKey)
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()
    assert raw == me.public_key_hex
    der = cert.public_bytes(serialization.Encoding.DER)
    assert tls.peer_id_of_certificate(der) == (me.peer_id, me.public_key_hex)
    with pytest.raises(tls.CertificateError, match="no certificate"):
        tls.peer_id_of_certificate(None)
    with pytest.raises(tls.CertificateError, match="malformed"):
        tls.peer_id_of_certificate(b"\x30\x03abc")


async def test_a_pinned_peer_answers_over_tls_1_3(serve: Serve) -> None:
    server, alice = Identity.generate(), Identity.generate()
    seen: list[str] = []
    url = await serve(peer_app(server, seen=seen), server)
    async with PeerClient(alice, ADMISSION) as client:
        # First contact: the id is learned from the certificate, and /info agrees.
        answer = await client.post_bytes(url, "/p2p/v1/echo", b"[1]", Echo)
        assert answer == Echo(peer=alice.peer_id, size=3)
        assert client.peer_at(url) == server.peer_id
        # Known id, kept-alive connection.
        answer = await client.post_bytes(
            url, "/p2p/v1/echo", b"[1, 2]", Echo, target=server.peer_id
        )
        assert answer.size == 6
    assert seen == ["info", "echo", "echo"]


async def test_a_man_in_the_middle_with_another_key_is_refused(serve: Serve) -> None:
    victim, mallory, alice = Identity.generate(), Identity.generate(), Identity.generate()
    seen: list[str] = []
    # Mallory answers at the URL, with its own key, claiming to be the victim in every answer.
    url = await serve(peer_app(mallory, claims=victim.peer_id, seen=seen), mallory)
    async with PeerClient(alice, ADMISSION) as client:
        with pytest.raises(PeerRequestError, match=r"is .* by its certificate, expected") as e:
            await client.post_bytes(
                url, "/p2p/v1/echo", b"secret delta", Echo, target=victim.peer_id
            )
        assert mallory.peer_id in str(e.value) and victim.peer_id in str(e.value)
        assert seen == [], "nothing was written to the connection before the check"
        # First contact: /info says "victim", the certificate says mallory.
        with pytest.raises(PeerRequestError, match=r"names peer .* but the TLS certificate is"):
            await client.info(url)
        assert client.peer_at(url) is None
        with pytest.raises(PeerRequestError, match="TLS certificate is"):
            await client.post_bytes(url, "/p2p/v1/echo", b"secret delta", Echo)
    assert seen == ["info", "info"], "only the unsigned /info was asked; no request body sent"


async def test_answers_count_only_from_the_pinned_key(serve: Serve) -> None:
    """A connection kept alive to one peer does not answer for another peer id at that URL."""
    server, other, alice = Identity.generate(), Identity.generate(), Identity.generate()
    url = await serve(peer_app(server), server)
    async with PeerClient(alice, ADMISSION) as client:
        await client.info(url)  # a kept-alive connection to `server` is in the pool now
        with pytest.raises(PeerRequestError, match=r"the answer comes from peer .* expected"):
            await client.post_bytes(url, "/p2p/v1/echo", b"{}", Echo, target=other.peer_id)
        # The membership's id for that URL is stale (not given by the caller): asked again.
        client._remember(url, other.peer_id)
        assert (await client.post_bytes(url, "/p2p/v1/echo", b"{}", Echo)).size == 2
        assert client.peer_at(url) == server.peer_id


async def test_a_plain_http_peer_is_refused_when_tls_is_on(serve: Serve) -> None:
    server, alice = Identity.generate(), Identity.generate()
    seen: list[str] = []
    url = await serve(peer_app(server, seen=seen), None)  # a plain-HTTP server
    plain = url.replace("https://", "http://")
    async with PeerClient(alice, ADMISSION) as client:
        with pytest.raises(PeerRequestError, match="plain HTTP refused"):
            await client.post_bytes(plain, "/p2p/v1/echo", b"{}", Echo, target=server.peer_id)
        with pytest.raises(PeerRequestError, match="plain HTTP refused"):
            await client.info(plain)
        with pytest.raises(PeerRequestError, match=r"TLS handshake with .* failed"):
            await client.post_bytes(url, "/p2p/v1/echo", b"{}", Echo, target=server.peer_id)
    assert seen == []
    # And the other way round: a plain-HTTP client does not call a TLS URL.
    async with PeerClient(alice, ADMISSION, tls=False) as client:
        with pytest.raises(PeerRequestError, match="runs without TLS"):
            await client.info(url)
        assert (await client.post_bytes(plain, "/p2p/v1/echo", b"{}", Echo)).size == 2


async def test_a_tls_server_refuses_a_plain_http_client_and_old_tls(serve: Serve) -> None:
    server = Identity.generate()
    url = await serve(peer_app(server), server)
    port = int(url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /p2p/v1/info HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(4096), 5)
    writer.close()
    assert b"HTTP/1.1 200" not in answer and b"p2p" not in answer
    old = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    old.check_hostname, old.verify_mode = False, ssl.CERT_NONE
    old.maximum_version = ssl.TLSVersion.TLSv1_2
    with pytest.raises((ssl.SSLError, ConnectionError)):
        await asyncio.open_connection("127.0.0.1", port, ssl=old)


def test_settings_default_to_tls_and_refuse_mixed_urls(tmp_path: Any) -> None:
    s = Settings(data_dir=tmp_path, listen="127.0.0.1:32071")
    assert s.peer_tls and s.advertise_url == "https://127.0.0.1:32071"
    off = Settings(data_dir=tmp_path, listen="127.0.0.1:32071", peer_tls=False)
    assert off.advertise_url == "http://127.0.0.1:32071"
    with pytest.raises(ValidationError, match="peer plane uses TLS"):
        Settings(data_dir=tmp_path, seeds=["http://a:7071"])
    with pytest.raises(ValidationError, match="without TLS"):
        Settings(data_dir=tmp_path, peer_tls=False, advertise="https://a:7071")


def test_a_member_of_the_other_scheme_is_refused_with_the_reason() -> None:
    me = Identity.generate()
    for url, on in (("http://a:7071", True), ("https://a:7071", False)):
        record = sign_record(MemberRecord(
            id=me.peer_id, url=url, public_key=me.public_key_hex, state="alive",
            incarnation=int(time.time() * 1000),
        ), me, "lab")  # fmt: skip
        signed = SignedRequest(VerifiedPeer(me.peer_id, me.public_key_hex), b"")
        with pytest.raises(PeerAuthError, match="mixed swarm") as e:
            _check_sender(record, signed, "lab", on)
        assert e.value.status == 403
        _check_sender(record, signed, "lab", not on)


class Port(Message):
    port: int


def port_app(me: Identity) -> FastAPI:
    """``peer_app`` with ``POST /p2p/v1/port``: the client's port as the server saw it, which
    tells the connection a request came on."""
    app = peer_app(me)

    @app.post("/p2p/v1/port")
    async def port(request: Request) -> dict[str, int]:
        assert request.client is not None
        return {"port": request.client.port}

    return app


async def test_peer_connections_outlive_an_idle_pause_of_more_than_5_s(serve: Serve) -> None:
    """A settled swarm probes each member every few seconds and a slow link's rounds come
    every 5-30 s: both ends keep an idle connection longer than httpx's and uvicorn's 5 s, so
    such traffic costs no new TCP and TLS handshake. The server is the daemon's own."""
    from atomd.daemon import _server
    from atomd.p2p.client import KEEPALIVE_S, SERVER_KEEPALIVE_S

    server, alice = Identity.generate(), Identity.generate()
    app = port_app(server)

    peer = _server(app, "critical", tls.server_context(server), keep_alive_s=SERVER_KEEPALIVE_S)
    assert peer.config.timeout_keep_alive > KEEPALIVE_S > 5
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    task = asyncio.create_task(peer.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(10):
            while not peer.started:  # noqa: ASYNC110 (uvicorn offers only a flag)
                await asyncio.sleep(0.01)
        url = f"https://127.0.0.1:{sock.getsockname()[1]}"
        async with PeerClient(alice, ADMISSION) as client:
            first = await client.post_bytes(url, "/p2p/v1/port", b"{}", Port)
            await asyncio.sleep(6.5)
            again = await client.post_bytes(url, "/p2p/v1/port", b"{}", Port)
        assert again.port == first.port  # the same connection
    finally:
        peer.should_exit = True
        await asyncio.wait_for(task, 10)
        sock.close()


def _congestion_of_local_port(port: int) -> str | None:
    """The TCP congestion control of this process's socket bound to local ``port`` (Linux)."""
    import os
    import stat

    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue  # closed meanwhile
        with s:
            try:
                if s.family != socket.AF_INET or s.getsockname()[1] != port:
                    continue
                name = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
            except OSError:
                continue
            return name.rstrip(b"\0").decode()
    return None


@pytest.mark.skipif(not hasattr(socket, "TCP_CONGESTION"), reason="Linux only")
@pytest.mark.parametrize("over_tls", [True, False], ids=["tls", "plain"])
async def test_peer_connections_use_the_chosen_congestion_control(
    serve: Serve, over_tls: bool
) -> None:
    """``Settings.tcp_congestion`` reaches the sockets the peer client opens (over TLS, the
    daemon's path, and plain HTTP); without it they keep the system's default, which is not
    the one chosen."""
    default, name = another_congestion()
    chosen = congestion.choose(name)
    assert chosen.note == f"TCP {name}"

    server, alice = Identity.generate(), Identity.generate()
    app = port_app(server)

    url = await serve(app, server if over_tls else None)
    if not over_tls:
        url = url.replace("https://", "http://")
    for given, expected in ((chosen, name), (None, default)):
        async with PeerClient(alice, ADMISSION, tls=over_tls, congestion=given) as client:
            used = await client.post_bytes(url, "/p2p/v1/port", b"{}", Port)
            assert _congestion_of_local_port(used.port) == expected


@pytest.mark.skipif(not hasattr(socket, "TCP_CONGESTION"), reason="Linux only")
async def test_a_congestion_control_refused_later_does_not_fail_the_connection(
    serve: Serve, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An option the kernel refuses on a connection (an administrator changed what is allowed
    after the daemon's check) leaves that connection on the system's default, with one
    warning for all such connections; the requests go through."""
    monkeypatch.setattr(congestion, "_warned", set())
    refused = congestion.Congestion(
        ((socket.IPPROTO_TCP, socket.TCP_CONGESTION, b"nosuchalgo"),), "x"
    )
    server, alice = Identity.generate(), Identity.generate()
    url = await serve(port_app(server), server)
    ports = []
    for _ in range(2):  # two clients: two connections
        async with PeerClient(alice, ADMISSION, congestion=refused) as client:
            ports.append((await client.post_bytes(url, "/p2p/v1/port", b"{}", Port)).port)
    assert len(set(ports)) == 2
    assert caplog.text.count("could not set TCP congestion control nosuchalgo") == 1


def test_a_congestion_control_the_kernel_refuses_leaves_the_systems(
    caplog: pytest.LogCaptureFixture,
) -> None:
    refused = congestion.choose("nosuchalgo")
    assert refused.options == ()
    if hasattr(socket, "TCP_CONGESTION"):
        assert "TCP congestion control nosuchalgo: not offered by this kernel" in caplog.text
    system = congestion.choose(congestion.SYSTEM)
    assert system.options == () and "the system's" in system.note
    with pytest.raises(ValidationError, match="tcp_congestion"):
        Settings(tcp_congestion="cubic; rm")
