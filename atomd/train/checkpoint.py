"""Checkpoints: safetensors for tensors, a JSON file of metadata, written atomically.

Layout: ``<out>/checkpoints/step-00001200/{model.safetensors, state.safetensors, meta.json}``.
``state.safetensors`` holds the optimizer state and RNG states. ``meta.json`` holds the step,
the model config, the spec, the data position and the sha256 of both tensor files.

A checkpoint is written into a hidden temporary folder, every file fsync'ed, then renamed into
place (and the parent fsync'ed), so a crash leaves either the old set or the new one. Loading
verifies hashes and sizes; a corrupt or truncated checkpoint is refused with the reason, and the
newest good one is used instead.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError

if TYPE_CHECKING:
    from torch import Tensor

from atomd.errors import CheckpointError
from atomd.logs import get_logger

log = get_logger(__name__)

FORMAT_VERSION = 1
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.safetensors"
META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.json"  # the run's tokenizer (atomd.data.tokenizer)
# In a checkpoint another peer gave (a state transfer), until the trainer has checked it: a
# daemon that stops between the fetch and the check checks it when it resumes (the file names
# the donor; it is not listed in meta.json, and a checkpoint is read without it).
DONATED_FILE = "donated"
_PREFIX = "step-"


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint, loaded into host memory."""

    path: Path
    step: int
    meta: dict[str, Any]
    model: dict[str, Tensor]
    state: dict[str, Tensor]


def sha256_file(path: Path, *, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with path.open("rb+") as f:
        os.fsync(f.fileno())


def _disk_full(e: BaseException) -> bool:
    """ENOSPC or EDQUOT, raised by Python (OSError) or by safetensors (its message)."""
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    return f"os error {errno.ENOSPC})" in str(e) or "No space left on device" in str(e)


def checkpoint_root(out_dir: Path) -> Path:
    return out_dir / "checkpoints"


def checkpoint_dir(root: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` lives under ``root``."""
    return root / f"{_PREFIX}{step:08d}"


def checkpoint_step(path: Path) -> int:
    """The step of a checkpoint folder ``checkpoint_dir`` named (one ``list_checkpoints`` gives)."""
    return int(path.name[len(_PREFIX) :])


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoint folders under ``root``, newest (highest step) first. Temp folders are skipped."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith(_PREFIX) and p.name[len(_PREFIX) :].isdigit():
            found.append(p)
    return sorted(found, key=checkpoint_step, reverse=True)


# Folders a writer fills before it renames them into place (``save_checkpoint``'s, a state
# transfer's ``.incoming-step-*``), named by the writing process's pid.
_PARTIAL_PREFIXES = (".tmp-", ".incoming-")


def remove_partial(root: Path) -> list[str]:
    """Remove the half-written folders under ``root`` that a crash left (named by a pid that
    is gone, they were never removed: each up to ~6 model sizes, counted against the free
    disk); their names. Only while nothing writes under ``root``: a job's checkpoints and
    state transfers are written only while it is the daemon's active job."""
    if not root.is_dir():
        return []
    gone = []
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith(_PARTIAL_PREFIXES):
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p.name)
    return sorted(gone)


def remove_checkpoints_after(root: Path, step: int) -> None:
    """Remove the checkpoints under ``root`` past ``step`` (a job resumes from the newest)."""
    for where in list_checkpoints(root):
        if checkpoint_step(where) > step:
            shutil.rmtree(where, ignore_errors=True)


def save_checkpoint(
    root: Path,
    *,
    step: int,
    model: dict[str, Tensor],
    state: dict[str, Tensor],
    meta: dict[str, Any],
    keep: int = 3,
    extra: dict[str, bytes] | None = None,
) -> Path:
    """Write a checkpoint atomically and prune old ones, keeping ``keep`` good ones.
    ``extra`` files (``tokenizer.json``) are written beside the tensors and hashed too."""
    from safetensors.torch import save_file  # torch loads only where tensors are written

    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir(root, step)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        files = {MODEL_FILE: model, STATE_FILE: state}
        hashes = {}
        for name, tensors in files.items():
            path = tmp / name
            save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))
            _fsync_file(path)
            hashes[name] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
        for name, blob in (extra or {}).items():
            path = tmp / name
            path.write_bytes(blob)
            _fsync_file(path)
            hashes[name] = {"sha256": sha256_file(path), "bytes": len(blob)}
        full_meta = {**meta, "format_version": FORMAT_VERSION, "step": step, "files": hashes}
        meta_path = tmp / META_FILE
        meta_path.write_text(json.dumps(full_meta, indent=2, sort_keys=True))
        _fsync_file(meta_path)
        _fsync_dir(tmp)
        if final.exists():  # the same step written again (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except (OSError, SafetensorError) as e:
        shutil.rmtree(tmp, ignore_errors=True)  # the older checkpoints are untouched
        good = [p for p in list_checkpoints(root) if p != final]
        last = f"step {checkpoint_step(good[0])} ({good[0]})" if good else "none"
        if _disk_full(e):
            raise CheckpointError(
                f"no space left on device writing {final}; the last good checkpoint is {last}"
            ) from e
        raise CheckpointError(
            f"could not write checkpoint {final}: {e}; the last good checkpoint is {last}"
        ) from e
    for old in list_checkpoints(root)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path) -> Checkpoint:
    """Load and verify one checkpoint folder; raise ``CheckpointError`` saying what is wrong."""
    from safetensors.torch import load_file

    meta_path = path / META_FILE
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {META_FILE} is missing (incomplete checkpoint)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: {META_FILE} is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        got = meta.get("format_version") if isinstance(meta, dict) else None
        raise CheckpointError(f"{path}: format_version {got!r}, expected {FORMAT_VERSION}")
    loaded: dict[str, dict[str, Tensor]] = {}
    listed = meta.get("files", {})
    extras = [n for n in listed if n not in (MODEL_FILE, STATE_FILE)]
    for name in (MODEL_FILE, STATE_FILE, *extras):
        f = path / name
        want = listed.get(name)
        if want is None:
            raise CheckpointError(f"{path}: {META_FILE} does not list {name}")
        if not f.is_file():
            raise CheckpointError(f"{path}: {name} is missing")
        size = f.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"{path}: {name} has {size} bytes, expected {want['bytes']}")
        digest = sha256_file(f)
        if digest != want["sha256"]:
            raise CheckpointError(
                f"{path}: {name} sha256 {digest[:12]}…, expected {want['sha256'][:12]}…"
            )
        if name in extras:
            continue
        try:
            loaded[name] = load_file(str(f))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: {name} cannot be read: {e}") from e
    return Checkpoint(
        path=path,
        step=int(meta["step"]),
        meta=meta,
        model=loaded[MODEL_FILE],
        state=loaded[STATE_FILE],
    )


def resolve_checkpoint_dir(path: Path) -> Path:
    """Accept a run's output folder, its ``checkpoints`` folder, or one checkpoint folder."""
    if (path / META_FILE).exists():
        return path
    if (path / "checkpoints").is_dir():
        return path / "checkpoints"
    return path


def load_latest(root: Path) -> Checkpoint | None:
    """The newest good checkpoint under ``root`` (or ``root`` itself if it is one).

    Corrupt ones are skipped with a warning. ``None`` when there are none at all; raises
    ``CheckpointError`` when there are some but none is good.
    """
    root = resolve_checkpoint_dir(root)
    if (root / META_FILE).exists():
        return load_checkpoint(root)
    candidates = list_checkpoints(root)
    if not candidates:
        return None
    problems = []
    for path in candidates:
        try:
            ckpt = load_checkpoint(path)
        except CheckpointError as e:
            log.warning("skipping bad checkpoint: %s", e)
            problems.append(str(e))
            continue
        if problems:
            log.warning("using the previous good checkpoint %s", path.name)
        return ckpt
    raise CheckpointError("no usable checkpoint in " + str(root) + ": " + "; ".join(problems))


def rng_state() -> dict[str, Tensor]:
    """RNG states as tensors, to be stored in ``state.safetensors``."""
    import torch

    out = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng.cuda.{i}"] = s
    return out


def set_rng_state(state: dict[str, Tensor]) -> None:
    import torch

    if "rng.torch" in state:
        torch.set_rng_state(state["rng.torch"])
    if torch.cuda.is_available():
        cuda = [state[k] for k in sorted(k for k in state if k.startswith("rng.cuda."))]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
