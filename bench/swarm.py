"""The real-daemon swarm benchmark: does training together beat training alone?

N real ``atomd run`` daemons (default 4), as root each in its own network namespace
(``bench/netns.py``: veth byte counters, an optional upload limit with ``tc tbf``; delay is not
emulated where the kernel has no ``netem``, and the JSON says so), else on loopback. The first
is the others' seed; a job is started through its REST API and the others join it. The task is
``atomd bench sync``'s (``bench/sync.py``): the tiny GPT, sequences of 128, batch 16 per peer,
600 steps, lr 3e-3, 50 warm-up steps, cosine to 10%, 20 x 16 fixed validation windows.

In the same run, on the same validation windows, the two references, each one real daemon
training a local job: one peer alone at the per-peer batch (``alone``) and one process at N
times the batch (``S``, the swarm's batches in lockstep). The score:

    gain_recovered = (alone - swarm_mean) / (alone - S)

1 when the swarm learns as well as the large-batch process, 0 when no better than one peer.

Scenarios: ``unlimited``; ``upload-1mbit`` and ``upload-256kbit`` (every peer's upload limited
by a token bucket); ``sigkill`` (unlimited; a peer SIGKILLed at 40% of its steps and restarted
20 s later); ``sigstop`` (unlimited; a peer stopped with SIGSTOP at 40% of its steps and
continued 20 s later, as a machine that sleeps or swaps: it comes back with the state it had,
long after membership declared it dead); ``partition`` (a peer's link cut at 40 % and joined
again 20 s later, as a network that fails: it trains on alone meanwhile; namespaces only). Each
reports per-peer final validation loss, the swarm mean, ``gain_recovered``, wall time, bytes per
peer on the wire (the veth: membership, deltas and state transfers) and in delta frames,
membership bytes per second while the swarm idles before the job, the cadence used (steps per
round sent, the swarm's round period), deltas late and refused (and why), and the trainer time
each peer spent in sync work and waiting for deltas. Load averages are recorded with every
timing (the machine may be shared).

Bounds: every daemon dies with the benchmark (``PR_SET_PDEATHSIG``) and is stopped at the end of
its scenario; every scenario has a deadline; polling loops are bounded by it; namespaces are
removed on every way out (and those of a benchmark that was SIGKILLed, by the next run).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from atomd.launch import interrupts, shielded
from atomd_bench import netns
from atomd_bench.swarm_daemon import (
    DONE,
    POLL_S,
    START_TIMEOUT_S,
    Daemon,
    idle_bytes,
    job_state,
    load_avg,
    open_network,
    until,
    wait_formed,
)
from atomd_bench.swarm_report import (
    anchor_divergence,
    peer_report,
    scenario_report,
    settled_divergence,
    targets,
)
from atomd_bench.swarm_scenarios import (
    FAULT_AT,
    QUICK,
    SCENARIOS,
    Fault,
    Scenario,
    ScenarioRecord,
    Task,
)
from atomd_bench.sync_runs import PEERS, STEPS


def run_scenario(
    task: Task, scenario: Scenario, root: Path, *, network: str,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One scenario: start the swarm, let it idle, train the job, report (see the docstring)."""
    say = progress or (lambda _: None)
    n = task.peers
    deadline = time.monotonic() + task.deadline_s
    net = open_network(network, n, scenario.upload_kbit)
    daemons: list[Daemon] = []
    threads = max(1, (os.cpu_count() or 1) // n)
    load_start = load_avg()
    t0 = time.monotonic()
    seen = ScenarioRecord()
    try:
        netem = net.probe_netem() if isinstance(net, netns.Namespaces) else "loopback"
        for i in range(n):
            seed = daemons[0].peer_url if daemons else None
            daemons.append(Daemon(i, root / scenario.name, net, seed=seed, threads=threads,
                                  env=_daemon_env(task)))  # fmt: skip
            daemons[-1].start()
            if i == 0:
                until(daemons[0].ready, deadline=deadline, what="peer0 ready")
        wait_formed(daemons, deadline=deadline)
        say(f"{scenario.name}: {n} daemons up ({net.mode}) in {time.monotonic() - t0:.1f} s")
        idle = idle_bytes(net, n, task.idle_s)
        at_start = [net.counters(i) for i in range(n)]
        spec = {**task.spec(task.batch), "sync": {**task.sync, "every": task.every}}
        r = daemons[0].request("POST", "/v1/jobs", json=spec, timeout=START_TIMEOUT_S)
        r.raise_for_status()
        seen.job_id = r.json()["id"]
        seen.started = time.monotonic()
        if scenario.fault is not None:
            seen.fault = Fault(victim=n - 1, at_step=max(1, int(FAULT_AT * task.steps)),
                              how=scenario.fault)  # fmt: skip
        _train(task, daemons, net, seen, deadline, say)
        seen.ended = time.monotonic()
        at_end = [net.counters(i) for i in range(n)]
        peers = [peer_report(d, seen.job_id) for d in daemons]
    finally:
        with shielded():  # a second signal does not leave daemons or namespaces behind
            try:
                for d in daemons:
                    d.stop()
            finally:
                net.close()
    wall = seen.ended - seen.started
    report = scenario_report(
        scenario, net.mode, netem, peers, idle, at_start, at_end, seen, wall,
        load_start, load_avg(),
    )  # fmt: skip
    if seen.job_id is not None:
        dirs = [d.data_dir for d in daemons]
        report["anchor_divergence_final"] = anchor_divergence(dirs, seen.job_id)
        report["settled_divergence_final"] = settled_divergence(
            dirs, seen.job_id, {**task.sync, "every": task.every}
        )
    return report


def _train(
    task: Task, daemons: list[Daemon], net: netns.Network, seen: ScenarioRecord, deadline: float,
    say: Callable[[str], None],
) -> None:  # fmt: skip
    """Poll until every peer's job is done (or the deadline); strike the victim with its fault
    and undo it (``_strike``)."""
    fault = seen.fault
    last_line = 0.0
    while True:
        now = time.monotonic()
        # A stopped daemon answers nothing: not asked until it is continued.
        stopped = None
        if fault is not None and fault.how == "sigstop" and fault.restarted_at is None:
            stopped = None if fault.killed_at is None else fault.victim
        states = {
            d.i: job_state(d, seen.job_id) if d.alive() and d.i != stopped else None
            for d in daemons
        }
        for i, s in states.items():
            back = fault is None or i != fault.victim or fault.restarted_at is not None
            if s is not None and s["state"] in DONE and i not in seen.finished and back:
                seen.finished[i] = now
        if len(seen.finished) == len(daemons):
            return
        if fault is not None:
            victim = daemons[fault.victim]
            s = states[fault.victim]
            if fault.killed_at is None and s is not None and s["step"] >= fault.at_step:
                say(f"  {_strike(fault.how, victim, net, undo=False)} at step {s['step']}")
                fault.killed_at, fault.killed_step = now, s["step"]
            elif (
                fault.killed_at is not None
                and fault.restarted_at is None
                and now - fault.killed_at >= task.restart_after_s
            ):
                say(f"  {_strike(fault.how, victim, net, undo=True)}")
                fault.restarted_at = now
        if now - last_line > 30:
            steps = " ".join(
                f"{s['step'] if s else '-'}" for s in states.values()
            )  # fmt: skip
            say(f"  t+{now - seen.started:.0f} s: steps {steps} (load {load_avg()[0]})")
            last_line = now
        if now > deadline:
            seen.timed_out = True
            say("  deadline reached: stopping")
            return
        time.sleep(POLL_S)


def _strike(how: str, victim: Daemon, net: netns.Network, *, undo: bool) -> str:
    """Strike ``victim`` with fault ``how`` (``Scenario.fault``), or undo it; what was done."""
    if how == "sigkill":
        victim.start() if undo else victim.kill()
        return f"{'restarted' if undo else 'SIGKILL'} peer{victim.i}"
    if how == "sigstop":
        victim.resume() if undo else victim.pause()
        return f"{'continued' if undo else 'SIGSTOP'} peer{victim.i}"
    if how == "partition" and isinstance(net, netns.Namespaces):
        net.cut(victim.i, cut=not undo)
        return f"{'joined again' if undo else 'cut off'} peer{victim.i}'s link"
    raise ValueError(f"no fault {how!r} on a {net.mode} network")


def _daemon_env(task: Task) -> dict[str, str]:
    return {} if task.tcp_congestion is None else {"ATOMD_TCP_CONGESTION": task.tcp_congestion}


def run_references(
    task: Task, root: Path, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """One peer alone at the per-peer batch and one process at N x the batch: two daemons on
    loopback, each training a local job, side by side."""
    say = progress or (lambda _: None)
    net = netns.Loopback(2)
    runs = {"alone": task.batch, "large_batch": task.batch * task.peers}
    threads = max(1, (os.cpu_count() or 1) // 2)
    daemons = [
        Daemon(i, root / "references", net, seed=None, threads=threads, env=_daemon_env(task))
        for i in range(2)
    ]
    deadline = time.monotonic() + task.deadline_s
    load_start = load_avg()
    out: dict[str, Any] = {}
    try:
        for d in daemons:
            d.start()
        for d in daemons:
            until(d.ready, deadline=deadline, what=f"reference daemon {d.i} ready")
        jobs = {}
        t0 = time.monotonic()
        for d, (name, batch) in zip(daemons, runs.items(), strict=True):
            r = d.request(
                "POST", "/v1/jobs?scope=local", json=task.spec(batch), timeout=START_TIMEOUT_S
            )
            r.raise_for_status()
            jobs[name] = (d, r.json()["id"], batch)
        done: dict[str, float] = {}
        while len(done) < len(jobs):
            if time.monotonic() > deadline:
                raise TimeoutError("the references did not finish before the deadline")
            for name, (d, jid, _) in jobs.items():
                s = job_state(d, jid)
                if name not in done and s is not None and s["state"] in DONE:
                    done[name] = time.monotonic() - t0
                    say(f"reference {name}: val {s['val_loss']} in {done[name]:.0f} s")
            time.sleep(POLL_S)
        for name, (d, jid, batch) in jobs.items():
            job = d.json(f"/v1/jobs/{jid}")
            out[name] = {"batch": batch, "state": job["state"], "step": job["step"],
                         "val_loss": job["val_loss"], "wall_s": round(done[name], 1)}  # fmt: skip
    finally:
        for d in daemons:
            d.stop()
    out["load_avg_start"], out["load_avg_end"] = load_start, load_avg()
    return out


def run(
    *,
    quick: bool = False,
    peers: int | None = None,
    scenarios: Sequence[str] | None = None,
    every: int | str | None = None,
    sync: Mapping[str, Any] | None = None,
    steps: int | None = None,
    network: str = "auto",
    references: bool = True,
    references_from: Path | None = None,
    root: Path | None = None,
    progress: Callable[[str], None] | None = None,
    tcp_congestion: str | None = None,
) -> dict[str, Any]:
    """Run the references and the scenarios; the benchmark's JSON object. ``references_from``:
    take the references from an earlier run's JSON instead (the same task, checked), to save
    their ~16 min on 2 cores; the JSON says where they came from."""
    task = QUICK if quick else Task()
    task = replace(
        task,
        peers=peers or task.peers,
        every=task.every if every is None else every,
        sync=dict(sync or {}),
        steps=steps or task.steps,
        tcp_congestion=tcp_congestion,
    )
    names = list(scenarios or SCENARIOS)
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    # A daemon resumes what its folder holds: an earlier run's job would answer 409.
    used = [root / s for s in names if root is not None and (root / s).exists()]
    if used:
        raise ValueError(
            f"{', '.join(map(str, used))}: used by an earlier run; keep in a new folder"
        )
    why_not = netns.namespaces_available()
    if network == "auto":
        network = "netns" if why_not is None else "loopback"
    elif network == "netns" and why_not is not None:
        raise RuntimeError(f"network namespaces unavailable: {why_not}")
    if network == "loopback":
        skipped = [s for s in names if SCENARIOS[s].needs_namespaces]
        names = [s for s in names if s not in skipped]
    else:
        skipped = []
    say = progress or (lambda line: print(f"[bench swarm] {line}", file=sys.stderr, flush=True))
    t0 = time.monotonic()
    results: list[dict[str, Any]] = []
    refs: dict[str, Any] | None = None
    stale = netns.sweep_stale() if network == "netns" else []
    with contextlib.ExitStack() as stack:
        stack.enter_context(interrupts())  # SIGTERM unwinds too: every finally runs
        base = root or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-swarm-")))
        if references_from is not None:
            refs = _earlier_references(references_from, task)
        elif references:
            refs = run_references(task, base, say)
        for name in names:
            s = run_scenario(task, SCENARIOS[name], base, network=network, progress=say)
            if refs is not None and s["swarm_mean_val_loss"] is not None:
                alone, large = refs["alone"]["val_loss"], refs["large_batch"]["val_loss"]
                s["gain_recovered"] = (alone - s["swarm_mean_val_loss"]) / (alone - large)
            say(f"{name}: swarm mean {s['swarm_mean_val_loss']}, gain "
                f"{s.get('gain_recovered')}, {s['wall_s']} s")  # fmt: skip
            results.append(s)
    return {
        "task": {**asdict(task), "spec_per_peer": task.spec(task.batch), "quick": quick},
        "network": network,
        "network_note": None if network == "netns" else f"loopback: {why_not}",
        "skipped_scenarios": {
            s: "an upload limit or a cut link needs network namespaces" for s in skipped
        },
        "stale_namespaces_removed": stale,
        "references": refs,
        "scenarios": results,
        "targets": targets(results, refs),
        "wall_s": round(time.monotonic() - t0, 1),
    }


def _earlier_references(path: Path, task: Task) -> dict[str, Any]:
    """The references of an earlier run of the same task (their training is deterministic:
    the same seeds, data and validation windows), marked as such."""
    earlier = json.loads(path.read_text())
    theirs = {k: v for k, v in earlier["task"].items() if k in asdict(task)}
    ours = {k: v for k, v in asdict(task).items() if k in ("peers", "steps", "batch", "seq_len",
                                                             "eval_batches")}  # fmt: skip
    differ = {k: (theirs.get(k), v) for k, v in ours.items() if theirs.get(k) != v}
    if differ:
        raise ValueError(f"{path}: references of another task (earlier, now): {differ}")
    if not earlier.get("references"):
        raise ValueError(f"{path} holds no references")
    return {**earlier["references"], "from": str(path)}


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m atomd_bench swarm [--quick] [--peers N] [--scenarios a,b] [--every auto|N]
    [--sync JSON] [--steps N] [--network auto|netns|loopback] [--no-references]
    [--references-from FILE] [--tcp-congestion NAME] [--out FILE] [--keep DIR]``."""
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m atomd_bench swarm", description=__doc__.split("\n")[0]
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"a smoke run: {QUICK.peers} peers, {QUICK.steps} steps of a smaller batch "
        "(minutes instead of ~10 per scenario; its gains mean little)",
    )
    ap.add_argument("--peers", type=int, help=f"daemons in the swarm (default {PEERS})")
    ap.add_argument(
        "--scenarios",
        help=f"comma-separated, of: {', '.join(SCENARIOS)} (default: all; the upload limits "
        "need root for network namespaces)",
    )
    ap.add_argument("--every", help='the job\'s sync.every: "auto" (default) or a number of steps')
    ap.add_argument(
        "--sync",
        type=json.loads,
        default={},
        help="more of the job's sync settings, as JSON (e.g. '{\"topk_fraction\": 0.02}')",
    )
    ap.add_argument("--steps", type=int, help=f"training steps per peer (default {STEPS})")
    ap.add_argument(
        "--network",
        choices=["auto", "netns", "loopback"],
        default="auto",
        help="netns (root: a namespace per daemon, bytes counted on each veth), loopback, or "
        "auto: netns when root",
    )
    ap.add_argument(
        "--no-references",
        action="store_true",
        help="skip the two references (one peer alone; one process at N times the batch)",
    )
    ap.add_argument(
        "--references-from",
        type=Path,
        help="take the references from an earlier run's JSON (the same task)",
    )
    ap.add_argument(
        "--tcp-congestion",
        help="the daemons' ATOMD_TCP_CONGESTION (default: theirs, cubic; 'system': the "
        "kernel's); each peer's report says what its start-up line named",
    )
    ap.add_argument("--out", type=Path, help="also write the JSON (indented) here")
    ap.add_argument(
        "--keep", type=Path, help="keep the daemons' folders and logs here (a new folder)"
    )
    a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    every: int | str | None = None
    if a.every is not None:
        every = a.every if a.every == "auto" else int(a.every)
    result = run(
        quick=a.quick, peers=a.peers, scenarios=a.scenarios.split(",") if a.scenarios else None,
        every=every, sync=a.sync, steps=a.steps, network=a.network,
        references=not a.no_references, references_from=a.references_from, root=a.keep,
        tcp_congestion=a.tcp_congestion,
    )  # fmt: skip
    text = json.dumps(result)
    if a.out is not None:
        a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    main()
