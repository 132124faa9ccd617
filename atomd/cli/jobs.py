"""``atomd job ...``: start, stop and inspect the training jobs of a running daemon."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from atomd.cli import common
from atomd.cli.common import URL_DEFAULT, JsonOpt, TokenOpt, UrlOpt, read_json_object
from atomd.cli.render import job_detail, job_table, progress_line, progress_table, show
from atomd.client import ControlClient
from atomd.db.schemas import TERMINAL_JOB_STATES
from atomd.logs import printable

job_app = typer.Typer(
    help="Start, stop and inspect training jobs of a running daemon.",
    no_args_is_help=True,
    rich_markup_mode=None,
)


@job_app.command("start")
def job_start(
    url: UrlOpt = URL_DEFAULT,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
    spec_file: Annotated[Path | None, typer.Option("--spec", help="A JSON job spec.")] = None,
    preset: Annotated[str | None, typer.Option(help=common.spec_help("preset"))] = None,
    data: Annotated[str | None, typer.Option(help=common.spec_help("data"))] = None,
    max_steps: Annotated[int | None, typer.Option(help=common.spec_help("max_steps"))] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Any spec field: KEY=VALUE (JSON value); repeatable."),
    ] = None,
) -> None:
    """Start a job. With no options: the tiny model on the bundled corpus."""
    body: dict[str, Any] = {}
    if spec_file is not None:
        body = read_json_object(spec_file)
    for item in set_ or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"--set {item!r}: expected KEY=VALUE")
        try:
            body[key] = json.loads(value)
        except json.JSONDecodeError:
            body[key] = value
    given = {"preset": preset, "data": data, "max_steps": max_steps}
    body.update({k: v for k, v in given.items() if v is not None})
    with common.connect(url, token) as c:
        job = c.request("POST", "/v1/jobs", json=body)
    show(job, as_json, lambda j: typer.echo(f"started job {j['id']} ({j['state']})"))


@job_app.command("stop")
def job_stop(
    job_id: str, url: UrlOpt = URL_DEFAULT, token: TokenOpt = None, as_json: JsonOpt = False
) -> None:
    """Stop a job at its next step boundary; it writes a checkpoint first."""
    with common.connect(url, token) as c:
        job = c.request("POST", f"/v1/jobs/{job_id}/stop")
    show(job, as_json, lambda j: typer.echo(f"job {j['id']}: {j['state']}"))


@job_app.command("resume")
def job_resume(
    job_id: str, url: UrlOpt = URL_DEFAULT, token: TokenOpt = None, as_json: JsonOpt = False
) -> None:
    """Continue a stopped or failed job from its newest good checkpoint."""
    with common.connect(url, token) as c:
        job = c.request("POST", f"/v1/jobs/{job_id}/resume")
    show(job, as_json, lambda j: typer.echo(f"job {j['id']}: {j['state']} (resuming)"))


@job_app.command("list")
def job_list(url: UrlOpt = URL_DEFAULT, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """List jobs, newest first."""
    with common.connect(url, token) as c:
        show(c.request("GET", "/v1/jobs"), as_json, job_table)


@job_app.command("show")
def job_show(
    job_id: str,
    url: UrlOpt = URL_DEFAULT,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
    last: Annotated[
        int, typer.Option(min=1, max=10000, help="Progress points to show, the newest.")
    ] = 5,
) -> None:
    """Show one job and its latest progress."""
    with common.connect(url, token) as c:
        job = c.request("GET", f"/v1/jobs/{job_id}")
        points = c.request(
            "GET", f"/v1/jobs/{job_id}/progress", params={"limit": last, "newest": "true"}
        )
    if as_json:
        common.print_json({**job, "progress": points[-last:]})
        return
    job_detail(job)
    progress_table(points[-last:])


def progress_after(c: ControlClient, job_id: str, after: int | None) -> list[dict[str, Any]]:
    """Every progress point of the job after step ``after`` (all with None), a page at a time."""
    points: list[dict[str, Any]] = []
    while True:
        params: dict[str, Any] = {"limit": common.PROGRESS_PAGE}
        last = points[-1]["step"] if points else after
        if last is not None:
            params["after_step"] = last
        page = c.request("GET", f"/v1/jobs/{job_id}/progress", params=params)
        points.extend(page)
        if len(page) < common.PROGRESS_PAGE:
            return points


@job_app.command("logs")
def job_logs(
    job_id: str,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new lines until the job ends.")
    ] = False,
    last: Annotated[
        int | None, typer.Option(min=1, max=10000, help="Start with the newest N lines only.")
    ] = None,
    url: UrlOpt = URL_DEFAULT,
    token: TokenOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
) -> None:
    """Print a job's progress lines (step, tokens, loss, validation loss, throughput), oldest
    first; with --follow, new ones as they come until the job ends (or Ctrl-C)."""

    def emit(points: list[dict[str, Any]]) -> int | None:
        for p in points:
            typer.echo(json.dumps(p) if as_json else progress_line(p))
        return points[-1]["step"] if points else None

    with common.connect(url, token) as c:
        job = c.request("GET", f"/v1/jobs/{job_id}")
        if last is not None:
            params = {"limit": last, "newest": "true"}
            step = emit(c.request("GET", f"/v1/jobs/{job_id}/progress", params=params))
        else:
            step = emit(progress_after(c, job_id, None))
        try:
            while follow and job["state"] not in TERMINAL_JOB_STATES:
                common.pause(common.POLL_S)
                job = c.request("GET", f"/v1/jobs/{job_id}")  # before the points: none missed
                newest = emit(progress_after(c, job_id, step))
                step = step if newest is None else newest
        except KeyboardInterrupt:
            return
    if follow:
        reason = f": {job['reason']}" if job.get("reason") else ""
        end = f"job {job['id']} {job['state']} at step {job['step']}{reason}"
        typer.echo(printable(end), err=True)  # the reason may quote a peer


@job_app.command("wait")
def job_wait(
    job_id: str,
    url: UrlOpt = URL_DEFAULT,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Wait until a job ends; exit 0 if it finished, 1 if it failed or was stopped (for
    scripts: `atomd job wait ID && atomd export ...`)."""
    with common.connect(url, token) as c:
        job = c.request("GET", f"/v1/jobs/{job_id}")
        try:
            while job["state"] not in TERMINAL_JOB_STATES:
                common.pause(common.POLL_S)
                job = c.request("GET", f"/v1/jobs/{job_id}")
        except KeyboardInterrupt:
            raise typer.Exit(130) from None
    reason = f": {job['reason']}" if job.get("reason") else ""
    show(
        job,
        as_json,
        lambda j: typer.echo(printable(f"job {j['id']} {j['state']} at step {j['step']}{reason}")),
    )
    if job["state"] != "finished":
        raise typer.Exit(1)
