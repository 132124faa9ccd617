"""CLI commands for the daemon: ``atomd run``, ``migrate`` and the REST clients."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from atomd.client import ControlClient
from atomd.logs import printable

URL = Annotated[
    str, typer.Option("--url", envvar="ATOMD_URL", help="Control API of the daemon to talk to.")
]
TOKEN = Annotated[
    str | None,
    typer.Option(
        "--token", envvar="ATOMD_CONTROL_TOKEN", help="Bearer token, if the daemon needs one."
    ),
]
JSON = Annotated[bool, typer.Option("--json", help="Print the raw JSON answer.")]
DEFAULT_URL = "http://127.0.0.1:7070"

job_app = typer.Typer(
    help="Start, stop and inspect training jobs of a running daemon.",
    no_args_is_help=True,
    rich_markup_mode=None,
)


class _PlainConsole(Console):
    """A console that prints every string as it is: no rich markup (`[bold]`, `[link=...]`;
    a stray `[/x]` raised MarkupError), no emoji codes, control characters escaped
    (``atomd.logs.printable``). The tables show what peers chose (a member's URL, a reason
    quoting its frame, a joined job's spec): a review of 2026-12-06."""

    def render_str(self, text: str, **kwargs: Any) -> Text:
        return super().render_str(printable(text), **{**kwargs, "markup": False, "emoji": False})


def _console() -> Console:
    # Piped output keeps whole ids and timestamps instead of squeezing to 80 columns.
    width = None if sys.stdout.isatty() else 240
    return _PlainConsole(width=width, markup=False, emoji=False)


def _print(data: Any, as_json: bool, render: Any) -> None:
    if as_json:
        typer.echo(json.dumps(data, indent=2))
    else:
        render(data)


def _fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _job_table(jobs: list[dict[str, Any]]) -> None:
    t = Table("id", "state", "preset", "step", "tokens", "loss", "val_loss", "created", box=None)
    for j in jobs:
        t.add_row(
            j["id"],
            j["state"],
            j["spec"].get("preset", "?"),
            str(j["step"]),
            f"{j['tokens']:,}",
            _fmt(j["loss"]),
            _fmt(j["val_loss"]),
            j["created_at"][:19].replace("T", " "),
        )
    _console().print(t)


def _job_detail(j: dict[str, Any]) -> None:
    t = Table(box=None, show_header=False)
    for key in (
        "id",
        "state",
        "reason",
        "step",
        "tokens",
        "loss",
        "val_loss",
        "out_dir",
        "created_at",
        "started_at",
        "finished_at",
    ):
        t.add_row(key, _fmt(j.get(key)))
    if j.get("sync"):
        t.add_row("cadence", _cadence(j["sync"]))
    t.add_row("spec", json.dumps(j["spec"], separators=(",", ":")))
    _console().print(t)


def _cadence(sync: dict[str, Any]) -> str:
    """The cadence in force and the time in sync, as a swarm job reports them."""
    every = sync.get("every")
    text = "every ? steps" if every is None else f"every {every} step{'s' * (every != 1)}"
    if sync.get("auto"):
        text += f" (auto: a round every {_fmt(sync.get('period_s'))} s across the swarm)"
    text = (
        f"{text}, {sync.get('rounds', 0)} rounds; sync work {_fmt(sync.get('busy_s'), 1)} s, "
        f"waiting {_fmt(sync.get('wait_s'), 1)} s"
    )
    final = sync.get("final_model")
    if final == "average":
        shares, tail = sync.get("average_shares"), sync.get("average_tail")
        text += f"; ended on the average of the peers' models ({shares} other share(s)"
        text += f", each peer's mean over its last {tail} models)" if tail and tail > 1 else ")"
    elif final is not None:
        text += "; ended on " + ("the swarm's model" if final == "swarm" else "its own replica")
    return text


def run(
    data_dir: Annotated[
        Path | None,
        typer.Option(
            help="Database, identity key, job folders; used by one daemon at a time. "
            "(env ATOMD_DATA_DIR)"
        ),
    ] = None,
    control: Annotated[
        str | None,
        typer.Option(help="Control API HOST:PORT (default 127.0.0.1:7070). (env ATOMD_CONTROL)"),
    ] = None,
    listen: Annotated[
        str | None,
        typer.Option(help="Peer plane HOST:PORT (default 0.0.0.0:7071). (env ATOMD_LISTEN)"),
    ] = None,
    advertise: Annotated[
        str | None, typer.Option(help="URL peers use to reach this daemon. (env ATOMD_ADVERTISE)")
    ] = None,
    seed: Annotated[
        list[str] | None,
        typer.Option(help="Peer URL to join through; repeatable. (env ATOMD_SEEDS)"),
    ] = None,
    swarm: Annotated[str | None, typer.Option(help="Swarm name. (env ATOMD_SWARM)")] = None,
    swarm_secret: Annotated[
        str | None, typer.Option(help="Shared swarm secret. (env ATOMD_SWARM_SECRET)")
    ] = None,
    allow_key: Annotated[
        list[str] | None,
        typer.Option(
            help="Admit only these peer public keys (hex); repeatable. (env ATOMD_ALLOWED_KEYS)"
        ),
    ] = None,
    auto_join: Annotated[
        bool | None,
        typer.Option(
            "--auto-join/--no-auto-join",
            help="Join jobs peers announce. (env ATOMD_AUTO_JOIN; default on)",
        ),
    ] = None,
    peer_tls: Annotated[
        bool | None,
        typer.Option(
            "--peer-tls/--no-peer-tls",
            help="TLS on the peer plane, bound to the peer id (default on). Off is unsafe: "
            "plain HTTP, for loopback tests only. (env ATOMD_PEER_TLS)",
        ),
    ] = None,
    zeroconf: Annotated[
        bool | None,
        typer.Option(
            "--zeroconf/--no-zeroconf",
            help="Find peers on the LAN by mDNS. (env ATOMD_ZEROCONF; default off)",
        ),
    ] = None,
    device: Annotated[
        str | None, typer.Option(help="auto, cpu or cuda. (env ATOMD_DEVICE)")
    ] = None,
    log_level: Annotated[
        str | None, typer.Option(help="DEBUG, INFO, WARNING, ERROR. (env ATOMD_LOG_LEVEL)")
    ] = None,
    parent_pid: Annotated[
        int | None,
        typer.Option(
            help="Stop (checkpointing) when this process exits; for launchers. "
            "(env ATOMD_PARENT_PID)"
        ),
    ] = None,
) -> None:
    """Run the daemon in the foreground (what the systemd unit starts).

    Settings come from these flags, then ATOMD_* variables, then the TOML file named by
    ATOMD_CONFIG. Unknown ATOMD_* variables are an error. Stop with SIGTERM or Ctrl-C: the
    running job checkpoints at its next step boundary and resumes on the next start.
    """
    from atomd.config import load_settings
    from atomd.daemon import Daemon
    from atomd.logs import setup_logging

    settings = load_settings(
        data_dir=data_dir,
        control=control,
        listen=listen,
        advertise=advertise,
        seeds=seed or None,
        swarm=swarm,
        swarm_secret=swarm_secret,
        device=device,
        log_level=log_level,
        allowed_keys=allow_key or None,
        auto_join=auto_join,
        zeroconf=zeroconf,
        peer_tls=peer_tls,
        parent_pid=parent_pid,
    )
    setup_logging(settings.log_level)
    asyncio.run(Daemon(settings).run())


def migrate(
    data_dir: Annotated[
        Path | None, typer.Option(help="The daemon's data folder. (env ATOMD_DATA_DIR)")
    ] = None,
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


def status(url: URL = DEFAULT_URL, token: TOKEN = None, as_json: JSON = False) -> None:
    """Show the daemon's state and its current job."""
    with ControlClient(url, token=token) as c:
        data = c.request("GET", "/v1/status")

    def render(d: dict[str, Any]) -> None:
        t = Table(box=None, show_header=False)
        for k in ("version", "peer_id", "public_key", "peers_alive", "uptime_s", "swarm",
                  "device", "control", "advertise", "data_dir"):  # fmt: skip
            t.add_row(k, _fmt(d[k], 1))
        job = d.get("job")
        t.add_row(
            "job",
            "-"
            if job is None
            else f"{job['id']} {job['state']} step {job['step']} loss {_fmt(job['loss'])}",
        )
        _console().print(t)

    _print(data, as_json, render)


def peers(url: URL = DEFAULT_URL, token: TOKEN = None, as_json: JSON = False) -> None:
    """List the peers this daemon knows, with their state."""
    with ControlClient(url, token=token) as c:
        data = c.request("GET", "/v1/peers")

    def render(rows: list[dict[str, Any]]) -> None:
        t = Table("id", "url", "state", "last seen", "rtt ms", "excluded", box=None)
        for p in rows:
            excluded = p.get("excluded")
            why = f"{excluded}: {p.get('excluded_reason') or ''}" if excluded else ""
            t.add_row(
                p["id"][:16], p["url"], p["state"], p["last_seen_at"][:19], _fmt(p["rtt_ms"], 1),
                why,
            )  # fmt: skip
        _console().print(t)

    _print(data, as_json, render)


def _read_spec(path: Path) -> dict[str, Any]:
    """A JSON job spec from ``path``; a clear error (exit 2) when it cannot be read."""
    try:
        body = json.loads(path.read_text())
    except OSError as e:
        _fail(f"cannot read job spec {path}: {e.strerror or e}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        _fail(f"job spec {path} is not valid JSON: {e}")
    if not isinstance(body, dict):
        _fail(f"job spec {path} must be a JSON object, not {type(body).__name__}")
    return body


def _fail(message: str) -> NoReturn:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def ban(
    public_key: Annotated[str, typer.Argument(help="The peer's Ed25519 key (64 hex).")],
    reason: Annotated[str, typer.Option(help="Recorded with the ban.")] = "banned by the operator",
    url: URL = DEFAULT_URL,
    token: TOKEN = None,
    as_json: JSON = False,
) -> None:
    """Ban a peer's key: refused on the peer plane, its deltas never merged, never a state
    donor; persisted until `atomd unban`. `atomd peers --json` shows each peer's key."""
    with ControlClient(url, token=token) as c:
        data = c.request(
            "POST", "/v1/bans", json={"public_key": public_key.lower(), "reason": reason}
        )
    _print(data, as_json, lambda b: typer.echo(f"banned {b['public_key']}: {b['reason']}"))


def unban(
    public_key: Annotated[str, typer.Argument(help="The peer's Ed25519 key (64 hex).")],
    url: URL = DEFAULT_URL,
    token: TOKEN = None,
) -> None:
    """Lift a ban, or end the quarantine of a peer with that key."""
    with ControlClient(url, token=token) as c:
        c.request("DELETE", f"/v1/bans/{public_key.lower()}")
    typer.echo(f"unbanned {public_key.lower()}")


@job_app.command("start")
def job_start(
    url: URL = DEFAULT_URL,
    token: TOKEN = None,
    as_json: JSON = False,
    spec_file: Annotated[Path | None, typer.Option("--spec", help="A JSON job spec.")] = None,
    preset: Annotated[str | None, typer.Option(help="Model preset.")] = None,
    data: Annotated[str | None, typer.Option(help="Dataset.")] = None,
    max_steps: Annotated[int | None, typer.Option(help="Optimizer steps.")] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Any spec field: KEY=VALUE (JSON value); repeatable."),
    ] = None,
) -> None:
    """Start a job. With no options: the tiny model on the bundled corpus."""
    body: dict[str, Any] = {}
    if spec_file is not None:
        body = _read_spec(spec_file)
    for item in set_ or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"--set {item!r}: expected KEY=VALUE")
        try:
            body[key] = json.loads(value)
        except json.JSONDecodeError:
            body[key] = value
    body.update(
        {
            k: v
            for k, v in {"preset": preset, "data": data, "max_steps": max_steps}.items()
            if v is not None
        }
    )
    with ControlClient(url, token=token) as c:
        job = c.request("POST", "/v1/jobs", json=body)
    _print(job, as_json, lambda j: typer.echo(f"started job {j['id']} ({j['state']})"))


@job_app.command("stop")
def job_stop(
    job_id: str, url: URL = DEFAULT_URL, token: TOKEN = None, as_json: JSON = False
) -> None:
    """Stop a job at its next step boundary; it writes a checkpoint first."""
    with ControlClient(url, token=token) as c:
        job = c.request("POST", f"/v1/jobs/{job_id}/stop")
    _print(job, as_json, lambda j: typer.echo(f"job {j['id']}: {j['state']}"))


@job_app.command("resume")
def job_resume(
    job_id: str, url: URL = DEFAULT_URL, token: TOKEN = None, as_json: JSON = False
) -> None:
    """Continue a stopped or failed job from its newest good checkpoint."""
    with ControlClient(url, token=token) as c:
        job = c.request("POST", f"/v1/jobs/{job_id}/resume")
    _print(job, as_json, lambda j: typer.echo(f"job {j['id']}: {j['state']} (resuming)"))


@job_app.command("list")
def job_list(url: URL = DEFAULT_URL, token: TOKEN = None, as_json: JSON = False) -> None:
    """List jobs, newest first."""
    with ControlClient(url, token=token) as c:
        _print(c.request("GET", "/v1/jobs"), as_json, _job_table)


@job_app.command("show")
def job_show(
    job_id: str,
    url: URL = DEFAULT_URL,
    token: TOKEN = None,
    as_json: JSON = False,
    last: Annotated[
        int, typer.Option(min=1, max=10000, help="Progress points to show, the newest.")
    ] = 5,
) -> None:
    """Show one job and its latest progress."""
    with ControlClient(url, token=token) as c:
        job = c.request("GET", f"/v1/jobs/{job_id}")
        points = c.request(
            "GET", f"/v1/jobs/{job_id}/progress", params={"limit": last, "newest": "true"}
        )
    if as_json:
        typer.echo(json.dumps({**job, "progress": points[-last:]}, indent=2))
        return
    _job_detail(job)
    t = Table("step", "tokens", "loss", "val_loss", "tokens/s", "every", "at", box=None)
    for p in points[-last:]:
        t.add_row(
            str(p["step"]),
            f"{p['tokens']:,}",
            _fmt(p["loss"]),
            _fmt(p["val_loss"]),
            f"{p['tokens_per_s']:,.0f}",
            _fmt((p.get("sync") or {}).get("every")),
            p["at"][:19],
        )
    _console().print(t)


def register(app: typer.Typer) -> None:
    app.command()(run)
    app.command()(migrate)
    app.command()(status)
    app.command()(peers)
    app.command()(ban)
    app.command()(unban)
    app.add_typer(job_app, name="job")
