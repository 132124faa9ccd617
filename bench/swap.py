"""The swap engine against resident training, in one run: the same optimizer steps on the same
batches from the same seed, resident (skipped, and said so, when it cannot fit) then swapped.

Prints throughput of both, their ratio, how far the two runs' parameters ended apart, the
swapped run's peak device memory and bytes loaded per step, and the planner's prediction.
With a profile folder, a few more swapped steps run under torch.profiler, untimed by the
throughput figures: the trace lands there and its summary (``atomd_bench.profile``) in the JSON.
"""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path
from typing import Any

import torch

from atomd.data.dataset import Batch, load_dataset
from atomd.devices import resolve_device
from atomd.engine_choice import optim_config
from atomd.logs import get_logger
from atomd.model.gpt import GPT, GPTConfig
from atomd.model.presets import get_preset
from atomd.spec import JobSpec, lr_at
from atomd.swap import hardware
from atomd.swap.compare import max_rel_param_diff
from atomd.swap.engine import SwapEngine
from atomd.swap.plan import Link, Optimizer, make_plan, resident_peak_bytes
from atomd.swap.planning import device_budget, plan_for, shape_for
from atomd.swap.record import check_schedule
from atomd.swap.trace import Costs, simulate
from atomd.swap.trace import write as write_trace
from atomd.train.step_engine import ResidentEngine, StepEngine
from atomd.units import format_bytes
from atomd_bench.profile import read_trace, summarize, write_gz

log = get_logger("atomd.bench.swap")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # timing only: the engines themselves never synchronize the device
        torch.cuda.synchronize(device)


def _train(
    engine: StepEngine, steps: list[list[Batch]], lrs: list[float], device: torch.device
) -> tuple[float, float]:
    """One untimed warm-up step, then the rest timed: (seconds, last loss)."""
    name = type(engine).__name__
    t0 = time.perf_counter()
    loss = engine.train_step(steps[0], lrs[0])
    engine.settle()  # the warm-up's host optimizer work stays out of the timed steps
    _sync(device)
    log.info("%s: warm-up step in %.2f s, loss %.4f", name, time.perf_counter() - t0, loss)
    t0 = time.perf_counter()
    for i, (batches, lr) in enumerate(zip(steps[1:], lrs[1:], strict=True)):
        loss = engine.train_step(batches, lr)
        log.info(
            "%s: step %d/%d, %.2f s in all", name, i + 1, len(steps) - 1, time.perf_counter() - t0
        )
    engine.settle()  # the last step's optimizer work counts too
    _sync(device)
    return time.perf_counter() - t0, loss


def _profile(
    engine: StepEngine,
    steps: list[list[Batch]],
    lrs: list[float],
    device: torch.device,
    out_dir: Path,
) -> dict[str, Any]:
    """Train ``steps`` more under torch.profiler; the trace goes to ``out_dir`` (gzipped) and
    its summary (busy and overlap seconds of compute, loads, stores) is returned."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    out_dir.mkdir(parents=True, exist_ok=True)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for batches, lr in zip(steps, lrs, strict=True):
            engine.train_step(batches, lr)
        engine.settle()
        _sync(device)
        wall = time.perf_counter() - t0
    raw = out_dir / "swap-trace.json"
    prof.export_chrome_trace(str(raw))
    summary = summarize(read_trace(raw), len(steps))
    # Host-side time per operator and CUDA runtime call: a call that should be asynchronous
    # but blocks (a copy, an event wait) shows up here with milliseconds per call.
    averages = prof.key_averages()
    summary["host_calls"] = {
        e.key: {"count": e.count, "self_cpu_s": round(e.self_cpu_time_total / 1e6, 4)}
        for e in sorted(averages, key=lambda e: -e.self_cpu_time_total)[:40]
    }
    summary["wall_s"] = round(wall, 4)
    write_gz(raw, out_dir / "swap-trace.json.gz")
    summary["trace"] = str(out_dir / "swap-trace.json.gz")
    return summary


def _params(engine: StepEngine) -> dict[str, torch.Tensor]:
    """References, not copies: a 6.7B model's copy would not fit in host memory beside the
    swapped run's masters and moments (the resident run's stay on its device until compared)."""
    return {k: v.detach() for k, v in engine.model_tensors().items()}


def _model(cfg: GPTConfig, dev: torch.device) -> GPT:
    """The model from seed 0, initialized on ``dev``: a 6.7B model's init on the CPU took over
    a minute; on the GPU it takes a moment, and both runs draw the same numbers."""
    torch.manual_seed(0)
    with torch.device(dev):
        return GPT(cfg)


def _free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _resident(
    cfg: GPTConfig,
    spec: JobSpec,
    dev: torch.device,
    batches: list[list[Batch]],
    lrs: list[float],
    *,
    recompute: bool,
) -> tuple[float, float, ResidentEngine]:
    """(seconds, last loss, engine) of resident training, all blocks recomputed or none."""
    t0 = time.perf_counter()
    engine = ResidentEngine(_model(cfg, dev), optim_config(spec), dev, recompute=recompute)
    log.info("resident engine (recompute %s) built in %.1f s", recompute, time.perf_counter() - t0)
    seconds, loss = _train(engine, batches, lrs, dev)
    return seconds, loss, engine


def run(
    preset: str = "tiny",
    device: str = "cpu",
    micro_batch_size: int = 8,
    seq_len: int = 64,
    grad_accum: int = 4,
    steps: int = 4,
    slots: int | None = None,
    micro_batches: int | None = None,
    resident_blocks: int | None = 0,
    gpu_mem: str | None = None,
    optimizer: Optimizer | None = None,
    device_steps: int | None = None,
    graph_blocks: int | None = None,
    link: Link | None = None,
    resident: bool = True,
    grad_clip: float | None = None,
    also_grad_clip: list[float] | None = None,
    profile: Path | None = None,
    profile_steps: int = 2,
    trace: Path | None = None,
    host_threads: int | None = None,
) -> dict[str, Any]:
    """See the module docstring. ``also_grad_clip``: the same swapped engine trains the same
    steps again with each of these clipping thresholds (0: none), timed and predicted apart."""
    dev = resolve_device(device)
    if host_threads is not None:  # the host optimizer's intra-op threads (and every CPU op's)
        torch.set_num_threads(host_threads)
    spec = JobSpec(
        preset=preset,
        seq_len=seq_len,
        micro_batch_size=micro_batch_size,
        grad_accum=grad_accum,
        max_steps=steps + 1,
        swap="on",
        gpu_mem=gpu_mem,
        swap_slots=slots,
        swap_micro_batches=micro_batches,
        swap_resident_blocks=resident_blocks,
        swap_optimizer=optimizer or "auto",
        swap_device_steps=device_steps,
        swap_graph_blocks=graph_blocks,
        swap_link=link or "auto",
        **({} if grad_clip is None else {"grad_clip": grad_clip}),
    )
    cfg = get_preset(preset)
    data = load_dataset(spec.data, seq_len=seq_len)
    batches = [
        [
            data.train_batch(seed=0, step=s, micro=m, batch_size=micro_batch_size)
            for m in range(grad_accum)
        ]
        for s in range(steps + 1)
    ]
    # The schedule's first steps (warm-up): the preset's peak rate from a fresh init diverges.
    lrs = [lr_at(spec, s) for s in range(steps + 1)]
    tokens = steps * spec.tokens_per_step
    out: dict[str, Any] = {
        "preset": preset,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "micro_batch_size": micro_batch_size,
        "seq_len": seq_len,
        "grad_accum": grad_accum,
        "steps": steps,
        "threads": torch.get_num_threads(),
        "grad_clip": spec.grad_clip,
        # max_rel_param_diff is relative to the parameters themselves, after steps this small
        "lrs": [round(lr, 8) for lr in lrs],
        "load_average": os.getloadavg(),
    }

    # The plan first: whether the swapped run recomputes decides the second reference.
    whole = device_budget(spec.model_copy(update={"gpu_mem": None}), dev)
    hw = hardware.measure(dev)
    need = resident_peak_bytes(shape_for(spec, dev))
    resident_params: dict[str, torch.Tensor] | None = None
    resident_tps: float | None = None
    resident_loss: float | None = None
    fits = dev.type != "cuda" or need <= whole
    if not resident:
        out["resident_skipped"] = "--no-resident"
    elif not fits:
        out["resident_skipped"] = (
            f"resident training needs about {format_bytes(need)}, more than the device's "
            f"{format_bytes(whole)}"
        )
    if resident:
        # Resident training with every block recomputed, as the swapped run recomputes (also
        # when plain resident training does not fit): the reference with the same compute.
        planned = plan_for(spec, dev, hw)
        if planned.graph_blocks < cfg.n_layer:
            seconds, _, engine = _resident(cfg, spec, dev, batches, lrs, recompute=True)
            out["resident_recompute_tokens_per_s"] = round(tokens / seconds, 1)
            del engine
            _free(dev)
    if resident and fits:
        seconds, resident_loss, engine = _resident(cfg, spec, dev, batches, lrs, recompute=False)
        resident_tps = tokens / seconds
        resident_params = _params(engine)
        del engine
        _free(dev)

    baseline = 0  # the resident run's parameters, kept on the device for the comparison
    plan_spec = spec
    if dev.type == "cuda":
        baseline = torch.cuda.memory_allocated(dev)
        if spec.gpu_mem is None and baseline:  # the swapped run gets what they leave
            plan_spec = spec.model_copy(update={"gpu_mem": whole - baseline})
    plan = plan_for(plan_spec, dev, hw)
    t0 = time.perf_counter()
    swapped = SwapEngine(_model(cfg, dev), optim_config(spec), dev, plan)
    log.info("swap engine built in %.1f s", time.perf_counter() - t0)
    _free(dev)  # the device copy of the swapped blocks the model was initialized in
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    # ATOMD_SYNC_DEBUG=1: torch warns at every call that synchronizes the device (the engine
    # should make none but the loss it returns and, when clipping, the clipping coefficient).
    sync_debug = dev.type == "cuda" and os.environ.get("ATOMD_SYNC_DEBUG") == "1"
    if sync_debug:
        torch.cuda.set_sync_debug_mode("warn")
    seconds, loss = _train(swapped, batches, lrs, dev)
    if sync_debug:
        torch.cuda.set_sync_debug_mode("default")
    swapped_tps = tokens / seconds
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated(dev) - baseline
        source = "torch.cuda.max_memory_allocated, less the resident run's parameters"
    else:
        peak = swapped.device_state_bytes() + swapped.stats.peak_held_bytes
        source = "accounted: slots, resident state and activations held between layers"
    diff = (
        max_rel_param_diff(_params(swapped), resident_params)
        if resident_params is not None
        else None
    )
    stats = swapped.stats
    recompute_tps = out.get("resident_recompute_tokens_per_s")
    variants = []
    for clip in also_grad_clip or []:  # the same engine, another clipping threshold
        clipped = spec.model_copy(update={"grad_clip": clip})
        swapped.optim = optim_config(clipped)
        shape = shape_for(clipped, dev)
        v_seconds, _ = _train(swapped, batches, lrs, dev)
        v_tps = tokens / v_seconds
        predicted = make_plan(
            shape,
            budget_bytes=plan.budget_bytes,
            hardware=hw,
            slots=plan.slots,
            micro_batches=plan.micro_batches,
            resident_blocks=plan.resident_blocks,
            spill=plan.spill,
            optimizer=plan.optimizer,
            device_steps=plan.device_steps,
            graph_blocks=plan.graph_blocks,
            link=plan.link,
        )
        variants.append(
            {
                "grad_clip": clip,
                "swapped_tokens_per_s": round(v_tps, 1),
                "ratio": round(v_tps / resident_tps, 3) if resident_tps else None,
                "ratio_to_recompute": round(v_tps / recompute_tps, 3) if recompute_tps else None,
                "predicted_step_s": predicted.step_s,
                "measured_step_s": round(spec.tokens_per_step / v_tps, 4),
                "predicted_bound": predicted.bottleneck,
            }
        )
    swapped.optim = optim_config(spec)
    if trace is not None:  # 2 more steps recorded, replayed at the measured rates
        with swapped.recording() as recorder:
            for batches_, lr in zip(batches[1:3], lrs[1:3], strict=True):
                swapped.train_step(batches_, lr)
        swapped.settle()
        costs = Costs(shape_for(spec, dev), plan, hw)
        sim = simulate(recorder.events, costs)
        write_trace(trace, recorder, sim, costs)
        out["trace"] = {"file": str(trace), **sim.summary(last=6)}
        out["trace"]["schedule_problems"] = check_schedule(recorder)
    if profile is not None:  # after the comparison: these steps move the parameters on
        out["profile"] = _profile(
            swapped, batches[1 : 1 + profile_steps], lrs[1 : 1 + profile_steps], dev, profile
        )
    swapped.close()
    out.update(
        {
            "resident_tokens_per_s": round(resident_tps, 1) if resident_tps else None,
            "swapped_tokens_per_s": round(swapped_tps, 1),
            "ratio": round(swapped_tps / resident_tps, 3) if resident_tps else None,
            "ratio_to_recompute": round(swapped_tps / recompute_tps, 3) if recompute_tps else None,
            "measured_step_s": round(spec.tokens_per_step / swapped_tps, 4),
            "max_rel_param_diff": diff,
            "final_loss": round(loss, 4),
            "resident_final_loss": round(resident_loss, 4) if resident_loss is not None else None,
            "peak_device_bytes": int(peak),
            "peak_device_bytes_source": source,
            "bytes_loaded_per_step": stats.bytes_loaded,
            "bytes_stored_per_step": stats.bytes_stored,
            "layer_loads_per_step": stats.layer_loads,
            "other_clipping": variants,
            "plan": {
                "slots": plan.slots,
                "micro_batches": plan.micro_batches,
                "resident_blocks": plan.resident_blocks,
                "spill": plan.spill,
                "optimizer": plan.optimizer,
                "device_steps": plan.steps_on_device,
                "graph_blocks": plan.graph_blocks,
                "link": plan.link,
                "host_bytes": plan.host_bytes,
                "predicted_tokens_per_s": round(plan.tokens_per_s, 1),
                "predicted_step_s": plan.step_s,
                "predicted_bound": plan.bottleneck,
                "predicted_peak_device_bytes": plan.peak_device_bytes,
                "predicted_bytes_loaded_per_step": plan.bytes_loaded,
                "rates": plan.hardware,
            },
        }
    )
    return out
