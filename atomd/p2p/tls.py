"""TLS on the peer plane, bound to each daemon's Ed25519 identity.

The server presents a self-signed X.509 certificate whose key *is* the daemon's Ed25519 key
(made at every start from the key in the data directory; nothing else to manage or renew).
There is no certificate authority: the client accepts no certificate for what a CA says, only
for its key. After the TLS 1.3 handshake (in which the server proves it holds the private key:
the CertificateVerify signature is always checked), the client derives the peer id from the
certificate's public key and compares it with the peer id it expects at that URL; a
connection to anyone else is closed before a byte of the request is sent
(``PeerBackend``). A URL whose peer id is not known yet (a seed) learns it from the
certificate, and the ``/info`` answer and the signed member record served there must name the
same id (``atomd.p2p.client``).

So answers are authenticated (only the pinned key can have sent them) and every byte between
peers is encrypted. Requests are still signed (``atomd.p2p.signing``): TLS authenticates the
answerer, the signature the requester.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import os
import ssl
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpcore
import httpx
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.x509.oid import NameOID

from atomd.datadir import TLS_SCRATCH_PREFIX
from atomd.p2p.congestion import SocketOption, tune
from atomd.p2p.identity import Identity, peer_id_from_public_key

CERT_DAYS = 3650  # the certificate is made anew at every start; its dates are not checked

# The peer id the current request expects at the other end; set by the peer client around
# each request (the connection is made in the same task, so the handshake sees it).
expected_peer: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "atomd_expected_peer", default=None
)


class CertificateError(ValueError):
    """A peer's certificate that cannot be an atomd identity, or is not the one expected."""


def certificate_pem(identity: Identity) -> bytes:
    """A self-signed X.509 certificate (PEM) for ``identity``'s Ed25519 key; CN = peer id."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"atomd {identity.peer_id}")])
    now = datetime.datetime.now(datetime.UTC)
    key = identity.private_key
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .sign(key, algorithm=None)  # Ed25519 takes no separate hash
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def server_context(identity: Identity, scratch: Path | None = None) -> ssl.SSLContext:
    """The peer-plane server's TLS 1.3 context, presenting ``identity``'s certificate.

    ``load_cert_chain`` reads files only: the certificate and key are written to a private
    temporary folder (in ``scratch`` when given, e.g. the data directory) and removed at once."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    key_pem = identity.private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    if scratch is not None:
        scratch.mkdir(parents=True, exist_ok=True)
    # A kill while the files exist leaves the folder, with a copy of the key: the data
    # directory's holder sweeps it at its next start (``atomd.datadir.sweep``).
    with tempfile.TemporaryDirectory(dir=scratch, prefix=TLS_SCRATCH_PREFIX) as tmp:  # 0700
        cert_path, key_path = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
        cert_path.write_bytes(certificate_pem(identity))
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key_pem)
        ctx.load_cert_chain(cert_path, key_path)
    return ctx


def client_context() -> ssl.SSLContext:
    """The peer client's TLS 1.3 context: no CA and no host name (peers are pinned by key by
    ``PeerBackend``, which is what makes this safe)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def peer_id_of_certificate(der: bytes | None) -> tuple[str, str]:
    """(peer id, public key hex) of a peer certificate (DER); ``CertificateError`` if it is
    missing, malformed, or not for an Ed25519 key."""
    if not der:
        raise CertificateError("the peer presented no certificate")
    if len(der) > 16384:
        raise CertificateError(f"the peer's certificate is {len(der)} bytes; expected < 16 KiB")
    try:
        key = x509.load_der_x509_certificate(der).public_key()
    except ValueError as e:
        raise CertificateError(f"the peer's certificate is malformed ({e})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise CertificateError(
            f"the peer's certificate holds a {type(key).__name__}, expected the Ed25519 key of "
            "an atomd peer"
        )
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()
    return peer_id_from_public_key(raw), raw


def stream_peer(stream: Any) -> tuple[str, str] | None:
    """(peer id, key) of the TLS connection behind an httpx response's ``network_stream``
    extension, or None when the stream is not TLS."""
    if stream is None:
        return None
    ssl_object = stream.get_extra_info("ssl_object")
    if ssl_object is None:
        return None
    return peer_id_of_certificate(ssl_object.getpeercert(binary_form=True))


def check_expected(found: str, url: str) -> None:
    """Raise ``CertificateError`` when the request expects another peer than ``found``."""
    want = expected_peer.get()
    if want is not None and want != found:
        raise CertificateError(
            f"TLS peer at {url} is {found} by its certificate, expected {want}: refused "
            "(another daemon answers at that address, or someone is in the middle)"
        )


@contextlib.contextmanager
def expecting(peer_id: str | None) -> Iterator[None]:
    """Expect ``peer_id`` (None: anyone, to learn it) at the other end of requests made here."""
    token = expected_peer.set(peer_id)
    try:
        yield
    finally:
        expected_peer.reset(token)


class _PinnedStream(httpcore.AsyncNetworkStream):
    """A TCP stream whose ``start_tls`` refuses a certificate that is not the expected peer's."""

    def __init__(self, inner: httpcore.AsyncNetworkStream, where: str) -> None:
        self._inner = inner
        self._where = where

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self._inner.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            tls = await self._inner.start_tls(ssl_context, server_hostname, timeout)
        except httpcore.ConnectError as e:
            raise httpcore.ConnectError(
                f"TLS handshake with {self._where} failed ({e or type(e).__name__}); is it a "
                "plain-HTTP peer (--no-peer-tls)? every member of a swarm must use the same "
                "setting"
            ) from e
        try:
            found = stream_peer(tls)
            if found is None:
                raise CertificateError(f"{self._where} did not start TLS")
            check_expected(found[0], self._where)
        except CertificateError as e:
            await tls.aclose()
            raise httpcore.ConnectError(str(e)) from None
        return tls

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class PeerBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend for the peer plane: TCP only, each connection's socket
    given ``options`` (its congestion control, ``atomd.p2p.congestion.tune``: best effort, so
    a refused option never fails a connection), and with ``pinned`` each TLS handshake
    checked against the peer id the request expects (``expecting``) before the request is
    written."""

    def __init__(self, options: Iterable[SocketOption] = (), *, pinned: bool = True) -> None:
        self._inner = httpcore.AnyIOBackend()
        self._options = tuple(options)
        self._pinned = pinned

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._inner.connect_tcp(host, port, timeout, local_address, socket_options)
        tune(stream.get_extra_info("socket"), self._options)
        return _PinnedStream(stream, f"{host}:{port}") if self._pinned else stream

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("peers are reached over TCP only")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class PeerTransport(httpx.AsyncHTTPTransport):
    """httpx's transport over ``PeerBackend``, no proxies; with ``pinned`` (TLS on the peer
    plane) over ``client_context``."""

    def __init__(
        self, limits: httpx.Limits, options: Iterable[SocketOption] = (), *, pinned: bool
    ) -> None:
        context = client_context() if pinned else None
        super().__init__(verify=context if context is not None else True, trust_env=False)
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=context,
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=PeerBackend(options, pinned=pinned),
        )
