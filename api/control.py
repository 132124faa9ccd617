"""The control plane: REST for users and scripts (`curl`), on localhost by default."""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request, Response
from fastapi.responses import JSONResponse
from fastapi_offline import FastAPIOffline
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from atomd import __version__
from atomd.config import Settings
from atomd.db import repo
from atomd.db.health import DatabaseFile
from atomd.errors import NotFoundError, UnauthorizedError
from atomd.jobs import JobManager, Scope
from atomd.p2p.messages import MAX_CURVE_POINTS, ProgressCurve, curve_of
from atomd.p2p.node import SwarmNode
from atomd.rejections import Rejections
from atomd.spec import JobSpec
from atomd.telemetry import Telemetry
from atomd_api import dashboard, errors
from atomd_api.gate import ControlGate
from atomd_api.schemas import (
    BanIn,
    BanPublic,
    CurvePointPublic,
    CurvesPublic,
    EventPublic,
    Health,
    JobPublic,
    PeerCurvePublic,
    PeerPublic,
    ProgressPublic,
    Readiness,
    RoundPublic,
    StatusPublic,
)


@dataclass
class ControlContext:
    """What the control routes need from the daemon."""

    settings: Settings
    jobs: JobManager
    telemetry: Telemetry
    sessions: async_sessionmaker[AsyncSession]
    readiness: Callable[[], dict[str, bool]]
    started_at: float
    swarm: SwarmNode | None = None
    database: DatabaseFile | None = None
    rejections: Rejections | None = None  # refused requests (the gate's rate limit and counts)
    # job id -> (monotonic time, answer): the peers' curves, asked at most every CURVES_TTL_S
    curves: dict[str, tuple[float, CurvesPublic]] = field(default_factory=dict)


CURVES_TTL_S = 2.0
CURVES_CACHED = 8


def _ctx(request: Request) -> ControlContext:
    ctx: ControlContext = request.app.state.ctx
    return ctx


Ctx = Annotated[ControlContext, Depends(_ctx)]


async def require_token(ctx: Ctx, authorization: Annotated[str | None, Header()] = None) -> None:
    """Bearer-token check when ``ATOMD_CONTROL_TOKEN`` is set (always off loopback)."""
    token = ctx.settings.control_token
    if token is None:
        return
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        given.encode(), token.get_secret_value().encode()
    ):
        raise UnauthorizedError("missing or wrong bearer token (Authorization: Bearer <token>)")


def _job(j: object) -> JobPublic:
    return JobPublic.model_validate(j, from_attributes=True)


v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_token)], responses=errors.responses(401))


@v1.get("/status", response_model=StatusPublic, summary="This daemon and its current job")
async def get_status(ctx: Ctx) -> StatusPublic:
    active = ctx.jobs.active
    job = _job(await ctx.jobs.get(active.id)) if active is not None else None
    s = ctx.settings
    node = ctx.swarm
    return StatusPublic(
        version=__version__,
        peer_id=node.peer_id if node else "",
        public_key=node.identity.public_key_hex if node else "",
        peers_alive=len(node.membership.others("alive")) if node else 0,
        uptime_s=round(time.monotonic() - ctx.started_at, 3),
        data_dir=str(s.data_dir),
        control=s.control,
        listen=s.listen,
        advertise=s.advertise_url,
        swarm=s.swarm,
        device=ctx.jobs.device,
        job=job,
    )


@v1.get("/peers", response_model=list[PeerPublic], summary="Known peers and their state")
async def get_peers(ctx: Ctx) -> list[PeerPublic]:
    """Every member this daemon knows, itself first (``is_self``), live from the protocol;
    without a swarm, the peers remembered in the database."""
    if ctx.swarm is not None:
        return [PeerPublic.model_validate(p) for p in ctx.swarm.peers()]
    async with ctx.sessions() as s:
        peers = await repo.list_peers(s)
    return [PeerPublic.model_validate(p, from_attributes=True) for p in peers]


def _node(ctx: ControlContext) -> SwarmNode:
    if ctx.swarm is None:
        raise NotFoundError("this daemon runs without a swarm (no peer plane): nothing to ban")
    return ctx.swarm


@v1.get("/bans", response_model=list[BanPublic], summary="Keys banned by the operator")
async def list_bans(ctx: Ctx) -> list[BanPublic]:
    async with ctx.sessions() as s:
        bans = await repo.list_bans(s)
    return [BanPublic.model_validate(b, from_attributes=True) for b in bans]


@v1.post(
    "/bans",
    status_code=201,
    response_model=BanPublic,
    summary="Ban a peer's key",
    responses=errors.responses(400, 404),
)
async def ban(ctx: Ctx, body: BanIn) -> BanPublic:
    """Refused on the peer plane (403), its deltas out of every merge, never a state donor,
    until unbanned; persisted across restarts."""
    node = _node(ctx)
    await node.ban(body.public_key, body.reason)
    async with ctx.sessions() as s:
        bans = {b.public_key: b for b in await repo.list_bans(s)}
    return BanPublic.model_validate(bans[body.public_key], from_attributes=True)


@v1.delete(
    "/bans/{public_key}",
    status_code=204,
    summary="Lift a ban (and a quarantine of that key)",
    responses=errors.responses(404),
)
async def unban(ctx: Ctx, public_key: str) -> Response:
    node = _node(ctx)
    key = public_key.lower()
    was_quarantined = any(
        p["public_key"] == key and p["excluded"] == "quarantined" for p in node.peers()
    )
    if not await node.unban(key) and not was_quarantined:
        raise NotFoundError(f"key {public_key[:64]!r} is neither banned nor quarantined here")
    return Response(status_code=204)


@v1.post(
    "/jobs",
    status_code=201,
    response_model=JobPublic,
    summary="Start a training job",
    responses=errors.responses(400, 409),
)
async def create_job(
    ctx: Ctx,
    spec: JobSpec,
    scope: Annotated[
        Scope, Query(description="swarm: announce it, peers join; local: this daemon only")
    ] = "swarm",
) -> JobPublic:
    """Every field of the spec has a default: `{"preset": "tiny"}` is a valid body.
    One job runs per daemon: 409 while another is active."""
    return _job(await ctx.jobs.start(spec, scope))


@v1.get("/jobs", response_model=list[JobPublic], summary="Jobs, newest first")
async def list_jobs(ctx: Ctx) -> list[JobPublic]:
    return [_job(j) for j in await ctx.jobs.list_jobs()]


@v1.get("/jobs/{job_id}", response_model=JobPublic, responses=errors.responses(404))
async def get_job(ctx: Ctx, job_id: str) -> JobPublic:
    return _job(await ctx.jobs.get(job_id))


@v1.post(
    "/jobs/{job_id}/stop",
    response_model=JobPublic,
    summary="Stop a job at the next step boundary (it checkpoints first)",
    responses=errors.responses(404, 409),
)
async def stop_job(
    ctx: Ctx,
    job_id: str,
    scope: Annotated[
        Scope, Query(description="local: this daemon only; swarm: every peer training it")
    ] = "local",
) -> JobPublic:
    return _job(await ctx.jobs.stop(job_id, scope))


@v1.post(
    "/jobs/{job_id}/resume",
    response_model=JobPublic,
    summary="Continue a stopped or failed job from its newest good checkpoint",
    responses=errors.responses(404, 409),
)
async def resume_job(ctx: Ctx, job_id: str) -> JobPublic:
    """For example a job that stopped on a full disk, once there is space again. 409 while
    another job is active, or if this one is active or finished."""
    return _job(await ctx.jobs.resume(job_id))


@v1.get(
    "/jobs/{job_id}/progress",
    response_model=list[ProgressPublic],
    summary="Logged training steps, ascending",
    responses=errors.responses(404),
)
async def get_progress(
    ctx: Ctx,
    job_id: str,
    after_step: Annotated[int | None, Query(ge=0, description="Only steps after this one")] = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
    newest: Annotated[
        bool, Query(description="The last `limit` points (still ascending), not the first")
    ] = False,
) -> list[ProgressPublic]:
    """Page through a run from its start with ``after_step``; ``newest=true`` gives its latest
    points. Older points of a long run are thinned (``ATOMD_PROGRESS_KEEP``)."""
    points = await ctx.jobs.progress(job_id, after_step, limit, newest=newest)
    return [ProgressPublic.model_validate(p, from_attributes=True) for p in points]


@v1.get(
    "/jobs/{job_id}/rounds",
    response_model=list[RoundPublic],
    summary="Sync rounds sent and received",
    responses=errors.responses(404),
)
async def get_rounds(
    ctx: Ctx, job_id: str, limit: Annotated[int, Query(ge=1, le=10000)] = 1000
) -> list[RoundPublic]:
    await ctx.jobs.get(job_id)
    async with ctx.sessions() as s:
        rounds = await repo.list_rounds(s, job_id=job_id, limit=limit)
    return [RoundPublic.model_validate(r, from_attributes=True) for r in rounds]


def _curve(peer_id: str, curve: ProgressCurve, is_self: bool = False) -> PeerCurvePublic:
    points = [
        CurvePointPublic(
            step=p.step, loss=p.loss, val_loss=p.val_loss, tokens_per_s=p.tokens_per_s,
            at=datetime.fromtimestamp(p.at, UTC),
        )
        for p in curve.points
    ]  # fmt: skip
    return PeerCurvePublic(peer_id=peer_id, is_self=is_self, points=points)


@v1.get(
    "/jobs/{job_id}/curves",
    response_model=CurvesPublic,
    summary="Loss curves of a job on this daemon and on each peer training it",
    responses=errors.responses(404),
)
async def get_curves(ctx: Ctx, job_id: str) -> CurvesPublic:
    """Each curve spans the whole run in at most 402 logged steps (every n-th step, the
    steps with a validation loss, the newest). The peers' are asked over the signed peer
    plane, at once, each within 3 s, at most every 2 s (a cached answer in between); a peer
    that did not answer is listed with the reason. At most 32 peers are asked (the first heard
    training the job); ``left_out`` counts the others."""
    await ctx.jobs.get(job_id)
    now = time.monotonic()
    cached = ctx.curves.get(job_id)
    if cached is not None and now - cached[0] < CURVES_TTL_S:
        return cached[1]
    mine = curve_of(await ctx.jobs.progress_curve(job_id, MAX_CURVE_POINTS))
    me = ctx.swarm.peer_id if ctx.swarm is not None else ""
    peers = [_curve(me, mine, is_self=True)]
    left_out = 0
    if ctx.swarm is not None:
        answers, left_out = await ctx.swarm.peer_curves(job_id)
        for member, got in answers:
            if isinstance(got, str):
                peers.append(PeerCurvePublic(peer_id=member.id, points=[], error=got))
            else:
                peers.append(_curve(member.id, got))
    answer = CurvesPublic(job_id=job_id, peers=peers, left_out=left_out)
    ctx.curves[job_id] = (time.monotonic(), answer)
    while len(ctx.curves) > CURVES_CACHED:
        ctx.curves.pop(next(iter(ctx.curves)))
    return answer


@v1.get("/events", response_model=list[EventPublic], summary="Recent events, newest first")
async def list_events(
    ctx: Ctx,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    kind: Annotated[str | None, Query(max_length=64, description="Only this kind")] = None,
) -> list[EventPublic]:
    """The audit log: jobs started and ended, peers joining, failing, leaving, refused
    requests (``auth.rejected``, aggregated a minute at a time)."""
    async with ctx.sessions() as s:
        events = await repo.list_events(s, limit=limit, kind=kind)
    return [EventPublic.model_validate(e, from_attributes=True) for e in events]


def create_control_app(ctx: ControlContext) -> FastAPI:
    # /docs and /redoc serve Swagger UI and ReDoc from files shipped with the package
    # (fastapi-offline), not from a CDN: they work on a machine with no Internet.
    app = FastAPIOffline(
        title="atomd control API",
        version=__version__,
        description="Start and stop training jobs, watch progress, check health.",
        static_url="/docs-assets",
    )
    app.state.ctx = ctx
    errors.install(app)

    @app.get("/healthz", response_model=Health, summary="200 while the event loop is responsive")
    async def healthz() -> Health:
        return Health()

    @app.get(
        "/readyz",
        response_model=Readiness,
        dependencies=[Depends(require_token)],
        responses={503: {"model": Readiness, "description": "not ready"}, **errors.responses(401)},
        summary="200 once the database is migrated, the jobs the daemon's last run left are "
        "taken up and both servers listen, until a shutdown begins; 503 with the reasons when "
        "not (a database file deleted or replaced under the daemon, for example)",
    )
    async def readyz(c: Ctx) -> Response:
        checks = c.readiness()
        reasons: dict[str, str] = {}
        if not checks.get("accepting", True):
            reasons["accepting"] = (
                "the daemon is shutting down: its job checkpoints at a step boundary, then it exits"
            )
        if c.database is not None:
            problem = await asyncio.to_thread(c.database.problem)
            if problem is not None:
                checks["database"] = False
                reasons["database"] = problem
        body = Readiness(ready=all(checks.values()), checks=checks, reasons=reasons)
        return JSONResponse(body.model_dump(), status_code=200 if body.ready else 503)

    @app.get(
        "/metrics",
        dependencies=[Depends(require_token)],
        response_class=Response,
        responses={
            200: {"content": {"text/plain": {}}, "description": "Prometheus text format"},
            **errors.responses(401),
        },
        summary="Prometheus metrics",
    )
    async def metrics(c: Ctx) -> Response:
        return Response(c.telemetry.render(), media_type="text/plain; version=0.0.4")

    app.include_router(v1)
    app.include_router(dashboard.router)
    rejections = ctx.rejections or (ctx.swarm.rejections if ctx.swarm else Rejections())
    app.add_middleware(ControlGate, settings=ctx.settings, rejections=rejections)
    return app
