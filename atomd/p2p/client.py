"""The peer client: calls other daemons' peer planes, signing every request for its target.

Messages go out and come back as the typed models of ``atomd.p2p.messages``; an answer that
does not fit its model, or is larger than its model's ``MAX_ANSWER_BYTES``, is a
``PeerRequestError``.
Every call has a timeout. A request is signed for the peer id it is meant for: given by the
caller where the membership knows it, otherwise asked of the URL first (``GET /p2p/v1/info``,
remembered per URL and asked again when the peer answers that the request was not for it).

With TLS (the default, ``atomd.p2p.tls``) every connection is pinned: the server's certificate
key must be the one behind the peer id the request is for, checked after the handshake and
before the request is written, and again on every answer (a kept-alive connection), so no
answer is trusted from anyone else. A URL of the other scheme (``http://`` with TLS on,
``https://`` with it off) is refused with the reason: a swarm does not mix the two.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import TracebackType

import httpx

from atomd import __version__
from atomd.errors import PeerRequestError
from atomd.p2p import paths
from atomd.p2p.congestion import SYSTEMS, Congestion
from atomd.p2p.identity import Identity
from atomd.p2p.messages import M, Message, PeerInfo, parse_answer
from atomd.p2p.signing import Admission, sign_request
from atomd.p2p.tls import CertificateError, PeerTransport, expecting, stream_peer

DEFAULT_TIMEOUT_S = 5.0
INFO_TIMEOUT_S = 3.0
# Enough of an error answer to show its detail.
MAX_ERROR_BYTES = 64 << 10
# Connections to peers are kept open between calls for KEEPALIVE_S: a settled swarm probes
# each member every few seconds and a slow link's rounds come every 5-30 s, and a new
# connection costs a TCP and a TLS handshake (~5 kB, and round trips through a full upload
# queue) where a kept one costs nothing. httpx's default is 5 s. The peer plane's server keeps
# them SERVER_KEEPALIVE_S, longer, so that it is the client that closes an idle connection,
# never the server just as the client sends on it.
KEEPALIVE_S = 30.0
SERVER_KEEPALIVE_S = KEEPALIVE_S + 5
LIMITS = httpx.Limits(
    max_connections=100, max_keepalive_connections=20, keepalive_expiry=KEEPALIVE_S
)
_TARGETS_KEPT = 1024  # URLs whose peer id is remembered

_JSON = "application/json"
_OCTETS = "application/octet-stream"


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


@asynccontextmanager
async def _anyone() -> AsyncIterator[None]:
    """Accept any certificate on a new connection (first contact: it tells who is there)."""
    with expecting(None):
        yield


def _detail(body: bytes | None) -> str:
    """The ``detail`` of an atomd error answer, else the start of the body."""
    if body is None:
        return "(error body too large)"
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("detail"), str):
        return str(parsed["detail"])[:500]
    text = body.decode("utf-8", "replace").strip()
    return (text[:200] + "...") if len(text) > 200 else text or "(empty body)"


class PeerClient:
    """Calls other daemons' peer planes, signing every request. One pooled HTTP client.

    Every call has a timeout (``timeout`` seconds unless given): the whole call for the message
    methods, each connect/read/write for ``stream`` (so large downloads may take longer).
    Failures raise ``PeerRequestError``."""

    def __init__(
        self,
        identity: Identity,
        admission: Admission,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        tls: bool = True,
        transport: httpx.AsyncBaseTransport | None = None,
        congestion: Congestion | None = None,
    ) -> None:
        self._identity = identity
        self.tls = tls
        # Answers are checked against the certificate only on our own pinned transport (a
        # test's in-process transport has no TLS to check).
        self._pinned = tls and transport is None
        # The TCP congestion control of the connections it opens (``atomd.p2p.congestion``).
        self.congestion = congestion or SYSTEMS
        if transport is None:
            transport = PeerTransport(LIMITS, self.congestion.options, pinned=tls)
        self._admission = admission
        self.swarm = admission.swarm
        self._timeout = timeout
        # No redirects: the signature covers one path; another would go unsigned.
        self._client = httpx.AsyncClient(
            timeout=timeout,
            follow_redirects=False,
            transport=transport,
            headers={"User-Agent": f"atomd/{__version__}"},
            trust_env=False,  # a proxy from the environment would sit between pinned peers
        )
        self._targets: OrderedDict[str, str] = OrderedDict()  # base URL -> peer id

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

    # -- who answers at a URL ----------------------------------------------------------------

    async def info(self, base_url: str, *, timeout: float = INFO_TIMEOUT_S) -> PeerInfo:
        """``GET /p2p/v1/info`` (not signed): the swarm, version and peer id at ``base_url``."""
        url = base_url.rstrip("/")
        self.check_scheme(url)
        certified: str | None = None
        try:
            async with (
                asyncio.timeout(timeout),
                _anyone(),
                self._client.stream("GET", url + paths.INFO, timeout=timeout) as response,
            ):
                if self._pinned:
                    # First contact: the certificate tells who is there; /info must agree.
                    certified = self._certified(response, url, paths.INFO, None)
                body = await _read_capped(response, MAX_ERROR_BYTES)
                status = response.status_code
        except (TimeoutError, httpx.HTTPError, httpx.InvalidURL) as e:
            reason = str(e) or type(e).__name__
            raise PeerRequestError(f"peer {url}: {paths.INFO} failed: {reason}") from e
        if not 200 <= status < 300:
            raise PeerRequestError(
                f"peer {url}: {paths.INFO} answered {status}: {_detail(body)}", status=status
            )
        if body is None:
            raise PeerRequestError(f"peer {url}: {paths.INFO} answered too many bytes")
        info = parse_answer(PeerInfo, body, url, paths.INFO)
        if certified is not None and info.id != certified:
            raise PeerRequestError(
                f"peer {url}: {paths.INFO} names peer {info.id} but the TLS certificate is "
                f"peer {certified}'s: refused"
            )
        self._remember(url, info.id)
        return info

    def check_scheme(self, base_url: str) -> None:
        """``PeerRequestError`` for a URL of the other scheme than this daemon's peer plane."""
        https = base_url.lower().startswith("https://")
        if self.tls and not https:
            raise PeerRequestError(
                f"peer {base_url}: plain HTTP refused: this daemon's peer plane uses TLS "
                "(ATOMD_PEER_TLS, the default) and every member of a swarm must use the same "
                "setting; give the peer's https:// URL, or run every member with --no-peer-tls"
            )
        if not self.tls and https:
            raise PeerRequestError(
                f"peer {base_url}: this daemon runs without TLS (--no-peer-tls) and every "
                "member of a swarm must use the same setting; run every member with TLS, or "
                "that one with --no-peer-tls and an http:// URL"
            )

    def _certified(
        self, response: httpx.Response, base_url: str, path: str, expected: str | None
    ) -> str:
        """The peer id of the certificate behind ``response``; ``PeerRequestError`` when there
        is none or it is not ``expected``'s."""
        try:
            found = stream_peer(response.extensions.get("network_stream"))
        except CertificateError as e:
            raise PeerRequestError(f"peer {base_url}: {path}: {e}") from None
        if found is None:
            raise PeerRequestError(f"peer {base_url}: {path}: the answer did not come over TLS")
        if expected is not None and found[0] != expected:
            raise PeerRequestError(
                f"peer {base_url}: {path}: the answer comes from peer {found[0]} by its TLS "
                f"certificate, expected {expected}: refused"
            )
        return found[0]

    def peer_at(self, base_url: str) -> str | None:
        """The peer id last seen at ``base_url`` (by its certificate and /info), or None."""
        return self._targets.get(base_url.rstrip("/"))

    def _remember(self, url: str, peer_id: str) -> None:
        self._targets[url] = peer_id
        self._targets.move_to_end(url)
        while len(self._targets) > _TARGETS_KEPT:
            self._targets.popitem(last=False)

    def forget(self, base_url: str) -> None:
        """Ask the URL who it is again next time (another daemon may answer there now)."""
        self._targets.pop(base_url.rstrip("/"), None)

    async def _target(self, base_url: str, target: str | None) -> str:
        if target is not None:
            return target
        known = self._targets.get(base_url.rstrip("/"))
        if known is not None:
            return known
        return (await self.info(base_url)).id

    # -- messages ----------------------------------------------------------------------------

    async def post(
        self,
        base_url: str,
        path: str,
        message: Message,
        reply: type[M],
        *,
        target: str | None = None,
        timeout: float | None = None,
    ) -> M:
        """POST ``message`` to ``base_url + path``; the answer as ``reply``."""
        return await self._call("POST", base_url, path, message.to_bytes(), reply, target, timeout)

    async def post_bytes(
        self,
        base_url: str,
        path: str,
        body: bytes,
        reply: type[M],
        *,
        target: str | None = None,
        timeout: float | None = None,
    ) -> M:
        """POST raw bytes (a delta frame) to ``base_url + path``; the answer as ``reply``."""
        return await self._call("POST", base_url, path, body, reply, target, timeout, _OCTETS)

    async def get(
        self,
        base_url: str,
        path: str,
        reply: type[M],
        *,
        target: str | None = None,
        timeout: float | None = None,
    ) -> M:
        """GET ``base_url + path``; the answer as ``reply``."""
        return await self._call("GET", base_url, path, b"", reply, target, timeout)

    def stream(
        self,
        method: str,
        base_url: str,
        path: str,
        *,
        target: str | None = None,
        timeout: float | None = None,
    ) -> AbstractAsyncContextManager[httpx.Response]:
        """A signed request without body whose answer is read in chunks (``aiter_bytes``);
        raises ``PeerRequestError`` on a non-2xx answer or a transfer that fails midway."""
        return self._open(method, base_url, path, b"", target, timeout)

    async def _call(
        self,
        method: str,
        base_url: str,
        path: str,
        body: bytes,
        reply: type[M],
        target: str | None,
        timeout: float | None,
        content_type: str = _JSON,
    ) -> M:
        cap = reply.MAX_ANSWER_BYTES  # files go by stream()
        try:
            data = await self._exchange(
                method, base_url, path, body, target, timeout, content_type, cap
            )
        except PeerRequestError as e:
            # Our remembered peer id for that URL is out of date: ask who is there, once.
            stale = (e.status == 401 and "wrong target" in str(e)) or (
                e.status is None and "by its certificate" in str(e)
            )
            if target is not None or not stale:
                raise
            self.forget(base_url)
            data = await self._exchange(
                method, base_url, path, body, None, timeout, content_type, cap
            )
        return parse_answer(reply, data, base_url, path)

    async def _exchange(
        self,
        method: str,
        base_url: str,
        path: str,
        body: bytes,
        target: str | None,
        timeout: float | None,
        content_type: str,
        cap: int,
    ) -> bytes:
        limit = self._timeout if timeout is None else timeout
        try:
            async with (
                asyncio.timeout(limit),
                self._open(method, base_url, path, body, target, limit, content_type) as response,
            ):
                data = await _read_capped(response, cap)
                status = response.status_code
        except TimeoutError:
            raise PeerRequestError(
                f"peer {base_url}: {method} {path} timed out after {limit:g} s"
            ) from None
        if data is None:
            raise PeerRequestError(
                f"peer {base_url}: {method} {path} answered more than {cap} bytes",
                status=status,
            )
        return data

    @asynccontextmanager
    async def _open(
        self,
        method: str,
        base_url: str,
        path: str,
        body: bytes,
        target: str | None,
        timeout: float | None,
        content_type: str = _JSON,
    ) -> AsyncIterator[httpx.Response]:
        method = method.upper()
        if not path.startswith("/"):
            raise ValueError(f"path {path!r} must start with /")
        self.check_scheme(base_url)
        try:
            url = httpx.URL(base_url.rstrip("/") + path)
        except httpx.InvalidURL as e:
            raise PeerRequestError(f"peer {base_url}: invalid URL ({e})") from None
        peer = await self._target(base_url, target)
        # Sign the target exactly as it goes on the wire (httpx percent-encodes the path).
        raw_target = url.raw_path.decode("ascii")
        headers = sign_request(
            self._identity, self._admission, method, raw_target, body, target=peer
        )
        if body:
            headers["Content-Type"] = content_type
        limit = self._timeout if timeout is None else timeout
        try:
            # A new connection's handshake must show this peer (``atomd.p2p.tls``).
            with expecting(peer):
                async with self._client.stream(
                    method, url, content=body, headers=headers, timeout=httpx.Timeout(limit)
                ) as response:
                    if self._pinned:
                        # Also on a kept-alive connection: only the pinned key's answers count.
                        self._certified(response, base_url, path, peer)
                    if not response.is_success:
                        detail = _detail(await _read_capped(response, MAX_ERROR_BYTES))
                        raise PeerRequestError(
                            f"peer {base_url}: {method} {path} answered "
                            f"{response.status_code}: {detail}",
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
