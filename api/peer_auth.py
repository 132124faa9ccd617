"""The peer plane's FastAPI dependency: a signed request, its body read within its limit.

In this order, so that nobody but an admitted peer can make this daemon read or hash a body:
the ``X-Atomd-*`` headers are checked (form, swarm, target, clock, key id, the key's
admission: allow-list and bans), then the body is read up to the route's limit (a declared
``Content-Length`` over it is refused before reading, a body that streams past it as soon as
it does), then the signature and the swarm secret are checked. A refusal is reported to
``on_reject`` (rate limit and records) and answered 401/403/413 by ``api.errors``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from fastapi import Request
from starlette.requests import ClientDisconnect

from atomd.errors import AtomdError, MessageError, PeerAuthError, RateLimitedError, TooLargeError
from atomd.logs import get_logger
from atomd.p2p.signing import RequestVerifier, VerifiedPeer

log = get_logger(__name__)

# Bodies above this are hashed off the event loop (a 100 MB delta takes ~0.1 s to hash).
INLINE_BODY_BYTES = 1 << 20


@dataclass(frozen=True)
class SignedRequest:
    """A request that passed every check: who signed it, its body, and when the body was whole
    (``time.monotonic()``: how long a route's own work then held the answer goes to /metrics)."""

    peer: VerifiedPeer
    body: bytes
    whole_at: float = field(default_factory=time.monotonic)


def request_target(request: Request) -> str:
    """The path as it came over the wire, plus ``?query``: what the sender signed.

    ``request.url.path`` is percent-decoded, so ``/a%2Fb`` and ``/a/b`` would read the same;
    the ASGI ``raw_path`` keeps the bytes (the decoded path is the fallback for servers
    without it)."""
    raw = request.scope.get("raw_path")
    path = raw.decode("latin-1") if isinstance(raw, bytes) else request.url.path
    query = request.scope.get("query_string", b"").decode("latin-1")
    return f"{path}?{query}" if query else path


async def read_body(request: Request, limit: int, *, deadline_s: float | None = None) -> bytes:
    """The request's body, at most ``limit`` bytes; ``TooLargeError`` before reading when its
    declared length is over, or as soon as the bytes streamed are; ``MessageError`` when the
    sender disconnects before the body is whole, or it takes longer than ``deadline_s``."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not (declared.isascii() and declared.isdigit()):  # int("²") raises
            raise TooLargeError(f"Content-Length {declared[:20]!r} is not a number of bytes")
        if int(declared) > limit:
            raise TooLargeError(f"a body of {declared} bytes; this route takes at most {limit}")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(deadline_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise TooLargeError(
                        f"the body streamed past this route's limit of {limit} bytes"
                    )
                chunks.append(chunk)
    except TimeoutError:
        raise MessageError(
            f"the body took longer than {deadline_s:g} s ({size} bytes had come)"
        ) from None
    except ClientDisconnect:
        # A sender that gave up mid-upload (its timeout): nothing to answer, nothing to log
        # as a server error.
        raise MessageError(f"the sender disconnected after {size} bytes of its body") from None
    return b"".join(chunks)


def peer_auth(
    verifier: RequestVerifier,
    *,
    limit: Callable[[Request], int],
    deadline: Callable[[Request], float] | None = None,
    on_reject: Callable[[Request, AtomdError], Awaitable[None]] | None = None,
    retry_after: Callable[[str], float | None] | None = None,
) -> Callable[[Request], Awaitable[SignedRequest]]:
    """A FastAPI dependency giving the ``SignedRequest`` of a signed request whose body is at
    most ``limit(request)`` bytes (0: the route takes no body) and arrives within
    ``deadline(request)`` seconds (default, and at most, the verifier's ``max_body_s``). The
    deadline must depend on the route alone (its method and path, which are signed): the
    request's nonce is kept that long past its freshness window, which a replay must not
    outlast on another route.

    On refusal it awaits ``on_reject(request, error)``, then raises the error. A source that
    ``retry_after`` says must wait (refused too often) is answered 429 before anything else."""

    async def dependency(request: Request) -> SignedRequest:
        source = request.client.host if request.client else "?"
        wait = retry_after(source) if retry_after is not None else None
        if wait is not None:
            raise RateLimitedError(
                f"too many refused requests from {source}; retry in {wait:.1f} s",
                retry_after_s=wait,
            )
        try:
            arrived = time.time()  # freshness is judged when the headers came
            verifier.check_headers(request.headers, now=arrived)
            body_s = verifier.max_body_s if deadline is None else deadline(request)
            body_s = min(body_s, verifier.max_body_s)
            body = await read_body(request, limit(request), deadline_s=body_s)
            whole_at = time.monotonic()
            args = (request.method, request_target(request), request.headers, body)
            if len(body) > INLINE_BODY_BYTES:
                peer = await asyncio.to_thread(
                    verifier.verify, *args, arrived=arrived, body_s=body_s
                )
            else:
                peer = verifier.verify(*args, arrived=arrived, body_s=body_s)
        except (PeerAuthError, TooLargeError) as e:
            client = request.client.host if request.client else "?"
            log.debug("refused %s %s from %s: %s", request.method, request.url.path, client, e)
            if on_reject is not None:
                try:
                    await on_reject(request, e)
                except Exception:
                    # Recording the refusal must not turn a 401/403 into a 500.
                    log.exception("on_reject failed for a refused peer request")
            raise
        return SignedRequest(peer, body, whole_at)

    return dependency
