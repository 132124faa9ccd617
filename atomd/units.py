"""Byte sizes as people write them: ``24GiB``, ``8GB``, ``512MiB``, or a plain integer."""

from __future__ import annotations

import re

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int) -> int:
    """``"24GiB"`` -> 25769803776. Decimal (GB) and binary (GiB) units; a bare number is bytes."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a size cannot be negative, got {text}")
        return text
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size: use e.g. 24GiB, 8GB, 512MiB or bytes")
    return int(float(m.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    """A short human form in binary units: ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
