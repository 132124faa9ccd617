"""``atomd bench ...``: benchmarks that each print what they measured in one run as JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from atomd.cli.common import DeviceOpt, fail, renaming, spec_help
from atomd.cli.planning import (
    RENAMED_SWAP_OPTIONS,
    DeviceStepsOpt,
    GraphBlocksOpt,
    LinkOpt,
    MicroBatchesOpt,
    SlotsOpt,
    SwapOptimizerOpt,
    link_choice,
    optimizer_choice,
)

NO_BENCH = "atomd bench needs the bench/ package (a source checkout or `pip install -e .`)"

bench_app = typer.Typer(
    help="Benchmarks: each prints what it measured in one run as JSON.",
    no_args_is_help=True,
    rich_markup_mode=None,
)


@bench_app.command("swap", cls=renaming(RENAMED_SWAP_OPTIONS))
def bench_swap(
    preset: Annotated[str, typer.Option(help=spec_help("preset"))] = "tiny",
    device: DeviceOpt = "auto",
    micro_batch_size: Annotated[int, typer.Option(help="Sequences per micro-batch.")] = 8,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = 64,
    grad_accum: Annotated[int, typer.Option(help="Micro-batches per step.")] = 4,
    steps: Annotated[int, typer.Option(help="Timed optimizer steps (after one warm-up).")] = 4,
    swap_slots: SlotsOpt = None,
    swap_micro_batches: MicroBatchesOpt = None,
    swap_resident_blocks: Annotated[
        int, typer.Option(help="Blocks kept on the device (default 0: swap every block).")
    ] = 0,
    gpu_mem: Annotated[str | None, typer.Option(help="Device-memory budget, e.g. 8GiB.")] = None,
    swap_optimizer: SwapOptimizerOpt = None,
    swap_device_steps: DeviceStepsOpt = None,
    swap_graph_blocks: GraphBlocksOpt = None,
    swap_link: LinkOpt = None,
    resident: Annotated[
        bool,
        typer.Option(
            help="Also train resident for the ratio and the parameter diff (--no-resident: "
            "the swapped run alone, e.g. a model whose resident run would take minutes)."
        ),
    ] = True,
    grad_clip: Annotated[
        float | None,
        typer.Option(
            min=0,
            help="Gradient-norm clipping (default: the job spec's 1.0); 0 lets the host AdamW "
            "step each layer as its gradient completes instead of after the whole backward.",
        ),
    ] = None,
    also_grad_clip: Annotated[
        list[float] | None,
        typer.Option(
            min=0,
            help="Train the same steps again on the same swapped engine with this clipping "
            "threshold (repeatable; 0: none), timed and predicted apart ('other_clipping').",
        ),
    ] = None,
    profile: Annotated[
        Path | None,
        typer.Option(
            help="Folder for a torch.profiler trace of 2 more swapped steps; the JSON gets its "
            "summary: busy and overlap seconds of compute, loads and stores."
        ),
    ] = None,
    trace: Annotated[
        Path | None,
        typer.Option(
            help="Record 2 more swapped steps (every copy, compute segment and host task with "
            "what it waited for), replay them at the measured rates and write both to this "
            "JSON file; the output gets the simulated step times and critical path."
        ),
    ] = None,
    host_threads: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="torch's intra-op threads for this run (default: torch's): fewer than the cores "
            "leaves one for the thread that issues the device's work beside the host AdamW.",
        ),
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="One line of JSON.")] = False,
) -> None:
    """Train the same steps resident and swapped; print throughput, ratio and parameter diff."""
    if profile is not None and profile.exists() and not profile.is_dir():
        fail(f"--profile {profile}: exists and is not a folder")
    try:
        from atomd_bench.swap import run as run_swap_bench
    except ImportError:
        fail(NO_BENCH)
    result = run_swap_bench(
        preset=preset,
        device=device,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        grad_accum=grad_accum,
        steps=steps,
        slots=swap_slots,
        micro_batches=swap_micro_batches,
        resident_blocks=swap_resident_blocks,
        gpu_mem=gpu_mem,
        optimizer=optimizer_choice(swap_optimizer),
        device_steps=swap_device_steps,
        graph_blocks=swap_graph_blocks,
        link=link_choice(swap_link),
        resident=resident,
        grad_clip=grad_clip,
        also_grad_clip=also_grad_clip,
        profile=profile,
        trace=trace,
        host_threads=host_threads,
    )
    typer.echo(json.dumps(result) if json_out else json.dumps(result, indent=2))


@bench_app.command("sync")
def bench_sync(
    quick: Annotated[
        bool, typer.Option("--quick", help="A smoke test: fewer, smaller steps (under a minute).")
    ] = False,
    runs: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated run names (default: the default selection; "
            "`python -m atomd_bench.sync --list` lists every run)."
        ),
    ] = None,
    workers: Annotated[
        int, typer.Option(help="Processes of one thread each; 0 runs in this process.")
    ] = 2,
    sync: Annotated[
        str | None,
        typer.Option(
            help="Sync settings every swarm run takes over its own, as JSON (e.g. "
            "'{\"swarm_adam\": false}': each peer's own AdamW)."
        ),
    ] = None,
    seed: Annotated[
        int | None,
        typer.Option(
            help="Another draw of the task: initial weights, batch order, delays (default 0); "
            "the validation windows stay the same."
        ),
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="One line of JSON.")] = False,
) -> None:
    """Simulated 4-peer swarms on the tiny GPT: val loss, bytes per round, anchor divergence."""
    try:
        from atomd_bench.sync import run as run_sync_bench
    except ImportError:
        fail(NO_BENCH)
    try:
        extra = json.loads(sync) if sync else None
    except json.JSONDecodeError as e:
        fail(f"--sync is not JSON: {e}")
    try:
        result = run_sync_bench(
            quick=quick,
            runs=runs.split(",") if runs else None,
            workers=workers,
            sync=extra,
            seed=seed,
        )
    except ValueError as e:
        fail(str(e))
    typer.echo(json.dumps(result) if json_out else json.dumps(result, indent=2))


@bench_app.command("swarm")
def bench_swarm(
    quick: Annotated[
        bool, typer.Option("--quick", help="A smoke test: 3 peers, 150 small steps.")
    ] = False,
    peers: Annotated[int | None, typer.Option(help="Daemons in the swarm (default 4).")] = None,
    scenarios: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated: unlimited, upload-1mbit, upload-256kbit, sigkill (default: all)."
        ),
    ] = None,
    every: Annotated[
        str | None, typer.Option(help="sync.every of the job: auto (default) or a number.")
    ] = None,
    steps: Annotated[int | None, typer.Option(help="Steps per peer (default 600).")] = None,
    network: Annotated[
        str, typer.Option(help="auto (namespaces as root, else loopback), netns or loopback.")
    ] = "auto",
    references: Annotated[
        bool, typer.Option(help="Also train one peer alone and one large-batch process.")
    ] = True,
    keep: Annotated[
        Path | None, typer.Option(help="Keep the daemons' folders and logs here.")
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="One line of JSON.")] = False,
) -> None:
    """Real daemons train together (each in its own network namespace as root): val loss
    against one peer alone and one large-batch process, bytes on the wire, cadence, waits."""
    try:
        from atomd_bench.swarm import run as run_swarm_bench
    except ImportError:
        fail(NO_BENCH)
    if network not in ("auto", "netns", "loopback"):
        fail(f"--network {network}: expected auto, netns or loopback")
    every_value: int | str | None = every
    if every is not None and every != "auto":
        if not every.isdigit() or int(every) < 1:
            fail(f"--every {every}: expected auto or a number >= 1")
        every_value = int(every)
    try:
        result = run_swarm_bench(
            quick=quick, peers=peers, scenarios=scenarios.split(",") if scenarios else None,
            every=every_value, steps=steps, network=network, references=references, root=keep,
        )  # fmt: skip
    except (ValueError, RuntimeError) as e:
        fail(str(e))
    typer.echo(json.dumps(result) if json_out else json.dumps(result, indent=2))
