"""The peer plane: what other daemons call, under ``/p2p/v1/``.

Every route but ``/info`` takes only requests signed by an admitted peer (``atomd.p2p.auth``);
a refusal is answered 401/403 with the reason, recorded as an event, and changes nothing.
The body's sender must be the peer that signed the request.
"""

# No `from __future__ import annotations` here: FastAPI must see the real `Peer` dependency
# type, which is built inside create_peer_app (string annotations resolve only from globals).
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel

from atomd import __version__
from atomd.errors import NotFoundError, PeerAuthError, WireError
from atomd.p2p.auth import VerifiedPeer, peer_auth
from atomd.p2p.node import SwarmNode
from atomd.p2p.transfer import checkpoint_file, newest_manifest
from atomd.sync.exchange import DeltaExchange
from atomd.train.checkpoint import checkpoint_root
from atomd_api import errors


class PeerInfo(BaseModel):
    swarm: str
    version: str
    id: str
    url: str


def _sender(msg: Any, peer: VerifiedPeer) -> None:
    """The gossip's "from" must be the signer: nobody speaks for another peer."""
    sender = msg.get("from") if isinstance(msg, dict) else None
    if not isinstance(sender, dict) or sender.get("id") != peer.peer_id:
        raise PeerAuthError(
            f"message sent as {sender.get('id') if isinstance(sender, dict) else None!r} "
            f"but signed by {peer.peer_id!r}",
            status=401,
        )
    if sender.get("public_key") != peer.public_key_hex:
        raise PeerAuthError("message public key does not match the signing key", status=401)


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise HTTPException(400, "body is not JSON") from None
    if not isinstance(body, dict):
        raise HTTPException(400, "body must be a JSON object")
    return body


def create_peer_app(node: SwarmNode, exchange: DeltaExchange) -> FastAPI:
    app = FastAPI(title="atomd peer plane", version=__version__, docs_url=None, redoc_url=None)
    errors.install(app)

    async def on_reject(request: Request, error: PeerAuthError) -> None:
        client = request.client.host if request.client else "?"
        await node.record_rejection(request.url.path, client, error)

    Peer = Annotated[VerifiedPeer, Depends(peer_auth(node.verifier, on_reject))]

    async def message(request: Request, peer: VerifiedPeer) -> dict[str, Any]:
        body = await _json(request)
        try:
            _sender(body, peer)
        except PeerAuthError as e:
            await on_reject(request, e)
            raise
        return body

    @app.get("/p2p/v1/info", response_model=PeerInfo)
    async def info() -> PeerInfo:
        return PeerInfo(
            swarm=node.settings.swarm, version=__version__, id=node.peer_id,
            url=node.membership.me.url,
        )  # fmt: skip

    @app.post("/p2p/v1/ping")
    async def ping(request: Request, peer: Peer) -> dict[str, Any]:
        return node.swim.handle_ping(await message(request, peer))

    @app.post("/p2p/v1/ping-req")
    async def ping_req(request: Request, peer: Peer) -> dict[str, Any]:
        return await node.swim.handle_ping_req(await message(request, peer))

    @app.post("/p2p/v1/join")
    async def join(request: Request, peer: Peer) -> dict[str, Any]:
        return node.swim.handle_join(await message(request, peer))

    @app.post("/p2p/v1/leave")
    async def leave(request: Request, peer: Peer) -> dict[str, Any]:
        node.swim.handle_leave(await message(request, peer))
        return {}

    @app.post("/p2p/v1/jobs/announce")
    async def announce(request: Request, peer: Peer) -> dict[str, Any]:
        node.swim.receive(await message(request, peer))  # carries the job: may join it
        return {}

    @app.post("/p2p/v1/jobs/{job_id}/stop")
    async def stop(job_id: str, request: Request, peer: Peer) -> dict[str, Any]:
        await message(request, peer)
        await node.jobs.stop_from_peer(job_id, peer.peer_id)
        return {}

    async def size_guard(job_id: str, request: Request) -> None:
        """Refuse an oversized delta before its body is read (memory stays bounded)."""
        limit = exchange.max_frame_bytes(job_id)
        if limit == 0:
            raise NotFoundError(f"not training job {job_id} here")
        length = request.headers.get("content-length")
        if length is None or not length.isdigit():
            raise HTTPException(411, "a delta upload needs a Content-Length")
        if int(length) > limit:
            raise WireError("oversize", f"{length} bytes; this job's frames are at most {limit}")

    @app.post(
        "/p2p/v1/jobs/{job_id}/deltas",
        status_code=202,
        dependencies=[Depends(size_guard)],  # runs before the body is read for `peer`
    )
    async def delta(job_id: str, request: Request, peer: Peer) -> dict[str, Any]:
        """A signed delta frame for the next round boundary; checked whole before queueing."""
        size = await exchange.receive(job_id, await request.body(), peer.peer_id)
        return {"accepted": True, "bytes": size}

    def _root(job_id: str) -> Any:
        if not job_id.isalnum():
            raise NotFoundError(f"no job {job_id!r}")
        return checkpoint_root(node.jobs.job_dir(job_id))

    @app.get("/p2p/v1/jobs/{job_id}/state")
    async def state_manifest(job_id: str, peer: Peer, at_least: int = 0) -> dict[str, Any]:
        """The newest checkpoint from step ``at_least`` on: of the live state when the job
        trains here (written at the trainer's next step boundary for this request), else the
        newest on disk; 404 when there is none that new."""
        root = _root(job_id)
        await node.jobs.live_state(job_id, at_least)
        manifest = newest_manifest(root)
        if manifest is None or int(manifest.get("step", -1)) < at_least:
            raise NotFoundError(f"no checkpoint of job {job_id} from step {at_least} on here")
        return manifest

    @app.get("/p2p/v1/jobs/{job_id}/state/{step}/{name}")
    async def state_file(job_id: str, step: int, name: str, peer: Peer) -> FileResponse:
        path = checkpoint_file(_root(job_id), step, name)
        if path is None:
            raise NotFoundError(f"job {job_id} has no {name} at step {step} here (pruned?)")
        return FileResponse(path, media_type="application/octet-stream")

    return app
