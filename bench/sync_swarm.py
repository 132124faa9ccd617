"""The simulated swarm of the sync benchmark: peers that train in one process and exchange
compressed deltas with drawn delays (``run_swarm``), and the single-process references
(``run_single``). The delivery model is described in ``atomd_bench.sync``."""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from atomd.data.dataset import TokenDataset, load_dataset
from atomd.p2p.identity import Identity
from atomd.spec import SyncSpec, lr_at
from atomd.sync.codecs import decode
from atomd.sync.intake import Contribution
from atomd.sync.state import Outgoing, SyncState
from atomd.sync.wire import encode_frame
from atomd_bench.ideal_codec import IdealCodec, ideal_frame_bytes
from atomd_bench.peer_models import build_engine, loss_of, max_divergence, mean_model
from atomd_bench.sync_link import SimulatedLink
from atomd_bench.sync_runs import BATCH, JOB_ID, PEERS, SEED, Budget, RunSpec, job_spec


def frame_bytes_of(out: Outgoing, identity: Identity) -> int:
    """Bytes on the wire: the signed frame the daemon sends (header per tensor + payload)."""
    frame = encode_frame(
        identity=identity,
        job_id=JOB_ID,
        round=out.round,
        base_version=out.base_version,
        tensors=out.tensors,
        now=0.0,
    )
    return len(frame)


class FrameBytes:
    """Each peer's frame of the round being closed: its bytes on the wire, encoded once."""

    def __init__(self, identities: Sequence[Identity]) -> None:
        self.identities = identities
        self._sizes: dict[int, int] = {}

    def clear(self) -> None:
        self._sizes.clear()

    def __call__(self, peer: int, out: Outgoing) -> int:
        if peer not in self._sizes:
            self._sizes[peer] = frame_bytes_of(out, self.identities[peer])
        return self._sizes[peer]


def _contribution(sender: int, out: Outgoing) -> Contribution:
    return Contribution(
        sender=f"peer-{sender}",
        round=out.round,
        base_version=out.base_version,
        tensors={name: decode(enc) for name, enc in out.tensors},
    )


def sync_round(states: Sequence[SyncState]) -> list[Outgoing]:
    """Every peer sends, waits for all the others' deltas of the round, then merges."""
    outs = [s.prepare() for s in states]
    received = [_contribution(i, o) for i, o in enumerate(outs)]
    for i, s in enumerate(states):
        s.merge([c for j, c in enumerate(received) if j != i], n_peers=len(states))
    return outs


Inbox = dict[tuple[int, int], list[Contribution]]  # (receiver, step it is there by) -> deltas


def _async_round(
    states: Sequence[SyncState],
    inbox: Inbox,
    rnd: int,
    step: int,
    total: int,
    every: int,
    seed: int = SEED,
    transit: Callable[[int, Outgoing, int], int] | None = None,
) -> list[Outgoing]:
    """Peers close round ``rnd`` (after ``step`` steps) in a seeded order, each merging what has
    reached it; each delta is posted to the others with its drawn delay (see the docstring), at
    most until the next boundary, ``every`` steps on (the last round may be short). Over a
    simulated link a delta arrives no sooner than its upload is done: ``transit(i, out, k)``,
    the steps until peer i's k-th upload of ``out`` is (the draw stands for the peers' phases,
    which place its arrival anywhere in the receiver's round)."""
    n, h = len(states), min(every, max(1, total - step))
    if step >= total:  # the last close waits for the frames still on their way (as the
        for j, at in sorted(k for k in inbox if k[1] > step):  # daemon's final wait does)
            inbox.setdefault((j, step), []).extend(inbox.pop((j, at)))
    outs: dict[int, Outgoing] = {}
    for i in random.Random(f"order:{seed}:{rnd}").sample(range(n), n):
        outs[i] = states[i].round_boundary(_arrived(inbox, i, step), n_peers=n)
        c = _contribution(i, outs[i])
        others = random.Random(f"uploads:{seed}:{rnd}:{i}").sample(range(n), n)
        for k, j in enumerate(j for j in others if j != i):
            delay = random.Random(f"delay:{seed}:{rnd}:{i}:{j}").randint(0, h)
            if transit is not None:
                delay = max(delay, transit(i, outs[i], k))
            if delay == 0 and j in outs:
                delay = 1
            inbox.setdefault((j, step + delay), []).append(c)
    return [outs[i] for i in range(n)]


def _arrived(inbox: Inbox, receiver: int, step: float) -> list[Contribution]:
    """Take what has reached ``receiver`` by ``step`` (in order of arrival)."""
    due = sorted(k for k in inbox if k[0] == receiver and k[1] <= step)
    return [c for k in due for c in inbox.pop(k)]


def run_swarm(run: RunSpec, budget: Budget) -> dict[str, Any]:
    """Train ``run.peers`` simulated peers; see the module docstring for the delivery model."""
    assert run.codec is not None
    t0 = time.perf_counter()
    n = budget.peers or run.peers
    spec = job_spec(budget.batch(run.batch_size), budget)
    link = None if run.link is None else SimulatedLink(run.link)
    auto = run.every == "auto"  # with a link (RunSpec checks)
    h = link.closes_after(link.next_every()) if link and auto else budget.every(run.every)
    sync = run.sync_spec() if auto else replace_every(run.sync_spec(), h)
    data = load_dataset(spec.data, seq_len=spec.effective_seq_len, val_fraction=spec.val_fraction)
    shards = [
        TokenDataset(
            data.train,
            data.val,
            seq_len=spec.effective_seq_len,
            shard_index=i,
            num_shards=n,
            shard_mode=run.shard_mode,
        )
        for i in range(n)
    ]
    val = data.val_batches(count=budget.val_batches, batch_size=BATCH)
    engines = [build_engine(spec) for _ in range(n)]
    states = [SyncState.of_engine(e, sync, peer_id=f"peer-{i}") for i, e in enumerate(engines)]
    if run.ideal_rate is not None:
        for i, state in enumerate(states):
            ideal = IdealCodec(rate=run.ideal_rate, seed=1000 * budget.seed + i)
            state.encoder.use(ideal)
    for e in engines:  # the daemon's SyncPlugin sets this each round
        e.set_peers(n if sync.swarm_adam else 1)
    frame_bytes = FrameBytes([Identity.generate() for _ in range(n)])
    transit = None
    if link is not None:
        transit = lambda i, out, k: link.transit(frame_bytes(i, out), k, n)  # noqa: E731
    inbox: Inbox = {}
    bytes_sent: list[int] = []
    ratios: list[float] = []
    divergences: list[float] = []  # committed anchors
    start_divergences: list[float] = []  # where the replicas restart (anchor + pending deltas)
    rnd = 0
    boundary = h  # the step the current round closes after
    for step in range(spec.total_steps):
        lr = lr_at(spec, step)
        for i, (eng, ds) in enumerate(zip(engines, shards, strict=True)):
            batch = ds.train_batch(
                seed=spec.seed, step=step, micro=0, batch_size=spec.micro_batch_size
            )
            loss = eng.train_step([batch], lr)
            if not math.isfinite(loss):
                raise RuntimeError(f"{run.name}: peer {i} loss {loss} at step {step + 1}")
        if link is not None:
            link.step()
        if step + 1 < boundary and step + 1 < spec.total_steps:
            if run.mode == "async":
                for i, state in enumerate(states):
                    arrived = _arrived(inbox, i, step + 1)
                    if arrived:
                        state.absorb(arrived)
            continue
        if step + 1 == spec.total_steps and sync.consolidate_rounds:
            for state in states:  # as the daemon's SyncPlugin.finish does
                state.average_from_now()
        frame_bytes.clear()
        if link is not None and auto:
            link.before_round(states, sync.topk_fraction)
            h = link.next_every()
        if run.mode == "sync":
            outs = sync_round(states)
        else:
            outs = _async_round(
                states, inbox, rnd, step + 1, spec.total_steps, h, budget.seed, transit
            )
        frames = [frame_bytes(i, o) for i, o in enumerate(outs)]
        bytes_sent += frames
        if link is not None:
            link.after_round(states, outs, frames)
            h = link.closes_after(h if auto else budget.every(run.every))
        boundary = step + 1 + h
        ratios += [o.wire_ratio for o in outs]
        if (step + 1) > spec.warmup_steps:
            divergences.append(max_divergence([s.anchor for s in states]))
            start_divergences.append(max_divergence([s.start_point() for s in states]))
        rnd += 1
    # The daemon's final wait (sync.final_wait_s): the last round's deltas still in flight reach
    # every peer before it finishes. The loss before it is reported too.
    losses_at_last_step = [e.evaluate(val) for e in engines]
    for i, state in enumerate(states):
        state.absorb(_arrived(inbox, i, math.inf))
    losses_before_consolidation = [e.evaluate(val) for e in engines]
    # sync.consolidate_rounds: rounds without training, each waiting for all deltas.
    consolidation_bytes: list[int] = []
    for _ in range(sync.consolidate_rounds):
        frame_bytes.clear()
        consolidation_bytes += [frame_bytes(i, o) for i, o in enumerate(sync_round(states))]
    losses = (
        [e.evaluate(val) for e in engines] if consolidation_bytes else losses_before_consolidation
    )
    # The models the peers hold: each also carries its unsent residual.
    models = [{n: p.detach().clone() for n, p in e.model.named_parameters()} for e in engines]
    anchor_losses = [loss_of(e, s.anchor, val) for e, s in zip(engines, states, strict=True)]
    # What exact averaging of the final models would give (no peer holds it: a diagnostic).
    mean = mean_model(engines)
    model_bytes = states[0].numel * 4
    per_round = sum(bytes_sent) / max(1, len(bytes_sent))
    if run.ideal_rate is not None:
        numels = [p.numel() for p in states[0].params.values()]
        per_round = ideal_frame_bytes(run.ideal_rate, numels)
    return {
        "name": run.name,
        "peers": n,
        "codec": run.codec,
        "ideal_rate": run.ideal_rate,
        "every": statistics.median_low(link.every[:rnd]) if auto and link else h,
        "link_bytes_per_step": run.link,
        "every_per_round": None if link is None else link.every[:rnd],
        "fraction_per_round": None if link is None else link.fractions,
        "frame_bytes_per_round": None if link is None else link.frames,
        "bytes_per_step": sum(bytes_sent) / n / spec.total_steps,
        "mode": run.mode,
        "shard_mode": run.shard_mode,
        "batch_size": spec.micro_batch_size,
        "steps": spec.total_steps,
        "rounds": rnd,
        "sync": sync.model_dump(),
        "val_loss": sum(losses) / len(losses),
        "val_loss_per_peer": losses,
        "val_loss_at_last_step": sum(losses_at_last_step) / len(losses_at_last_step),
        "val_loss_before_consolidation": sum(losses_before_consolidation) / n,
        "consolidation_rounds": sync.consolidate_rounds,
        "consolidation_bytes_per_peer": sum(consolidation_bytes) / n,
        "val_loss_anchor": sum(anchor_losses) / len(anchor_losses),
        "val_loss_mean_model": loss_of(engines[0], mean, val),
        "bytes_per_round": per_round,
        "model_fp32_bytes": model_bytes,
        "ratio_vs_fp32_model": model_bytes / max(per_round, 1.0),
        "payload_ratio": sum(ratios) / max(1, len(ratios)),
        "divergence_max": max(divergences, default=0.0),
        "divergence_final": divergences[-1] if divergences else 0.0,
        "model_divergence_final": max_divergence(models),
        "start_divergence_max": max(start_divergences, default=0.0),
        "start_divergence_final": start_divergences[-1] if start_divergences else 0.0,
        "wall_s": time.perf_counter() - t0,
    }


def replace_every(sync: SyncSpec, every: int) -> SyncSpec:
    return sync.model_copy(update={"every": every})


def run_single(run: RunSpec, budget: Budget) -> dict[str, Any]:
    """One process, no sync: a lone peer on its quarter of the data, or batch 64 on all of it."""
    t0 = time.perf_counter()
    spec = job_spec(budget.batch(run.batch_size), budget)
    data = load_dataset(spec.data, seq_len=spec.effective_seq_len, val_fraction=spec.val_fraction)
    # A peer alone reads its shard; the large-batch process reads everything.
    ds = data
    if run.batch_size == BATCH:
        ds = TokenDataset(
            data.train,
            data.val,
            seq_len=spec.effective_seq_len,
            shard_index=0,
            num_shards=budget.peers or PEERS,
            shard_mode=run.shard_mode,
        )
    eng = build_engine(spec)
    for step in range(spec.total_steps):
        batch = ds.train_batch(seed=spec.seed, step=step, micro=0, batch_size=spec.micro_batch_size)
        eng.train_step([batch], lr_at(spec, step))
    loss = eng.evaluate(data.val_batches(count=budget.val_batches, batch_size=BATCH))
    return {
        "name": run.name,
        "peers": 1,
        "codec": None,
        "batch_size": spec.micro_batch_size,
        "steps": spec.total_steps,
        "shard_mode": run.shard_mode,
        "val_loss": loss,
        "wall_s": time.perf_counter() - t0,
    }
