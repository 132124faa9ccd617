"""A swap plan as a readable table (``atomd plan``)."""

from __future__ import annotations

from atomd.swap.plan import SwapPlan
from atomd.swap.trace import Simulation
from atomd.units import format_bytes

_MEMORY_LABELS = {
    "resident_state": "resident state (16 B/param)",
    "slots": "layer slots (weights + grads)",
    "saved_inputs": "saved layer inputs",
    "kept_graphs": "kept forward graphs",
    "flowing": "activations in flight",
    "working": "working set of one layer",
    "reserve": "reserve",
}


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB"


_OPTIMIZER = {
    "host": "host (fused AdamW on a worker thread)",
    "device": "device (AdamW as the layer is next loaded)",
    "split": "split: the first {n} layers on the device, the rest on the host",
}
_STORED = {"host": "gradients", "device": "grads, state", "split": "grads, state"}
_LINK = {
    "bf16": "bf16 matrices (copies of the fp32 masters), fp32 vectors",
    "fp32": "fp32 weights and gradients",
}


def format_plan(plan: SwapPlan, *, preset: str, free: SwapPlan | None = None) -> str:
    """The plan in three short tables: choices, device memory, time per optimizer step."""
    hw = plan.hardware
    overlap, duplex = hw.get("copy_compute_overlap", 1.0), hw.get("duplex", 1.0)
    resident = "embedding + head (tied)"
    if plan.resident_blocks == 1:
        resident += " + block 0"
    elif plan.resident_blocks:
        resident += f" + blocks 0..{plan.resident_blocks - 1}"
    rows = [
        f"atomd plan: {preset} ({plan.params_total / 1e9:.2f}B parameters), micro-batch "
        f"{plan.micro_batch_size} x {plan.seq_len} tokens, device budget "
        f"{format_bytes(plan.budget_bytes)}",
        f"rates: {hw['source']}"
        + (
            f"; copies hide behind compute {overlap:.0%}, the two directions overlap {duplex:.0%}"
            if min(overlap, duplex) < 1
            else ""
        ),
        "",
        f"  {'slots (K)':<36}{plan.slots}",
        f"  {'micro-batches per layer visit (M)':<36}{plan.micro_batches}",
        f"  {'gradient accumulation':<36}{plan.grad_accum} ({plan.waves} wave(s) per step)",
        f"  {'resident on the device':<36}{resident}",
        f"  {'swapped':<36}{plan.swapped_blocks} blocks x {plan.params_per_block / 1e6:.1f}M "
        f"params ({_gb(4 * plan.params_per_block)} fp32 each)",
        f"  {'saved layer inputs':<36}{'spilled to host memory' if plan.spill else 'on device'}",
        f"  {'blocks not recomputed':<36}{plan.graph_blocks} of {plan.n_layer} "
        "(forward graph kept until backward)",
        f"  {'optimizer of swapped layers':<36}"
        + _OPTIMIZER[plan.optimizer].format(n=plan.steps_on_device),
        f"  {'over the link':<36}{_LINK[plan.link]}",
        "",
        f"  {'device memory':<36}{'predicted':>12}",
    ]
    for key, value in plan.memory.items():
        rows.append(f"    {_MEMORY_LABELS.get(key, key):<34}{format_bytes(value):>12}")
    rows += [
        f"    {'peak':<34}{format_bytes(plan.peak_device_bytes):>12}"
        f"  of {format_bytes(plan.budget_bytes)}",
        f"  {'host memory':<36}{format_bytes(plan.host_bytes):>12}"
        f"  ({plan.host_bytes / max(1, plan.swapped_blocks * plan.params_per_block):.0f} B/param"
        " of swapped blocks + spill buffers)",
        "",
        f"  {'per optimizer step':<36}{'bytes':>12}{'seconds':>10}",
        f"    {'tokens':<34}{plan.tokens_per_step:>12,}",
        f"    {'host -> device (' + str(plan.layer_loads) + ' layer loads)':<34}"
        f"{_gb(plan.bytes_loaded):>12}{plan.load_s:>10.3f}",
        f"    {'device -> host (' + _STORED[plan.optimizer] + ')':<34}"
        f"{_gb(plan.bytes_stored):>12}{plan.store_s:>10.3f}",
        f"    {'compute (with recomputes)':<34}{'':>12}{plan.compute_s:>10.3f}",
        f"    {'host AdamW (+ bf16 copies, sums)':<34}{'':>12}{plan.host_optimizer_s:>10.3f}",
        f"    {'pipeline fill':<34}{'':>12}{plan.fill_s:>10.3f}",
        f"    {'step (bound: ' + plan.bottleneck + ')':<34}{'':>12}{plan.step_s:>10.3f}",
        f"  {'predicted throughput':<36}{plan.tokens_per_s:,.0f} tokens/s "
        f"({plan.resident_step_s / plan.step_s:.2f} x resident training's compute-bound rate)",
    ]
    if free is not None and free.tokens_per_step == plan.tokens_per_step:
        rows.append(f"  {'swapping is free':<36}at this batch: the step is its compute")
    elif free is not None:
        rows.append(
            f"  {'swapping is free from':<36}{free.tokens_per_step:,} tokens per step "
            f"(grad_accum {free.grad_accum}, M={free.micro_batches}: transfers and host "
            f"AdamW hide behind compute, {free.tokens_per_s:,.0f} tokens/s)"
        )
    else:
        rows.append(f"  {'swapping is free':<36}not within 4096 micro-batches per step")
    return "\n".join(rows)


def format_simulation(sim: Simulation, problems: list[str], *, predicted_s: float) -> str:
    """``atomd plan --simulate``: the recorded schedule replayed at the plan's rates."""
    summary = sim.summary(last=8)
    steps = ", ".join(f"{s:.3f}" for s in summary["step_s"])
    rows = [
        "simulated (the plan's schedule recorded on a stand-in model, replayed at these rates)",
        f"  {'steps (s)':<36}{steps}  (planner: {predicted_s:.3f})",
        "  busy (s): " + ", ".join(f"{k} {v:.3f}" for k, v in summary["busy_s"].items()),
        "  critical path (s): "
        + ", ".join(f"{k} {v:.3f}" for k, v in summary["critical_path_s_by_lane"].items()),
        "  its last links:",
    ]
    for link in summary["critical_path_tail"]:
        rows.append(
            f"    {link['start']:>9.4f} {link['finish']:>9.4f}  {link['work']}"
            f" (held by: {link['held_by']})"
        )
    rows.append(
        "  schedule check: "
        + (
            "loads wait only for their slot's compute, stores never for loads"
            if not problems
            else f"{len(problems)} problem(s): " + "; ".join(problems[:3])
        )
    )
    return "\n".join(rows)
