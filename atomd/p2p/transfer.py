"""State transfer: a peer joining a running job fetches the newest checkpoint from a live peer.

A donor that trains the job first checkpoints its live state at its next step boundary, so the
joiner starts from the swarm's current model; a donor with nothing newer than the joiner's own
checkpoint (``at_least``), or whose swarm has closed no round yet, has no state to give, and the
joiner starts from its checkpoint or the initial weights. The
donor serves its newest checkpoint as a
manifest (the checkpoint's ``meta.json``: step, file sizes and sha256) and the files as chunked
streams. The joiner writes them into a hidden
``.incoming-*`` folder, checking sizes and hashes as bytes arrive, writes ``meta.json`` last,
fsyncs and renames the folder into place. A donor that dies, lies or stalls costs that attempt:
the temporary folder is removed and the next donor is tried. Nothing half-downloaded is used,
because only a complete, verified folder ever gets a ``step-*`` name.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from safetensors import SafetensorError, safe_open

from atomd.errors import AtomdError, CheckpointError, PeerRequestError
from atomd.logs import get_logger
from atomd.p2p import paths
from atomd.p2p.client import PeerClient
from atomd.p2p.messages import StateManifest, manifest_problem, parse
from atomd.train import checkpoint as ckpt

log = get_logger(__name__)

TRANSFER_FILES = (ckpt.MODEL_FILE, ckpt.STATE_FILE)
# Sent too when the manifest lists them (checkpoints of runs with a tokenizer).
OPTIONAL_FILES = (ckpt.TOKENIZER_FILE,)
MANIFEST_TIMEOUT_S = 45.0
_CHUNK = 1 << 20
DEADLINE_S = 900.0  # the whole transfer, every donor tried included
DISK_MARGIN = 64 << 20  # free bytes left on the disk after a transfer
MAX_TOKENIZER_BYTES = 64 << 20  # a BPE vocabulary of ~10^6 entries is ~50 MB of JSON


def _unchecked(path: Path) -> bool:
    """A donor's state this daemon fetched and its trainer has not yet evaluated (the fetch
    marks it ``DONATED_FILE``; the trainer removes the mark once the state passed): never
    passed on, not even after a crash between the two."""
    return (path / ckpt.DONATED_FILE).exists()


def newest_manifest(root: Path) -> StateManifest | None:
    """The newest complete, checked checkpoint's meta.json under ``root`` (None if there is
    none)."""
    for path in ckpt.list_checkpoints(root):
        if _unchecked(path):
            continue
        try:
            meta = parse(StateManifest, (path / ckpt.META_FILE).read_bytes())
        except (OSError, AtomdError):
            continue
        if all((path / name).is_file() for name in TRANSFER_FILES):
            return meta
    return None


def checkpoint_file(root: Path, step: int, name: str) -> Path | None:
    """The path of one transferable file of checkpoint ``step``, if it still exists."""
    if name not in TRANSFER_FILES + OPTIONAL_FILES:
        return None
    where = ckpt.checkpoint_dir(root, step)
    path = where / name
    return path if path.is_file() and not _unchecked(where) else None


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
            raise LyingDonorError(
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
            raise LyingDonorError(f"{self.path.name}: sha256 mismatch (corrupt in transfer)")


@dataclass(frozen=True)
class Fetched:
    """A state fetched: its step and the donor's URL; ``claimed_val``: what the job's other
    members last measured, the higher median of their newest validation losses (None with
    fewer than ``SwarmNode``'s quorum of them), for the joiner's check of the state."""

    step: int
    donor: str
    claimed_val: float | None = None
    donor_id: str | None = None  # the donor's peer id, where a live member served it


class LyingDonorError(CheckpointError):
    """A donor announced what it did not send (sizes, hashes) or more than the job's model can
    be: it is not asked again."""


def _check_sizes(url: str, manifest: StateManifest, root: Path, max_file_bytes: int | None) -> None:
    """Sizes the job's model implies, and room on the disk, before a byte is downloaded."""
    files = manifest.files.entries()
    tokenizer = manifest.files.tokenizer
    if tokenizer is not None and tokenizer.bytes > MAX_TOKENIZER_BYTES:
        raise LyingDonorError(
            f"{url} announces a tokenizer.json of {tokenizer.bytes} bytes; "
            f"at most {MAX_TOKENIZER_BYTES} are accepted"
        )
    if max_file_bytes is not None:
        for name, f in files.items():
            if f.bytes > max_file_bytes:
                raise LyingDonorError(
                    f"{url} announces {name} of {f.bytes} bytes; this job's model makes it at "
                    f"most {max_file_bytes}"
                )
    need = sum(f.bytes for f in files.values()) + DISK_MARGIN
    free = shutil.disk_usage(root).free
    if need > free:
        raise CheckpointError(
            f"the state from {url} needs {need / 2**20:.0f} MiB on the disk of {root}; "
            f"{free / 2**20:.0f} MiB are free"
        )


KeyAt = Callable[[str, str], tuple[str, str] | None]
"""(A donor URL, the peer its manifest names as signer) -> (that peer's id, its public key
hex), from the membership, when that member is at that URL; None otherwise."""


async def _fetch_from(
    client: PeerClient,
    url: str,
    job_id: str,
    root: Path,
    max_file_bytes: int | None = None,
    key_at: KeyAt | None = None,
    at_least: int = 0,
) -> int:
    # The donor may checkpoint its live state for us first (up to 30 s; jobs.LIVE_STATE_...);
    # it answers 404 when it has no state from step ``at_least`` on.
    path = paths.job_state(job_id) + (f"?at_least={at_least}" if at_least > 0 else "")
    manifest = await client.get(url, path, StateManifest, timeout=MANIFEST_TIMEOUT_S)
    step = manifest.step
    if step < at_least:  # a donor that did not honour the query: it has nothing newer
        raise PeerRequestError(
            f"{url} has state at step {step}, not from step {at_least} on", status=404
        )
    if key_at is not None:  # the donor's own word: its signature over the step and the files
        if manifest.signer is None:
            raise LyingDonorError(f"{url}: the manifest is not signed")
        # The member the manifest names, if it is the one at this URL: by URL alone, a member
        # advertising an honest donor's URL would be taken for it, and the honest manifest
        # would fail against that member's key (the donor branded a liar for good).
        who = key_at(url, manifest.signer)
        if who is None:
            raise CheckpointError(
                f"{url} is not the URL of member {manifest.signer}, who its manifest says signed "
                "it: not a donor"
            )
        problem = manifest_problem(manifest, client.swarm, job_id, *who)
        if problem is not None:
            raise LyingDonorError(f"{url}: {problem}")
    await asyncio.to_thread(_check_sizes, url, manifest, root, max_file_bytes)
    files = manifest.files.entries()
    tmp = root / f".incoming-step-{step:08d}-{os.getpid()}"
    await asyncio.to_thread(shutil.rmtree, tmp, True)
    await asyncio.to_thread(tmp.mkdir, parents=True)
    publish: asyncio.Future[None] | None = None
    try:
        for name, want in files.items():
            dl = await asyncio.to_thread(_Download, tmp / name, want.bytes, want.sha256)
            try:
                path = paths.job_state_file(job_id, step, name)
                async with client.stream("GET", url, path, timeout=30) as resp:
                    async for chunk in resp.aiter_bytes(_CHUNK):
                        await asyncio.to_thread(dl.write, chunk)
                await asyncio.to_thread(dl.finish)
            finally:
                dl.file.close()
        meta = json.dumps(
            manifest.model_dump(mode="json", by_alias=True, exclude_none=True),
            indent=2,
            sort_keys=True,
        )
        await asyncio.to_thread((tmp / ckpt.META_FILE).write_text, meta)
        await asyncio.to_thread((tmp / ckpt.DONATED_FILE).write_text, url)
        publish = asyncio.ensure_future(
            asyncio.to_thread(_fsync_and_publish, tmp, ckpt.checkpoint_dir(root, step))
        )
        await asyncio.shield(publish)
    except BaseException:
        if publish is not None and not publish.done():
            # Cancelled (a stop) while the thread publishes: let it finish, or the removal
            # below would run beside its rename and empty the folder it has just published.
            with contextlib.suppress(BaseException):
                await publish
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
            raise LyingDonorError(f"{name} from the donor is not a safetensors file: {e}") from e
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
    max_file_bytes: int | None = None,
    deadline_s: float = DEADLINE_S,
    liars: set[str] | None = None,
    key_at: KeyAt | None = None,
    at_least: int = 0,
) -> Fetched | None:
    """Fetch the newest checkpoint of ``job_id`` from the first donor that delivers it whole,
    within ``deadline_s`` in all. A file announced larger than ``max_file_bytes`` (what the
    job's model implies) or than the free disk is not downloaded; a donor that lies (sizes,
    hashes) is added to ``liars`` and not asked again.

    Returns the step fetched and its donor, or None when no donor has one from step
    ``at_least`` on (the job starts from its seed, or from the joiner's own checkpoint).
    """
    try:
        async with asyncio.timeout(deadline_s):
            return await _fetch_state(client, donors, job_id, root, rounds, max_file_bytes,
                                      liars if liars is not None else set(), key_at,
                                      at_least)  # fmt: skip
    except TimeoutError:
        raise CheckpointError(
            f"the state of job {job_id} did not arrive within {deadline_s:g} s"
        ) from None


async def _fetch_state(
    client: PeerClient,
    donors: Sequence[str],
    job_id: str,
    root: Path,
    rounds: int,
    max_file_bytes: int | None,
    liars: set[str],
    key_at: KeyAt | None = None,
    at_least: int = 0,
) -> Fetched | None:
    await asyncio.to_thread(root.mkdir, parents=True, exist_ok=True)
    honest = [u for u in donors if u not in liars]
    if not honest and donors:
        raise CheckpointError(
            f"every donor of job {job_id} was refused before: {', '.join(donors)}"
        )
    donors = honest
    no_state = 0
    for attempt in range(rounds):
        for url in donors:
            if url in liars:
                continue
            try:
                step = await _fetch_from(
                    client, url, job_id, root, max_file_bytes, key_at, at_least
                )
            except LyingDonorError as e:
                liars.add(url)
                log.warning("state transfer from %s refused: %s; not asking it again", url, e)
                continue
            except PeerRequestError as e:
                if e.status == 404:
                    no_state += 1
                log.warning("state transfer from %s failed: %s", url, e)
                continue
            except (AtomdError, httpx.HTTPError, OSError, ValueError, KeyError) as e:
                log.warning("state transfer from %s failed: %s; trying the next peer", url, e)
                continue
            log.info("fetched job %s at step %d from %s", job_id, step, url)
            return Fetched(step, url)
        if no_state == len(donors) * (attempt + 1):
            return None  # every donor answered: nobody has a checkpoint yet
        await asyncio.sleep(1.0)
    raise CheckpointError(f"could not fetch the state of job {job_id} from {len(donors)} peer(s)")
