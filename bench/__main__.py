"""``python -m bench [NAME ...]``: run benchmarks and print their JSON, one object per line."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

from bench import healthz, membership, swap, sync, train_tiny

BENCHES: dict[str, Callable[[], dict[str, Any]]] = {
    "train_tiny": train_tiny.run,
    "healthz": healthz.run,
    "swap": swap.run,
    "membership": membership.run,
    "sync": sync.run,
}


def main(argv: list[str]) -> None:
    names = argv or list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {unknown}; known: {', '.join(BENCHES)}")
    for name in names:
        print(json.dumps({"bench": name, **BENCHES[name]()}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
