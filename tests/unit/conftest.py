"""Fixtures shared by the unit tests: a real, migrated SQLite database."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from atomd.db import migrate
from atomd.db.engine import make_engine, make_sessionmaker

Sessions = async_sessionmaker[AsyncSession]


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "data" / "atomd.db"


@pytest.fixture
async def sessions(db: Path) -> AsyncIterator[Sessions]:
    await asyncio.to_thread(migrate.upgrade, db)
    engine = make_engine(db)
    yield make_sessionmaker(engine)
    await engine.dispose()
