"""The swarm node's records of membership changes, on a real SQLite file."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import pytest

from atomd.config import Settings
from atomd.db import repo
from atomd.p2p.identity import Identity
from atomd.p2p.membership import Member
from atomd.p2p.node import SwarmNode
from atomd.telemetry import Telemetry
from tests.unit.conftest import Sessions


async def test_changes_queued_at_shutdown_are_recorded(tmp_path: Path, sessions: Sessions) -> None:
    """A swarm stopping together: the others' leaves reach this daemon as it stops, and the
    recorder task is cancelled with changes queued and one being written. Those writes were cut
    off (8 of 251 daemon logs of a flake hunt, 1-5 changes each); now they all land."""
    settings = Settings(data_dir=tmp_path, device="cpu")
    node = SwarmNode(settings=settings, identity=Identity.generate(), sessions=sessions,
                     telemetry=Telemetry(), jobs=cast(Any, None))  # fmt: skip
    members = [
        Member(Identity.generate().peer_id, f"https://127.0.0.1:{42000 + i}", "00" * 32, "left", 1)
        for i in range(6)
    ]
    for m in members:
        node._on_change(m, "alive")
    recorder = asyncio.create_task(node._record_changes())
    await asyncio.sleep(0)  # it takes the first change and starts writing it
    recorder.cancel()
    with pytest.raises(asyncio.CancelledError):
        await recorder
    async with sessions() as s:
        left = await repo.list_events(s, kind="peer.left")
    assert sorted(e.peer_id for e in left) == sorted(m.id for m in members)
