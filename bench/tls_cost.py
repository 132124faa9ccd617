"""``python -m atomd_bench tls``: what TLS on the peer plane costs.

One real uvicorn peer plane on loopback (the daemon's route stack: signed requests, bounded
bodies) served with and without TLS (``atomd.p2p.tls``), called by ``PeerClient`` through a
byte-counting TCP relay. Reported for each mode:

- ``connect_ms``: median time to a usable connection (TCP, and the TLS 1.3 handshake with the
  certificate check against the expected peer id), over ``connects`` fresh connections;
- ``ping_ms``: median time of one signed ping-sized POST on a kept-alive connection;
- bytes on the wire (both directions) of one round on a kept-alive connection: a ping of
  ~1 KiB of gossip, and a delta frame of ``frame_bytes`` (a top-k 1 % frame of the tiny GPT
  is ~60 KB), and of the first request on a new connection (the handshake included).

Takes ~20 s (``quick``: ~8 s).
"""

# No ``from __future__ import annotations``: FastAPI resolves the route's dependency type.

import asyncio
import os
import socket
import statistics
import time
from typing import Annotated, Any

import uvicorn
from fastapi import Depends, FastAPI

from atomd.p2p import tls
from atomd.p2p.client import PeerClient
from atomd.p2p.identity import Identity
from atomd.p2p.messages import Ack
from atomd.p2p.signing import Admission, RequestVerifier
from atomd_api import errors
from atomd_api.peer_auth import SignedRequest, peer_auth

ADMISSION = Admission(swarm="bench", secret=b"s3cret", allowed_keys=frozenset())


def _app(me: Identity) -> FastAPI:
    app = FastAPI()
    errors.install(app)
    auth = peer_auth(RequestVerifier(ADMISSION, self_id=me.peer_id), limit=lambda r: 16 << 20)

    @app.post("/p2p/v1/sink")
    async def sink(peer: Annotated[SignedRequest, Depends(auth)]) -> Ack:
        return Ack()

    return app


class Relay:
    """A TCP relay that counts the bytes it carries each way."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.up = self.down = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._one, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _one(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection("127.0.0.1", self.port)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, up: bool) -> None:
            try:
                while data := await src.read(65536):
                    if up:
                        self.up += len(data)
                    else:
                        self.down += len(data)
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(r, uw, True), pipe(ur, w, False))

    def take(self) -> int:
        n = self.up + self.down
        self.up = self.down = 0
        return n


async def _measure(use_tls: bool, connects: int, pings: int, frame_bytes: int) -> dict[str, Any]:
    me, caller = Identity.generate(), Identity.generate()
    ctx = tls.server_context(me) if use_tls else None
    config = uvicorn.Config(
        _app(me), log_level="critical", lifespan="off",
        ssl_context_factory=None if ctx is None else (lambda _c, _d: ctx),
    )  # fmt: skip
    server = uvicorn.Server(config)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    relay = Relay(sock.getsockname()[1])
    port = await relay.start()
    url = f"{'https' if use_tls else 'http'}://127.0.0.1:{port}"
    ping = os.urandom(512).hex().encode()  # ~1 KiB, like a gossip message
    frame = os.urandom(frame_bytes)
    out: dict[str, Any] = {"tls": use_tls}
    try:
        connect_ms, first_bytes = [], []
        for _ in range(connects):
            async with PeerClient(caller, ADMISSION, tls=use_tls) as client:
                relay.take()
                t0 = time.perf_counter()
                await client.post_bytes(url, "/p2p/v1/sink", ping, Ack, target=me.peer_id)
                connect_ms.append((time.perf_counter() - t0) * 1000)
                await asyncio.sleep(0.01)
                first_bytes.append(relay.take())
        async with PeerClient(caller, ADMISSION, tls=use_tls) as client:
            await client.post_bytes(url, "/p2p/v1/sink", ping, Ack, target=me.peer_id)
            times = []
            await asyncio.sleep(0.01)
            relay.take()
            for _ in range(pings):
                t0 = time.perf_counter()
                await client.post_bytes(url, "/p2p/v1/sink", ping, Ack, target=me.peer_id)
                times.append((time.perf_counter() - t0) * 1000)
            await asyncio.sleep(0.01)
            ping_bytes = relay.take() / pings
            await client.post_bytes(url, "/p2p/v1/sink", frame, Ack, target=me.peer_id)
            await asyncio.sleep(0.01)
            frame_wire = relay.take()
        out.update(
            first_request_ms=round(statistics.median(connect_ms), 2),
            first_request_bytes=int(statistics.median(first_bytes)),
            ping_ms=round(statistics.median(times), 2),
            ping_bytes=round(ping_bytes),
            frame_bytes=frame_bytes,
            frame_wire_bytes=frame_wire,
        )
    finally:
        server.should_exit = True
        await task
        sock.close()
        if relay.server is not None:
            relay.server.close()
    return out


def run(connects: int = 40, pings: int = 200, frame_bytes: int = 60_000) -> dict[str, Any]:
    plain = asyncio.run(_measure(False, connects, pings, frame_bytes))
    with_tls = asyncio.run(_measure(True, connects, pings, frame_bytes))
    return {
        "bench": "tls",
        "plain": plain,
        "tls": with_tls,
        "handshake_ms": round(with_tls["first_request_ms"] - plain["first_request_ms"], 2),
        "handshake_bytes": with_tls["first_request_bytes"] - plain["first_request_bytes"],
        "ping_overhead_bytes": with_tls["ping_bytes"] - plain["ping_bytes"],
        "frame_overhead_bytes": with_tls["frame_wire_bytes"] - plain["frame_wire_bytes"],
    }
