"""The peer plane: what other daemons call, under ``/p2p/v1/`` (``atomd.p2p.paths``).

Every route but ``/info`` takes only requests signed by an admitted peer for this daemon
(``atomd.p2p.signing``, ``api.peer_auth``), with a body no larger than the route takes
(``MAX_MESSAGE_BYTES`` for a message, the job's largest frame for a delta) and arriving within
the route's time (``MESSAGE_BODY_S``, ``MAX_BODY_S`` for a delta); a refusal is
answered 401/403/413 with the reason, counted, and changes nothing. Bodies are the typed
messages of ``atomd.p2p.messages`` (422 naming the field when one does not fit), and a
message's sender must be the peer that signed the request.
"""

# No `from __future__ import annotations` here: FastAPI must see the real `Peer` dependency
# type, which is built inside create_peer_app (string annotations resolve only from globals).
import time
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import FileResponse

from atomd import __version__
from atomd.errors import AtomdError, NotFoundError, PeerAuthError
from atomd.p2p import paths
from atomd.p2p.messages import (
    MAX_CURVE_POINTS,
    Ack,
    Announce,
    DeltaAccepted,
    Gossip,
    JoinReply,
    M,
    MemberRecord,
    PeerInfo,
    PingReq,
    PingReqReply,
    ProgressCurve,
    StateManifest,
    StopJob,
    curve_of,
    parse,
    record_problem,
    sign_manifest,
)
from atomd.p2p.node import SwarmNode
from atomd.p2p.signing import MAX_BODY_S, body_deadline_s
from atomd.p2p.transfer import checkpoint_file, newest_manifest
from atomd.sync.exchange import DeltaExchange
from atomd.train.checkpoint import checkpoint_root
from atomd_api import errors
from atomd_api.peer_auth import SignedRequest, peer_auth

MAX_MESSAGE_BYTES = 256 << 10
"""The largest membership or job message accepted (a ping with 64 updates is about 30 KiB)."""
MESSAGE_BODY_S = body_deadline_s(MAX_MESSAGE_BYTES)
"""The longest such a message may take to arrive (~63 s)."""


def _check_sender(
    sender: MemberRecord, signed: SignedRequest, swarm: str, tls: bool = True
) -> None:
    """The message's "from" must be the signer's own signed record: nobody speaks for
    another peer. Its URL must be of this swarm's scheme (TLS or not: no mixed swarms)."""
    peer = signed.peer
    if sender.id != peer.peer_id:
        raise PeerAuthError(
            f"message sent as {sender.id!r} but signed by {peer.peer_id!r}", status=401
        )
    if sender.public_key != peer.public_key_hex:
        raise PeerAuthError("message public key does not match the signing key", status=401)
    problem = record_problem(sender, swarm)
    if problem is not None:
        raise PeerAuthError(f"the sender's own record: {problem}", status=401)
    if sender.url.lower().startswith("https://") != tls:
        mode = "uses TLS (ATOMD_PEER_TLS)" if tls else "runs without TLS (--no-peer-tls)"
        raise PeerAuthError(
            f"mixed swarm: the sender advertises {sender.url}, but this daemon's peer plane "
            f"{mode}; every member of a swarm must use the same setting",
            status=403,
        )


def create_peer_app(node: SwarmNode, exchange: DeltaExchange) -> FastAPI:
    app = FastAPI(
        title="atomd peer plane",
        version=__version__,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    errors.install(app)

    async def on_reject(request: Request, error: AtomdError) -> None:
        client = request.client.host if request.client else "?"
        await node.record_rejection(request.url.path, client, error)

    def is_delta(request: Request) -> bool:
        return (
            request.method == "POST"
            and request.path_params.get("job_id") is not None
            and request.url.path.endswith("/deltas")
        )

    def limit(request: Request) -> int:
        if request.method != "POST":
            return 0
        if is_delta(request):
            return exchange.max_frame_bytes(str(request.path_params["job_id"]))
        return MAX_MESSAGE_BYTES

    def deadline(request: Request) -> float:
        """By route: a frame (a share of a job's final average on a slow link) may take up to
        MAX_BODY_S, a membership message what its 256 KiB take at the slowest link served."""
        return MAX_BODY_S if is_delta(request) else MESSAGE_BODY_S

    Peer = Annotated[
        SignedRequest,
        Depends(
            peer_auth(
                node.verifier,
                limit=limit,
                deadline=deadline,
                on_reject=on_reject,
                retry_after=node.rejections.retry_after,
            )
        ),
    ]

    async def message(request: Request, signed: SignedRequest, model: type[M]) -> M:
        msg = parse(model, signed.body)
        sender = getattr(msg, "sender", None)
        if isinstance(sender, MemberRecord):
            try:
                _check_sender(sender, signed, node.settings.swarm, node.settings.peer_tls)
            except PeerAuthError as e:
                await on_reject(request, e)
                raise
        return msg

    @app.get(paths.INFO, response_model=PeerInfo)
    async def info() -> PeerInfo:
        return PeerInfo(
            swarm=node.settings.swarm, version=__version__[:64], id=node.peer_id,
            url=node.membership.me.url,
        )  # fmt: skip

    @app.post(paths.PING)
    async def ping(request: Request, peer: Peer) -> Gossip:
        return node.swim.handle_ping(await message(request, peer, Gossip))

    @app.post(paths.PING_REQ)
    async def ping_req(request: Request, peer: Peer) -> PingReqReply:
        return await node.swim.handle_ping_req(await message(request, peer, PingReq))

    @app.post(paths.JOIN)
    async def join(request: Request, peer: Peer) -> JoinReply:
        return node.swim.handle_join(await message(request, peer, Gossip))

    @app.post(paths.LEAVE)
    async def leave(request: Request, peer: Peer) -> Ack:
        node.swim.handle_leave(await message(request, peer, Gossip))
        return Ack()

    @app.post(paths.ANNOUNCE)
    async def announce(request: Request, peer: Peer) -> Ack:
        node.swim.receive(await message(request, peer, Announce))  # carries the job: may join
        return Ack()

    @app.post(paths.JOB_STOP)
    async def stop(job_id: str, request: Request, peer: Peer) -> Ack:
        msg = await message(request, peer, StopJob)
        await node.stop_from_peer(job_id, peer.peer.peer_id, msg.notice)
        return Ack()

    async def training(job_id: str) -> None:
        """Runs before the body is read: a job not trained here takes no frame."""
        if exchange.max_frame_bytes(job_id) == 0:
            raise NotFoundError(f"not training job {job_id} here")

    @app.post(paths.JOB_DELTAS, status_code=202, dependencies=[Depends(training)])
    async def delta(job_id: str, peer: Peer) -> DeltaAccepted:
        """A signed delta frame for the next round boundary; checked whole before queueing."""
        size = await exchange.receive(job_id, peer.body, peer.peer.peer_id)
        # The frame's checks, which the sender's upload time includes (its cadence's traffic).
        exchange.telemetry.answer_held_seconds.observe(time.monotonic() - peer.whole_at)
        return DeltaAccepted(accepted=True, bytes=size)

    def _root(job_id: str) -> Any:
        if len(job_id) != 32 or not job_id.isalnum():
            raise NotFoundError(f"no job {job_id[:40]!r}")
        return checkpoint_root(node.jobs.job_dir(job_id))

    @app.get(paths.JOB_STATE)
    async def state_manifest(job_id: str, peer: Peer, at_least: int = 0) -> Any:
        """The newest checkpoint from step ``at_least`` on: of the live state when the job
        trains here (written at the trainer's next step boundary for this request), else the
        newest on disk; 404 when there is none that new."""
        root = _root(job_id)
        await node.jobs.live_state(job_id, at_least)
        manifest: StateManifest | None = newest_manifest(root)
        if manifest is None or manifest.step < at_least:
            raise NotFoundError(f"no checkpoint of job {job_id} from step {at_least} on here")
        signed = sign_manifest(manifest, node.identity, node.settings.swarm, job_id)
        return signed.model_dump(mode="json", by_alias=True, exclude_none=True)

    @app.get(paths.JOB_PROGRESS)
    async def progress(job_id: str, peer: Peer) -> ProgressCurve:
        """This daemon's loss curve of a job (for a peer's dashboard): bounded, whole run."""
        _root(job_id)  # a well-formed job id, else 404
        return curve_of(await node.jobs.progress_curve(job_id, MAX_CURVE_POINTS))

    @app.get(paths.JOB_STATE_FILE)
    async def state_file(job_id: str, step: int, name: str, peer: Peer) -> FileResponse:
        path = checkpoint_file(_root(job_id), step, name)
        if path is None:
            raise NotFoundError(f"job {job_id} has no {name} at step {step} here (pruned?)")
        return FileResponse(path, media_type="application/octet-stream")

    return app
