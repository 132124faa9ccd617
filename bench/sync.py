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
is the loss of the exact average of the final models (a diagnostic no peer holds), and
``val_loss_tail_model`` that of the average of the peers' means over their last
``sync.final_tail`` of the steps, the model the daemons' final average makes (where every share
arrives whole and the anchors agree; ``atomd.sync.average.TailMean``).

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
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import random
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from atomd.data.dataset import Batch, TokenDataset, load_dataset
from atomd.engines import optim_config
from atomd.model.gpt import GPT
from atomd.model.presets import get_preset
from atomd.p2p.identity import Identity
from atomd.spec import JobSpec, SyncSpec, lr_at
from atomd.sync.average import TailMean
from atomd.sync.cadence import Cadence, FrameSize
from atomd.sync.codecs import Encoded, Fp32Codec, decode
from atomd.sync.state import Contribution, Outgoing, SyncState
from atomd.sync.wire import encode_frame
from atomd.train.engine import ResidentEngine

Mode = Literal["async", "sync"]
ShardMode = Literal["interleaved", "contiguous"]

PRESET = "tiny"
PEERS = 4
STEPS = 600
BATCH = 16
LR = 3e-3
WARMUP = 50
VAL_BATCHES = 20
SEED = 0
JOB_ID = "0" * 32  # any job id of the daemon's length; only its size matters here
# Hivemind's figure for this task, and the bars the default codec has to clear.
TARGET_LOSS = 1.87
TARGET_REL_LOSS = 0.02
TARGET_RATIO = 100.0
TARGET_DIVERGENCE = 1e-2
# Bytes a step of a link that carries the tiny model's fp32 weights (842,496 x 4 B) every 50
# steps: item 5's reference exchange, per receiving peer.
FP32_EVERY_50 = 842_496 * 4 / 50


@dataclass(frozen=True)
class RunSpec:
    """One run: a swarm (``codec`` set) or a single process (``codec`` None)."""

    name: str
    peers: int = PEERS
    batch_size: int = BATCH
    codec: str | None = None
    every: int | Literal["auto"] = 50  # "auto": the daemon's automatic cadence (needs a link)
    mode: Mode = "async"
    shard_mode: ShardMode = "interleaved"
    # Further SyncSpec fields (outer_lr, ef_decay, topk_fraction, ...) for experiments.
    sync: dict[str, Any] = field(default_factory=dict)
    # Bits a parameter for ``IdealCodec`` (an oracle, not a codec a daemon can send): set, the
    # peers send what the best code for their deltas' per-chunk variances would deliver at
    # that rate; bytes a round are then the rate's, not the frame's.
    ideal_rate: float | None = None
    # A simulated link (``SimulatedLink``): each peer's frames reach each other peer at this
    # many bytes a step.
    link: float | None = None

    def __post_init__(self) -> None:
        if self.every == "auto" and self.link is None:
            raise ValueError(f"{self.name}: the automatic cadence needs a link to measure")

    def sync_spec(self) -> SyncSpec:
        assert self.codec is not None
        return SyncSpec(codec=self.codec, every=self.every, **self.sync)


@dataclass(frozen=True)
class Budget:
    """The task's size: the full benchmark, ``--quick``, or a test's."""

    steps: int = STEPS
    peers: int | None = None  # override every swarm's peer count
    seq_len: int | None = None  # None: the preset's 128
    batch_scale: float = 1.0  # quick mode shrinks batches
    every_scale: float = 1.0  # and H with the steps, so a run still has several rounds
    val_batches: int = VAL_BATCHES
    # The initial weights, the order of each shard's batches and the deltas' delays; the
    # validation windows stay the same whatever the seed.
    seed: int = SEED

    def every(self, h: int | Literal["auto"]) -> int:
        assert h != "auto"
        return max(1, round(h * self.every_scale))

    def batch(self, b: int) -> int:
        return max(1, round(b * self.batch_scale))


QUICK = Budget(steps=20, seq_len=32, batch_scale=0.5, every_scale=0.1, val_batches=2)


def default_runs() -> list[RunSpec]:
    """The default selection: the codec frontier at H=50, then the default codec's variants:
    synchronous, H=10 and H=2 (each with fp32 at the same H), contiguous shards."""
    dflt = SyncSpec().codec
    runs = [RunSpec(f"{c}-h50", codec=c) for c in ("fp32", "bf16", "int8", "topk")]
    runs += [
        RunSpec(f"{dflt}-h50-sync", codec=dflt, mode="sync"),
        RunSpec(f"{dflt}-h10", codec=dflt, every=10),
        RunSpec("fp32-h10", codec="fp32", every=10),
        RunSpec(f"{dflt}-h2", codec=dflt, every=2),
        RunSpec("fp32-h2", codec="fp32", every=2),
        RunSpec(f"{dflt}-h2-sync", codec=dflt, every=2, mode="sync"),
        RunSpec(f"{dflt}-h50-contiguous", codec=dflt, shard_mode="contiguous"),
        RunSpec("alone-b16", peers=1),
        RunSpec("single-b64", peers=1, batch_size=64),
    ]
    # With fp32 as the default codec some names repeat: keep the first of each.
    unique: dict[str, RunSpec] = {}
    for r in runs:
        unique.setdefault(r.name, r)
    return list(unique.values())


def _job_spec(batch_size: int, budget: Budget) -> JobSpec:
    return JobSpec(
        preset=PRESET,
        seq_len=budget.seq_len,
        micro_batch_size=batch_size,
        max_steps=budget.steps,
        lr=LR,
        warmup_steps=min(WARMUP, budget.steps // 4),
        seed=budget.seed,
    )


class IdealCodec(Fp32Codec):
    """An oracle for the codec study: what the best code of ``rate`` bits a parameter delivers
    if a delta's entries are Gaussian with each chunk's own variance (each tensor gets the same
    rate; within it, the chunks share it). Not a bound for every code: a delta's tails are
    heavier than Gaussian, and top-k, which uses them, beats it at half its bytes.

    Rate-distortion theory gives the least mean squared error at a rate: per chunk of variance
    s2, D = min(theta, s2), with theta chosen so the chunks' rates, n/2 log2(s2 / D), add up
    to ``rate`` x numel (reverse water-filling). The encoder-decoder pair that reaches it is
    the test channel x_hat = a x + sqrt(a D) z, a = 1 - D / s2, z ~ N(0, 1) independent at each
    sender: the receiver gets a shrunk estimate with independent noise; the residual x - x_hat
    stays with the sender as any codec's would. No real code reaches the bound; a code that
    beats it must use more than each chunk's variance (heavier tails than Gaussian, the peers'
    deltas being alike). Frames carry x_hat as fp32 (the harness counts
    ``ideal_frame_bytes``).
    """

    def __init__(self, *, rate: float, seed: int, chunk: int = 4096) -> None:
        super().__init__(zstd=False)
        if rate <= 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        self.rate = rate
        self.chunk = chunk
        self.gen = torch.Generator().manual_seed(seed)

    def encode(self, x: torch.Tensor) -> Encoded:
        flat = x.detach().reshape(-1).to(torch.float64)
        n = flat.numel()
        n_chunks = max(1, math.ceil(n / self.chunk))
        size = math.ceil(n / n_chunks)
        pad = torch.zeros(n_chunks * size - n, dtype=torch.float64)
        rows = torch.cat([flat, pad]).reshape(n_chunks, size)
        counts = torch.full((n_chunks,), float(size), dtype=torch.float64)
        counts[-1] -= pad.numel()
        var = rows.square().sum(1) / counts
        live = var > 0
        if not live.any():
            return super().encode(x)
        budget = self.rate * n

        def bits(log_theta: float) -> float:
            ratio = (var[live].log() - log_theta).clamp(min=0.0)
            return float((counts[live] * ratio).sum() / (2 * math.log(2)))

        lo, hi = float(var[live].log().max()) - 80.0, float(var[live].log().max())
        for _ in range(100):  # bits() falls as theta rises
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if bits(mid) > budget else (lo, mid)
        theta = math.exp(hi)
        dist = torch.where(live, var.clamp(max=theta), torch.zeros_like(var))
        alpha = torch.where(live, 1 - dist / var.clamp(min=1e-300), torch.zeros_like(var))
        beta = (alpha * dist).sqrt()
        z = torch.randn(rows.shape, generator=self.gen, dtype=torch.float64)
        out = (alpha[:, None] * rows + beta[:, None] * z).reshape(-1)[:n]
        return super().encode(out.to(torch.float32).reshape(x.shape))


def ideal_frame_bytes(rate: float, numels: Sequence[int], chunk: int = 4096) -> int:
    """An ideal frame's size for tensors of ``numels`` entries: the rate's payload, a bf16
    variance per chunk, and the 702 B of a top-k frame's signed header for the tiny model's 52
    tensors (measured; scaled by the tensors' count)."""
    payload = math.ceil(rate * sum(numels) / 8)
    chunks = sum(max(1, math.ceil(n / chunk)) for n in numels)
    return payload + 2 * chunks + 702 * len(numels) // 52


def _build(spec: JobSpec) -> ResidentEngine:
    torch.manual_seed(spec.seed)  # every peer starts from the same weights
    return ResidentEngine(GPT(get_preset(spec.preset)), optim_config(spec), torch.device("cpu"))


def _frame_bytes(out: Outgoing, identity: Identity) -> int:
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


class _FrameBytes:
    """Each peer's frame of the round being closed: its bytes on the wire, encoded once."""

    def __init__(self, identities: Sequence[Identity]) -> None:
        self.identities = identities
        self._sizes: dict[int, int] = {}

    def clear(self) -> None:
        self._sizes.clear()

    def __call__(self, peer: int, out: Outgoing) -> int:
        if peer not in self._sizes:
            self._sizes[peer] = _frame_bytes(out, self.identities[peer])
        return self._sizes[peer]


def _contribution(sender: int, out: Outgoing) -> Contribution:
    return Contribution(
        sender=f"peer-{sender}",
        round=out.round,
        base_version=out.base_version,
        tensors={name: decode(enc) for name, enc in out.tensors},
    )


def _rel_l2(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    num = sum(float((a[k] - b[k]).double().square().sum()) for k in a)
    den = sum(float(a[k].double().square().sum()) for k in a)
    return math.sqrt(num / max(den, 1e-30))


def _max_divergence(points: Sequence[dict[str, torch.Tensor]]) -> float:
    """Largest relative L2 distance between two peers' tensors."""
    return max(
        (_rel_l2(a, b) for i, a in enumerate(points) for b in points[i + 1 :]),
        default=0.0,
    )


def _mean_model(engines: Sequence[ResidentEngine]) -> dict[str, torch.Tensor]:
    """The exact average of the peers' live models (CPU float32)."""
    models = [dict(e.model.named_parameters()) for e in engines]
    return {
        n: torch.stack([m[n].detach().float().cpu() for m in models]).mean(0) for n in models[0]
    }


def _loss_of(engine: ResidentEngine, tensors: dict[str, torch.Tensor], val: list[Batch]) -> float:
    """Validation loss of other parameters in ``engine``'s model (its own are put back)."""
    params = dict(engine.model.named_parameters())
    saved = {n: p.detach().clone() for n, p in params.items()}
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(tensors[n])
        loss = engine.evaluate(val)
        for n, p in params.items():
            p.copy_(saved[n])
    return loss


def _sync_round(states: Sequence[SyncState]) -> list[Outgoing]:
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


class SimulatedLink:
    """A link of ``rate`` bytes a step to each other peer, and the automatic cadence
    (``sync.every: "auto"``) over it as ``atomd.sync.cadence`` runs it in the daemon (a fixed H
    calls only ``after_round``, ``transit`` and ``closes_after``): every step takes one
    simulated second and a round's work none (the link alone spaces the rounds), so each
    ``Cadence`` measurement is exact. Peers are alike (one step time, one link), so one cadence
    stands for every peer's: it sizes the share of entries a frame carries (``FrameSize.fit``
    of ``Cadence.frame_budget``) and H (``Cadence.every``), from the largest frame of the
    last rounds. As in the daemon, a round's traffic time is known once its frames have gone,
    so the next round's H comes from the rounds before; a peer's uploads go one after another
    on its uplink, so its k-th upload of a round (of n - 1) is done (k + 1) / (n - 1) of its
    frame's traffic time after the round closes; and a peer does not close a round while its
    last frame is still on its way (the daemon's one round in flight)."""

    def __init__(self, rate: float) -> None:
        if rate <= 0:
            raise ValueError(f"a link's rate must be positive, got {rate}")
        self.rate = rate
        self.cadence = Cadence(None)
        self.frame = FrameSize()
        self.now = 0.0
        self.traffic_s = 0.0  # the last round's: its largest frame over the rate
        self.every: list[int] = []  # H of each round
        self.fractions: list[float | None] = []  # each round's share of entries
        self.frames: list[int] = []  # each round's largest frame, bytes

    def step(self) -> None:
        self.cadence.step(1.0)
        self.now += 1.0

    def before_round(self, states: Sequence[SyncState], ceiling: float) -> None:
        """Each peer's share of entries for the round it closes now (the daemon's
        ``SyncPlugin._fit_fraction``)."""
        budget = self.cadence.frame_budget()
        for state in states:
            if state.fraction is not None and budget is not None:
                fraction = self.frame.fit(ceiling, budget, state.payload_estimate)
                if fraction is not None and fraction != state.fraction:
                    state.set_fraction(fraction)
        self.fractions.append(states[0].fraction)

    def after_round(
        self, states: Sequence[SyncState], outs: Sequence[Outgoing], frame_bytes: Sequence[int]
    ) -> None:
        """The round's frames left: the largest one's traffic time, and what it weighed."""
        k = max(range(len(outs)), key=lambda i: frame_bytes[i])
        fraction = states[k].fraction
        raw = None if fraction is None else states[k].payload_estimate(fraction)
        self.frame.measured(frame_bytes[k], outs[k].payload_bytes, raw)
        self.frames.append(frame_bytes[k])
        self.traffic_s = frame_bytes[k] / self.rate
        self.cadence.traffic(self.traffic_s, frame_bytes[k])

    def transit(self, nbytes: int, k: int, n: int) -> int:
        """Steps until a frame of ``nbytes`` has gone on its (k+1)-th upload of n - 1."""
        return math.ceil((k + 1) * nbytes / self.rate / max(1, n - 1))

    def next_every(self) -> int:
        """H of the round that starts now, by what is measured so far."""
        return self.cadence.every(now=self.now)

    def closes_after(self, every: int) -> int:
        """Steps the round that starts now lasts: ``every``, or until the last frame has gone."""
        h = max(every, math.ceil(self.traffic_s))
        self.every.append(h)
        return h


def _arrived(inbox: Inbox, receiver: int, step: float) -> list[Contribution]:
    """Take what has reached ``receiver`` by ``step`` (in order of arrival)."""
    due = sorted(k for k in inbox if k[0] == receiver and k[1] <= step)
    return [c for k in due for c in inbox.pop(k)]


def run_swarm(run: RunSpec, budget: Budget) -> dict[str, Any]:
    """Train ``run.peers`` simulated peers; see the module docstring for the delivery model."""
    assert run.codec is not None
    t0 = time.perf_counter()
    n = budget.peers or run.peers
    spec = _job_spec(budget.batch(run.batch_size), budget)
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
    engines = [_build(spec) for _ in range(n)]
    states = [SyncState.of_engine(e, sync, peer_id=f"peer-{i}") for i, e in enumerate(engines)]
    if run.ideal_rate is not None:
        for i, state in enumerate(states):
            ideal = IdealCodec(rate=run.ideal_rate, seed=1000 * budget.seed + i)
            state.codec = state.feedback.codec = ideal
    for e in engines:  # the daemon's SyncPlugin sets this each round
        e.set_peers(n if sync.swarm_adam else 1)
    frame_bytes = _FrameBytes([Identity.generate() for _ in range(n)])
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
    # The peers' means over their last models: linear, so the mean of the peers' models' mean.
    tail = TailMean(spec.total_steps, sync.final_tail)
    for step in range(spec.total_steps):
        if step and tail.due(step):  # the model after ``step`` steps (the last one: below)
            tail.add(_mean_model(engines))
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
            outs = _sync_round(states)
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
            divergences.append(_max_divergence([s.anchor for s in states]))
            start_divergences.append(_max_divergence([s.start_point() for s in states]))
        rnd += 1
    # The daemon's final wait (sync.final_wait_s): the last round's deltas still in flight reach
    # every peer before it finishes. The loss before it is reported too.
    losses_at_last_step = [e.evaluate(val) for e in engines]
    for i, state in enumerate(states):
        state.absorb(_arrived(inbox, i, math.inf))
    losses_before_consolidation = [e.evaluate(val) for e in engines]
    if tail.due(spec.total_steps):  # the last models, after the others' last deltas
        tail.add(_mean_model(engines))
    tail_model = tail.mean()
    # sync.consolidate_rounds: rounds without training, each waiting for all deltas.
    consolidation_bytes: list[int] = []
    for _ in range(sync.consolidate_rounds):
        frame_bytes.clear()
        consolidation_bytes += [frame_bytes(i, o) for i, o in enumerate(_sync_round(states))]
    losses = (
        [e.evaluate(val) for e in engines] if consolidation_bytes else losses_before_consolidation
    )
    # The models the peers hold: with residual="replica" each also carries its unsent residual.
    models = [{n: p.detach().clone() for n, p in e.model.named_parameters()} for e in engines]
    anchor_losses = [_loss_of(e, s.anchor, val) for e, s in zip(engines, states, strict=True)]
    # What exact averaging of the final models would give (no peer holds it: a diagnostic).
    mean_model = _mean_model(engines)
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
        "val_loss_mean_model": _loss_of(engines[0], mean_model, val),
        "val_loss_tail_model": None
        if tail_model is None
        else _loss_of(engines[0], tail_model, val),
        "tail_models": tail.count,
        "bytes_per_round": per_round,
        "model_fp32_bytes": model_bytes,
        "ratio_vs_fp32_model": model_bytes / max(per_round, 1.0),
        "payload_ratio": sum(ratios) / max(1, len(ratios)),
        "divergence_max": max(divergences, default=0.0),
        "divergence_final": divergences[-1] if divergences else 0.0,
        "model_divergence_final": _max_divergence(models),
        "start_divergence_max": max(start_divergences, default=0.0),
        "start_divergence_final": start_divergences[-1] if start_divergences else 0.0,
        "wall_s": time.perf_counter() - t0,
    }


def replace_every(sync: SyncSpec, every: int) -> SyncSpec:
    return sync.model_copy(update={"every": every})


def run_single(run: RunSpec, budget: Budget) -> dict[str, Any]:
    """One process, no sync: a lone peer on its quarter of the data, or batch 64 on all of it."""
    t0 = time.perf_counter()
    spec = _job_spec(budget.batch(run.batch_size), budget)
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
    eng = _build(spec)
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


_PLAIN = {"outer_momentum": 0.0}  # the plain average


def extra_runs() -> list[RunSpec]:
    """Runs outside the default selection (``--runs``): the evidence behind the defaults."""
    nesterov = {"outer_lr": 0.7, "outer_momentum": 0.9}  # DiLoCo's outer step
    dflt = SyncSpec().codec
    return [
        RunSpec("fp32-h50-nesterov", codec="fp32", sync=nesterov),
        RunSpec("fp32-h50-sync", codec="fp32", mode="sync"),
        RunSpec("fp32-h50-sync-nesterov", codec="fp32", mode="sync", sync=nesterov),
        RunSpec("topk-h50-feedback", codec="topk", sync={"residual": "feedback"}),
        RunSpec(
            "topk-h50-sparseloco", codec="topk", sync={"residual": "feedback", "ef_decay": 0.9}
        ),
        RunSpec("fp32-h50-contiguous", codec="fp32", shard_mode="contiguous"),
        # The outer step per codec: top-k with the plain average (the default before), with the
        # amplification as an outer lr instead of momentum; fp32 with top-k's momentum.
        *(RunSpec(f"topk-h{h}-plain", codec="topk", every=h, sync=_PLAIN) for h in (50, 2)),
        RunSpec("topk-h2-lr2", codec="topk", every=2, sync={"outer_lr": 2.0, **_PLAIN}),
        RunSpec("fp32-h2-momentum", codec="fp32", every=2, sync={"outer_momentum": 0.5}),
        # Issue #14's codec study at H=50: Golomb-Rice positions and 2-bit values (2.5% of the
        # entries for topk's bytes), with the residual in the replica and top-k's momentum, and
        # SparseLoCo-style (arXiv 2508.15706): error feedback with decay, no outer momentum.
        RunSpec("rice2-h50", codec="rice2"),
        RunSpec("fp32-h50-momentum", codec="fp32", sync={"outer_momentum": 0.5}),
        RunSpec(
            "rice2-h50-sparseloco",
            codec="rice2",
            sync={"residual": "feedback", "ef_decay": 0.95, "outer_momentum": 0.0},
        ),
        # rice2 where rounds are frequent, with top-k's momentum there (2026-12-01: 1.7725
        # against top-k's 1.7245 at H=2: more entries of 2 bits lose to fewer of 8 bits).
        RunSpec("rice2-h2-momentum07", codec="rice2", every=2, sync={"outer_momentum": 0.7}),
        # Issue #14, a fixed upload budget per step (the link): fewer bytes a frame at more
        # frequent rounds against top-k 1% at rare ones. Signed frames of the tiny model
        # (52 tensors, ~6 KiB of headers each): top-k 1% 31.0 KB, 0.25% 12.9 KB, 0.1% 9.3 KB;
        # rice2 0.5% 12.5 KB. Budget of top-k 1% at H=12 (~2.6 KB a step): top-k 0.25% and
        # rice2 0.5% at H=5 (2.6 / 2.5 KB), top-k 0.1% at H=4 (2.3 KB). Budget of H=50 (~620 B
        # a step; topk-h50 is a default run): top-k 0.25% and rice2 0.5% at H=20 (650 / 620 B).
        RunSpec("topk-h12", codec="topk", every=12),
        # top-k's momentum under "auto" (0.7, whatever H): the reference the product gives today.
        RunSpec("topk-h12-momentum07", codec="topk", every=12, sync={"outer_momentum": 0.7}),
        *(
            RunSpec(f"{c}-f{f * 100:g}-h{h}", codec=c, every=h, sync={"topk_fraction": f})
            for c, f, h in (
                ("topk", 0.0025, 5),
                ("rice2", 0.005, 5),
                ("topk", 0.001, 4),
                ("topk", 0.0025, 20),
                ("rice2", 0.005, 20),
                # Issue #14, a free link (2026-12-02): more entries at H=2, where top-k 1%
                # reaches 1.7245, for the automatic cadence's ceiling.
                ("topk", 0.02, 2),
                ("topk", 0.04, 2),
                ("topk", 0.005, 5),
            )
        ),
        # Issue #14, low-rank deltas (``lowrank``: each matrix's best rank-r factors, 4-bit,
        # no positions): where rounds are frequent, at a slow link's budget and at H=50.
        *(
            RunSpec(
                f"lowrank-f{f * 100:g}-h{h}-m{m * 10:g}",
                codec="lowrank",
                every=h,
                sync={"topk_fraction": f, "outer_momentum": m},
            )
            for f, h, m in (
                (0.04, 2, 0.7),
                (0.04, 2, 0.0),
                (0.06, 50, 0.5),
                (0.015, 5, 0.0),
            )
        ),
        # Issue #14, 256 kbit/s (2026-12-03): real daemons settle at top-k 1 % every ~6 steps
        # (``LINK_EVERY`` = 5 sizes the frame); half the share at ~2/3 of the H, at the same
        # bytes a step: would a smaller LINK_EVERY pay? (topk-f1-h6-m7, topk-f0.5-h4-m7)
        # Issue #14, item 5 read per step: a link 100x slower than one that carries the fp32
        # model every 50 steps (674 B a step). What the automatic cadence sends there (top-k's
        # smallest shares, momentum 0.7), at an H whose frames fit: 4-bit values with gap-coded
        # positions make a 0.25 % frame ~6 KB and a 0.5 % frame ~9.4 KB.
        *(
            RunSpec(
                f"topk-f{f * 100:g}-h{h}-m7",
                codec="topk",
                every=h,
                sync={"topk_fraction": f, "outer_momentum": 0.7},
            )
            for f, h in (
                (0.0025, 10),
                (0.005, 15),
                (0.01, 6),
                (0.005, 4),
                # 2026-12-05, fifth: would top-k at a slow link's cadence gain from more
                # entries, were positions free (2-3x the entries in the same bytes)?
                (0.01, 5),
                (0.02, 5),
                (0.03, 5),
            )
        ),
        # A free link: a larger share of top-k's entries with less amplification.
        RunSpec(
            "topk-f2-h2-m5",
            codec="topk",
            every=2,
            sync={"topk_fraction": 0.02, "outer_momentum": 0.5},
        ),
        # The free link's neighbours: what a round every step, or every third, gives with the
        # defaults (real daemons close rounds every 2 or 3 steps, the round's work sets which).
        RunSpec("topk-h1", codec="topk", every=1),
        RunSpec("topk-h3", codec="topk", every=3),
        # A slow link's cadence (top-k 1 % every 6 steps, what real daemons settle on at
        # 256 kbit/s) with part of the unsent residual leaving the replica for the error
        # feedback each round (ef_decay < 1): do replicas nearer the swarm's model pay there?
        *(
            RunSpec(
                f"topk-f1-h6-m7-ef{d * 10:g}",
                codec="topk",
                every=6,
                sync={"outer_momentum": 0.7, "ef_decay": d},
            )
            for d in (0.9, 0.7)
        ),
        # sync.final_tail: the final average of each peer's mean over its last 5 % of steps
        # (``val_loss_tail_model`` beside ``val_loss_mean_model``), at a free link's cadence and
        # at a slow link's (bench/results-sync-tail-2026-12-04.json).
        RunSpec("topk-h2-tail", codec="topk", every=2, sync={"final_tail": 0.05}),
        RunSpec(
            "topk-f1-h6-m7-tail",
            codec="topk",
            every=6,
            sync={"outer_momentum": 0.7, "final_tail": 0.05},
        ),
        # sync.swarm_adam (docs/swarm-adam.md): each peer's AdamW divides by the swarm's second
        # moment, or by its own (the runs named -adamw). The peers' exact mean every step, and
        # top-k 1 % at a free link's cadence and at a slow link's
        # (bench/results-sync-swarm-adam-2026-12-06.json).
        *(
            RunSpec(
                f"fp32-h1-sync-plain{suffix}",
                codec="fp32",
                every=1,
                mode="sync",
                sync={"outer_momentum": 0.0, **extra},
            )
            for suffix, extra in (("", {}), ("-adamw", {"swarm_adam": False}))
        ),
        *(
            RunSpec(f"topk-h{h}{suffix}", codec="topk", every=h, sync=extra)
            for h in (2, 5)
            for suffix, extra in (("-swarm-adam", {}), ("-adamw", {"swarm_adam": False}))
        ),
        # The same at 8 peers (the swarm's AdamW's share a = 0.076 there, 0.21 at 4), against
        # one process at 8 times the batch.
        RunSpec("single-b128", peers=1, batch_size=128),
        *(
            RunSpec(f"topk-h2-p8{suffix}", codec="topk", every=2, peers=8, sync=extra)
            for suffix, extra in (("-swarm-adam", {}), ("-adamw", {"swarm_adam": False}))
        ),
        # What keeps 8 peers from the batch-128 process (2026-12-06, sixth): the peers' exact
        # mean every step, with the swarm's AdamW (bench/results-sync-p8-exact-2026-12-06.json).
        RunSpec(
            "fp32-h1-sync-plain-p8",
            codec="fp32",
            every=1,
            mode="sync",
            peers=8,
            sync={"outer_momentum": 0.0},
        ),
        # ... and top-k at 8 peers with twice the entries, or a round every step
        # (bench/results-sync-p8-topk-2026-12-06.json).
        RunSpec("topk-f2-h2-p8", codec="topk", every=2, peers=8, sync={"topk_fraction": 0.02}),
        RunSpec("topk-h1-p8", codec="topk", every=1, peers=8),
        # Issue #14 item 5 (2026-12-06): more entries at H=50 within the 100x bar (33,699 B a
        # round): top-k 2 %, with the default momentum (0.5 at H=50) and with 0.7
        # (bench/results-sync-h50-topk-f2-2026-12-06.json).
        *(
            RunSpec(f"topk-f2-h50{suffix}", codec="topk", sync={"topk_fraction": 0.02, **extra})
            for suffix, extra in (("", {}), ("-m7", {"outer_momentum": 0.7}))
        ),
        # Item 5's bar against the best code for the deltas' variances (2026-12-06, third):
        # ``IdealCodec`` at 0.3 bits a parameter, a 32.7 kB frame (103x), with top-k's residual
        # in the replica, at H=50's momentum (0.5) and with the plain average; then at 1 and 3
        # bits a parameter (32x, 11x), where it nears fp32.
        *(
            RunSpec(f"ideal-r0.3-h50{suffix}", codec="topk", ideal_rate=0.3, sync=extra)
            for suffix, extra in (("", {}), ("-m0", {"outer_momentum": 0.0}))
        ),
        *(RunSpec(f"ideal-r{r:g}-h50", codec="topk", ideal_rate=r) for r in (1.0, 3.0)),
        # Issue #14, item 5 as the product runs it: the automatic cadence over a link r times
        # slower than one that carries the fp32 model every 50 steps (``SimulatedLink``), the
        # default codec choosing its share of entries and H itself.
        *(
            RunSpec(f"{dflt}-auto-link{r}x", codec=dflt, every="auto", link=FP32_EVERY_50 / r)
            for r in (30, 100, 300)
        ),
        # ... and the reference over its own link: fp32 every 50 steps, its frames taking the
        # round to reach the last peer.
        RunSpec("fp32-h50-link1x", codec="fp32", link=FP32_EVERY_50),
        # Issue #14, item 5 (2026-12-07, fourth): top-k ranked by |delta| alone at H=50, as
        # before ``sync.topk_rank`` 'moment' (|delta| / v^2 where rounds are rare; where they
        # are frequent, 'moment' ranks by |delta| too).
        RunSpec("topk-h50-magnitude", codec="topk", sync={"topk_rank": "magnitude"}),
    ]


def resolve_runs(names: Sequence[str] | None) -> list[RunSpec]:
    if not names:
        return default_runs()
    known = {r.name: r for r in [*default_runs(), *extra_runs()]}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown run(s) {unknown}; known: {', '.join(known)}")
    return [known[n] for n in names]


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
    SyncSpec fields every swarm run takes over its own (e.g. ``{"swarm_adam": False}``, the
    peers' AdamW before 2026-12-06).

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
        "'{\"swarm_adam\": false}': the peers' own AdamW, as before 2026-12-06)",
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
