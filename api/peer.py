"""The peer plane: what other daemons call, under ``/p2p/v1/``. Membership and delta routes
arrive with the swarm; for now it answers who this daemon is."""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import BaseModel

from atomd import __version__


class PeerInfo(BaseModel):
    swarm: str
    version: str
    url: str


def create_peer_app(*, swarm: str, url: str) -> FastAPI:
    app = FastAPI(title="atomd peer plane", version=__version__, docs_url=None, redoc_url=None)

    @app.get("/p2p/v1/info", response_model=PeerInfo)
    async def info() -> PeerInfo:
        return PeerInfo(swarm=swarm, version=__version__, url=url)

    return app
