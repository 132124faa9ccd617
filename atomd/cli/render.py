"""Tables and values as the daemon commands print them."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from atomd.cli.common import print_json
from atomd.logs import printable


class PlainConsole(Console):
    """A console that prints every string as it is: no rich markup (a stray `[/x]` would raise
    MarkupError), no emoji codes, control characters escaped (``atomd.logs.printable``). The
    tables show what peers chose: a member's URL, a reason quoting its frame, a joined job's
    spec."""

    def render_str(self, text: str, **kwargs: Any) -> Text:
        return super().render_str(printable(text), **{**kwargs, "markup": False, "emoji": False})


def console() -> Console:
    # Piped output keeps whole ids and timestamps instead of squeezing to 80 columns.
    width = None if sys.stdout.isatty() else 240
    return PlainConsole(width=width, markup=False, emoji=False)


def show(data: Any, as_json: bool, render: Callable[[Any], None]) -> None:
    """``data`` as JSON, or through ``render``."""
    if as_json:
        print_json(data)
    else:
        render(data)


def fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def when(at: str) -> str:
    """An API timestamp as ``YYYY-MM-DD HH:MM:SS``."""
    return at[:19].replace("T", " ")


def job_table(jobs: list[dict[str, Any]]) -> None:
    t = Table("id", "state", "preset", "step", "tokens", "loss", "val_loss", "created", box=None)
    for j in jobs:
        t.add_row(
            j["id"],
            j["state"],
            j["spec"].get("preset", "?"),
            str(j["step"]),
            f"{j['tokens']:,}",
            fmt(j["loss"]),
            fmt(j["val_loss"]),
            when(j["created_at"]),
        )
    console().print(t)


JOB_FIELDS = (
    "id", "state", "reason", "step", "tokens", "loss", "val_loss", "out_dir", "created_at",
    "started_at", "finished_at",
)  # fmt: skip


def job_detail(j: dict[str, Any]) -> None:
    t = Table(box=None, show_header=False)
    for key in JOB_FIELDS:
        t.add_row(key, fmt(j.get(key)))
    if j.get("sync"):
        t.add_row("cadence", cadence(j["sync"]))
    t.add_row("spec", json.dumps(j["spec"], separators=(",", ":")))
    console().print(t)


def progress_table(points: list[dict[str, Any]]) -> None:
    t = Table("step", "tokens", "loss", "val_loss", "tokens/s", "every", "at", box=None)
    for p in points:
        t.add_row(
            str(p["step"]),
            f"{p['tokens']:,}",
            fmt(p["loss"]),
            fmt(p["val_loss"]),
            f"{p['tokens_per_s']:,.0f}",
            fmt((p.get("sync") or {}).get("every")),
            p["at"][:19],
        )
    console().print(t)


def progress_line(p: dict[str, Any]) -> str:
    """One progress point as one line of ``atomd job logs``."""
    parts = [
        when(p["at"]),
        f"step {p['step']}",
        f"tokens {p['tokens']:,}",
        f"loss {fmt(p['loss'])}",
    ]
    if p.get("val_loss") is not None:
        parts.append(f"val_loss {fmt(p['val_loss'])}")
    if p.get("lr") is not None:
        parts.append(f"lr {p['lr']:.3g}")
    parts.append(f"{p['tokens_per_s']:,.0f} tokens/s")
    every = (p.get("sync") or {}).get("every")
    if every is not None:
        parts.append(f"every {every}")
    return printable("  ".join(parts))


def event_line(e: dict[str, Any]) -> str:
    """One event as one line of ``atomd events``."""
    about = " ".join(f"{k} {e[k][:16]}" for k in ("job_id", "peer_id") if e.get(k) is not None)
    return printable(
        f"{when(e['at'])}  {e['kind']:<18} {e['message']}" + (f"  [{about}]" if about else "")
    )


def cadence(sync: dict[str, Any]) -> str:
    """The cadence in force and the time in sync, as a swarm job reports them."""
    every = sync.get("every")
    text = "every ? steps" if every is None else f"every {every} step{'s' * (every != 1)}"
    if sync.get("auto"):
        text += f" (auto: a round every {fmt(sync.get('period_s'))} s across the swarm)"
    text = (
        f"{text}, {sync.get('rounds', 0)} rounds; sync work {fmt(sync.get('busy_s'), 1)} s, "
        f"waiting {fmt(sync.get('wait_s'), 1)} s"
    )
    final = sync.get("final_model")
    if final == "average":
        shares = sync.get("average_shares")
        text += f"; ended on the average of the peers' models ({shares} other share(s))"
    elif final is not None:
        text += "; ended on " + ("the swarm's model" if final == "swarm" else "its own replica")
    return text
