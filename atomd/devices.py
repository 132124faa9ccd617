"""Choosing the compute device."""

from __future__ import annotations

from typing import Literal

import torch

from atomd.errors import ConfigError

DeviceName = Literal["auto", "cpu", "cuda"]


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present, else the CPU; ``cuda`` without CUDA is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda asked for, but torch sees no CUDA device")
        return torch.device("cuda")
    if name == "cpu":
        return torch.device("cpu")
    raise ConfigError(f"unknown device {name!r}: use auto, cpu or cuda")
