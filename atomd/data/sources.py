"""Naming and checking data sources, and dealing shards to peers (no torch, no numpy)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from atomd.errors import DataError

BUNDLED = "shakespeare"


def check_source(data: str) -> None:
    """Cheap up-front check that a source exists (the daemon calls it before queueing a job)."""
    if data != BUNDLED and not Path(data).expanduser().exists():
        raise DataError(
            f"dataset {data!r} not found: give {BUNDLED!r}, a .txt/.bin file or a folder"
        )


def shard_for_peer(peer_id: str, num_shards: int) -> int:
    """A deterministic shard index for a peer id."""
    digest = hashlib.sha256(peer_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") % num_shards
