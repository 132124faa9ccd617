"""Fixtures shared by the unit tests: a real, migrated SQLite database, and the control app
through httpx's ASGI transport over one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from atomd.config import Settings
from atomd.daemon import Daemon
from atomd.db import migrate
from atomd.db.connection import make_engine, make_sessionmaker
from atomd.jobs import JobManager
from atomd.telemetry import Telemetry
from atomd_api.control import ControlContext, create_control_app

Sessions = async_sessionmaker[AsyncSession]
Factory = Callable[..., Any]


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "data" / "atomd.db"


@pytest.fixture
async def sessions(db: Path) -> AsyncIterator[Sessions]:
    await asyncio.to_thread(migrate.upgrade, db)
    engine = make_engine(db)
    yield make_sessionmaker(engine)
    await engine.dispose()


class Started:
    started = True  # uvicorn's flag, for a server that listens


@pytest.fixture
async def make_client(tmp_path: Path) -> AsyncIterator[Factory]:
    """Makes clients of a control app with its own settings, database and job manager."""
    cleanups: list[Any] = []

    async def make(
        token: str | None = None,
        ready: bool = True,
        started: bool = True,
        daemon: Daemon | None = None,
    ) -> httpx.AsyncClient:
        settings = Settings(
            data_dir=tmp_path, control_token=SecretStr(token) if token else None, device="cpu"
        )
        await asyncio.to_thread(migrate.upgrade, settings.db_path)
        engine = make_engine(settings.db_path)
        sessions = make_sessionmaker(engine)
        telemetry = Telemetry()
        jobs = JobManager(
            jobs_dir=settings.jobs_dir, sessions=sessions, telemetry=telemetry, device="cpu"
        )
        task = asyncio.create_task(jobs.run()) if started else None
        if task is not None:
            await jobs.wait_started()
        ctx = ControlContext(
            settings=settings,
            jobs=jobs,
            telemetry=telemetry,
            sessions=sessions,
            readiness=(
                (lambda: {"database": True, "peer": ready})
                if daemon is None
                else (lambda: daemon.readiness(jobs, Started(), Started()))
            ),
            started_at=time.monotonic(),
        )
        app = create_control_app(ctx)
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1"
        )

        async def cleanup() -> None:
            await client.aclose()
            await jobs.shutdown()
            if task is not None:
                await task
            await engine.dispose()

        cleanups.append(cleanup)
        return client

    yield make
    for c in cleanups:
        await c()
