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
import ctypes
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from atomd.launch import check_interrupts, interrupts, shielded
from atomd_bench import netns
from atomd_bench.sync import BATCH, LR, PEERS, PRESET, SEED, STEPS, VAL_BATCHES, WARMUP

POLL_S = 2.0
HTTP_TIMEOUT_S = 10.0
START_TIMEOUT_S = 120.0  # POST /v1/jobs: admission loads torch, slow on a busy machine
STOP_TIMEOUT_S = 60.0
PR_SET_PDEATHSIG = 1
# The targets (#14): gain_recovered per scenario, bytes per round vs the fp32 model,
# membership bytes/s per idle peer, time blocked on sync as a share of wall time.
GAIN_BARS = {"unlimited": 0.9, "upload-256kbit": 0.7, "sigkill": 0.8}
RATIO_BAR = 100.0
IDLE_BAR = 4000.0
WAIT_BAR = 0.02


@dataclass(frozen=True)
class Task:
    """What every run trains (bench sync's task unless ``--quick``)."""

    peers: int = PEERS
    steps: int = STEPS
    batch: int = BATCH
    seq_len: int | None = None  # the preset's 128
    eval_batches: int = VAL_BATCHES
    every: int | str = "auto"
    sync: dict[str, Any] = field(default_factory=dict)  # more of the job's sync settings
    idle_s: float = 10.0  # membership measured while the swarm idles
    restart_after_s: float = 20.0
    deadline_s: float = 3600.0  # per scenario, and for the references
    tcp_congestion: str | None = None  # the daemons' ATOMD_TCP_CONGESTION; None: their default

    def spec(self, batch: int) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "preset": PRESET,
            "micro_batch_size": batch,
            "max_steps": self.steps,
            "lr": LR,
            "warmup_steps": min(WARMUP, self.steps // 4),
            "eval_batches": self.eval_batches,
            "seed": SEED,
        }
        if self.seq_len is not None:
            spec["seq_len"] = self.seq_len
        return spec


# A smoke test (a few minutes): long enough that the peers that join after the first still
# train most of the job alongside it.
QUICK = Task(
    peers=3, steps=150, batch=8, seq_len=64, eval_batches=2, idle_s=3.0, restart_after_s=5.0,
    deadline_s=600.0,
)  # fmt: skip


@dataclass(frozen=True)
class Scenario:
    name: str
    upload_kbit: int | None = None
    # What befalls the last peer at 40 % of its steps, undone restart_after_s later: "sigkill"
    # (restarted), "sigstop" (continued), "partition" (its link cut: it trains on alone).
    fault: str | None = None

    @property
    def needs_namespaces(self) -> bool:
        return self.upload_kbit is not None or self.fault == "partition"


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("unlimited"),
        Scenario("upload-1mbit", upload_kbit=1000),
        Scenario("upload-256kbit", upload_kbit=256),
        Scenario("sigkill", fault="sigkill"),
        Scenario("sigstop", fault="sigstop"),
        Scenario("partition", fault="partition"),
    )
}


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the benchmark dies, however it dies."""
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class Daemon:
    """One ``atomd run`` of the benchmark, reached through its network's ``call``."""

    def __init__(
        self, i: int, root: Path, net: netns.Network, *, seed: str | None, threads: int,
        env: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.i, self.net = i, net
        self.data_dir = root / f"peer{i}"
        self.log_path = root / f"peer{i}.log"
        listen = net.listen(i)
        self.peer_url = f"https://{listen}"  # TLS, as any swarm runs
        self.argv = [
            sys.executable, "-m", "atomd", "run", "--data-dir", str(self.data_dir),
            "--control", net.control(i), "--listen", listen, "--advertise", self.peer_url,
            "--device", "cpu", "--swarm", "bench-swarm", "--log-level", "INFO",
            *(["--seed", seed] if seed else []),
        ]  # fmt: skip
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("ATOMD_")}
        self.env["OMP_NUM_THREADS"] = str(threads)
        self.env.update(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self._http: httpx.Client | None = None

    def start(self) -> None:
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.net.command(self.i, self.argv),
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )

    def _client(self) -> httpx.Client:  # made and used on the network's thread only
        if self._http is None:
            self._http = httpx.Client(
                base_url=f"http://{self.net.control(self.i)}", timeout=HTTP_TIMEOUT_S
            )
        return self._http

    def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return self.net.call(self.i, lambda: self._client().request(method, path, **kw))

    def json(self, path: str) -> Any:
        r = self.request("GET", path)
        r.raise_for_status()
        return r.json()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ready(self) -> bool:
        if not self.alive():
            raise RuntimeError(f"peer{self.i} exited {self.proc and self.proc.returncode}:\n"
                               + self.tail())  # fmt: skip
        try:
            return self.request("GET", "/readyz").status_code == 200
        except httpx.HTTPError:
            return False

    def pause(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        self._drop_client()

    def stop(self) -> None:
        """SIGTERM (the job checkpoints), SIGKILL after ``STOP_TIMEOUT_S``."""
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGCONT)  # a stopped process holds SIGTERM until then
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=STOP_TIMEOUT_S)
        self._drop_client()

    def _drop_client(self) -> None:
        if self._http is not None:
            client, self._http = self._http, None
            with contextlib.suppress(Exception):
                self.net.call(self.i, client.close)

    def tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""


def _until(predicate: Callable[[], bool], *, deadline: float, what: str) -> None:
    while not predicate():
        check_interrupts()
        if time.monotonic() > deadline:
            raise TimeoutError(f"not before the deadline: {what}")
        time.sleep(0.2)


def _network(kind: str, n: int, upload_kbit: int | None) -> netns.Network:
    if kind == "loopback":
        if upload_kbit is not None:
            raise RuntimeError("an upload limit needs network namespaces (root)")
        return netns.Loopback(n)
    return netns.Namespaces(n, upload_kbit=upload_kbit)


def _job_state(d: Daemon, job_id: str) -> dict[str, Any] | None:
    try:
        r = d.request("GET", f"/v1/jobs/{job_id}")
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


DONE = {"finished", "failed", "stopped"}


FAULT_AT = 0.4  # the share of its steps at which the victim's fault comes (``Scenario.fault``)


@dataclass
class _Kill:
    """The victim's fault (``Scenario.fault``), struck at ``at_step`` and undone after
    ``Task.restart_after_s``."""

    victim: int
    at_step: int
    how: str = "sigkill"
    killed_at: float | None = None
    killed_step: int | None = None
    restarted_at: float | None = None
    resumed_from: int | None = None


@dataclass
class _Run:
    """What one scenario's loop saw, for its report."""

    job_id: str = ""
    started: float = 0.0
    ended: float = 0.0
    finished: dict[int, float] = field(default_factory=dict)
    timed_out: bool = False
    kill: _Kill | None = None


def run_scenario(
    task: Task, scenario: Scenario, root: Path, *, network: str,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One scenario: start the swarm, let it idle, train the job, report (see the docstring)."""
    say = progress or (lambda _: None)
    n = task.peers
    deadline = time.monotonic() + task.deadline_s
    net = _network(network, n, scenario.upload_kbit)
    daemons: list[Daemon] = []
    threads = max(1, (os.cpu_count() or 1) // n)
    load_start = _load()
    t0 = time.monotonic()
    seen = _Run()
    try:
        netem = net.probe_netem() if isinstance(net, netns.Namespaces) else "loopback"
        for i in range(n):
            seed = daemons[0].peer_url if daemons else None
            daemons.append(Daemon(i, root / scenario.name, net, seed=seed, threads=threads,
                                  env=_daemon_env(task)))  # fmt: skip
            daemons[-1].start()
            if i == 0:
                _until(daemons[0].ready, deadline=deadline, what="peer0 ready")
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
            seen.kill = _Kill(victim=n - 1, at_step=max(1, int(FAULT_AT * task.steps)),
                              how=scenario.fault)  # fmt: skip
        _train(task, daemons, net, seen, deadline, say)
        seen.ended = time.monotonic()
        at_end = [net.counters(i) for i in range(n)]
        peers = [_peer_report(d, seen.job_id) for d in daemons]
    finally:
        with shielded():  # a second signal does not leave daemons or namespaces behind
            try:
                for d in daemons:
                    d.stop()
            finally:
                net.close()
    wall = seen.ended - seen.started
    report = _scenario_report(
        task, scenario, net.mode, netem, peers, idle, at_start, at_end, seen, wall,
        load_start, _load(),
    )  # fmt: skip
    if seen.job_id is not None:
        dirs = [d.data_dir for d in daemons]
        report["anchor_divergence_final"] = anchor_divergence(dirs, seen.job_id)
        report["settled_divergence_final"] = settled_divergence(
            dirs, seen.job_id, {**task.sync, "every": task.every}
        )
    return report


def anchor_divergence(data_dirs: Sequence[Path], job_id: str) -> float | None:
    """The largest relative L2 distance between two peers' anchors (``sync.anchor.*``) in
    their newest checkpoints of the job, each written as the peer ended it: ~0 where every
    peer commits the same sums (``atomd bench sync``: ~1e-8); None with fewer than two."""
    states = _final_sync_states(data_dirs, job_id)
    return _widest([{k: v for k, v in s.items() if k.startswith("anchor.")} for s in states])


def settled_divergence(
    data_dirs: Sequence[Path], job_id: str, sync: Mapping[str, Any]
) -> float | None:
    """As ``anchor_divergence``, of the settled anchors (``SyncState.settled``: every pending
    delta committed, the outer momentum run out), what the final average is relative to. With
    outer momentum the anchors differ by when each peer committed a late delta and by deltas
    still pending at the end; the settled anchors of peers that merged the same deltas agree."""
    from atomd.spec import SyncSpec
    from atomd.sync.state import SyncState

    spec = SyncSpec(**sync)
    settled = []
    for tensors in _final_sync_states(data_dirs, job_id):
        anchor = {k[len("anchor.") :]: v for k, v in tensors.items() if k.startswith("anchor.")}
        if anchor:
            s = SyncState({k: v.clone() for k, v in anchor.items()}, spec, robust=None)
            s.load_state_tensors(tensors)
            settled.append(s.settled())
    return _widest(settled)


def _final_sync_states(data_dirs: Sequence[Path], job_id: str) -> list[dict[str, Any]]:
    """Each peer's sync state (``sync.*``, the prefix dropped) in its newest checkpoint of the
    job; peers without one are left out."""
    from safetensors.torch import load_file

    out = []
    for d in data_dirs:
        steps = sorted((d / "jobs" / job_id / "checkpoints").glob("step-*"))
        state = steps[-1] / "state.safetensors" if steps else None
        if state is not None and state.exists():
            out.append({k[len("sync.") :]: v for k, v in load_file(str(state)).items()
                        if k.startswith("sync.")})  # fmt: skip
    return out


def _widest(models: Sequence[Mapping[str, Any]]) -> float | None:
    """The largest relative L2 distance between two of ``models`` (None with fewer than two)."""
    models = [m for m in models if m]
    if len(models) < 2:
        return None

    def rel(a: Mapping[str, Any], b: Mapping[str, Any]) -> float:
        num = sum(float((a[k].double() - b[k].double()).square().sum()) for k in a)
        den = sum(float(a[k].double().square().sum()) for k in a)
        return (num / den) ** 0.5 if den > 0 else 0.0

    return max(rel(a, b) for i, a in enumerate(models) for b in models[i + 1 :])


def wait_formed(daemons: list[Daemon], *, deadline: float) -> None:
    """Until every daemon is ready and sees all of them alive (``TimeoutError`` past
    ``deadline``, a ``time.monotonic()``)."""
    for d in daemons:
        _until(d.ready, deadline=deadline, what=f"peer{d.i} ready")
    n = len(daemons)
    _until(
        lambda: all(sum(p["state"] == "alive" for p in d.json("/v1/peers")) == n for d in daemons),
        deadline=deadline,
        what="every daemon sees every other alive",
    )


def idle_bytes(net: netns.Network, n: int, seconds: float) -> list[dict[str, float]] | None:
    """Bytes per second each peer's link carries while the swarm idles (membership only)."""
    before = [net.counters(i) for i in range(n)]
    if any(b is None for b in before):
        time.sleep(min(seconds, 1.0))
        return None
    t = time.monotonic()
    time.sleep(seconds)
    after = [net.counters(i) for i in range(n)]
    dt = time.monotonic() - t
    out = []
    for b, a in zip(before, after, strict=True):
        assert a is not None and b is not None
        out.append({"tx": (a.tx - b.tx) / dt, "rx": (a.rx - b.rx) / dt})
    return out


def _train(
    task: Task, daemons: list[Daemon], net: netns.Network, seen: _Run, deadline: float,
    say: Callable[[str], None],
) -> None:  # fmt: skip
    """Poll until every peer's job is done (or the deadline); strike the victim with its fault
    and undo it (``_strike``)."""
    kill = seen.kill
    last_line = 0.0
    while True:
        now = time.monotonic()
        # A stopped daemon answers nothing: not asked until it is continued.
        stopped = None
        if kill is not None and kill.how == "sigstop" and kill.restarted_at is None:
            stopped = None if kill.killed_at is None else kill.victim
        states = {
            d.i: _job_state(d, seen.job_id) if d.alive() and d.i != stopped else None
            for d in daemons
        }
        for i, s in states.items():
            back = kill is None or i != kill.victim or kill.restarted_at is not None
            if s is not None and s["state"] in DONE and i not in seen.finished and back:
                seen.finished[i] = now
        if len(seen.finished) == len(daemons):
            return
        if kill is not None:
            victim = daemons[kill.victim]
            s = states[kill.victim]
            if kill.killed_at is None and s is not None and s["step"] >= kill.at_step:
                say(f"  {_strike(kill.how, victim, net, undo=False)} at step {s['step']}")
                kill.killed_at, kill.killed_step = now, s["step"]
            elif (
                kill.killed_at is not None
                and kill.restarted_at is None
                and now - kill.killed_at >= task.restart_after_s
            ):
                say(f"  {_strike(kill.how, victim, net, undo=True)}")
                kill.restarted_at = now
        if now - last_line > 30:
            steps = " ".join(
                f"{s['step'] if s else '-'}" for s in states.values()
            )  # fmt: skip
            say(f"  t+{now - seen.started:.0f} s: steps {steps} (load {_load()[0]})")
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


def _code(reason: str | None) -> str:
    """A refusal's or failure's kind: the wire reason ("stale"), an HTTP status, a timeout."""
    text = reason or "?"
    answered = re.search(r"answered (\d{3})", text)
    if answered:
        return f"http {answered.group(1)}"
    if "timed out" in text:
        return "timeout"
    if " failed: " in text:
        return "unreachable"
    return text.split(":", 1)[0].strip()[:40]


_TIMINGS = (
    ("atomd_sync_upload_seconds", "upload_s_mean"),
    ("atomd_sync_round_traffic_seconds", "round_traffic_s_mean"),
    ("atomd_sync_answer_held_seconds", "answer_held_s_mean"),
)


def _mean_seconds(metrics: str) -> dict[str, float | None]:
    """From a daemon's /metrics: the mean of each sync timing histogram (None: no sample)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(metrics):
        if family.name in {name for name, _ in _TIMINGS}:
            for sample in family.samples:
                kind = sample.name.removeprefix(family.name)
                totals.setdefault(family.name, {})[kind] = sample.value
    out: dict[str, float | None] = {}
    for name, key in _TIMINGS:
        t = totals.get(name, {})
        count = t.get("_count", 0.0)
        out[key] = round(t.get("_sum", 0.0) / count, 4) if count else None
    return out


def _daemon_env(task: Task) -> dict[str, str]:
    return {} if task.tcp_congestion is None else {"ATOMD_TCP_CONGESTION": task.tcp_congestion}


_READY = re.compile(r"ready: control \S+, peer plane \S+ \((?:TLS|plain HTTP), (.+?), advertised")


def tcp_congestion_of(log_path: Path) -> str | None:
    """What a daemon's last start-up line in ``log_path`` says its peer connections use
    (``TCP cubic``, ``TCP bbr (the system's)``)."""
    found = _READY.findall(log_path.read_text(errors="replace")) if log_path.exists() else []
    return found[-1] if found else None


def _peer_report(d: Daemon, job_id: str) -> dict[str, Any]:
    """One peer's figures from its own records (job, progress, rounds)."""
    if not d.alive():
        return {"peer": d.i, "state": "dead"}
    job = d.json(f"/v1/jobs/{job_id}")
    rounds = d.json(f"/v1/jobs/{job_id}/rounds?limit=10000")
    sent = [r for r in rounds if r["direction"] == "sent"]
    received = [r for r in rounds if r["direction"] == "received"]
    sent_ok = [r for r in sent if r["applied"]]
    got = [r for r in received if r["applied"]]
    refused = [r for r in received if not r["applied"]]
    frames = {(r["round"]): r for r in sent}  # one frame per round, sent to every peer
    every = [r["every"] for r in frames.values() if r.get("every")]
    sync = job.get("sync") or {}
    model_bytes = max((r["compression_ratio"] * r["bytes"] for r in sent), default=0.0)
    frame_bytes = [r["bytes"] for r in frames.values()]
    return {
        "peer": d.i,
        "tcp_congestion": tcp_congestion_of(d.log_path),
        "state": job["state"],
        "step": job["step"],
        "val_loss": job["val_loss"],
        "rounds_sent": len(frames),
        "delta_bytes_sent": sum(r["bytes"] for r in sent_ok),
        "delta_bytes_received": sum(r["bytes"] for r in got),
        "frame_bytes_mean": statistics.fmean(frame_bytes) if frame_bytes else None,
        "model_fp32_bytes": round(model_bytes),
        "deltas_merged": len(got),
        # Committed one round late is on time; staleness 2+ arrived after its round's commit.
        "staleness": dict(sorted(Counter(r["staleness"] or 0 for r in got).items())),
        "deltas_late": sum(1 for r in got if (r["staleness"] or 0) >= 2),
        "deltas_refused": len(refused),
        "refusals": dict(Counter(_code(r["reason"]) for r in refused)),
        "sends_failed": sum(1 for r in sent if not r["applied"]),
        "send_failures": dict(Counter(_code(r["reason"]) for r in sent if not r["applied"])),
        "every": {
            "min": min(every, default=None),
            "median": statistics.median(every) if every else None,
            "max": max(every, default=None),
            "final": sync.get("every"),
        },
        "period_s_final": sync.get("period_s"),
        "sync_busy_s": sync.get("busy_s"),
        "sync_wait_s": sync.get("wait_s"),
        "sync_held_steps": sync.get("held_steps"),  # due rounds held for the previous one
        "sync_probes": sync.get("probes"),  # the loss guard's probe passes
        "final_model": sync.get("final_model"),  # the swarm's model, its own, or the average
        # The final average: the others' shares in it, and its time (sending, waiting, making).
        "average_shares": sync.get("average_shares"),
        "average_s": sync.get("average_s"),
        "average_tail": sync.get("average_tail"),  # this peer's last models its share averaged
        "fraction_final": sync.get("fraction"),  # a sparse codec's share of entries at the end
        # Each upload until its answer, and a round's whole traffic (the cadence's measure).
        **_mean_seconds(d.request("GET", "/metrics").text),
    }


def _scenario_report(
    task: Task,
    scenario: Scenario,
    mode: str,
    netem: str | None,
    peers: list[dict[str, Any]],
    idle: list[dict[str, float]] | None,
    at_start: Sequence[netns.LinkBytes | None],
    at_end: Sequence[netns.LinkBytes | None],
    seen: _Run,
    wall: float,
    load_start: list[float],
    load_end: list[float],
) -> dict[str, Any]:
    vals = [p.get("val_loss") for p in peers]
    finite = [v for v in vals if isinstance(v, float)]
    for p, a, b in zip(peers, at_start, at_end, strict=True):
        p["wire_bytes"] = None if a is None or b is None else {"tx": b.tx - a.tx, "rx": b.rx - a.rx}
        done = seen.finished.get(p["peer"])
        p["wall_s"] = None if done is None else round(done - seen.started, 1)
        wait = p.get("sync_wait_s")
        p["sync_wait_share"] = None if wait is None or not p["wall_s"] else wait / p["wall_s"]
    frames = [p["frame_bytes_mean"] for p in peers if p.get("frame_bytes_mean")]
    model = max((p.get("model_fp32_bytes") or 0 for p in peers), default=0)
    kill = seen.kill
    return {
        "scenario": scenario.name,
        "network": mode,
        "upload_limit_kbit": scenario.upload_kbit,
        "delay_emulated": False,
        "netem": "not tried on loopback" if mode == "loopback" else (netem or "available"),
        "job_id": seen.job_id,
        "timed_out": seen.timed_out,
        "wall_s": round(wall, 1),
        "load_avg_start": load_start,
        "load_avg_end": load_end,
        "val_loss_per_peer": vals,
        "swarm_mean_val_loss": statistics.fmean(finite) if finite else None,
        "frame_bytes_mean": statistics.fmean(frames) if frames else None,
        "model_fp32_bytes": model,
        "bytes_ratio_vs_fp32_model": model / statistics.fmean(frames) if frames else None,
        "idle_membership_bytes_per_s": idle,
        **{
            how: _kill_report(kill, seen.started) if kill is not None and kill.how == how else None
            for how in ("sigkill", "sigstop", "partition")
        },
        "peers": peers,
    }


def _kill_report(kill: _Kill, started: float) -> dict[str, Any]:
    def since(t: float | None) -> float | None:
        return None if t is None else round(t - started, 1)

    return {
        "victim": kill.victim,
        "at_step": kill.at_step,
        "killed_step": kill.killed_step,
        "killed_at_s": since(kill.killed_at),
        "restarted_at_s": since(kill.restarted_at),
    }


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
    load_start = _load()
    out: dict[str, Any] = {}
    try:
        for d in daemons:
            d.start()
        for d in daemons:
            _until(d.ready, deadline=deadline, what=f"reference daemon {d.i} ready")
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
                s = _job_state(d, jid)
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
    out["load_avg_start"], out["load_avg_end"] = load_start, _load()
    return out


def _targets(scenarios: list[dict[str, Any]], refs: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for s in scenarios:
        t: dict[str, Any] = {}
        bar = GAIN_BARS.get(s["scenario"])
        if bar is not None and s.get("gain_recovered") is not None:
            t["gain_recovered"] = {"value": s["gain_recovered"], "bar": bar,
                                   "ok": s["gain_recovered"] >= bar}  # fmt: skip
        ratio = s.get("bytes_ratio_vs_fp32_model")
        if ratio is not None:
            t["bytes_ratio"] = {"value": ratio, "bar": RATIO_BAR, "ok": ratio >= RATIO_BAR}
        idle = s.get("idle_membership_bytes_per_s")
        if idle:
            worst = max(max(p["tx"], p["rx"]) for p in idle)
            t["idle_membership_bytes_per_s"] = {
                "value": worst, "what": "the busier direction of the busiest peer's link",
                "bar": IDLE_BAR, "ok": worst <= IDLE_BAR,
            }  # fmt: skip
        waits = [p["sync_wait_share"] for p in s["peers"] if p.get("sync_wait_share") is not None]
        if waits:
            worst = max(waits)
            t["sync_wait_share_of_wall"] = {
                "value": worst,
                "bar": WAIT_BAR,
                "ok": worst <= WAIT_BAR,
            }
        out[s["scenario"]] = t
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
        "targets": _targets(results, refs),
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
        help="more of the job's sync settings, as JSON (e.g. '{\"value_bits\": 8}')",
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
