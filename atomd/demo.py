"""``atomd demo``: a small swarm of real daemons on loopback training one model together.

Three ``atomd run`` processes start from one seed, a job is started through the REST API of the
first, the others join it, and every few seconds one line per peer shows its step, loss,
validation loss, the cadence of its rounds and the delta bytes it has sent and received. Beside
them one more daemon trains the same job alone (a local job: the same batch and steps, its share
of this machine, the same validation windows), and at the end the demo prints the swarm's final
validation loss next to the lone peer's. Ctrl-C stops every daemon cleanly (each checkpoints);
so does the end of the job.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from atomd.launch import (
    READY_TIMEOUT,
    DaemonProcess,
    Interrupted,
    check_interrupts,
    interrupts,
    peer_id,
    start_swarm,
    stop_all,
    wait_until,
)


def _get(d: DaemonProcess, path: str) -> Any:
    r = httpx.get(d.url + path, timeout=10)
    r.raise_for_status()
    return r.json()


def _bytes(d: DaemonProcess, job_id: str) -> tuple[int, int, int]:
    """Bytes sent, bytes received and deltas merged, from the daemon's own round records."""
    rounds = _get(d, f"/v1/jobs/{job_id}/rounds?limit=10000")
    sent = sum(r["bytes"] for r in rounds if r["direction"] == "sent" and r["applied"])
    received = [r for r in rounds if r["direction"] == "received" and r["applied"]]
    return sent, sum(r["bytes"] for r in received), len(received)


def _line(name: str, d: DaemonProcess, job_id: str) -> tuple[str, dict[str, Any]]:
    job = _get(d, f"/v1/jobs/{job_id}")
    val = f"{job['val_loss']:.3f}" if job["val_loss"] is not None else "  -  "
    loss = f"{job['loss']:.3f}" if job["loss"] is not None else "  -  "
    text = f"  {name:<6} {job['state']:<9} step {job['step']:>4}  loss {loss}  val {val}"
    if job.get("scope") == "swarm":
        sent, received, merged = _bytes(d, job_id)
        every = (job.get("sync") or {}).get("every")
        text += (
            f"  every {every if every is not None else '-':>3}  sent {sent / 1024:>7.1f} KiB  "
            f"received {received / 1024:>7.1f} KiB  deltas merged {merged:>3}"
        )
    return text, job


def _verdict(swarm: list[float | None], alone: float | None) -> str:
    """The demo's last line: the swarm's final validation loss against the lone peer's."""
    done = [v for v in swarm if v is not None]
    if not done or alone is None:
        return "no final validation loss to compare (stopped early)"
    mean = sum(done) / len(done)
    verdict = "the swarm wins" if mean < alone else "the swarm does NOT win"
    return (
        f"final validation loss: swarm {mean:.3f} (mean of {len(done)} peers), one peer alone "
        f"(the same steps, side by side) {alone:.3f}: {verdict} by {alone - mean:+.3f}"
    )


def run_swarm_demo(
    root: Path, *, peers: int = 3, max_steps: int = 600, every: int | str = "auto"
) -> int:
    """0 when the job finished or Ctrl-C stopped it, 1 on a failure, 143 on SIGTERM. Every
    daemon started (the lone one included) is stopped on every way out; if the demo itself is
    killed, the kernel sends them SIGTERM (see ``atomd.launch``)."""
    spec: dict[str, Any] = {"preset": "tiny", "micro_batch_size": 16, "max_steps": max_steps}
    lone_spec = dict(spec)
    spec["sync"] = {"every": every}
    how_often = "as often as it pays" if every == "auto" else f"every {every} steps"
    print(f"atomd demo: {peers} daemons on loopback train the tiny GPT on Shakespeare together,")
    print(f"each on its own data, exchanging compressed weight deltas {how_often};")
    print("one more daemon trains the same job alone, for comparison.")
    print(f"Data and logs: {root}   (Ctrl-C stops everything cleanly)\n", flush=True)
    with interrupts():
        return _swarm_demo(root, peers, spec, lone_spec)


def _swarm_demo(root: Path, peers: int, spec: dict[str, Any], lone_spec: dict[str, Any]) -> int:
    ds: list[DaemonProcess] = []
    everyone: list[DaemonProcess] = []  # the swarm's daemons and the lone one
    code = 1
    try:
        t0 = time.monotonic()
        start_swarm(root, peers, started=ds)
        everyone.extend(ds)
        # The lone daemon: no seed, so it never meets the others; the swarm's share of cores.
        alone = DaemonProcess(root / "alone", env=ds[0].env)
        everyone.append(alone)
        alone.start()
        wait_until(
            lambda: all(len(_get(d, "/v1/peers")) == peers for d in ds),
            timeout=READY_TIMEOUT,
            what=f"every daemon to list all {peers} peers",
        )
        check_interrupts()
        ids = [peer_id(d) for d in ds]
        print(f"{peers} daemons ready in {time.monotonic() - t0:.1f} s:")
        for i, d in enumerate(ds):
            print(f"  peer{i}: {ids[i][:16]}…  control {d.url}  peer plane {d.peer_url}")
        job = httpx.post(f"{ds[0].url}/v1/jobs", json=spec, timeout=READY_TIMEOUT).json()
        job_id = job["id"]
        lone = httpx.post(
            f"{alone.url}/v1/jobs?scope=local", json=lone_spec, timeout=READY_TIMEOUT
        ).json()
        print(f"\nstarted job {job_id} on peer0 (POST {ds[0].url}/v1/jobs); the others join:\n")
        done = False
        while not done:
            time.sleep(5)
            check_interrupts()
            lines, states = [], []
            for i, d in enumerate(ds):
                try:
                    text, j = _line(f"peer{i}", d, job_id)
                    states.append(j["state"])
                except httpx.HTTPError:
                    text = f"  peer{i}  (not answering)"
                lines.append(text)
            try:
                text, lone = _line("alone", alone, lone["id"])
            except httpx.HTTPError:
                text = "  alone  (not answering)"
            lines.append(text)
            print(time.strftime("%H:%M:%S"), flush=True)
            print("\n".join(lines), flush=True)
            done = bool(states) and all(s in ("finished", "failed", "stopped") for s in states)
            done = done and lone.get("state") in ("finished", "failed", "stopped")
        print("\nthe job has finished on every peer.")
        finals = [_get(d, f"/v1/jobs/{job_id}")["val_loss"] for d in ds]
        print(_verdict(finals, _get(alone, f"/v1/jobs/{lone['id']}")["val_loss"]))
        code = 0
    except Interrupted as e:
        what = "Ctrl-C" if e.signum == signal.SIGINT else str(e)
        print(f"\n{what}: stopping the daemons (each checkpoints first)…", flush=True)
        code = 0 if e.signum == signal.SIGINT else 128 + e.signum
    except (httpx.HTTPError, RuntimeError, TimeoutError) as e:
        print(f"demo failed: {e}", file=sys.stderr)
        for d in everyone or ds:
            print(f"--- {d.log_path}\n{d.log()[-2000:]}", file=sys.stderr)
    finally:
        _stop(everyone or ds)
    return code


def _stop(ds: list[DaemonProcess]) -> None:
    """Stop every daemon, say what happened to each, and whether any is left."""

    def force(signum: int, frame: Any) -> None:
        print("\nagain: killing the daemons (SIGKILL)", flush=True)
        for d in ds:
            d.kill()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, force)
    if not ds:
        print("no daemon was started.")
        return
    print(f"stopping {len(ds)} daemon(s) (SIGTERM; a second Ctrl-C kills them):", flush=True)
    for line in stop_all(ds):
        print(f"  {line}", flush=True)
    left = [d for d in ds if d.running()]
    if left:
        print(f"still running: {', '.join(f'{d.name} (pid {d.pid})' for d in left)}")
    else:
        print(f"all {len(ds)} daemons stopped.")
