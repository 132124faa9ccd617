"""What every command module shares: errors, the common options, help taken from the models."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from typer.core import TyperCommand

from atomd.client import ControlClient

URL_DEFAULT = "http://127.0.0.1:7070"


def fail(message: str, code: int = 2) -> NoReturn:
    """Print ``error: message`` in red on stderr and exit with ``code``."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def warn(message: str) -> None:
    typer.secho(f"warning: {message}", fg=typer.colors.YELLOW, err=True)


def spec_help(field: str) -> str:
    """The help of an option that sets a job-spec field: the field's own description."""
    from atomd.spec import JobSpec

    return JobSpec.model_fields[field].description or ""


def settings_help(field: str, more: str = "") -> str:
    """The help of an option of `atomd run`: the setting's description (``more`` added) and
    its variable."""
    from atomd.config import ENV_PREFIX, Settings

    text = (Settings.model_fields[field].description or "").rstrip(".")
    return f"{text}{'; ' + more if more else ''}. (env {ENV_PREFIX}{field.upper()})"


def read_json_object(path: Path, what: str = "job spec") -> dict[str, Any]:
    """A JSON object from ``path``; a clear error (exit 2) when it cannot be read."""
    try:
        body = json.loads(path.read_text())
    except OSError as e:
        fail(f"cannot read {what} {path}: {e.strerror or e}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        fail(f"{what} {path} is not valid JSON: {e}")
    if not isinstance(body, dict):
        fail(f"{what} {path} must be a JSON object, not {type(body).__name__}")
    return body


def print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2))


DeviceOpt = Annotated[
    str,
    typer.Option("--device", help="auto (CUDA if present), cpu or cuda.", envvar="ATOMD_DEVICE"),
]
UrlOpt = Annotated[
    str, typer.Option("--url", envvar="ATOMD_URL", help="Control API of the daemon to talk to.")
]
TokenOpt = Annotated[
    str | None,
    typer.Option(
        "--token", envvar="ATOMD_CONTROL_TOKEN", help="Bearer token, if the daemon needs one."
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the raw JSON answer.")]

# Seconds between two polls of the daemon by a command that follows a job or the events.
POLL_S = 2.0
# Points asked of a daemon at a time when reading a job's progress (the API's largest page).
PROGRESS_PAGE = 10000


def connect(url: str, token: str | None) -> ControlClient:
    """A client of the daemon at ``url``: each call has a timeout, and an unreachable daemon
    is a clear error (``atomd.client``)."""
    return ControlClient(url, token=token)


def pause(seconds: float) -> None:
    time.sleep(seconds)


def renaming(renamed: dict[str, str]) -> type[TyperCommand]:
    """A command class that still takes each old option spelling in ``renamed`` (old -> new)
    for one release: it warns and reads it as the new one; help shows only the new one."""

    class Renaming(TyperCommand):
        def parse_args(self, ctx: Any, args: list[str]) -> list[str]:  # typer's own click
            out: list[str] = []
            for i, arg in enumerate(args):
                if arg == "--":
                    out += args[i:]
                    break
                name, eq, value = arg.partition("=")
                if name in renamed:
                    new = renamed[name]
                    warn(f"{name} is deprecated and goes away in the next release; use {new}")
                    arg = new + eq + value
                out.append(arg)
            return super().parse_args(ctx, out)

    return Renaming
