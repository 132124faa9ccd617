"""The ``atomd`` command line."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, cast

import typer
from pydantic import ValidationError

from atomd import __version__
from atomd.errors import AtomdError
from atomd.logs import setup_logging

if TYPE_CHECKING:
    from atomd.swap.plan import Link, Optimizer

app = typer.Typer(
    name="atomd",
    help=(
        "atomd: train large language models together on ordinary machines.\n\n"
        "Each host runs the daemon (`atomd run`); `atomd train` trains one model in one process."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain help: rich's panels print boolean flags as `--zeroconf / --no-zeroconf <bool>`.
    rich_markup_mode=None,
)

# Points asked of a daemon at a time when plotting a job (the API's largest page).
PROGRESS_PAGE = 10000

DeviceOpt = Annotated[
    str,
    typer.Option("--device", help="auto (CUDA if present), cpu or cuda.", envvar="ATOMD_DEVICE"),
]


def fail(message: str, code: int = 2) -> NoReturn:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _spec_from(spec_file: Path | None, overrides: dict[str, Any]) -> Any:
    from atomd.spec import JobSpec

    base: dict[str, Any] = {}
    if spec_file is not None:
        try:
            base = json.loads(spec_file.read_text())
        except OSError as e:
            fail(f"cannot read job spec {spec_file}: {e.strerror or e}")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            fail(f"job spec {spec_file} is not valid JSON: {e}")
        if not isinstance(base, dict):
            fail(f"job spec {spec_file} must be a JSON object")
    base.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return JobSpec(**base)
    except ValidationError as e:
        lines = [
            f"  {'.'.join(map(str, err['loc'])) or 'spec'}: {err['msg']}" for err in e.errors()
        ]
        fail("invalid job spec:\n" + "\n".join(lines))


@app.command()
def train(
    preset: Annotated[str | None, typer.Option(help="Model preset (see `atomd presets`).")] = None,
    data: Annotated[
        str | None,
        typer.Option(
            help="'shakespeare' (bundled), a .txt file, a folder of text, or .bin tokens."
        ),
    ] = None,
    max_steps: Annotated[int | None, typer.Option(help="Optimizer steps to train.")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="Stop after this many tokens.")] = None,
    out: Annotated[Path, typer.Option(help="Output folder: metrics.jsonl, checkpoints/.")] = Path(
        "runs/train"
    ),
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue from the newest good checkpoint in --out.")
    ] = False,
    device: DeviceOpt = "auto",
    seed: Annotated[int | None, typer.Option(help="Seed for init and data order.")] = None,
    micro_batch_size: Annotated[int | None, typer.Option(help="Sequences per micro-batch.")] = None,
    grad_accum: Annotated[int | None, typer.Option(help="Micro-batches per step.")] = None,
    seq_len: Annotated[int | None, typer.Option(help="Tokens per sequence.")] = None,
    lr: Annotated[float | None, typer.Option(help="Peak learning rate.")] = None,
    eval_interval: Annotated[int | None, typer.Option(help="Validate every N steps.")] = None,
    checkpoint_interval: Annotated[
        int | None, typer.Option(help="Checkpoint every N steps.")
    ] = None,
    spec_file: Annotated[
        Path | None, typer.Option("--spec", help="A JSON job spec; flags override its fields.")
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress bar.")] = False,
    swap: Annotated[
        str | None,
        typer.Option(
            help="auto (swap layers only when resident training does not fit the device), "
            "on or off. See `atomd plan`."
        ),
    ] = None,
    gpu_mem: Annotated[
        str | None, typer.Option(help="Device-memory budget, e.g. 24GiB (default: all of it).")
    ] = None,
    swap_optimizer: Annotated[
        str | None,
        typer.Option(
            help="Where swapped layers' AdamW runs: auto (the planner's choice), host or device."
        ),
    ] = None,
    precision: Annotated[
        str | None,
        typer.Option(
            help="bf16, fp16 (dynamic loss scaling; skipped steps in metrics.jsonl), fp32, or "
            "auto: bf16 where supported, else fp16 on CUDA, fp32 on the CPU."
        ),
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            help="bytes (default), default (the bundled 4096-token BPE) or a tokenizer.json "
            "(`atomd tokenizer train`); its vocabulary must fit --vocab-size."
        ),
    ] = None,
    vocab_size: Annotated[
        int | None,
        typer.Option(help="The model's vocabulary (default: the preset's; 256 for tiny)."),
    ] = None,
    init_from: Annotated[
        str | None,
        typer.Option(
            help="Start from this checkpoint's weights (e.g. one `atomd import` made) instead "
            "of a random initialization."
        ),
    ] = None,
) -> None:
    """Train one model in this process (no daemon): progress bar, metrics.jsonl, TensorBoard
    events (<out>/tensorboard), checkpoints (each with its tokenizer.json)."""
    overrides = {
        "preset": preset,
        "data": data,
        "max_steps": max_steps,
        "max_tokens": max_tokens,
        "seed": seed,
        "micro_batch_size": micro_batch_size,
        "grad_accum": grad_accum,
        "seq_len": seq_len,
        "lr": lr,
        "eval_interval": eval_interval,
        "checkpoint_interval": checkpoint_interval,
        "swap": swap,
        "gpu_mem": gpu_mem,
        "swap_optimizer": swap_optimizer,
        "precision": precision,
        "tokenizer": tokenizer,
        "vocab_size": vocab_size,
        "init_from": init_from,
    }
    spec = _spec_from(spec_file, overrides)
    from atomd.engines import build_engine
    from atomd.train.trainer import Trainer

    built = build_engine(spec, device)
    trainer = Trainer(spec, out, built.engine, plan=built.plan, resume=resume, progress=not quiet)
    n_params = trainer.engine.model.num_parameters()
    typer.echo(
        f"training {spec.preset} ({n_params / 1e6:.2f}M parameters) on {spec.data} "
        f"[{trainer.dataset.train_tokens:,} training tokens] with {built.device.type}, "
        f"{spec.total_steps} steps of {spec.tokens_per_step:,} tokens -> {out} "
        "(Ctrl-C stops at the next step and checkpoints)"
    )
    with _stop_on_ctrl_c(trainer.stop_event):
        summary = trainer.run()
    val = f", val_loss {summary.val_loss:.4f}" if summary.val_loss is not None else ""
    loss = f", loss {summary.loss:.4f}" if summary.loss is not None else ""
    typer.echo(
        f"{summary.state} at step {summary.step}{loss}{val}; checkpoint {summary.checkpoint}"
    )
    if summary.state == "stopped":
        typer.echo(f"interrupted; continue with: atomd train --out {out} --resume", err=True)
        raise typer.Exit(130)


@contextlib.contextmanager
def _stop_on_ctrl_c(stop: threading.Event) -> Iterator[None]:
    """The first Ctrl-C stops training at the next step boundary (it checkpoints); a second
    one aborts at once, without a checkpoint."""

    def on_sigint(signum: int, frame: object) -> None:
        if stop.is_set():
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        stop.set()
        typer.echo(
            "\nCtrl-C: stopping at the next step boundary and writing a checkpoint "
            "(Ctrl-C again aborts without one)",
            err=True,
        )

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@app.command()
def sample(
    checkpoint: Annotated[
        Path, typer.Option(help="A run's --out folder, its checkpoints/ folder, or one checkpoint.")
    ],
    prompt: Annotated[str, typer.Option(help="Text to continue.")] = "\n",
    max_new_tokens: Annotated[
        int, typer.Option(help="Tokens to generate (bytes with the byte tokenizer).")
    ] = 400,
    temperature: Annotated[float, typer.Option(help="Softmax temperature (> 0).")] = 0.8,
    top_k: Annotated[int, typer.Option(help="Sample from the k likeliest tokens.")] = 40,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    device: DeviceOpt = "auto",
) -> None:
    """Print text generated by a trained model, decoded with the tokenizer its checkpoint
    carries."""
    typer.echo(_generate_text(checkpoint, prompt, max_new_tokens, temperature, top_k, seed, device))


def _generate_text(
    checkpoint: Path, prompt: str, n: int, temperature: float, top_k: int, seed: int, device: str
) -> str:
    import torch

    from atomd.devices import resolve_device
    from atomd.model.sample import generate
    from atomd.train.trainer import model_from_checkpoint, tokenizer_of

    if temperature <= 0:
        fail("--temperature must be positive")
    dev = resolve_device(device)
    model, found = model_from_checkpoint(checkpoint, dev)
    tok = tokenizer_of(found)  # the checkpoint's own (bytes for older checkpoints)
    ids = tok.encode(prompt) or tok.encode("\n")
    gen = torch.Generator(device=dev).manual_seed(seed)
    idx = torch.tensor([ids], dtype=torch.long, device=dev)
    out = generate(model, idx, n, temperature=temperature, top_k=top_k, generator=gen)
    return tok.decode(out[0].tolist())


@app.command()
def presets() -> None:
    """List the model presets with their shapes and parameter counts."""
    from atomd.model import PRESETS
    from atomd.model.config import num_parameters

    typer.echo(
        f"{'preset':<10} {'layers':>6} {'width':>6} {'heads':>5} {'context':>7} {'params':>10}"
    )
    for name, cfg in PRESETS.items():
        n = num_parameters(cfg)
        typer.echo(
            f"{name:<10} {cfg.n_layer:>6} {cfg.n_embd:>6} {cfg.n_head:>5} {cfg.block_size:>7} "
            f"{n / 1e6:>9.1f}M"
        )


@app.command()
def demo(
    out: Annotated[Path, typer.Option(help="Where the demo run goes.")] = Path("runs"),
    max_steps: Annotated[int, typer.Option(help="Training steps (per peer).")] = 600,
    local: Annotated[
        bool, typer.Option("--local", help="One process, no daemons: atomd train with a sample.")
    ] = False,
    peers: Annotated[int, typer.Option(help="Daemons in the swarm demo.")] = 3,
    every: Annotated[
        str, typer.Option(help="Steps between delta exchanges (H), or auto (the default).")
    ] = "auto",
    device: DeviceOpt = "auto",
) -> None:
    """A swarm of daemons on loopback training the tiny GPT on Shakespeare together
    (with --local: one process, then a sample of its text). Ctrl-C stops it cleanly."""
    if not local:
        from atomd.demo import run_swarm_demo

        if every != "auto" and (not every.isdigit() or int(every) < 1):
            fail(f"--every {every}: expected auto or a number >= 1")
        raise typer.Exit(
            run_swarm_demo(out / time.strftime("demo-swarm-%Y%m%d-%H%M%S"), peers=peers,
                           max_steps=max_steps, every=every if every == "auto" else int(every))
        )  # fmt: skip
    from atomd.engines import build_engine
    from atomd.spec import JobSpec
    from atomd.train.trainer import Trainer

    run_dir = out / time.strftime("demo-%Y%m%d-%H%M%S")
    spec = JobSpec(preset="tiny", max_steps=max_steps)
    built = build_engine(spec, device)
    trainer = Trainer(spec, run_dir, built.engine, plan=built.plan, progress=True)
    typer.secho(
        f"atomd demo: training the tiny GPT ({trainer.engine.model.num_parameters() / 1e6:.2f}M "
        f"parameters) on Shakespeare's plays, {spec.total_steps} steps on {built.device.type}. "
        f"Output: {run_dir}",
        bold=True,
    )
    t0 = time.perf_counter()
    summary = trainer.run()
    minutes = (time.perf_counter() - t0) / 60
    typer.secho(
        f"\nvalidation loss {summary.val_loss:.3f} nats/byte after {summary.step} steps "
        f"({summary.tokens:,} tokens, {minutes:.1f} min). A sample:\n",
        bold=True,
    )
    typer.echo(_generate_text(run_dir, "ROMEO:\n", 400, 0.8, 40, 0, device))
    typer.secho(
        f"\nmetrics: {run_dir / 'metrics.jsonl'}   more text: "
        f"atomd sample --checkpoint {run_dir} --prompt 'JULIET:'",
        bold=True,
    )


SwapOptimizerOpt = Annotated[
    str | None,
    typer.Option(
        help="Fix where swapped layers' AdamW runs: host, device, or split (the first layers "
        "on the device, the rest on the host)."
    ),
]
DeviceStepsOpt = Annotated[
    int | None,
    typer.Option(min=1, help="With --optimizer split: how many swapped layers step on the device."),
]
GraphBlocksOpt = Annotated[
    int | None, typer.Option(help="Fix the blocks not recomputed (default: as many as fit).")
]
LinkOpt = Annotated[
    str | None,
    typer.Option(
        help="Fix what swapped weights and gradients cross the link in: bf16 or fp32 "
        "(default: the planner's, weighing link time against host conversions)."
    ),
]


def _one_of(flag: str, value: str | None, allowed: tuple[str, ...]) -> str | None:
    if value is not None and value not in allowed:
        fail(f"{flag} must be {' or '.join(allowed)}, not {value!r}")
    return value


def _link_choice(value: str | None) -> Link | None:
    return cast("Link | None", _one_of("--link", value, ("bf16", "fp32")))


def _optimizer_choice(value: str | None) -> Optimizer | None:
    return cast("Optimizer | None", _one_of("--optimizer", value, ("host", "device", "split")))


@app.command()
def plan(
    preset: Annotated[str, typer.Option(help="Model preset (see `atomd presets`).")] = "gpt3-6.7b",
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
    slots: Annotated[int | None, typer.Option(help="Fix K, the layer slots (>= 2).")] = None,
    micro_batches: Annotated[
        int | None, typer.Option(help="Fix M, micro-batches per layer visit.")
    ] = None,
    resident_blocks: Annotated[
        int | None, typer.Option(help="Fix the blocks kept on the device.")
    ] = None,
    optimizer: SwapOptimizerOpt = None,
    device_steps: DeviceStepsOpt = None,
    graph_blocks: GraphBlocksOpt = None,
    link: LinkOpt = None,
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
        "slots": slots,
        "micro_batches": micro_batches,
        "resident_blocks": resident_blocks,
        "optimizer": _optimizer_choice(optimizer),
        "device_steps": device_steps,
        "graph_blocks": graph_blocks,
        "link": _link_choice(link),
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


bench_app = typer.Typer(
    help="Benchmarks: each prints what it measured in one run as JSON.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(bench_app, name="bench")


@bench_app.command("swap")
def bench_swap(
    preset: Annotated[str, typer.Option(help="Model preset.")] = "tiny",
    device: DeviceOpt = "auto",
    micro_batch_size: Annotated[int, typer.Option(help="Sequences per micro-batch.")] = 8,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = 64,
    grad_accum: Annotated[int, typer.Option(help="Micro-batches per step.")] = 4,
    steps: Annotated[int, typer.Option(help="Timed optimizer steps (after one warm-up).")] = 4,
    slots: Annotated[int | None, typer.Option(help="K (default: the planner's).")] = None,
    micro_batches: Annotated[int | None, typer.Option(help="M (default: the planner's).")] = None,
    resident_blocks: Annotated[
        int, typer.Option(help="Blocks kept on the device (default 0: swap every block).")
    ] = 0,
    gpu_mem: Annotated[str | None, typer.Option(help="Device-memory budget, e.g. 8GiB.")] = None,
    optimizer: SwapOptimizerOpt = None,
    device_steps: DeviceStepsOpt = None,
    graph_blocks: GraphBlocksOpt = None,
    link: LinkOpt = None,
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
        fail("atomd bench needs the bench/ package (a source checkout or `pip install -e .`)")
    result = run_swap_bench(
        preset=preset,
        device=device,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        grad_accum=grad_accum,
        steps=steps,
        slots=slots,
        micro_batches=micro_batches,
        resident_blocks=resident_blocks,
        gpu_mem=gpu_mem,
        optimizer=_optimizer_choice(optimizer),
        device_steps=device_steps,
        graph_blocks=graph_blocks,
        link=_link_choice(link),
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
            "'{\"swarm_adam\": false}': each peer's own AdamW, as before 2026-12-06)."
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
        fail("atomd bench needs the bench/ package (a source checkout or `pip install -e .`)")
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
        fail("atomd bench needs the bench/ package (a source checkout or `pip install -e .`)")
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


@app.command("export")
def export_cmd(
    checkpoint: Annotated[
        Path, typer.Argument(help="A run's folder, its checkpoints/ folder, or one checkpoint.")
    ],
    out: Annotated[Path, typer.Argument(help="The folder to write (new or empty).")],
) -> None:
    """Write a checkpoint (resident or swapped run, any preset) as a Hugging Face GPT-2 folder:
    config.json, model.safetensors, and the run's tokenizer.json, which transformers loads
    with GPT2LMHeadModel.from_pretrained(OUT) and AutoTokenizer.from_pretrained(OUT)."""
    from atomd.hf import export_checkpoint

    r = export_checkpoint(checkpoint, out)
    tok = " and tokenizer.json" if r["tokenizer"] else ""
    typer.echo(
        f"exported {r['checkpoint']} (step {r['step']}) to {out}: config.json, "
        f"model.safetensors ({r['tensors']} tensors){tok}"
    )


@app.command("import")
def import_cmd(
    hf_dir: Annotated[
        Path,
        typer.Argument(
            help="A GPT-2 folder as save_pretrained writes it: config.json, model.safetensors "
            "(and tokenizer.json)."
        ),
    ],
    out: Annotated[Path, typer.Argument(help="The run folder to write its checkpoint in.")],
) -> None:
    """Turn a Hugging Face GPT-2 checkpoint into an atomd checkpoint (step 0) that a job starts
    from: atomd train --init-from OUT (job spec: "init_from"), with the preset of its shape."""
    from atomd.hf import import_pretrained
    from atomd.model.config import GPTConfig
    from atomd.model.presets import PRESETS

    r = import_pretrained(hf_dir, out)
    cfg = GPTConfig.from_dict(r["model_config"])
    same = [n for n, p in PRESETS.items() if p.n_layer == cfg.n_layer and p.n_embd == cfg.n_embd
            and p.n_head == cfg.n_head and p.block_size == cfg.block_size]  # fmt: skip
    preset = same[0] if same else None
    typer.echo(
        f"imported {hf_dir} as {r['checkpoint']}: {cfg.n_layer} layers x {cfg.n_embd}, "
        f"{cfg.n_head} heads, vocabulary {cfg.vocab_size}, context {cfg.block_size}, "
        f"activation {cfg.activation}" + (", with its tokenizer.json" if r["tokenizer"] else "")
    )
    if preset is None:
        typer.echo("no preset has this shape: atomd cannot train it yet", err=True)
        return
    vocab = (
        "" if cfg.vocab_size == PRESETS[preset].vocab_size else f" --vocab-size {cfg.vocab_size}"
    )
    tok = f" --tokenizer {out}" if r["tokenizer"] else ""
    typer.echo(f"train it: atomd train --preset {preset}{vocab}{tok} --init-from {out} --out RUN")


@app.command()
def plot(
    run: Annotated[
        str,
        typer.Argument(
            help="A run's folder (or its metrics.jsonl), or the id of a job of the daemon at --url."
        ),
    ],
    out: Annotated[Path, typer.Option(help="The PNG to write.")] = Path("loss.png"),
    log_y: Annotated[bool, typer.Option("--log-y", help="Logarithmic loss axis.")] = False,
    url: Annotated[
        str, typer.Option(help="The daemon, for a job id.", envvar="ATOMD_URL")
    ] = "http://127.0.0.1:7070",
    token: Annotated[
        str | None, typer.Option(help="Its bearer token.", envvar="ATOMD_CONTROL_TOKEN")
    ] = None,
) -> None:
    """Render a run's train and validation loss curves to a PNG (no browser needed)."""
    from atomd.plot import curves_from_rows, curves_from_run, render

    path = Path(run)
    if path.exists():
        curves = curves_from_run(path)
    else:
        from atomd.client import ControlClient

        points: list[dict[str, Any]] = []
        with ControlClient(url, token=token) as c:
            while True:  # the whole run, a page at a time (bounded: ATOMD_PROGRESS_KEEP)
                params: dict[str, Any] = {"limit": PROGRESS_PAGE}
                if points:
                    params["after_step"] = points[-1]["step"]
                page = c.request("GET", f"/v1/jobs/{run}/progress", params=params)
                points.extend(page)
                if len(page) < PROGRESS_PAGE:
                    break
        curves = curves_from_rows(points, title=f"job {run}")
    render(curves, out, log_y=log_y)
    last = f", last validation loss {curves.val_loss[-1]:.4f}" if curves.val_loss else ""
    typer.echo(
        f"wrote {out}: {len(curves.steps)} training points to step "
        f"{max(curves.steps + curves.val_steps)}{last}"
    )


data_app = typer.Typer(
    help="Datasets: tokenize once into the token cache, print the content hash.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(data_app, name="data")


@data_app.command("prepare")
def data_prepare(
    data: Annotated[
        str,
        typer.Argument(
            help="'shakespeare', a text file or folder, .bin tokens, a .jsonl file, Parquet "
            "file(s) or a folder saved by datasets' save_to_disk."
        ),
    ],
    tokenizer: Annotated[
        str, typer.Option(help="bytes, default or a tokenizer.json, as the job will use.")
    ] = "bytes",
    text_field: Annotated[
        str, typer.Option(help="The field or column holding each document's text.")
    ] = "text",
) -> None:
    """Tokenize a dataset as a job would (documents go to a memory-mapped token cache next to
    the data) and print its token count and content hash, the job spec's data_sha256: every
    peer then checks its own copy against it."""
    from atomd.data.dataset import load_source, stream_sha256
    from atomd.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    tokens, val, sha = load_source(data, tok, text_field)
    parts = [tokens] if val is None else [tokens, val]
    n = sum(len(p) for p in parts)
    largest = max((int(p.max()) for p in parts if len(p)), default=0)
    typer.echo(f"{data}: {n:,} tokens (tokenizer {tokenizer}, largest id {largest:,})")
    typer.echo(f"data_sha256: {stream_sha256(tokens, val, sha)}")


tokenizer_app = typer.Typer(
    help="Byte-level BPE tokenizers (Hugging Face tokenizers, offline).",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(tokenizer_app, name="tokenizer")


@tokenizer_app.command("train")
def tokenizer_train(
    corpus: Annotated[
        list[Path],
        typer.Argument(help="Text files or folders (their .txt/.md files, in sorted order)."),
    ],
    vocab_size: Annotated[
        int, typer.Option(help="Tokens in the vocabulary: <|endoftext|>, 256 bytes, merges.")
    ] = 4096,
    min_frequency: Annotated[int, typer.Option(help="Merge pairs seen at least this often.")] = 2,
    out: Annotated[Path, typer.Option(help="The tokenizer.json to write.")] = Path(
        "tokenizer.json"
    ),
) -> None:
    """Fit a byte-level BPE (GPT-2's pre-tokenizer) on a corpus; a job uses it with
    "tokenizer": "PATH" and "vocab_size" of at least its size."""
    from atomd.data.tokenizer import BPETokenizer, train_bpe

    files: list[Path] = []
    for c in corpus:
        if c.is_dir():
            files += sorted(p for p in c.rglob("*") if p.is_file() and p.suffix in (".txt", ".md"))
        elif c.is_file():
            files.append(c)
        else:
            fail(f"{c}: no such file or folder")
    if not files:
        fail("no .txt/.md files in the corpus given")
    tok = train_bpe(files, vocab_size=vocab_size, min_frequency=min_frequency)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    bpe = BPETokenizer(tok, name=str(out))
    size = sum(f.stat().st_size for f in files)
    n = sum(len(bpe.encode_array(f.read_bytes())) for f in files)
    typer.echo(
        f"wrote {out}: {bpe.vocab_size} tokens, fitted on {len(files)} file(s) of {size:,} "
        f"bytes ({size / max(n, 1):.2f} bytes per token on them)"
    )


@app.command()
def version() -> None:
    """Print the atomd version."""
    typer.echo(__version__)


def _register_daemon_commands() -> None:
    from atomd import cli_daemon

    cli_daemon.register(app)


_register_daemon_commands()


def main() -> NoReturn:
    setup_logging()
    try:
        app()
    except AtomdError as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.secho("interrupted (Ctrl-C): stopped at once, nothing more was saved", err=True)
        sys.exit(130)
    sys.exit(0)
