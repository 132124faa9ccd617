"""The swarm convergence benchmark: simulated peers exchanging compressed deltas, one process.

A fixed task, so results compare with other systems (Hivemind, DiLoCo): the ``tiny`` GPT (4
layers, width 128, 4 heads, sequence 128, byte vocabulary) on the bundled corpus, its last 5%
held out; the score is the mean loss over 20 fixed validation batches of 16 sequences. A swarm
run trains 4 peers, each 600 AdamW steps on micro-batches of 16 sequences from its own shard
(lr 3e-3, 50 warm-up steps, cosine to 10%), all from the same initial weights, each with its own
``SyncState`` (the daemon's merge code). Baselines: one peer alone, and one process with batch 64.

Asynchrony is simulated deterministically. The peers step together, but a delta reaches each
other peer after a delay drawn per (sender, receiver, round) uniformly from 0 to H steps (peers
out of phase by up to a whole round, as when they run at different speeds). At a boundary the
peers close their rounds in a seeded random order; a delay of 0 reaches a peer at the same
boundary only if it closes later, otherwise the step after. Between boundaries a peer absorbs
what has arrived after each step, as the daemon does. So on average a delta is half a round late
and most arrive mid-round. ``sync`` runs wait for every delta of the round (all prepare, then
all merge).

Reported per run: final validation loss (``val_loss``: mean over peers of each peer's model once
the last round's deltas have arrived, as the daemon's final wait ``sync.final_wait_s`` gives it;
``val_loss_at_last_step``: the same right after the last step, before that wait;
``val_loss_anchor``: the committed anchor's), bytes each peer sends per round (the signed frame
the daemon sends, header included), the ratio of the fp32 model's size to that, the largest
relative L2 distance between two peers' committed anchors after warm-up (``divergence_max``),
between the points their replicas restart from, which also hold the deltas still in flight
(``start_divergence_max``), and between the models they end with (``model_divergence_final``:
start point plus any residual kept in the replica), and wall time. With
``sync.consolidate_rounds`` the peers then run that many synchronous rounds without training
(``val_loss_before_consolidation``, ``consolidation_bytes_per_peer``); ``val_loss_mean_model``
is the loss of the exact average of the final models (a diagnostic no peer holds).

A run with a ``link`` simulates one of that many bytes a step to each other peer
(``SimulatedLink``): a delta arrives no sooner than its upload is done, a round lasts at least
until its last frame has gone, and the last close waits for the frames still on their way. With
``every="auto"`` (``<codec>-auto-link<r>x``) the daemon's ``Cadence`` and ``FrameSize`` choose
each round's share of entries and H from that link. It also reports each round's H, share and
largest frame, and bytes a step.

The default runs (``default_runs``): fp32, bf16, int8 and top-k at H=50; top-k synchronous, at
H=10 and H=2 with fp32 beside each; top-k with contiguous shards; one peer alone; one process
with batch 64. ``extra_runs`` holds the evidence behind the defaults. ``targets`` checks the
default codec's bars for every H a ``<codec>-h<H>`` run covers.

The modules:  ``sync_runs`` (the task, ``RunSpec``, ``Budget`` and the runs), ``sync_swarm`` (the
simulated swarm and the single-process references), ``sync_link`` (``SimulatedLink``),
``ideal_codec`` (``IdealCodec``), ``engines`` (the peers' engines and the distances between
their models); this one runs a selection and reports it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Any

import torch

from atomd.model.presets import get_preset
from atomd.spec import SyncSpec
from atomd_bench.sync_runs import (
    BATCH,
    LR,
    PRESET,
    QUICK,
    SEED,
    TARGET_DIVERGENCE,
    TARGET_LOSS,
    TARGET_RATIO,
    TARGET_REL_LOSS,
    Budget,
    RunSpec,
    default_runs,
    extra_runs,
    resolve_runs,
)
from atomd_bench.sync_swarm import run_single, run_swarm


def _run_one(run: RunSpec, budget: Budget) -> dict[str, Any]:
    torch.set_num_threads(1)
    return (run_swarm if run.codec is not None else run_single)(run, budget)


def _progress(result: dict[str, Any]) -> None:
    parts = [f"[bench sync] {result['name']}: val {result['val_loss']:.4f}"]
    if result.get("codec"):
        parts.append(
            f"{result['bytes_per_round'] / 1024:.1f} KiB/round "
            f"({result['ratio_vs_fp32_model']:.0f}x), div {result['divergence_max']:.2e}"
        )
    parts.append(f"{result['wall_s']:.0f} s")
    print(", ".join(parts), file=sys.stderr, flush=True)


def _bar(value: float, bar: float, ok: bool) -> dict[str, Any]:
    return {"value": value, "bar": bar, "ok": ok}


def _targets(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The default codec's bars, per H, checked where the runs that decide them are present:
    loss below Hivemind's, bytes ratio and anchor divergence for ``<codec>-h<H>``, and within
    2% of ``fp32-h<H>`` and of ``<codec>-h<H>-sync``. ``best`` names the H with the lowest loss."""
    d = SyncSpec().codec
    by_every: dict[str, dict[str, Any]] = {}
    for name, main in results.items():
        named = re.fullmatch(rf"{d}-h(\d+)", name)  # H as named (a quick budget scales it)
        if named is None:
            continue
        h = int(named.group(1))
        t = {
            "val_loss": main["val_loss"],
            "loss_below_hivemind": _bar(
                main["val_loss"], TARGET_LOSS, main["val_loss"] < TARGET_LOSS
            ),
            "bytes_ratio": _bar(
                main["ratio_vs_fp32_model"],
                TARGET_RATIO,
                main["ratio_vs_fp32_model"] >= TARGET_RATIO,
            ),
            "divergence": _bar(
                main["divergence_max"],
                TARGET_DIVERGENCE,
                main["divergence_max"] <= TARGET_DIVERGENCE,
            ),
        }
        for other, key in ((f"fp32-h{h}", "vs_fp32_same_h"), (f"{d}-h{h}-sync", "async_vs_sync")):
            ref = results.get(other)
            if ref is not None and other != name:
                rel = main["val_loss"] / ref["val_loss"] - 1.0
                t[key] = _bar(rel, TARGET_REL_LOSS, rel <= TARGET_REL_LOSS)
        by_every[f"h{h}"] = t
    if not by_every:
        return {}
    best = min(by_every, key=lambda k: by_every[k]["val_loss"])
    return {"codec": d, "best": best, "by_every": dict(sorted(by_every.items()))}


def check_args(runs: Sequence[str | RunSpec] | None, sync: Any) -> list[RunSpec]:
    """The runs ``run`` would make, or ValueError for an unknown run or sync setting (before
    any run starts)."""
    names = [r for r in runs or [] if isinstance(r, str)]
    selected = [r for r in runs or [] if isinstance(r, RunSpec)]
    selected += resolve_runs(names) if names or not runs else []
    if sync is not None and not isinstance(sync, dict):
        raise ValueError(f"sync settings must be a JSON object, not {type(sync).__name__}")
    if sync:
        SyncSpec(**sync)  # an unknown or invalid setting
    return selected


def run(
    *,
    quick: bool = False,
    runs: Sequence[str | RunSpec] | None = None,
    budget: Budget | None = None,
    workers: int = 2,
    progress: Callable[[dict[str, Any]], None] | None = _progress,
    sync: dict[str, Any] | None = None,
    seed: int | None = None,
) -> dict[str, Any]:
    """Run the selected runs (default: all) and return the benchmark's JSON object. ``sync``:
    SyncSpec fields every swarm run takes over its own (e.g. ``{"swarm_adam": False}``, each
    peer's own AdamW).

    ``workers`` > 0 runs them in that many spawned processes of one torch thread each (on two
    shared cores, two single-threaded processes train ~1.5x faster than one with two threads);
    0 runs them here, one after another. ``seed``: another draw of the same task (initial
    weights, batch order, delays; the validation windows stay), references included.
    """
    budget = budget or (QUICK if quick else Budget())
    if seed is not None:
        budget = replace(budget, seed=seed)
    selected = check_args(runs, sync)
    if sync:
        selected = [r if r.codec is None else replace(r, sync={**r.sync, **sync}) for r in selected]
    # Longest first, so two workers finish together.
    order = sorted(selected, key=lambda r: -(budget.peers or r.peers) * r.batch_size)
    results: dict[str, dict[str, Any]] = {}
    t0 = time.perf_counter()
    load_start = [round(x, 2) for x in os.getloadavg()]  # the machine may be shared
    if workers > 0:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            futures = {r.name: pool.submit(_run_one, r, budget) for r in order}
            for r in order:
                results[r.name] = futures[r.name].result()
                if progress is not None:
                    progress(results[r.name])
    else:
        threads = torch.get_num_threads()
        try:
            for r in order:
                results[r.name] = _run_one(r, budget)
                if progress is not None:
                    progress(results[r.name])
        finally:
            torch.set_num_threads(threads)
    return {
        "task": {
            "preset": PRESET,
            "steps": budget.steps,
            "batch_size": budget.batch(BATCH),
            "seq_len": budget.seq_len or get_preset(PRESET).block_size,
            "lr": LR,
            "val_batches": budget.val_batches,
            "seed": budget.seed,
            "quick": quick,
        },
        "default_sync": SyncSpec().model_dump(),
        "runs": [results[r.name] for r in selected],
        "targets": _targets(results),
        "wall_s": time.perf_counter() - t0,
        "load_avg_start": load_start,
        "load_avg_end": [round(x, 2) for x in os.getloadavg()],
    }


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m atomd_bench.sync [--quick] [--runs a,b]``: JSON to stdout."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m atomd_bench.sync",
        description="Simulated peers exchanging compressed deltas in one process (the codec and "
        "outer-step study). Prints one JSON object; progress goes to stderr.",
    )
    parser.add_argument("--quick", action="store_true", help="a few steps of a small task")
    parser.add_argument(
        "--runs",
        type=lambda v: [n for n in v.split(",") if n],
        help="comma-separated run names (default: the default selection); `--list` shows them all",
    )
    parser.add_argument("--list", action="store_true", help="list the known runs and exit")
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help=f"another draw of the task: initial weights, batch order, delays (default {SEED}); "
        "the validation windows stay the same",
    )
    parser.add_argument(
        "--sync",
        type=json.loads,
        default=None,
        help="sync settings every swarm run takes over its own, as JSON (e.g. "
        "'{\"swarm_adam\": false}': each peer's own AdamW)",
    )
    args = parser.parse_args(argv)
    if args.list:
        for r in [*default_runs(), *extra_runs()]:
            print(r.name)
        return
    try:
        check_args(args.runs, args.sync)
    except ValueError as e:  # an unknown run or sync setting
        parser.error(str(e))
    print(json.dumps(run(quick=args.quick, runs=args.runs, sync=args.sync, seed=args.seed)))


if __name__ == "__main__":
    main()
