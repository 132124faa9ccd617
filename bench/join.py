"""A peer joining a running swarm: where should it start? Two simulated peers, one process.

Peer 0 trains alone until step ``join_at``, counting two peers (as a daemon does while the
joiner fetches its state) or, with ``alone``, itself only (as a daemon does while no other peer
trains the job: its rounds then commit its whole delta); then peer 1 takes peer 0's state, as
a daemon's state transfer gives it (model, AdamW moments and sync state; the donor's error
feedback dropped), and both train on, exchanging top-k deltas. Each delta reaches the other
peer 1 to H steps after its round closes (seeded). With ``--restart`` both peers train from
step 0, and at ``join_at`` peer 1 is killed (what was on its way to it is lost) and takes peer
0's state, as a restarted daemon does. The variants differ only in where the joiner's replica
starts:

- ``clone`` (what the daemon does, ``SyncState.adopt``): the donor's model, with the
  donor's progress the codec has not sent yet kept apart and not sent (it gives way by what the
  donor's deltas carry);
- ``reset``: the swarm's estimate, the anchor plus the deltas in;
  when no delta of peer 1 has reached peer 0 yet, peer 0 first closes its round whole
  (``SyncPlugin.before_snapshot``), so that estimate is its model. Where rounds are rare it is
  far behind the models (H=50 ``--restart``: 5.3 against 2.7-2.9), and a daemon refuses it;
- ``keep``: the donor's replica sent whole: the donor's unsent
  progress reaches the anchors from both peers.

A round commits the mean of the deltas it gets (``SyncState._close``), so peer 0's rounds
while the joiner fetches are its own delta whether it counts one peer or two.

Reported per variant and seed: both peers' validation loss every 10 steps and at the end (the
same fixed validation batches), their mean, and the joiner's right after it took the state.
``python -m atomd_bench.join --help``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

from atomd.data.dataset import TokenDataset, load_dataset
from atomd.spec import JobSpec, SyncSpec, lr_at
from atomd.sync.codecs import decode
from atomd.sync.intake import Contribution
from atomd.sync.state import SyncState
from atomd_bench.peer_models import build_engine

VARIANTS = ("clone", "reset", "keep")
VAL_BATCHES = 8


def run(
    variant: str,
    *,
    seed: int = 0,
    steps: int = 120,
    join_at: int = 20,
    every: int = 5,
    lr: float | None = None,
    seq_len: int = 32,
    batch: int = 4,
    alone: bool = False,
    restart: bool = False,
) -> dict[str, Any]:
    """One run; see the module docstring."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")
    if not 0 < join_at < steps:
        raise ValueError(f"join_at must be within the run's steps (1..{steps - 1}), got {join_at}")
    kw: dict[str, Any] = {"lr": lr} if lr is not None else {}
    spec = JobSpec(preset="tiny", seq_len=seq_len, micro_batch_size=batch, max_steps=steps,
                   warmup_steps=2, seed=0, **kw)  # fmt: skip
    sync = SyncSpec(codec="topk", every=every)
    data = load_dataset(spec.data, seq_len=spec.effective_seq_len, val_fraction=spec.val_fraction)
    shards = [
        TokenDataset(
            data.train, data.val, seq_len=spec.effective_seq_len, shard_index=i, num_shards=2
        )
        for i in range(2)
    ]
    val = data.val_batches(count=VAL_BATCHES, batch_size=16)
    engines = [build_engine(spec) for _ in range(2)]
    states = [SyncState.of_engine(e, sync, peer_id=f"peer-{i}") for i, e in enumerate(engines)]
    rng = random.Random(f"join:{seed}")
    active = [True, restart]
    started = [0, 0 if restart else join_at]
    inbox: list[tuple[int, int, Contribution]] = []  # (receiver, step it is there by, delta)
    curves: list[list[float]] = [[], []]
    at_join = float("nan")
    for step in range(steps):
        if step == join_at:  # the state transfer
            if restart:  # peer 1 is killed: what it held and what was on its way is lost
                inbox = [x for x in inbox if x[0] != 1]
                started[1] = join_at
            if variant == "reset" and states[0].alone_in_fact():
                # SyncPlugin.before_snapshot: nobody has sent peer 0 a delta yet, so it
                # commits its whole model before the snapshot (the frame goes nowhere: the
                # joiner's state holds it).
                states[0].round_boundary([], n_peers=1)
            engines[1].load_tensors(engines[0].model_tensors(), engines[0].optimizer_tensors())
            states[1].load_state_tensors(states[0].state_tensors())
            if variant == "clone":  # what the daemon does (SyncPlugin.adopt)
                states[1].adopt()
            elif variant == "reset":
                states[1].feedback.load_state_tensors({})
                states[1].reset_replica()
            else:  # the donor's replica kept; only its error feedback dropped
                states[1].feedback.load_state_tensors({})
            at_join = round(engines[1].evaluate(val), 4)
            active[1] = True
        lr_now = lr_at(spec, step)
        for i in (0, 1):
            if active[i]:
                b = shards[i].train_batch(seed=seed, step=step, micro=0, batch_size=batch)
                engines[i].train_step([b], lr_now)
        done = step + 1
        for i in (0, 1):
            if not active[i]:
                continue
            arrived = [c for r, at, c in inbox if r == i and at <= done]
            inbox = [x for x in inbox if not (x[0] == i and x[1] <= done)]
            if (done - started[i]) % every == 0:
                n = 1 if alone and not active[1] else 2
                out = states[i].round_boundary(arrived, n_peers=n)
                if active[1 - i]:
                    c = Contribution(f"peer-{i}", out.round, out.base_version,
                                     {n: decode(e) for n, e in out.tensors})  # fmt: skip
                    inbox.append((1 - i, done + rng.randint(1, every), c))
            elif arrived:
                states[i].absorb(arrived)
        if done % 10 == 0 or done == steps:
            for i in (0, 1):
                curves[i].append(round(engines[i].evaluate(val), 4) if active[i] else float("nan"))
    finals = [c[-1] for c in curves]
    return {
        "variant": variant,
        "seed": seed,
        "val_loss_per_peer": finals,
        "val_loss_mean": sum(finals) / 2,
        "joiner_val_at_join": at_join,
        "curves": {"steps_every": 10, "peer0": curves[0], "peer1": curves[1]},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m atomd_bench.join",
        description="Where a joining peer should start: the donor's model without its unsent "
        "progress (clone, the daemon's), the swarm's estimate (reset) or the donor's model "
        "whole (keep). Two simulated peers; JSON on stdout.",
    )
    p.add_argument("--steps", type=int, default=120, help="steps of the run (default 120)")
    p.add_argument("--join-at", type=int, default=20, help="the step peer 1 joins (default 20)")
    p.add_argument("--every", type=int, default=5, help="H, steps per round (default 5)")
    p.add_argument("--lr", type=float, default=None, help="AdamW lr (default: the job's)")
    p.add_argument("--seq-len", type=int, default=32, help="sequence length (default 32)")
    p.add_argument("--batch", type=int, default=4, help="micro-batch per peer (default 4)")
    p.add_argument("--seeds", type=int, default=3, help="data and delay seeds (default 3)")
    p.add_argument("--alone", action="store_true",
                   help="peer 0 counts itself only until the join (nobody else trains the job "
                   "yet) instead of two peers (the joiner counted while it fetches)")  # fmt: skip
    p.add_argument("--restart", action="store_true",
                   help="both peers train from step 0; at --join-at peer 1 is killed and "
                   "restarted: it takes peer 0's state (a SIGKILLed daemon restarted)")  # fmt: skip
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, of {','.join(VARIANTS)} (default all)")  # fmt: skip
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    task = {k: v for k, v in vars(a).items() if k not in ("seeds", "variants")}
    runs = []
    for variant in a.variants.split(","):
        for seed in range(a.seeds):
            r = run(variant, seed=seed, steps=a.steps, join_at=a.join_at, every=a.every, lr=a.lr,
                    seq_len=a.seq_len, batch=a.batch, alone=a.alone, restart=a.restart)  # fmt: skip
            print(f"[bench join] {variant} seed {seed}: {r['val_loss_mean']:.4f}",
                  file=sys.stderr, flush=True)  # fmt: skip
            runs.append(r)
    means = {
        v: sum(r["val_loss_mean"] for r in runs if r["variant"] == v)
        / max(1, sum(r["variant"] == v for r in runs))
        for v in a.variants.split(",")
    }
    print(json.dumps({"task": task, "runs": runs, "mean_by_variant": means,
                      "wall_s": round(time.perf_counter() - t0, 1)}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
