"""Start ``atomd run`` daemons as local subprocesses on free loopback ports.

Used by ``atomd demo``, the benchmarks and the integration tests: real processes, real HTTP.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DaemonProcess:
    """One ``atomd run`` subprocess with its own data folder, ports and log file."""

    def __init__(
        self,
        data_dir: Path,
        *,
        env: dict[str, str] | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.control_port = free_port()
        self.listen_port = free_port()
        self.url = f"http://127.0.0.1:{self.control_port}"
        self.peer_url = f"http://127.0.0.1:{self.listen_port}"
        # The daemon refuses unknown ATOMD_* variables: pass on none of the caller's.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("ATOMD_")}
        self.env.update(env or {})
        self.extra_args = extra_args or []
        self.proc: subprocess.Popen[str] | None = None
        self.log_path = data_dir.parent / f"{data_dir.name}.log"

    @property
    def args(self) -> list[str]:
        return [
            sys.executable, "-m", "atomd", "run",
            "--data-dir", str(self.data_dir),
            "--control", f"127.0.0.1:{self.control_port}",
            "--listen", f"127.0.0.1:{self.listen_port}",
            "--advertise", self.peer_url,
            "--device", "cpu",
            *self.extra_args,
        ]  # fmt: skip

    @property
    def headers(self) -> dict[str, str]:
        token = self.env.get("ATOMD_CONTROL_TOKEN")
        return {"Authorization": f"Bearer {token}"} if token else {}

    def start(self, wait: bool = True) -> DaemonProcess:
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a") as log:
            self.proc = subprocess.Popen(
                self.args, env=self.env, stdout=log, stderr=subprocess.STDOUT, text=True
            )
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(self.url + "/readyz", headers=self.headers, timeout=1)
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"daemon not ready in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=10, headers=self.headers, **kw)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM (the job checkpoints), then SIGKILL if it does not exit in ``timeout``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def wait_until(predicate: Any, *, timeout: float, interval: float = 0.1, what: str = "") -> float:
    """Poll ``predicate`` until truthy; return the seconds it took (TimeoutError past timeout)."""
    t0 = time.monotonic()
    while True:
        try:
            if predicate():
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass  # a daemon still starting or already gone: keep polling until the deadline
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"not within {timeout} s: {what or predicate}")
        time.sleep(interval)


def peer_view(d: DaemonProcess) -> dict[str, str]:
    """What one daemon believes: peer id -> state (itself included)."""
    r = httpx.get(d.url + "/v1/peers", headers=d.headers, timeout=5)
    r.raise_for_status()
    return {p["id"]: p["state"] for p in r.json()}


def peer_id(d: DaemonProcess) -> str:
    r = httpx.get(d.url + "/v1/status", headers=d.headers, timeout=5)
    r.raise_for_status()
    return str(r.json()["peer_id"])


def start_swarm(root: Path, n: int, **kw: Any) -> list[DaemonProcess]:
    """``n`` daemons, the first the seed of the others, started concurrently, all ready.

    They share this machine's cores: each gets its share of torch threads, since OpenMP
    threads spinning against each other make every daemon many times slower."""
    threads = max(1, (os.cpu_count() or 1) // n)
    kw["env"] = {"OMP_NUM_THREADS": str(threads), **kw.get("env", {})}
    seed = DaemonProcess(root / "peer0", **kw).start()
    rest = [
        DaemonProcess(root / f"peer{i}", extra_args=["--seed", seed.peer_url], **kw)
        for i in range(1, n)
    ]
    for d in rest:
        d.start(wait=False)
    for d in rest:
        d.wait_ready()
    return [seed, *rest]
