"""``atomd train``, ``sample``, ``demo``, ``presets``, ``export``, ``import`` and ``plot``:
one model in this process, and what a run leaves behind."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from atomd.cli import common
from atomd.cli.common import URL_DEFAULT, DeviceOpt, fail, read_json_object, spec_help


def spec_from(spec_file: Path | None, overrides: dict[str, Any]) -> Any:
    """The job spec of ``--spec`` (if given) with the flags given over its fields."""
    from atomd.spec import JobSpec

    base = read_json_object(spec_file) if spec_file is not None else {}
    base.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return JobSpec(**base)
    except ValidationError as e:
        lines = [
            f"  {'.'.join(map(str, err['loc'])) or 'spec'}: {err['msg']}" for err in e.errors()
        ]
        fail("invalid job spec:\n" + "\n".join(lines))


def train(
    preset: Annotated[str | None, typer.Option(help=spec_help("preset"))] = None,
    data: Annotated[str | None, typer.Option(help=spec_help("data"))] = None,
    max_steps: Annotated[int | None, typer.Option(help=spec_help("max_steps"))] = None,
    max_tokens: Annotated[int | None, typer.Option(help=spec_help("max_tokens"))] = None,
    out: Annotated[Path, typer.Option(help="Output folder: metrics.jsonl, checkpoints/.")] = Path(
        "runs/train"
    ),
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue from the newest good checkpoint in --out.")
    ] = False,
    device: DeviceOpt = "auto",
    seed: Annotated[int | None, typer.Option(help=spec_help("seed"))] = None,
    micro_batch_size: Annotated[
        int | None, typer.Option(help=spec_help("micro_batch_size"))
    ] = None,
    grad_accum: Annotated[int | None, typer.Option(help=spec_help("grad_accum"))] = None,
    seq_len: Annotated[int | None, typer.Option(help=spec_help("seq_len"))] = None,
    lr: Annotated[float | None, typer.Option(help=spec_help("lr"))] = None,
    eval_interval: Annotated[int | None, typer.Option(help=spec_help("eval_interval"))] = None,
    checkpoint_interval: Annotated[
        int | None, typer.Option(help=spec_help("checkpoint_interval"))
    ] = None,
    spec_file: Annotated[
        Path | None, typer.Option("--spec", help="A JSON job spec; flags override its fields.")
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress bar.")] = False,
    swap: Annotated[str | None, typer.Option(help=spec_help("swap"))] = None,
    gpu_mem: Annotated[str | None, typer.Option(help=spec_help("gpu_mem"))] = None,
    swap_optimizer: Annotated[str | None, typer.Option(help=spec_help("swap_optimizer"))] = None,
    swap_slots: Annotated[int | None, typer.Option(help=spec_help("swap_slots"))] = None,
    swap_micro_batches: Annotated[
        int | None, typer.Option(help=spec_help("swap_micro_batches"))
    ] = None,
    swap_resident_blocks: Annotated[
        int | None, typer.Option(help=spec_help("swap_resident_blocks"))
    ] = None,
    swap_device_steps: Annotated[
        int | None, typer.Option(help=spec_help("swap_device_steps"))
    ] = None,
    swap_graph_blocks: Annotated[
        int | None, typer.Option(help=spec_help("swap_graph_blocks"))
    ] = None,
    swap_link: Annotated[str | None, typer.Option(help=spec_help("swap_link"))] = None,
    precision: Annotated[str | None, typer.Option(help=spec_help("precision"))] = None,
    tokenizer: Annotated[str | None, typer.Option(help=spec_help("tokenizer"))] = None,
    vocab_size: Annotated[int | None, typer.Option(help=spec_help("vocab_size"))] = None,
    init_from: Annotated[str | None, typer.Option(help=spec_help("init_from"))] = None,
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
        "swap_slots": swap_slots,
        "swap_micro_batches": swap_micro_batches,
        "swap_resident_blocks": swap_resident_blocks,
        "swap_device_steps": swap_device_steps,
        "swap_graph_blocks": swap_graph_blocks,
        "swap_link": swap_link,
        "precision": precision,
        "tokenizer": tokenizer,
        "vocab_size": vocab_size,
        "init_from": init_from,
    }
    spec = spec_from(spec_file, overrides)
    from atomd.engine_choice import build_engine
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
    typer.echo(generate_text(checkpoint, prompt, max_new_tokens, temperature, top_k, seed, device))


def generate_text(
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
    from atomd.engine_choice import build_engine
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
    typer.echo(generate_text(run_dir, "ROMEO:\n", 400, 0.8, 40, 0, device))
    typer.secho(
        f"\nmetrics: {run_dir / 'metrics.jsonl'}   more text: "
        f"atomd sample --checkpoint {run_dir} --prompt 'JULIET:'",
        bold=True,
    )


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
    ] = URL_DEFAULT,
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
        from atomd.cli.jobs import progress_after

        with common.connect(url, token) as c:  # the whole run (bounded: ATOMD_PROGRESS_KEEP)
            points = progress_after(c, run, None)
        curves = curves_from_rows(points, title=f"job {run}")
    render(curves, out, log_y=log_y)
    last = f", last validation loss {curves.val_loss[-1]:.4f}" if curves.val_loss else ""
    typer.echo(
        f"wrote {out}: {len(curves.steps)} training points to step "
        f"{max(curves.steps + curves.val_steps)}{last}"
    )


def register(app: typer.Typer) -> None:
    app.command()(train)
    app.command()(sample)
    app.command()(presets)
    app.command()(demo)


def register_files(app: typer.Typer) -> None:
    app.command("export")(export_cmd)
    app.command("import")(import_cmd)
    app.command()(plot)
