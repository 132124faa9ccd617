"""``python -m atomd_bench [--quick] [NAME ...]`` (this ``bench/`` folder): run benchmarks and
print their JSON, one object per line on stdout; what runs and how long it takes goes to stderr
first.

The durations are those measured on a quiet 2-core machine without a GPU (``make bench``:
about 110 min in all, most of it the sync convergence runs; ``make bench-quick``: a few minutes).
``python -m atomd_bench swarm [OPTIONS]`` runs the real-daemon swarm benchmark with its own
options (``--help``); it is not part of the default list (its full run takes hours here), nor
is ``join`` (where a joining peer starts: two simulated peers, ~1 min with its defaults), nor
``link`` (what ``swarm``'s emulated links carry between bare asyncio peers: ~40 s, as root).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Bench:
    """A benchmark: how to run it, how long it takes, and its quick variant."""

    module: str
    takes: str
    quick_takes: str
    quick: dict[str, Any] = field(default_factory=dict)
    function: str = "run"

    def runner(self) -> Callable[..., dict[str, Any]]:
        import importlib

        run: Callable[..., dict[str, Any]] = getattr(
            importlib.import_module(self.module), self.function
        )
        return run


BENCHES: dict[str, Bench] = {
    "train_tiny": Bench("atomd_bench.train_tiny", "~2.5 min", "~20 s", {"max_steps": 60}),
    "healthz": Bench("atomd_bench.healthz", "~1 min", "~30 s", {"requests": 100}),
    "latency": Bench("atomd_bench.latency", "~8 min", "~1.5 min", {"quick": True}),
    "swap": Bench("atomd_bench.swap", "~1 min", "~30 s", {"steps": 1}),
    "membership": Bench("atomd_bench.membership", "~1 min", "~40 s", {"n": 4}),
    "membership_idle": Bench(
        "atomd_bench.membership", "~2 min", "~1 min", {"seconds": 10.0}, function="idle"
    ),
    "sync": Bench("atomd_bench.sync", "~70 min", "~1 min", {"quick": True}),
    "optim": Bench("atomd_bench.optim", "~30 s", "~10 s", {"quick": True}),
    "tls": Bench("atomd_bench.tls_cost", "~20 s", "~8 s", {"connects": 10, "pings": 50}),
    "attack": Bench("atomd_bench.attack", "~27 min", "~7 min", {"quick": True}),
    "activation_memory": Bench(
        "atomd_bench.activation_memory", "~10 min", "~1.5 min", {"quick": True}
    ),
}
# Benchmarks that take their own command-line options after their name: (module, function).
WITH_OPTIONS: dict[str, tuple[str, str]] = {
    "swarm": ("atomd_bench.swarm", "main"),
    "join": ("atomd_bench.join", "main"),
    "link": ("atomd_bench.link", "main"),
}


def usage() -> str:
    """What ``--help`` prints: every benchmark, how long it takes, and how to run it."""
    width = max(len(n) for n in [*BENCHES, *WITH_OPTIONS])
    lines = [
        "usage: python -m atomd_bench [--quick] [NAME ...]    (also: atomd bench ..., make bench)",
        "       python -m atomd_bench NAME --help             (for a benchmark with options)",
        "",
        "Runs the named benchmarks (default: all below) and prints one JSON object per line.",
        "Durations measured on a quiet 2-core machine; --quick runs each one's quick variant.",
        "",
    ]
    lines += [f"  {n:<{width}}  {b.takes:>8} (quick {b.quick_takes})" for n, b in BENCHES.items()]
    lines += [f"  {n:<{width}}  its own options: python -m atomd_bench {n} --help"
              for n in WITH_OPTIONS]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return
    if argv and argv[0] in WITH_OPTIONS:
        from importlib import import_module

        module, fn = WITH_OPTIONS[argv[0]]
        getattr(import_module(module), fn)(argv[1:])
        return
    quick = "--quick" in argv
    names = [a for a in argv if a != "--quick"] or list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {unknown}\n\n{usage()}")
    plan = ", ".join(
        f"{n} ({BENCHES[n].quick_takes if quick else BENCHES[n].takes})" for n in names
    )
    variant = "quick variants" if quick else "full runs; `make bench-quick` runs quick ones"
    print(f"bench: {plan} ({variant}); times measured on 2 cores", file=sys.stderr, flush=True)
    for name in names:
        b = BENCHES[name]
        print(f"bench: {name} starts (~{(b.quick_takes if quick else b.takes).lstrip('~')})",
              file=sys.stderr, flush=True)  # fmt: skip
        t0 = time.monotonic()
        result = b.runner()(**(b.quick if quick else {}))
        took = time.monotonic() - t0
        print(json.dumps({"bench": name, "quick": quick, "took_s": round(took, 1), **result}),
              flush=True)  # fmt: skip
        print(f"bench: {name} done in {took:.0f} s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
