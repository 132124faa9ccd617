"""The robust merge under attack, in one process: simulated peers, one of them hostile.

The setting of ``atomd_bench.sync`` (the ``tiny`` GPT on the bundled corpus, each peer on its own
shard, deltas delayed by 0..H steps and absorbed as they arrive) with ``HONEST`` honest peers
and one hostile member. The hostile member trains like the others but sends, in the job's codec
(so every check of the wire format passes), a delta made from its honest one by an attack of
the menu: ``const`` (every value 5.0), ``scale10``/``scale100``/``scale1e30`` (its honest delta
times that), ``signflip``, ``noise1``/``noise3``/``noise10`` (Gaussian noise of 1, 3, 10 times
its honest delta's norm). ``absent`` is the swarm without the hostile member (the reference),
``honest`` the same member behaving.

Each attack runs under three defences: ``none`` (no defence: every delta that passes
the wire checks is merged), ``screen`` (the robust rule of ``atomd.sync.robust``) and ``guard``
(the rule and the loss guard of ``atomd.sync.guard``, as the daemon runs them). Reported per
run: the honest peers' mean validation loss at the end (after the last deltas arrive), its
ratio to ``absent``, the largest relative distance between two honest peers' anchors, and what
the defence refused, clipped and rolled back. A run whose honest loss became non-finite reports
``val_loss`` null and the step (``diverged_at``).

Also reported: the cosines of the received deltas with the receiver's own progress (what it
trained that the swarm does not hold yet), in
quantiles, honest senders and the hostile one apart: what the direction check of the rule
judges by.

``python -m atomd_bench.robust_sim [--quick] [--attacks a,b] [--defences d,e]
[--no-direction] [--quarantine]``: JSON to stdout (``--no-direction``: the rule without its
direction check; ``--quarantine``: each honest peer quarantines as the daemon does, 3 strikes
in 10, and takes nothing more from the member it quarantined).
"""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing
import random
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from atomd.data.dataset import TokenDataset, load_dataset
from atomd.p2p.quarantine import Quarantine
from atomd.spec import JobSpec, SyncSpec, lr_at
from atomd.sync.codecs import decode, make_codec
from atomd.sync.guard import LossGuard
from atomd.sync.intake import Contribution
from atomd.sync.robust import RobustRule
from atomd.sync.state import DEFAULT_RULE, Outgoing, SyncState
from atomd_bench.peer_models import build_engine, max_divergence

HONEST = 3
ATTACKS = (
    "absent",
    "honest",
    "const",
    "scale10",
    "scale100",
    "scale1e30",
    "signflip",
    "noise1",
    "noise3",
    "noise10",
)
DEFENCES = ("none", "screen", "guard")


@dataclass(frozen=True)
class Budget:
    steps: int = 200
    every: int = 10
    seq_len: int = 64
    batch_size: int = 8
    val_batches: int = 8
    codec: str = "topk"


QUICK = Budget(steps=60, every=5, seq_len=32, batch_size=4, val_batches=2)


def _attack(name: str, honest: dict[str, Tensor], rng: torch.Generator) -> dict[str, Tensor]:
    """The hostile member's delta, made from its honest one."""
    if name == "const":
        return {k: torch.full_like(t, 5.0) for k, t in honest.items()}
    if name.startswith("scale"):
        factor = float(name.removeprefix("scale"))
        return {k: t * factor for k, t in honest.items()}
    if name == "signflip":
        return {k: -t for k, t in honest.items()}
    if name.startswith("noise"):
        k_times = float(name.removeprefix("noise"))
        norm = math.sqrt(sum(float(t.double().square().sum()) for t in honest.values()))
        noise = {k: torch.randn(t.shape, generator=rng) for k, t in honest.items()}
        total = math.sqrt(sum(float(t.double().square().sum()) for t in noise.values()))
        return {k: t * (k_times * norm / max(total, 1e-30)) for k, t in noise.items()}
    raise ValueError(f"unknown attack {name!r}")


def _contribution(sender: str, out: Outgoing) -> Contribution:
    tensors = {name: decode(enc) for name, enc in out.tensors}
    return Contribution(sender, out.round, out.base_version, tensors)


def _hostile(attack: str, out: Outgoing, spec: SyncSpec, rng: torch.Generator) -> Contribution:
    """The attack, encoded in the job's codec (it passes every check of the wire format)."""
    honest = {name: decode(enc) for name, enc in out.tensors}
    codec = make_codec(spec.codec, topk_fraction=spec.topk_fraction, zstd=False)
    sent = {k: decode(codec.encode(t)) for k, t in _attack(attack, honest, rng).items()}
    return Contribution("hostile", out.round, out.base_version, sent)


def _quantiles(xs: list[float]) -> dict[str, Any]:
    """min, 1/5/50/95th percentile, max and count of ``xs`` (rounded), or just the count."""
    if not xs:
        return {"n": 0}
    o = sorted(xs)

    def q(p: float) -> float:
        return round(o[min(len(o) - 1, int(p * (len(o) - 1) + 0.5))], 4)

    return {"n": len(o), "min": q(0), "p1": q(0.01), "p5": q(0.05), "p50": q(0.5),
            "p95": q(0.95), "max": q(1)}  # fmt: skip


def run_one(
    attack: str,
    defence: str,
    budget: Budget,
    rule: RobustRule = DEFAULT_RULE,
    quarantine: bool = False,
) -> dict[str, Any]:
    """One swarm run; see the module docstring. ``quarantine``: each honest peer keeps a
    ``Quarantine`` fed as the daemon's exchange feeds it, and takes nothing more from a member
    it quarantined (the hold outlasts the run)."""
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    n = HONEST + (0 if attack == "absent" else 1)
    spec = JobSpec(
        preset="tiny",
        seq_len=budget.seq_len,
        micro_batch_size=budget.batch_size,
        max_steps=budget.steps,
        lr=3e-3,
        warmup_steps=min(50, budget.steps // 4),
        seed=0,
    )
    sync = SyncSpec(codec=budget.codec, every=budget.every)
    data = load_dataset(spec.data, seq_len=spec.effective_seq_len, val_fraction=spec.val_fraction)
    shards = [
        TokenDataset(data.train, data.val, seq_len=spec.effective_seq_len, shard_index=i,
                     num_shards=n)
        for i in range(n)
    ]  # fmt: skip
    val = data.val_batches(count=budget.val_batches, batch_size=16)
    probe_batch = data.val_batches(count=1, batch_size=4, seed=99)
    engines = [build_engine(spec) for _ in range(n)]
    robust = None if defence == "none" else rule
    states = [
        SyncState.of_engine(e, sync, peer_id=f"peer-{i}", robust=robust)
        for i, e in enumerate(engines)
    ]
    guards: list[LossGuard | None] = [
        LossGuard(s, _probe(e, probe_batch)) if defence == "guard" else None
        for s, e in zip(states, engines, strict=True)
    ]
    honest_ids = range(HONEST)
    rng = torch.Generator().manual_seed(1)
    inbox: dict[tuple[int, int], list[Contribution]] = {}
    counts = {"refused": 0, "clipped": 0, "strikes": 0, "hostile_applied": 0, "honest_refused": 0}
    divergences: list[float] = []
    # Cosines of received deltas with the receiver's own progress, by sender kind.
    cosines: dict[str, list[float]] = {"honest": [], "hostile": []}
    diverged_at: int | None = None
    if not isinstance(sync.every, int):
        raise ValueError("robust_sim simulates a fixed cadence: give sync.every as a number")
    h, rnd = sync.every, 0

    held = [Quarantine() for _ in range(n)]
    quarantined_at: dict[int, int] = {}  # honest peer -> round it quarantined the hostile one

    def note(report: Any, i: int) -> None:
        if quarantine:  # as ``SyncExchange`` reports a merge to the node
            for a in report.applied:
                held[i].judged(a.sender, a.strike, a.note)
            for r in report.refused:
                if r.strike:
                    held[i].judged(r.sender, True, r.reason)
            if held[i].excluded("hostile") and i not in quarantined_at:
                quarantined_at[i] = rnd
        for d in [*report.applied, *report.refused]:
            if d.cosine is not None:
                cosines["hostile" if d.sender == "hostile" else "honest"].append(d.cosine)
        for a in report.applied:
            counts["clipped"] += a.note is not None
            counts["strikes"] += a.strike
            counts["hostile_applied"] += a.sender == "hostile"
        for r in report.refused:
            counts["refused"] += 1
            counts["strikes"] += r.strike
            counts["honest_refused"] += r.sender != "hostile" and not r.reason.startswith(
                ("stale", "ahead", "duplicate")
            )

    def arrived(i: int, step: float) -> list[Contribution]:
        due = sorted(k for k in inbox if k[0] == i and k[1] <= step)
        got = [c for k in due for c in inbox.pop(k)]
        return [c for c in got if not held[i].excluded(c.sender)]

    for step in range(spec.total_steps):
        lr = lr_at(spec, step)
        for i, (eng, ds) in enumerate(zip(engines, shards, strict=True)):
            batch = ds.train_batch(seed=0, step=step, micro=0, batch_size=spec.micro_batch_size)
            loss = eng.train_step([batch], lr)
            if i in honest_ids and not math.isfinite(loss) and diverged_at is None:
                diverged_at = step + 1
        if diverged_at is not None:
            break
        if (step + 1) % h and step + 1 < spec.total_steps:
            for i, state in enumerate(states):
                got = arrived(i, step + 1)
                if got:
                    g = guards[i]
                    report = g.absorb(got) if g is not None else state.absorb(got)
                    if i in honest_ids:
                        note(report, i)
            continue
        order = random.Random(f"order:{rnd}").sample(range(n), n)
        for i in order:
            got = arrived(i, step + 1)
            g = guards[i]
            if g is not None:
                out = g.round_boundary(got, n_peers=n)
            else:
                out = states[i].round_boundary(got, n_peers=n)
            if i in honest_ids:
                note(states[i].last_merge, i)
            hostile = attack not in ("absent", "honest") and i == HONEST
            c = _hostile(attack, out, sync, rng) if hostile else _contribution(f"peer-{i}", out)
            for j in range(n):
                if j != i:
                    delay = random.Random(f"delay:{rnd}:{i}:{j}").randint(0, h)
                    if delay == 0 and order.index(j) < order.index(i):
                        delay = 1
                    inbox.setdefault((j, step + 1 + delay), []).append(c)
        if step + 1 > spec.warmup_steps:
            divergences.append(max_divergence([states[i].anchor for i in honest_ids]))
        rnd += 1
    if diverged_at is None:
        for i in honest_ids:
            got = arrived(i, math.inf)
            g = guards[i]
            note(g.absorb(got) if g is not None else states[i].absorb(got), i)
        losses = [engines[i].evaluate(val) for i in honest_ids]
        mean = sum(losses) / len(losses)
        val_loss: float | None = mean if math.isfinite(mean) else None
    else:
        val_loss = None
    return {
        "attack": attack,
        "defence": defence,
        "val_loss": val_loss,
        "diverged_at": diverged_at,
        "anchor_divergence_max": max(divergences, default=0.0),
        "rollbacks": sum(g.rollbacks for g in guards[:HONEST] if g is not None),
        "largest_kept_rise": max((g.largest_rise for g in guards[:HONEST] if g), default=None),
        **counts,
        "cosines": {k: _quantiles(v) for k, v in cosines.items()},
        "quarantine": quarantine,
        "quarantined_at_round": [quarantined_at.get(i) for i in honest_ids],
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def _probe(engine: Any, batches: Any) -> Callable[[], float]:
    return lambda: float(engine.evaluate(batches))


def run(
    *,
    quick: bool = False,
    attacks: Sequence[str] = ATTACKS,
    defences: Sequence[str] = DEFENCES,
    workers: int = 2,
    rule: RobustRule = DEFAULT_RULE,
    quarantine: bool = False,
) -> dict[str, Any]:
    budget = QUICK if quick else Budget()
    jobs = [("absent", "none")] + [(a, d) for a in attacks if a != "absent" for d in defences]
    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futures = [pool.submit(run_one, a, d, budget, rule, quarantine) for a, d in jobs]
        results = []
        for f in futures:
            r = f.result()
            results.append(r)
            line = (
                f"[robust_sim] {r['attack']}/{r['defence']}: val {r['val_loss']}, "
                f"div {r['anchor_divergence_max']:.1e}, refused {r['refused']}, "
                f"rollbacks {r['rollbacks']}, {r['wall_s']} s"
            )
            print(line, file=sys.stderr, flush=True)
    ref = results[0]["val_loss"]
    for r in results:
        r["vs_absent"] = None if r["val_loss"] is None or ref is None else r["val_loss"] / ref - 1
    return {
        "task": {**budget.__dict__, "honest": HONEST, "quick": quick},
        "rule": rule.__dict__,
        "quarantine": quarantine,
        "runs": results,
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m atomd_bench.robust_sim [OPTIONS]``: JSON to stdout."""
    import argparse

    def names(value: str) -> list[str]:
        return [n for n in value.split(",") if n]

    ap = argparse.ArgumentParser(
        prog="python -m atomd_bench.robust_sim", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--quick", action="store_true", help="a few steps of a small task")
    ap.add_argument(
        "--attacks", type=names, default=list(ATTACKS), help=f"of: {', '.join(ATTACKS)}"
    )
    ap.add_argument(
        "--defences", type=names, default=list(DEFENCES), help=f"of: {', '.join(DEFENCES)}"
    )
    ap.add_argument(
        "--no-direction", action="store_true", help="the robust rule without its direction check"
    )
    ap.add_argument(
        "--quarantine",
        action="store_true",
        help="each honest peer quarantines a member as the daemon does",
    )
    args = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    rule = DEFAULT_RULE
    if args.no_direction:
        rule = dataclasses.replace(rule, direction=False)
    result = run(
        quick=args.quick,
        attacks=args.attacks,
        defences=args.defences,
        rule=rule,
        quarantine=args.quarantine,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
