"""The planner: K slots, M micro-batches per layer visit and the resident set for a budget.

It models each layer's compute (from FLOPs) and transfers (from bytes) with the rates in a
``Hardware``, and device memory from the tensors the engine keeps, then picks the plan with the
least predicted time per token that fits the budget. Units: bytes, seconds, FLOP.

Device memory of a plan (a = 4: the residual stream is fp32, also under bf16 autocast;
d = bytes of the compute dtype; BTC = micro_batch_size * seq_len * n_embd):
- resident state: 16 B per resident parameter (fp32 weight, gradient, AdamW m and v);
- slots: K * (l + 4) B per block parameter (weights in the link dtype, l = 2 for a bf16 link's
  matrices, else 4, and the fp32 gradient accumulator), plus one block's bf16 copy that a bf16
  link's gradient store converts through; K * 16 B with the optimizer on the device (fp32
  link; the layer's AdamW moments come in with it);
- saved layer inputs (activation checkpoints): (n_layer + 1) * M * BTC * a, or, when spilled
  to host memory, the 4 layers' worth that are on the device at once;
- kept graphs: the last ``graph_blocks`` blocks keep their forward's autograd graph until
  backward instead of recomputing it, M * BTC * (2a + 15d) each (as resident training keeps
  them), plus the weights autograd saves: a copy of the fp32 slot weights without autocast (the
  CPU), one bf16 copy for all M micro-batches under it. The planner keeps as many as the budget
  leaves room for: each one saves a quarter of a block's compute;
- flowing: 2 * M * BTC * a (one layer's outputs in forward; gradients in and out in backward);
- working set of one micro-batch inside one layer: a block's recomputed graph
  (BTC * (2a + 24d)) or the head's logits and their fp32 loss gradient (B*T*V * (2d + 12))
  with the tied weight's compute-dtype copy and the fp32 gradient returned for it (V*C*(4 + d));
- a fixed reserve for cuBLAS workspaces and allocator rounding.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import torch

from atomd.errors import PlanError
from atomd.model.gpt import Block, GPTConfig, Head
from atomd.swap.hardware import Hardware
from atomd.swap.schedule import count_loads
from atomd.units import format_bytes

RESERVE_BYTES = 256 * 2**20
ACT_BYTES = 4  # the residual stream (saved layer inputs, their gradients) is fp32
MAX_SLOTS = 8
FREE_M = (1, 2, 4, 8, 16, 32, 64)  # M candidates when the gradient accumulation is free
SPLITS = (0.125, 0.25, 0.375, 0.5, 0.75)
"""The 'split' optimizer's candidate shares of swapped blocks stepped on the device."""
NEAR_BEST = 1.03  # plans within 3% of the best time per token count as equally fast
GRAPH_HEADROOM = 0.05
MODEL_FLOPS_FRACTION = 0.5
"""A whole model's step (attention, norms, elementwise work, launch gaps) runs at about this
fraction of a large square matmul's rate: resident gpt3-xl on an H200 reached 0.53 of the
measured 778 TFLOP/s (`atomd bench swap`; research/README.md)."""
Optimizer = Literal["host", "device", "split"]
Link = Literal["bf16", "fp32"]


@dataclass(frozen=True)
class LayerSizes:
    """Parameter counts: one block, the embedding, the head (without a tied weight)."""

    block: int
    embed: int
    head: int
    block_matrix: int = 0
    """Of a block's parameters, those in matrices (what a bf16 link moves as bf16)."""

    @classmethod
    @functools.cache
    def of(cls, cfg: GPTConfig) -> LayerSizes:
        with torch.device("meta"):  # shapes only: nothing is allocated
            block_params = list(Block(cfg).parameters())
            block = sum(p.numel() for p in block_params)
            head = sum(p.numel() for p in Head(cfg).parameters())
        matrix = sum(p.numel() for p in block_params if p.dim() >= 2)
        # Embedding's wte + wpe, counted by hand: initializing it on meta takes a second.
        embed = (cfg.vocab_size + cfg.block_size) * cfg.n_embd
        if cfg.tie_embeddings:
            head -= cfg.vocab_size * cfg.n_embd
        return cls(block=block, embed=embed, head=head, block_matrix=matrix)

    def link_bytes(self, link: Link) -> int:
        """Bytes one block's weights (or gradient) take over the link."""
        if link == "fp32":
            return 4 * self.block
        return 2 * self.block_matrix + 4 * (self.block - self.block_matrix)

    def total(self, n_layer: int) -> int:
        return self.embed + self.head + n_layer * self.block


@dataclass(frozen=True, kw_only=True)
class SwapPlan:
    """What the engine does and what the planner predicts for it (all per optimizer step)."""

    slots: int
    micro_batches: int
    """M: micro-batches that pass through a layer per load."""
    waves: int
    """grad_accum / M: forward-backward passes per optimizer step."""
    grad_accum: int
    resident_blocks: int
    """Blocks kept on the device (the first ones), besides embedding and head."""
    swapped_blocks: int
    spill: bool
    """Saved layer inputs are kept in host memory (copied out in forward, back in backward)."""
    graph_blocks: int
    """The last blocks that keep their forward's autograd graph until backward (not
    recomputed); the others are checkpointed."""
    optimizer: Optimizer
    """Where swapped layers' AdamW runs: 'host' (fused, on a worker thread, overlapping the
    backward) or 'device' (the step is applied when the layer is next loaded: its gradient and
    moments travel with its weights, the updated master and moments go back on the store
    stream; exact, clipping included, since the global norm is known by then)."""
    device_steps: int | None = None
    """With the 'split' optimizer: how many swapped blocks (the first ones, needed first by
    the next forward) take their step on the device; the others step on the host. None:
    all ('device') or none ('host'), as plans recorded before the split recorded it."""
    link: Link = "fp32"
    """What swapped weights and gradients travel in: 'bf16' (the matrices as bf16 copies of
    their fp32 masters, gradients rounded to bf16 once per wave; CUDA with the host optimizer)
    or 'fp32'. Plans recorded before the choice existed moved fp32."""
    micro_batch_size: int
    seq_len: int
    tokens_per_step: int
    n_layer: int
    params_total: int
    params_per_block: int
    params_resident: int
    budget_bytes: int
    memory: dict[str, int]
    """Predicted device bytes by part (see the module docstring)."""
    peak_device_bytes: int
    host_bytes: int
    """Host memory of the swapped layers (16 B/parameter with one wave per step, 20 with
    several: the fp32 sum of the waves' gradients) plus spill buffers."""
    layer_loads: int
    bytes_loaded: int
    bytes_stored: int
    compute_s: float
    load_s: float
    store_s: float
    host_optimizer_s: float
    fill_s: float
    """Exposed time at the start of a step: the first swapped layer's update and load."""
    step_s: float
    bottleneck: str
    tokens_per_s: float
    resident_step_s: float
    """Compute time of the same step trained resident (no recompute, no transfers)."""
    hardware: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def steps_on_device(self) -> int:
        """Swapped blocks (the first ones) whose AdamW step runs on the device."""
        if self.device_steps is not None:
            return self.device_steps
        return self.swapped_blocks if self.optimizer == "device" else 0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SwapPlan:
        return cls(**data)


@dataclass(frozen=True, kw_only=True)
class Shape:
    """What the planner is asked about."""

    cfg: GPTConfig
    micro_batch_size: int
    seq_len: int
    grad_accum: int | None
    """Micro-batches per optimizer step; None lets the planner choose M (and grad_accum = M)."""
    dtype_bytes: int = 2
    """Bytes of the compute dtype: 2 (bf16 autocast on CUDA) or 4 (fp32 on the CPU)."""
    grad_clip: bool = True
    """Whether steps clip the gradient's global norm (the job spec's default): host AdamW steps
    then wait for the whole backward."""


def _graph_bytes(shape: Shape, sizes: LayerSizes, m: int) -> int:
    """Device bytes of one block whose forward graph is kept for M micro-batches."""
    btc = shape.micro_batch_size * shape.seq_len * shape.cfg.n_embd
    # The weights autograd saves: a copy of the fp32 slot weights without autocast, the
    # autocast region's one bf16 copy (shared by the M micro-batches) under it.
    weights = (4 if shape.dtype_bytes == 4 else 2) * sizes.block
    return m * btc * (2 * ACT_BYTES + 15 * shape.dtype_bytes) + weights


def _memory(
    shape: Shape,
    sizes: LayerSizes,
    k: int,
    m: int,
    r: int,
    spill: bool,
    optimizer: Optimizer,
    graphs: int = 0,
    link: Link = "fp32",
) -> dict[str, int]:
    cfg, d = shape.cfg, shape.dtype_bytes
    tokens = shape.micro_batch_size * shape.seq_len
    btc = tokens * cfg.n_embd
    # A block that keeps its graph needs no saved input of its own.
    saved_layers = min(cfg.n_layer + 1, 4) if spill else cfg.n_layer + 1 - graphs
    return {
        "resident_state": 16 * (sizes.embed + sizes.head + r * sizes.block),
        "slots": k * 16 * sizes.block if optimizer != "host" else _slots_bytes(sizes, link, k),
        "saved_inputs": saved_layers * m * btc * ACT_BYTES,
        "kept_graphs": graphs * _graph_bytes(shape, sizes, m),
        "flowing": 2 * m * btc * ACT_BYTES,
        "working": max(
            btc * (2 * ACT_BYTES + 24 * d),
            # the head: logits and their fp32 loss gradient, the tied weight's compute-dtype
            # copy and the fp32 gradient it returns before it is added to .grad
            tokens * cfg.vocab_size * (2 * d + 12)
            + 2 * btc * ACT_BYTES
            + cfg.vocab_size * cfg.n_embd * (4 + d),
        ),
        "reserve": RESERVE_BYTES,
    }


def _slots_bytes(sizes: LayerSizes, link: Link, k: int) -> int:
    """K slots of the host optimizer: weights over the link and fp32 gradient accumulators;
    with a bf16 link, plus the one bf16 copy a gradient store converts through (made on the
    store stream, which runs one store at a time)."""
    convert = sizes.link_bytes(link) if link != "fp32" else 0
    return k * (sizes.link_bytes(link) + 4 * sizes.block) + convert


def _host_bytes(sizes: LayerSizes, link: Link, waves: int) -> int:
    """Host memory of one swapped block (``host``): fp32 masters and AdamW moments (12 B), the
    bf16 copy of the matrices a slot loads (fp32 parameters load from the masters), the staging
    its gradient lands in, and
    the fp32 gradient: the staging itself with one wave and an fp32 link, a scratch at the
    step with one wave and a bf16 link, the sum of the waves with several."""
    over = sizes.link_bytes(link)
    copy = 0 if link == "fp32" else 2 * sizes.block_matrix  # vectors load from the masters
    one_wave = 4 * sizes.block if link == "fp32" else over
    grad = one_wave if waves == 1 else over + 4 * sizes.block
    return 12 * sizes.block + copy + grad


def host_worker_s(sizes: LayerSizes, hw: Hardware, link: Link, waves: int, clip: bool) -> float:
    """The host worker's time per swapped block and step that cannot hide in the backward:
    AdamW, then (bf16 link) the matrices' bf16 copy refreshed, and before it the last wave's
    gradient (bf16: widened to fp32) summed into ``.grad`` (with clipping, its norms: another
    pass), or with one wave over a bf16 link the gradient widened into the step's scratch.
    Earlier waves' sums run while later waves compute. Measured on the H200's host and a
    2-core one alike: a conversion costs 0.4-0.5 of an AdamW step per element."""
    t = sizes.block / hw.host_adam_params_per_s
    bf16 = link != "fp32"
    if bf16:
        t += sizes.block_matrix / hw.narrow_per_s
        if waves == 1:
            t += sizes.block_matrix / hw.widen_per_s
    if waves > 1:
        t += (sizes.block_matrix / hw.widen_per_s if bf16 else 0.0) + sizes.block / hw.add_per_s
        if clip:
            t += sizes.block / hw.add_per_s
    return t


def resident_peak_bytes(shape: Shape) -> int:
    """Device bytes for plain resident training (ResidentEngine: no checkpointing)."""
    cfg, d = shape.cfg, shape.dtype_bytes
    sizes = LayerSizes.of(cfg)
    tokens = shape.micro_batch_size * shape.seq_len
    btc = tokens * cfg.n_embd
    graph = cfg.n_layer * btc * (2 * ACT_BYTES + 15 * d)  # a whole micro-batch's saved graph
    head = tokens * cfg.vocab_size * (2 * d + 12)
    return 16 * sizes.total(cfg.n_layer) + graph + head + RESERVE_BYTES


@functools.cache
def _count_loads(swapped: int, slots: int, waves: int) -> int:
    return count_loads(list(range(swapped)), slots, waves)[1]


def flops(shape: Shape, sizes: LayerSizes) -> tuple[float, float]:
    """Forward FLOPs of one micro-batch: (one block, the head)."""
    cfg = shape.cfg
    b, t = shape.micro_batch_size, shape.seq_len
    # Matmuls: 2 FLOP per parameter per token; causal attention: QK^T and AV, half the square.
    block = 2.0 * sizes.block * b * t + 2.0 * b * t * t * cfg.n_embd
    head = 2.0 * cfg.n_embd * cfg.vocab_size * b * t
    return block, head


def _evaluate(
    shape: Shape,
    hw: Hardware,
    budget: int,
    k: int,
    m: int,
    g: int,
    r: int,
    spill: bool,
    optimizer: Optimizer,
    graphs: int | None,
    link: Link = "fp32",
    device_steps: int | None = None,
) -> SwapPlan:
    cfg, sizes = shape.cfg, LayerSizes.of(shape.cfg)
    q = cfg.n_layer - r
    # Blocks stepped on the device: all, none, or (split) the first device_steps.
    n_dev = {"device": q, "host": 0}.get(optimizer, min(q, device_steps or 0))
    waves = g // m
    btc = shape.micro_batch_size * shape.seq_len * cfg.n_embd
    if graphs is None:  # as many as fit: each saves compute and costs nothing but memory
        # Graphs fill the budget up to GRAPH_HEADROOM: estimates of activations are rough.
        room = int(budget * (1 - GRAPH_HEADROOM))
        room -= sum(_memory(shape, sizes, k, m, r, spill, optimizer, 0, link).values())
        saved_input = 0 if spill else m * btc * ACT_BYTES
        per_graph = _graph_bytes(shape, sizes, m) - saved_input
        graphs = max(0, min(cfg.n_layer, room // max(1, per_graph)))
    memory = _memory(shape, sizes, k, m, r, spill, optimizer, graphs, link)
    # Block inputs but the last block's, and those of blocks that keep their graph.
    spilled_layers = min(cfg.n_layer - 1, cfg.n_layer - graphs) if spill else 0
    loads = _count_loads(q, k, waves)
    w_bytes = sizes.link_bytes(link)  # one block's weights, or its gradient, over the link
    spill_bytes = waves * spilled_layers * m * btc * ACT_BYTES
    bytes_loaded = loads * w_bytes + spill_bytes
    bytes_stored = waves * q * w_bytes + spill_bytes  # gradients out, inputs out
    step_bytes = 12 * sizes.block  # device optimizer: fp32 gradient and moments in; master, out
    bytes_loaded += n_dev * step_bytes  # per block stepped on the device
    bytes_stored += n_dev * step_bytes
    f_block, f_head = flops(shape, sizes)
    rate = hw.flops_per_s * MODEL_FLOPS_FRACTION
    # A block recomputes its forward in backward (forward + recompute + 2x backward) unless it
    # kept its graph.
    compute_s = g * ((cfg.n_layer * 4 - graphs) * f_block + 3 * f_head) / rate
    resident_step_s = g * (cfg.n_layer * 3 * f_block + 3 * f_head) / rate
    load_s = bytes_loaded / hw.h2d_bytes_per_s
    store_s = bytes_stored / hw.d2h_bytes_per_s
    # On the device AdamW reads and writes ~28 B per parameter in device memory: next to the
    # link's 24 B per parameter of transfers it is left out.
    host_opt_s = (q - n_dev) * host_worker_s(sizes, hw, link, waves, shape.grad_clip)
    # The first swapped layer is stepped last in backward and needed first in forward; the
    # embedding and resident blocks' forward of the first micro-batches hides part of it.
    ahead_s = m * (r * f_block) / rate

    # Time per step, phase by phase: each wave's forward, then its backward. Transfers hide
    # behind compute only within their phase (the 16 B/param a device-optimizer forward loads
    # are not helped by a compute-heavy backward), so a phase lasts as long as its busiest
    # resource, plus what the hardware does not overlap (hw.duplex, hw.copy_compute_overlap).
    bound_by: dict[str, float] = {}  # seconds of the step each resource sets

    def phase(compute: float, loaded: float, stored: float) -> float:
        ld, st = loaded / hw.h2d_bytes_per_s, stored / hw.d2h_bytes_per_s
        link = max(ld, st) + (1.0 - hw.duplex) * min(ld, st)
        busiest = "compute" if compute >= link else "load" if ld >= st else "store"
        took = max(compute, link) + (1.0 - hw.copy_compute_overlap) * min(compute, link)
        bound_by[busiest] = bound_by.get(busiest, 0.0) + took
        return took

    kept = min(k, q)  # layers a phase finds in the slots from the phase before
    spill_wave = spilled_layers * m * btc * ACT_BYTES
    forward_s = m * cfg.n_layer * f_block / rate
    backward_s = m * ((cfg.n_layer * 3 - graphs) * f_block + 3 * f_head) / rate
    phases: list[float] = []

    def front_loaded_forward() -> float:
        """The first forward when layers step on the device: their steps' bytes come with
        the first n_dev loads, one layer of prefetch ahead, so a layer takes the longer of
        its compute and its own transfers (not the phase's totals: the device-stepped layers'
        transfers cannot spread over the others' compute)."""
        c = m * f_block / rate
        per_spill = spill_wave / cfg.n_layer

        def layer(loaded: float, stored: float) -> tuple[float, str]:
            ld, st = loaded / hw.h2d_bytes_per_s, (stored + per_spill) / hw.d2h_bytes_per_s
            link = max(ld, st) + (1.0 - hw.duplex) * min(ld, st)
            took = max(c, link) + (1.0 - hw.copy_compute_overlap) * min(c, link)
            return took, "compute" if c >= link else "load" if ld >= st else "store"

        total = r * c  # resident blocks: compute only
        for count, loaded, stored in (
            (n_dev, w_bytes + step_bytes, step_bytes),
            (q - n_dev, w_bytes, 0.0),
        ):
            took, busiest = layer(loaded, stored)
            total += count * took
            bound_by[busiest] = bound_by.get(busiest, 0.0) + count * took
        bound_by["compute"] = bound_by.get("compute", 0.0) + r * c
        return total

    for w in range(waves):
        loaded, stored = (q if w == 0 else q - kept) * w_bytes, spill_wave  # weights, inputs
        if w == 0 and n_dev:  # a device-stepped layer's step comes with its first load
            phases.append(front_loaded_forward())
        else:
            phases.append(phase(forward_s, loaded, stored))
        loaded = (q - kept) * w_bytes + spill_wave
        phases.append(phase(backward_s, loaded, q * w_bytes))
    # Before the first swapped layer's forward: its load (on the device: with its step's
    # gradient and moments), and its host step, which the host optimizer (one worker, first in
    # first out) may not have reached. With clipping the steps are queued in forward order
    # after the backward (the norm needs all of it) and each load, issued K layers ahead,
    # waits for its layer's: the first forward ends a layer after the last step. Without, a
    # layer's step is queued as its gradient completes, in backward order, so the first
    # swapped layer, needed first, is stepped last: the last backward hides the steps.
    # Split: the first n_dev layers step on the device (the first is then filled as with the
    # device optimizer) and the host's steps, of the later layers, have the forward through
    # the device-stepped ones to catch up.
    load_first = w_bytes / hw.h2d_bytes_per_s
    if n_dev == q:
        fill_s, host_s = max(0.0, 4 * load_first - ahead_s), 0.0
    elif shape.grad_clip:
        fill_s = (
            max(0.0, 4 * load_first - ahead_s)
            if n_dev
            else max(0.0, host_opt_s / (q - n_dev) + load_first - ahead_s)
        )
        one_layer = m * f_block / rate + load_first
        host_s = max(0.0, host_opt_s + one_layer - phases[0] - fill_s)
    else:
        late = max(0.0, host_opt_s - phases[-1])
        fill_s = max(0.0, (4 if n_dev else 1) * load_first - ahead_s) if late == 0 else 0.0
        host_s = max(0.0, late + load_first - ahead_s) if late > 0 else 0.0
    bound_by["load"] = bound_by.get("load", 0.0) + fill_s
    if host_s:
        bound_by["host_optimizer"] = host_s
    step_s = sum(phases) + fill_s + host_s
    bottleneck = max(bound_by, key=lambda key: bound_by[key])  # sets most of the step
    tokens = g * shape.micro_batch_size * shape.seq_len
    return SwapPlan(
        slots=k,
        micro_batches=m,
        waves=waves,
        grad_accum=g,
        resident_blocks=r,
        swapped_blocks=q,
        spill=spill,
        graph_blocks=graphs,
        optimizer=optimizer,
        device_steps=n_dev if optimizer == "split" else None,
        link=link,
        micro_batch_size=shape.micro_batch_size,
        seq_len=shape.seq_len,
        tokens_per_step=tokens,
        n_layer=cfg.n_layer,
        params_total=sizes.total(cfg.n_layer),
        params_per_block=sizes.block,
        params_resident=sizes.embed + sizes.head + r * sizes.block,
        budget_bytes=budget,
        memory=memory,
        peak_device_bytes=sum(memory.values()),
        host_bytes=q * _host_bytes(sizes, link, waves) + spilled_layers * m * btc * ACT_BYTES,
        layer_loads=loads,
        bytes_loaded=bytes_loaded,
        bytes_stored=bytes_stored,
        compute_s=compute_s,
        load_s=load_s,
        store_s=store_s,
        host_optimizer_s=host_opt_s,
        fill_s=fill_s,
        step_s=step_s,
        bottleneck=bottleneck,
        tokens_per_s=tokens / step_s,
        resident_step_s=resident_step_s,
        hardware=hw.to_dict(),
    )


def make_plan(
    shape: Shape,
    *,
    budget_bytes: int,
    hardware: Hardware,
    slots: int | None = None,
    micro_batches: int | None = None,
    resident_blocks: int | None = None,
    spill: bool | None = None,
    optimizer: Optimizer | None = None,
    graph_blocks: int | None = None,
    link: Link | None = None,
    host_budget_bytes: int | None = None,
    device_steps: int | None = None,
) -> SwapPlan:
    """The fastest plan per token that fits ``budget_bytes``; ``PlanError`` when none does.

    Among plans within 3% of the best time per token it takes the smallest M, then no spill,
    then the fp32 link, then the least device memory (so the host optimizer unless the
    device's is clearly faster). The 'split' optimizer steps the first swapped blocks on the
    device (their steps ride on the next forward's loads, when the host is still busy with the
    others: with clipping all host steps wait for the whole backward) and the rest on the host;
    ``device_steps`` fixes how many.
    Each plan keeps the graphs of as many blocks as its memory leaves room for.
    ``slots``, ``micro_batches``, ``resident_blocks``, ``spill``, ``optimizer``,
    ``graph_blocks`` and ``link`` fix a choice. With the host optimizer and a step that computes
    in bf16 (``shape.dtype_bytes == 2``) both links are weighed: bf16 halves the link's bytes
    but costs the host worker conversions; otherwise, and for the device optimizer (it steps
    fp32 masters in the slot), the link is fp32. ``host_budget_bytes`` bounds the
    swapped layers' host memory (``host_bytes``; several waves cost 4 B/parameter more).
    """
    cfg, g = shape.cfg, shape.grad_accum
    if cfg.n_layer < 2:
        raise PlanError(f"swapping needs at least 2 blocks, the model has {cfg.n_layer}")
    if cfg.dropout:
        raise PlanError("swapping recomputes layers in backward and needs dropout 0")
    if micro_batches is not None and g is not None and g % micro_batches:
        raise PlanError(f"M = {micro_batches} micro-batches must divide grad_accum {g}")
    if resident_blocks is not None and not 0 <= resident_blocks <= cfg.n_layer - 2:
        raise PlanError(
            f"resident_blocks must be in 0..{cfg.n_layer - 2} (at least 2 blocks are swapped), "
            f"got {resident_blocks}"
        )
    if graph_blocks is not None and not 0 <= graph_blocks <= cfg.n_layer:
        raise PlanError(f"graph_blocks must be in 0..{cfg.n_layer}, got {graph_blocks}")
    if slots is not None and not 2 <= slots <= cfg.n_layer:
        raise PlanError(f"slots (K) must be in 2..{cfg.n_layer}, got {slots}")
    if micro_batches is not None:
        ms: list[int] = [micro_batches]
    elif g is not None:
        ms = [d for d in range(1, g + 1) if g % d == 0]
    else:
        ms = list(FREE_M)
    rs = [resident_blocks] if resident_blocks is not None else list(range(cfg.n_layer - 1))
    ks = [slots] if slots is not None else list(range(2, min(MAX_SLOTS, cfg.n_layer) + 1))
    feasible: list[SwapPlan] = []
    smallest: SwapPlan | None = None
    too_big_for_host: SwapPlan | None = None
    spills = [spill] if spill is not None else [False, True]
    opts: list[Optimizer] = [optimizer] if optimizer is not None else ["host", "device", "split"]
    if link == "bf16" and optimizer in ("device", "split"):
        raise PlanError("the device optimizer steps fp32 masters: it needs an fp32 link")
    if device_steps is not None and optimizer not in (None, "split"):
        raise PlanError("device_steps goes with the 'split' optimizer")
    opts = [o for o in opts if not (link == "bf16" and o != "host")]

    def links_of(o: Optimizer) -> list[Link]:
        if link is not None:
            return [link]
        return ["fp32", "bf16"] if o == "host" and shape.dtype_bytes == 2 else ["fp32"]

    def splits(q: int) -> Sequence[int | None]:
        if device_steps is not None:
            if not 0 < device_steps < q:
                raise PlanError(f"device_steps must be in 1..{q - 1}, got {device_steps}")
            return [device_steps]
        return sorted({max(1, min(q - 1, round(q * f))) for f in SPLITS})

    for k, m, r, s, o in itertools.product(ks, ms, rs, spills, opts):
        q = cfg.n_layer - r
        if k > q:
            continue  # more slots than swapped blocks
        g_m = g if g is not None else m
        candidates = [
            (lk, n) for lk in links_of(o) for n in (splits(q) if o == "split" else [None])
        ]
        for lk, n in candidates:
            p = _evaluate(shape, hardware, budget_bytes, k, m, g_m, r, s, o, graph_blocks, lk, n)
            if host_budget_bytes is not None and p.host_bytes > host_budget_bytes:
                too_big_for_host = p
                continue
            if p.peak_device_bytes <= budget_bytes:
                feasible.append(p)
            elif smallest is None or p.peak_device_bytes < smallest.peak_device_bytes:
                smallest = p
    if not feasible and smallest is None and too_big_for_host is not None:
        big = too_big_for_host
        per_param = big.host_bytes / (big.swapped_blocks * big.params_per_block)
        raise PlanError(
            f"no swap plan fits {format_bytes(host_budget_bytes or 0)} of host memory: the "
            f"swapped layers need {format_bytes(big.host_bytes)} ({per_param:.0f} B/parameter). "
            "Use a machine with more memory or a smaller model."
        )
    if not feasible:
        assert smallest is not None
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in smallest.memory.items())
        raise PlanError(
            f"no swap plan fits {format_bytes(budget_bytes)} of device memory: the smallest "
            f"(K={smallest.slots}, M={smallest.micro_batches}, "
            f"{smallest.resident_blocks} resident blocks, spill "
            f"{'on' if smallest.spill else 'off'}, optimizer on the {smallest.optimizer}) needs "
            f"{format_bytes(smallest.peak_device_bytes)}"
            f" ({parts}). Raise the budget or lower the micro-batch size or sequence length."
        )
    best = min(p.step_s / p.tokens_per_step for p in feasible)
    near = [p for p in feasible if p.step_s / p.tokens_per_step <= best * NEAR_BEST]
    # Equally fast: the fp32 link keeps gradients exact and spares the host its conversions.
    return min(
        near,
        key=lambda p: (p.micro_batches, p.spill, p.link != "fp32", p.peak_device_bytes, p.slots),
    )


FREE_SLACK = 1.05
"""A plan whose step is within 5% of its compute counts as swapping for free."""


def free_from(shape: Shape, *, max_grad_accum: int = 4096, **choices: Any) -> SwapPlan | None:
    """The plan at the fewest tokens per step (grad_accum doubled from the shape's) whose
    transfers and host optimizer hide behind its compute (step within ``FREE_SLACK`` of
    compute), with the same budget and choices; None when none does up to
    ``max_grad_accum`` micro-batches."""
    g = shape.grad_accum or 1
    while g <= max_grad_accum:
        try:
            plan = make_plan(replace(shape, grad_accum=g), **choices)
        except PlanError:
            return None
        if plan.step_s <= FREE_SLACK * plan.compute_s:
            return plan
        g *= 2
    return None
