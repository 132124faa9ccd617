"""``atomd run``, ``migrate``, ``status`` and ``events``: the daemon itself."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from atomd.cli import common
from atomd.cli.common import URL_DEFAULT, JsonOpt, TokenOpt, UrlOpt, settings_help
from atomd.cli.render import console, event_line, fmt, show

# The most events the daemon answers at a time (``GET /v1/events``).
EVENTS_PAGE = 500


def run(
    data_dir: Annotated[Path | None, typer.Option(help=settings_help("data_dir"))] = None,
    control: Annotated[str | None, typer.Option(help=settings_help("control"))] = None,
    listen: Annotated[str | None, typer.Option(help=settings_help("listen"))] = None,
    advertise: Annotated[str | None, typer.Option(help=settings_help("advertise"))] = None,
    peer: Annotated[
        list[str] | None, typer.Option("--peer", help=settings_help("seeds", "repeatable"))
    ] = None,
    swarm: Annotated[str | None, typer.Option(help=settings_help("swarm"))] = None,
    swarm_secret: Annotated[str | None, typer.Option(help=settings_help("swarm_secret"))] = None,
    allow_key: Annotated[
        list[str] | None, typer.Option(help=settings_help("allowed_keys", "repeatable"))
    ] = None,
    auto_join: Annotated[
        bool | None, typer.Option("--auto-join/--no-auto-join", help=settings_help("auto_join"))
    ] = None,
    peer_tls: Annotated[
        bool | None, typer.Option("--peer-tls/--no-peer-tls", help=settings_help("peer_tls"))
    ] = None,
    zeroconf: Annotated[
        bool | None, typer.Option("--zeroconf/--no-zeroconf", help=settings_help("zeroconf"))
    ] = None,
    device: Annotated[str | None, typer.Option(help=settings_help("device"))] = None,
    log_level: Annotated[str | None, typer.Option(help=settings_help("log_level"))] = None,
    log_format: Annotated[str | None, typer.Option(help=settings_help("log_format"))] = None,
    wandb_project: Annotated[str | None, typer.Option(help=settings_help("wandb_project"))] = None,
    parent_pid: Annotated[int | None, typer.Option(help=settings_help("parent_pid"))] = None,
) -> None:
    """Run the daemon in the foreground (what the systemd unit starts).

    Settings come from these flags, then ATOMD_* variables, then the TOML file named by
    ATOMD_CONFIG. Unknown ATOMD_* variables are an error. Stop with SIGTERM or Ctrl-C: the
    running job checkpoints at its next step boundary and resumes on the next start.
    """
    from atomd.config import load_settings
    from atomd.daemon import Daemon
    from atomd.logs import setup_logging
    from atomd.train.tracking import WANDB_PROJECT_ENV

    settings = load_settings(
        data_dir=data_dir,
        control=control,
        listen=listen,
        advertise=advertise,
        seeds=peer or None,
        swarm=swarm,
        swarm_secret=swarm_secret,
        device=device,
        log_level=log_level,
        log_format=log_format,
        allowed_keys=allow_key or None,
        auto_join=auto_join,
        zeroconf=zeroconf,
        peer_tls=peer_tls,
        wandb_project=wandb_project,
        parent_pid=parent_pid,
    )
    setup_logging(settings.log_level, settings.log_format)
    if settings.wandb_project:  # the jobs' trackers read it (atomd.train.tracking)
        os.environ[WANDB_PROJECT_ENV] = settings.wandb_project
    asyncio.run(Daemon(settings).run())


def migrate(
    data_dir: Annotated[Path | None, typer.Option(help=settings_help("data_dir"))] = None,
    downgrade: Annotated[
        str | None, typer.Option(help="Downgrade to this revision instead ('base' = empty).")
    ] = None,
) -> None:
    """Upgrade the database to the newest schema (the daemon also does this at start).
    Refused while a daemon uses the data folder; a daemon started meanwhile waits for it."""
    from atomd.config import load_settings
    from atomd.datadir import lock_data_dir, sweep
    from atomd.db import migrate as m

    settings = load_settings(data_dir=data_dir)
    settings.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock = lock_data_dir(settings.data_dir, "migrate")  # not under a running daemon
    try:
        sweep(settings.data_dir)
        if downgrade is not None:
            m.downgrade(settings.db_path, downgrade)
        else:
            m.upgrade(settings.db_path)
    finally:
        os.close(lock)
    typer.echo(f"{settings.db_path}: revision {m.current_revision(settings.db_path) or 'base'}")


STATUS_FIELDS = (
    "version", "peer_id", "public_key", "peers_alive", "uptime_s", "swarm", "device", "control",
    "advertise", "data_dir",
)  # fmt: skip


def status(url: UrlOpt = URL_DEFAULT, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """Show the daemon's state and its current job."""
    with common.connect(url, token) as c:
        data = c.request("GET", "/v1/status")

    def render(d: dict[str, Any]) -> None:
        t = Table(box=None, show_header=False)
        for k in STATUS_FIELDS:
            t.add_row(k, fmt(d[k], 1))
        job = d.get("job")
        t.add_row(
            "job",
            "-"
            if job is None
            else f"{job['id']} {job['state']} step {job['step']} loss {fmt(job['loss'])}",
        )
        console().print(t)

    show(data, as_json, render)


def events(
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new events until Ctrl-C.")
    ] = False,
    last: Annotated[
        int, typer.Option(min=1, max=EVENTS_PAGE, help="Start with the newest N events.")
    ] = 20,
    kind: Annotated[
        str | None, typer.Option(help="Only events of this kind, e.g. job.finished.")
    ] = None,
    url: UrlOpt = URL_DEFAULT,
    token: TokenOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
) -> None:
    """Print the daemon's audit log, oldest first: jobs started and ended, peers joining,
    failing and leaving, refused requests; with --follow, new events as they come."""
    params: dict[str, Any] = {"limit": last} | ({"kind": kind} if kind else {})
    seen = -1
    with common.connect(url, token) as c:
        try:
            while True:
                fresh = [e for e in reversed(c.request("GET", "/v1/events", params=params))
                         if e["id"] > seen]  # fmt: skip
                for e in fresh:
                    typer.echo(json.dumps(e) if as_json else event_line(e))
                seen = max([seen, *(e["id"] for e in fresh)])
                if not follow:
                    return
                params["limit"] = EVENTS_PAGE
                common.pause(common.POLL_S)
        except KeyboardInterrupt:
            return


def register(app: typer.Typer) -> None:
    app.command(cls=common.renaming({"--seed": "--peer"}))(run)
    app.command()(migrate)
    app.command()(status)
    app.command()(events)
