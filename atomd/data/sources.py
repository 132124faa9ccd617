"""Naming and checking data sources, and dealing shards to peers (no torch, no numpy)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from atomd.errors import ConfigError, DataError

BUNDLED = "shakespeare"
# Tokenizer names (atomd.data.tokenizer): the byte tokenizer, the packaged BPE, or a path.
BYTES = "bytes"
DEFAULT = "default"
TOKENIZER_FILE = "tokenizer.json"


def expand_path(name: str) -> Path:
    """``~`` expanded where it can be (``~nobody-here/x`` stays as written, not an error)."""
    try:
        return Path(name).expanduser()
    except RuntimeError:  # no such user's home
        return Path(name)


def exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a name too long for the file system, for instance
        return False


def check_source(data: str) -> None:
    """Cheap up-front check that a source exists (the daemon calls it before queueing a job)."""
    if data != BUNDLED and not exists(expand_path(data)):
        raise DataError(
            f"dataset {data!r} not found: give {BUNDLED!r}, a .txt/.bin file or a folder"
        )


def shard_for_peer(peer_id: str, num_shards: int) -> int:
    """A deterministic shard index for a peer id."""
    digest = hashlib.sha256(peer_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") % num_shards


def tokenizer_path(name: str) -> Path:
    """The ``tokenizer.json`` a path names: the file, or the one in that folder (a checkpoint,
    an export, a Hugging Face model folder), or in a run's newest checkpoint."""
    path = expand_path(name)
    if not exists(path):
        raise ConfigError(
            f"tokenizer {name!r} not found: give {BYTES!r}, {DEFAULT!r} or the path of a "
            f"{TOKENIZER_FILE} (or of a folder holding one)"
        )
    if path.is_file():
        return path
    if path.is_dir():
        if (path / TOKENIZER_FILE).is_file():
            return path / TOKENIZER_FILE
        root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        steps = sorted(
            (p for p in root.glob("step-*") if p.name[5:].isdigit()),
            key=lambda p: int(p.name[5:]),
            reverse=True,
        )
        if steps and (steps[0] / TOKENIZER_FILE).is_file():
            return steps[0] / TOKENIZER_FILE
        raise ConfigError(f"tokenizer {name!r}: the folder holds no {TOKENIZER_FILE}")
    raise ConfigError(
        f"tokenizer {name!r} not found: give {BYTES!r}, {DEFAULT!r} or the path of a "
        f"{TOKENIZER_FILE} (or of a folder holding one)"
    )


def check_tokenizer_name(name: str) -> None:
    """Cheap up-front check (a stat, no read) for the daemon's request path."""
    if name not in (BYTES, DEFAULT):
        tokenizer_path(name)
