"""The ``atomd`` command line: one module per group of commands.

``training`` (train, sample, demo, presets, export, import, plot), ``planning`` (plan),
``bench``, ``data`` (data, tokenizer), ``daemon`` (run, migrate, status, events), ``jobs``
(job ...), ``peers`` (peers, bans, ban, unban); ``common`` and ``render`` are what they share.
"""

from __future__ import annotations

import sys
from typing import NoReturn

import typer

from atomd import __version__
from atomd.cli import bench, daemon, data, jobs, peers, planning, training
from atomd.errors import AtomdError
from atomd.logs import setup_logging

app = typer.Typer(
    name="atomd",
    help=(
        "atomd: train large language models together on ordinary machines.\n\n"
        "Each host runs the daemon (`atomd run`); `atomd train` trains one model in one process."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    # Plain help: rich's panels print boolean flags as `--zeroconf / --no-zeroconf <bool>`.
    rich_markup_mode=None,
)


def version() -> None:
    """Print the atomd version."""
    typer.echo(__version__)


training.register(app)
planning.register(app)
app.add_typer(bench.bench_app, name="bench")
training.register_files(app)
app.add_typer(data.data_app, name="data")
app.add_typer(data.tokenizer_app, name="tokenizer")
app.command()(version)
daemon.register(app)
peers.register(app)
app.add_typer(jobs.job_app, name="job")


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
