"""Choosing the compute device."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from atomd.errors import ConfigError

if TYPE_CHECKING:
    import torch

DeviceName = Literal["auto", "cpu", "cuda"]


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present, else the CPU; ``cuda`` without CUDA is an error."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda asked for, but torch sees no CUDA device")
        return torch.device("cuda")
    if name == "cpu":
        return torch.device("cpu")
    raise ConfigError(f"unknown device {name!r}: use auto, cpu or cuda")


# fp32 weights (4) + gradients (4) + AdamW moments (8): what training keeps per parameter.
TRAIN_BYTES_PER_PARAMETER = 16


def host_memory_available() -> int | None:
    """Bytes of host memory available for new allocations (Linux ``MemAvailable``), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
