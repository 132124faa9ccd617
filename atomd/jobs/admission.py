"""What may start here, and with what: the checks of a job's spec against this host (data,
tokenizer, memory, disk) and of a swarm's advert against this daemon's files."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

from atomd.data.sources import (
    BUNDLED,
    check_source,
    check_tokenizer_name,
    exists,
    expand_path,
)
from atomd.data.sources import BYTES as BYTES_TOKENIZER
from atomd.data.sources import DEFAULT as DEFAULT_TOKENIZER
from atomd.devices import (
    TRAIN_BYTES_PER_PARAMETER,
    host_memory_available,
    host_step_bytes,
    trains_on_host,
)
from atomd.errors import ConfigError, DataError, SpecError
from atomd.model.config import num_parameters
from atomd.spec import JobSpec

# A checkpoint holds about this many fp32 copies of the model: the weights, AdamW's two moments
# and the sync state (anchor, outer momentum, residuals).
CHECKPOINT_MODEL_SIZES = 6


def advert_data_problem(data: str, names: Mapping[str, str]) -> str | None:
    """Why a job another peer announced may not train on ``data`` here, or None: a swarm job
    names the bundled corpus or a dataset this daemon's operator registered by name
    (``ATOMD_DATA_NAMES``), never a path (a peer would otherwise make this daemon train on,
    and send deltas of, whatever local file the advert names)."""
    if data == BUNDLED or data in names:
        return None
    known = ", ".join(sorted([BUNDLED, *names]))
    return (
        f"its data {data[:200]!r} is neither the bundled corpus nor a dataset registered here "
        f"by name ({known}; ATOMD_DATA_NAMES): a job from the swarm may not name a local path"
    )


def advert_problem(spec: JobSpec, names: Mapping[str, str]) -> str | None:
    """Why this daemon may not join a job another peer announced, or None: no field of the
    advert may make it read a local file (its data, tokenizer, or initial weights)."""
    problem = advert_data_problem(spec.data, names)
    if problem is not None:
        return problem
    if spec.tokenizer not in (BYTES_TOKENIZER, DEFAULT_TOKENIZER):
        return (
            f"its tokenizer {spec.tokenizer[:200]!r} is a path: a job from the swarm may only "
            f"use {BYTES_TOKENIZER!r} or {DEFAULT_TOKENIZER!r}"
        )
    if spec.init_from is not None:
        return (
            f"it starts from init_from {spec.init_from[:200]!r}: a job from the swarm may not "
            f"name a local path (a joiner starts from the swarm's state)"
        )
    return None


def local_data(spec: JobSpec, names: Mapping[str, str]) -> JobSpec:
    """``spec`` with a registered dataset name replaced by its local path."""
    if spec.data in names:
        return spec.model_copy(update={"data": names[spec.data]})
    return spec


def state_file_bound(spec: JobSpec) -> int:
    """The most bytes a checkpoint file of ``spec``'s model can hold: fp32 weights, AdamW's two
    moments and the sync state (anchor, momentum, error feedback, pending rounds), with room
    to spare; a donor whose manifest announces more is lying."""
    return num_parameters(spec.model_shape) * 4 * 16 + (64 << 20)


def disk_problem(spec: JobSpec, jobs_dir: Path) -> str | None:
    """Why the disk under ``jobs_dir`` cannot hold the checkpoints a swarm's job asks this
    daemon to keep (``keep_checkpoints``, and one more while the next is written, each about
    CHECKPOINT_MODEL_SIZES fp32 models), or None. A member's advert chooses them: up to 1,000
    kept, which would fill the disk of every peer that joined."""
    size = CHECKPOINT_MODEL_SIZES * 4 * num_parameters(spec.model_shape)
    need = (spec.keep_checkpoints + 1) * size
    where = jobs_dir
    while not where.exists() and where.parent != where:
        where = where.parent
    free = shutil.disk_usage(where).free
    if need <= free:
        return None
    return (
        f"keeping {spec.keep_checkpoints} checkpoints of this model takes up to "
        f"{need / 2**30:.1f} GiB, and {free / 2**30:.1f} GiB are free under {where}"
    )


def admit(spec: JobSpec, device: str = "auto") -> None:
    """Refuse, with the reason, a job that cannot start here (before anything is queued).

    Cheap on purpose (microseconds, no torch): it runs on the request path of ``POST
    /v1/jobs``. The parameter count and, where the job trains on the CPU (``device``, the
    daemon's setting: ``trains_on_host``), one micro-batch's activations follow from the spec
    in closed form (``host_step_bytes``); whatever else can fail (building the model, loading
    the data) fails on the trainer thread after the 201 and is recorded on the job."""
    try:
        check_source(spec.data)
    except DataError as e:
        raise SpecError(str(e), field="data") from None
    try:
        check_tokenizer_name(spec.tokenizer)
    except ConfigError as e:
        raise SpecError(str(e), field="tokenizer") from None
    if spec.init_from is not None and not exists(expand_path(spec.init_from)):
        raise SpecError(f"init_from {spec.init_from!r} does not exist", field="init_from")
    have = host_memory_available()
    if have is None:
        return
    state = num_parameters(spec.model_shape) * TRAIN_BYTES_PER_PARAMETER
    if state > have:
        raise SpecError(
            f"preset {spec.preset!r} needs about {state / 2**30:.1f} GiB of host memory for its "
            f"weights, gradients and AdamW state; this host has {have / 2**30:.1f} GiB available",
            field="preset",
        )
    if not trains_on_host(device):
        return  # the activations live in the GPU's memory
    acts = host_step_bytes(spec)
    if state + acts > have:
        fit = _sequences_that_fit(spec, have - state)
        if fit:
            plural = "s fit" if fit > 1 else " fits"
            hint, lower = f"{fit} sequence{plural}", "micro_batch_size"
        else:
            hint, lower = "not one sequence fits", "seq_len"
        raise SpecError(
            f"preset {spec.preset!r} with micro_batch_size {spec.micro_batch_size} and seq_len "
            f"{spec.effective_seq_len} needs about {(state + acts) / 2**30:.1f} GiB of host "
            f"memory, training on the CPU: {state / 2**30:.1f} GiB for its weights, gradients "
            f"and AdamW state and {acts / 2**30:.1f} GiB for one micro-batch's activations "
            f"(with the allocator's slack); "
            f"this host has {have / 2**30:.1f} GiB available ({hint}): lower {lower} "
            f"(grad_accum keeps the tokens per step)",
            field=lower,
        )


def _sequences_that_fit(spec: JobSpec, room: int) -> int:
    """The largest micro_batch_size below the spec's whose activations fit ``room`` bytes
    (0: none); the activations grow with it, so a bisection of a dozen estimates finds it."""
    lo, hi = 0, spec.micro_batch_size  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if host_step_bytes(spec.model_copy(update={"micro_batch_size": mid})) <= room:
            lo = mid
        else:
            hi = mid
    return lo
