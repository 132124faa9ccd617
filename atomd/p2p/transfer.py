"""State transfer: a peer joining a running job fetches the newest checkpoint from a live peer.

A donor that trains the job first checkpoints its live state at its next step boundary, so the
joiner starts from the swarm's current model; a swarm younger than the joiner asks for
(``at_least``: its warm-up, or past the joiner's own checkpoint) has no state to give, and the
joiner starts from the initial weights instead of waiting for ~6 model sizes on the wire. The
donor serves its newest checkpoint as a manifest (the checkpoint's ``meta.json``: step, file
sizes and sha256) and the files as chunked streams. The joiner writes them into a hidden
``.incoming-*`` folder, checking sizes and hashes as bytes arrive, writes ``meta.json`` last,
fsyncs and renames the folder into place. A donor that dies, lies or stalls costs that attempt:
the temporary folder is removed and the next donor is tried. Nothing half-downloaded is used,
because only a complete, verified folder ever gets a ``step-*`` name.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from safetensors import SafetensorError, safe_open

from atomd.errors import AtomdError, CheckpointError, PeerRequestError
from atomd.logs import get_logger
from atomd.p2p.auth import PeerClient
from atomd.train import checkpoint as ckpt

log = get_logger(__name__)

TRANSFER_FILES = (ckpt.MODEL_FILE, ckpt.STATE_FILE)
MANIFEST_TIMEOUT_S = 45.0
_CHUNK = 1 << 20


def newest_manifest(root: Path) -> dict[str, Any] | None:
    """The newest complete checkpoint's meta.json under ``root`` (None if there is none)."""
    for path in ckpt.list_checkpoints(root):
        try:
            meta = json.loads((path / ckpt.META_FILE).read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(meta, dict) and all((path / name).is_file() for name in TRANSFER_FILES):
            return meta
    return None


def checkpoint_file(root: Path, step: int, name: str) -> Path | None:
    """The path of one transferable file of checkpoint ``step``, if it still exists."""
    if name not in TRANSFER_FILES:
        return None
    path = root / f"step-{step:08d}" / name
    return path if path.is_file() else None


class _Download:
    def __init__(self, path: Path, expect_bytes: int, expect_sha256: str) -> None:
        self.path = path
        self.expect_bytes = expect_bytes
        self.expect_sha256 = expect_sha256
        self.hash = hashlib.sha256()
        self.size = 0
        self.file = path.open("wb")

    def write(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.expect_bytes:
            raise CheckpointError(
                f"{self.path.name}: donor sent more than the {self.expect_bytes} bytes it announced"
            )
        self.hash.update(chunk)
        self.file.write(chunk)

    def finish(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        if self.size != self.expect_bytes:
            raise CheckpointError(
                f"{self.path.name}: got {self.size} bytes, expected {self.expect_bytes} (truncated)"
            )
        if self.hash.hexdigest() != self.expect_sha256:
            raise CheckpointError(f"{self.path.name}: sha256 mismatch (corrupt in transfer)")


async def _fetch_from(client: PeerClient, url: str, job_id: str, root: Path, at_least: int) -> int:
    # The donor may checkpoint its live state for us first (up to 30 s); it answers 404 when
    # it has no state from step ``at_least`` on.
    path = f"/p2p/v1/jobs/{job_id}/state?at_least={at_least}"
    manifest = await client.get_json(url, path, timeout=MANIFEST_TIMEOUT_S)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("step"), int):
        raise CheckpointError(f"malformed state manifest from {url}")
    if manifest["step"] < at_least:  # a donor that did not honour the query: nothing newer
        raise PeerRequestError(
            f"{url} has state at step {manifest['step']}, not from step {at_least} on", status=404
        )
    if manifest.get("format_version") != ckpt.FORMAT_VERSION:
        raise CheckpointError(
            f"state from {url} has format_version {manifest.get('format_version')!r}, "
            f"expected {ckpt.FORMAT_VERSION}"
        )
    step: int = manifest["step"]
    files = manifest.get("files", {})
    tmp = root / f".incoming-step-{step:08d}-{os.getpid()}"
    await asyncio.to_thread(shutil.rmtree, tmp, True)
    await asyncio.to_thread(tmp.mkdir, parents=True)
    try:
        for name in TRANSFER_FILES:
            want = files.get(name)
            if not isinstance(want, dict):
                raise CheckpointError(f"manifest from {url} does not list {name}")
            dl = await asyncio.to_thread(
                _Download, tmp / name, int(want["bytes"]), str(want["sha256"])
            )
            try:
                path = f"/p2p/v1/jobs/{job_id}/state/{step}/{name}"
                async with client.stream("GET", url, path, timeout=30) as resp:
                    async for chunk in resp.aiter_bytes(_CHUNK):
                        await asyncio.to_thread(dl.write, chunk)
                await asyncio.to_thread(dl.finish)
            finally:
                dl.file.close()
        meta = json.dumps(manifest, indent=2, sort_keys=True)
        await asyncio.to_thread((tmp / ckpt.META_FILE).write_text, meta)
        await asyncio.to_thread(_fsync_and_publish, tmp, root / f"step-{step:08d}")
    except BaseException:
        await asyncio.to_thread(shutil.rmtree, tmp, True)
        raise
    return step


def _fsync_and_publish(tmp: Path, final: Path) -> None:
    with (tmp / ckpt.META_FILE).open("rb") as f:
        os.fsync(f.fileno())
    # Sizes and sha256 were checked as the bytes arrived; here only that each file is a
    # well-formed safetensors file (its header, not its tensors: the trainer loads those once).
    for name in TRANSFER_FILES:
        try:
            with safe_open(str(tmp / name), framework="pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{name} from the donor is not a safetensors file: {e}") from e
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def fetch_state(
    client: PeerClient,
    donors: Sequence[str],
    job_id: str,
    root: Path,
    *,
    rounds: int = 2,
    at_least: int = 0,
) -> int | None:
    """Fetch the newest checkpoint of ``job_id`` from the first donor that delivers it whole.

    Returns the step fetched, or None when no donor has one from step ``at_least`` on (the job
    starts from its seed, or from the joiner's own checkpoint).
    """
    await asyncio.to_thread(root.mkdir, parents=True, exist_ok=True)
    no_state = 0
    for attempt in range(rounds):
        for url in donors:
            try:
                step = await _fetch_from(client, url, job_id, root, at_least)
            except PeerRequestError as e:
                if e.status == 404:
                    no_state += 1
                log.warning("state transfer from %s failed: %s", url, e)
                continue
            except (AtomdError, httpx.HTTPError, OSError, ValueError, KeyError) as e:
                log.warning("state transfer from %s failed: %s; trying the next peer", url, e)
                continue
            log.info("fetched job %s at step %d from %s", job_id, step, url)
            return step
        if no_state == len(donors) * (attempt + 1):
            return None  # every donor answered: nobody has a checkpoint yet
        await asyncio.sleep(1.0)
    raise CheckpointError(f"could not fetch the state of job {job_id} from {len(donors)} peer(s)")
