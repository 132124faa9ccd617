"""``python -m bench [NAME ...]``: run benchmarks and print their JSON, one object per line.

``python -m bench swarm [OPTIONS]`` runs the swarm benchmark with its own options
(``--help``)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

from bench import healthz, membership, swap, swarm, sync, train_tiny

BENCHES: dict[str, Callable[[], dict[str, Any]]] = {
    "train_tiny": train_tiny.run,
    "healthz": healthz.run,
    "swap": swap.run,
    "membership": membership.run,
    "sync": sync.run,
    "swarm": swarm.run,
}
# Benchmarks that take their own command-line options after their name.
WITH_OPTIONS: dict[str, Callable[[list[str]], None]] = {"swarm": swarm.main}


def main(argv: list[str]) -> None:
    if argv and argv[0] in WITH_OPTIONS and len(argv) > 1:
        WITH_OPTIONS[argv[0]](argv[1:])
        return
    names = argv or list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {unknown}; known: {', '.join(BENCHES)}")
    for name in names:
        print(json.dumps({"bench": name, **BENCHES[name]()}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
