"""``atomd peers``, ``bans``, ``ban`` and ``unban``: the swarm as a daemon sees it."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from atomd.cli import common
from atomd.cli.common import URL_DEFAULT, JsonOpt, TokenOpt, UrlOpt
from atomd.cli.render import console, fmt, show, when

KeyArg = Annotated[str, typer.Argument(help="The peer's Ed25519 key (64 hex).")]


def peers(url: UrlOpt = URL_DEFAULT, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """List the peers this daemon knows, with their state."""
    with common.connect(url, token) as c:
        data = c.request("GET", "/v1/peers")

    def render(rows: list[dict[str, Any]]) -> None:
        t = Table("id", "url", "state", "last seen", "rtt ms", "excluded", box=None)
        for p in rows:
            excluded = p.get("excluded")
            why = f"{excluded}: {p.get('excluded_reason') or ''}" if excluded else ""
            t.add_row(
                p["id"][:16], p["url"], p["state"], p["last_seen_at"][:19], fmt(p["rtt_ms"], 1),
                why,
            )  # fmt: skip
        console().print(t)

    show(data, as_json, render)


def bans(url: UrlOpt = URL_DEFAULT, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """List the peer keys banned on this daemon (`atomd ban` adds one, `atomd unban` lifts it)."""
    with common.connect(url, token) as c:
        data = c.request("GET", "/v1/bans")

    def render(rows: list[dict[str, Any]]) -> None:
        if not rows:
            typer.echo("no bans")
            return
        t = Table("public key", "since", "reason", box=None)
        for b in rows:
            t.add_row(b["public_key"], when(b["created_at"]), b["reason"])
        console().print(t)

    show(data, as_json, render)


def ban(
    public_key: KeyArg,
    reason: Annotated[str, typer.Option(help="Recorded with the ban.")] = "banned by the operator",
    url: UrlOpt = URL_DEFAULT,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Ban a peer's key: refused on the peer plane, its deltas never merged, never a state
    donor; persisted until `atomd unban`. `atomd peers --json` shows each peer's key."""
    with common.connect(url, token) as c:
        data = c.request(
            "POST", "/v1/bans", json={"public_key": public_key.lower(), "reason": reason}
        )
    show(data, as_json, lambda b: typer.echo(f"banned {b['public_key']}: {b['reason']}"))


def unban(public_key: KeyArg, url: UrlOpt = URL_DEFAULT, token: TokenOpt = None) -> None:
    """Lift a ban, or end the quarantine of a peer with that key."""
    with common.connect(url, token) as c:
        c.request("DELETE", f"/v1/bans/{public_key.lower()}")
    typer.echo(f"unbanned {public_key.lower()}")


def register(app: typer.Typer) -> None:
    app.command()(peers)
    app.command()(bans)
    app.command()(ban)
    app.command()(unban)
