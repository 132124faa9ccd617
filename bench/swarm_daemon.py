"""The swarm benchmark's daemons: one ``atomd run`` each (``Daemon``), on the network
``bench/netns.py`` gives them, and the waits and measurements made on them."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from atomd.launch import check_interrupts
from atomd_bench import netns

POLL_S = 2.0
HTTP_TIMEOUT_S = 10.0
START_TIMEOUT_S = 120.0  # POST /v1/jobs: admission loads torch, slow on a busy machine
STOP_TIMEOUT_S = 60.0
PR_SET_PDEATHSIG = 1


def load_avg() -> list[float]:
    """The machine's load averages (it may be shared), rounded."""
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
            *(["--peer", seed] if seed else []),
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


def until(predicate: Callable[[], bool], *, deadline: float, what: str) -> None:
    while not predicate():
        check_interrupts()
        if time.monotonic() > deadline:
            raise TimeoutError(f"not before the deadline: {what}")
        time.sleep(0.2)


def open_network(kind: str, n: int, upload_kbit: int | None) -> netns.Network:
    """``kind`` "loopback" or "netns" (a namespace per daemon, an optional upload limit)."""
    if kind == "loopback":
        if upload_kbit is not None:
            raise RuntimeError("an upload limit needs network namespaces (root)")
        return netns.Loopback(n)
    return netns.Namespaces(n, upload_kbit=upload_kbit)


def job_state(d: Daemon, job_id: str) -> dict[str, Any] | None:
    """The job as ``d`` reports it; None where it does not answer."""
    try:
        r = d.request("GET", f"/v1/jobs/{job_id}")
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


DONE = {"finished", "failed", "stopped"}


def wait_formed(daemons: list[Daemon], *, deadline: float) -> None:
    """Until every daemon is ready and sees all of them alive (``TimeoutError`` past
    ``deadline``, a ``time.monotonic()``)."""
    for d in daemons:
        until(d.ready, deadline=deadline, what=f"peer{d.i} ready")
    n = len(daemons)
    until(
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


_READY = re.compile(r"ready: control \S+, peer plane \S+ \((?:TLS|plain HTTP), (.+?), advertised")


def tcp_congestion_of(log_path: Path) -> str | None:
    """What a daemon's last start-up line in ``log_path`` says its peer connections use
    (``TCP cubic``, ``TCP bbr (the system's)``)."""
    found = _READY.findall(log_path.read_text(errors="replace")) if log_path.exists() else []
    return found[-1] if found else None
