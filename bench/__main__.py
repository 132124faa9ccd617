"""``python -m bench [NAME ...]``: run benchmarks and print their JSON, one object per line."""

from __future__ import annotations

import json
import sys

from bench import train_tiny

BENCHES = {"train_tiny": train_tiny.run}


def main(argv: list[str]) -> None:
    names = argv or list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {unknown}; known: {', '.join(BENCHES)}")
    for name in names:
        print(json.dumps({"bench": name, **BENCHES[name]()}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
