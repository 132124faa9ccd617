"""``atomd plan``: what swapped training of a model would choose, and the options it shares
with ``atomd bench swap`` (named as the job spec's swap settings, as in ``atomd train``)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any, cast

import typer

from atomd.cli.common import fail, renaming, spec_help

if TYPE_CHECKING:
    from atomd.swap.plan import Link, Optimizer

# The spellings these options had before they took the job spec's names.
RENAMED_SWAP_OPTIONS = {
    "--slots": "--swap-slots",
    "--micro-batches": "--swap-micro-batches",
    "--resident-blocks": "--swap-resident-blocks",
    "--optimizer": "--swap-optimizer",
    "--device-steps": "--swap-device-steps",
    "--graph-blocks": "--swap-graph-blocks",
    "--link": "--swap-link",
}

SlotsOpt = Annotated[int | None, typer.Option(help=spec_help("swap_slots"))]
MicroBatchesOpt = Annotated[int | None, typer.Option(help=spec_help("swap_micro_batches"))]
SwapOptimizerOpt = Annotated[str | None, typer.Option(help=spec_help("swap_optimizer"))]
DeviceStepsOpt = Annotated[int | None, typer.Option(min=1, help=spec_help("swap_device_steps"))]
GraphBlocksOpt = Annotated[int | None, typer.Option(help=spec_help("swap_graph_blocks"))]
LinkOpt = Annotated[str | None, typer.Option(help=spec_help("swap_link"))]


def _one_of(flag: str, value: str | None, allowed: tuple[str, ...]) -> str | None:
    """``value`` if it is one of ``allowed`` ('auto' means the planner's choice: None)."""
    if value is None or value == "auto":
        return None
    if value not in allowed:
        fail(f"{flag} must be {', '.join(('auto', *allowed[:-1]))} or {allowed[-1]}, not {value!r}")
    return value


def link_choice(value: str | None) -> Link | None:
    return cast("Link | None", _one_of("--swap-link", value, ("bf16", "fp32")))


def optimizer_choice(value: str | None) -> Optimizer | None:
    choices = ("host", "device", "split")
    return cast("Optimizer | None", _one_of("--swap-optimizer", value, choices))


def plan(
    preset: Annotated[str, typer.Option(help=spec_help("preset"))] = "gpt3-6.7b",
    gpu_mem: Annotated[
        str | None,
        typer.Option(help="Device-memory budget, e.g. 24GiB (default: this GPU's, else 24GiB)."),
    ] = None,
    micro_batch_size: Annotated[int, typer.Option(help="Sequences per micro-batch.")] = 1,
    seq_len: Annotated[
        int | None, typer.Option(help="Tokens per sequence (default: the preset's context).")
    ] = None,
    grad_accum: Annotated[
        int | None,
        typer.Option(help="Micro-batches per step (default: the planner picks M, one wave)."),
    ] = None,
    swap_slots: SlotsOpt = None,
    swap_micro_batches: MicroBatchesOpt = None,
    swap_resident_blocks: Annotated[
        int | None, typer.Option(help=spec_help("swap_resident_blocks"))
    ] = None,
    swap_optimizer: SwapOptimizerOpt = None,
    swap_device_steps: DeviceStepsOpt = None,
    swap_graph_blocks: GraphBlocksOpt = None,
    swap_link: LinkOpt = None,
    measure: Annotated[
        bool, typer.Option("--measure", help="Measure this machine's GPU rates (needs CUDA).")
    ] = False,
    clip: Annotated[
        bool,
        typer.Option(
            "--clip/--no-clip",
            help="Whether steps clip the gradient norm (the job spec's default, grad_clip 1.0): "
            "host AdamW steps then wait for the whole backward.",
        ),
    ] = True,
    simulate: Annotated[
        bool,
        typer.Option(
            "--simulate",
            help="Also run the plan's schedule on a stand-in model on the CPU, record every "
            "copy, compute and host task it issues, check it and replay it at these rates: "
            "simulated step time and critical path.",
        ),
    ] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """Plan swapped training: K slots, M micro-batches per visit, resident set, predictions,
    and the tokens per step from which swapping costs nothing."""
    from atomd.errors import PlanError
    from atomd.model.presets import get_preset
    from atomd.swap import hardware
    from atomd.swap.plan import Shape, free_from, make_plan
    from atomd.swap.report import format_plan
    from atomd.units import parse_bytes

    try:
        cfg = get_preset(preset)
        budget = parse_bytes(gpu_mem) if gpu_mem is not None else None
    except ValueError as e:
        fail(str(e))
    import torch

    cuda = torch.cuda.is_available()
    if measure and not cuda:
        fail("--measure needs a CUDA device; without one the planner uses stated assumptions")
    hw = hardware.measure(torch.device("cuda")) if measure else hardware.assumed()
    if budget is None:
        budget = torch.cuda.get_device_properties(0).total_memory if cuda else 24 * 2**30
    shape = Shape(
        cfg=cfg,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len or cfg.block_size,
        grad_accum=grad_accum,
        dtype_bytes=2,
        grad_clip=clip,
    )
    choices: dict[str, Any] = {
        "budget_bytes": budget,
        "hardware": hw,
        "slots": swap_slots,
        "micro_batches": swap_micro_batches,
        "resident_blocks": swap_resident_blocks,
        "optimizer": optimizer_choice(swap_optimizer),
        "device_steps": swap_device_steps,
        "graph_blocks": swap_graph_blocks,
        "link": link_choice(swap_link),
    }
    try:
        result = make_plan(shape, **choices)
    except PlanError as e:
        fail(str(e))
    free = free_from(shape, **(choices | {"micro_batches": None}))
    out: dict[str, Any] = {"preset": preset, **result.to_dict()}
    out["free_from_tokens_per_step"] = free.tokens_per_step if free else None
    text = format_plan(result, preset=preset, free=free)
    if simulate:
        from atomd.swap.record import check_schedule
        from atomd.swap.rehearse import rehearse
        from atomd.swap.report import format_simulation

        recorder, sim = rehearse(result, shape, hw, steps=2)
        problems = check_schedule(recorder)
        out["simulation"] = sim.summary() | {"schedule_problems": problems}
        text += "\n\n" + format_simulation(sim, problems, predicted_s=result.step_s)
    typer.echo(json.dumps(out, indent=2) if json_out else text)


def register(app: typer.Typer) -> None:
    app.command(cls=renaming(RENAMED_SWAP_OPTIONS))(plan)
