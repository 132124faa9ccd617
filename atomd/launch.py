"""Start ``atomd run`` daemons as local subprocesses on free loopback ports.

Used by ``atomd demo``, the benchmarks and the integration tests: real processes, real HTTP.

No daemon outlives its launcher. Each one runs in a session of its own (a Ctrl-C at the
terminal reaches the launcher, which stops its daemons in order and says so) and is asked by
the kernel for SIGTERM when the launcher dies, however it dies, SIGKILL included
(``PR_SET_PDEATHSIG``; the daemon then checkpoints and exits as on any SIGTERM). Deadlines
come from readiness: a launcher waits for the daemon's own ``/readyz``, for as long as
``READY_TIMEOUT`` allows, and stops waiting at once if the process exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

# Generous bounds: they only matter when something is wrong, and a busy machine (load 20 on
# 2 cores) takes a minute to start what takes 2 s on a quiet one.
READY_TIMEOUT = 300.0
STOP_TIMEOUT = 120.0
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> Callable[[], None]:
    """A ``preexec_fn``: SIGTERM this child when the launcher dies (Linux; a no-op elsewhere)."""

    def apply() -> None:
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
            if os.getppid() != parent:  # the launcher died before the prctl took hold
                os._exit(1)

    return apply


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached a launcher: unwind, so that every daemon it started is stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# Signals received inside ``interrupts()``, kept as well as raised: an exception raised by a
# signal handler inside an at-fork callback (logging's, while subprocess starts a daemon) is
# printed and dropped by Python ("Exception ignored in"), so ``check_interrupts`` delivers it at
# the launcher's next step (each ``DaemonProcess.start`` and each ``wait_until`` poll).
_pending: list[int] = []
# Nesting depth of ``shielded()`` on the main thread: while above 0 a signal is kept, not raised.
_shield = [0]


def _on_signal(signum: int, frame: Any) -> None:
    _pending.append(signum)
    if not _shield[0]:
        raise Interrupted(signum)


def check_interrupts() -> None:
    """Raise ``Interrupted`` for a signal whose exception Python dropped (not while shielded)."""
    if _pending and not _shield[0]:
        raise Interrupted(_pending[-1])


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Inside, the signals of ``interrupts()`` do not interrupt: a cleanup (stopping daemons,
    removing network namespaces), each step of which has its own timeout, runs to its end.
    Without it a second SIGTERM cut the first one's cleanup short: ``timeout`` forwards the
    signal that a ``pkill`` sends it too, and `atomd bench swarm` so left its daemons' five
    namespaces behind. A signal that came meanwhile is raised once the block is left, unless an
    exception is on its way already (the block ran in a ``finally`` or an ``except``): that one
    goes on, and ``check_interrupts`` raises the signal at the launcher's next step. Main
    thread only (the one that gets signals); elsewhere this changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = len(_pending)
    _shield[0] += 1
    try:
        yield
    finally:
        _shield[0] -= 1
    if len(_pending) > before and not _shield[0] and sys.exc_info()[1] is None:
        raise Interrupted(_pending[-1])


@contextlib.contextmanager
def interrupts(
    signums: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM),
) -> Iterator[None]:
    """Inside, each of ``signums`` raises ``Interrupted`` (a ``KeyboardInterrupt``), so every
    ``finally`` that stops daemons or removes namespaces runs, SIGTERM included. Only the main
    thread can install handlers; elsewhere this changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _pending.clear()
    previous = {sig: signal.signal(sig, _on_signal) for sig in signums}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _pending.clear()


PORTS_ENV = "ATOMD_TEST_PORTS"
"""``LOW-HIGH``: take the free ports from this range only (machines shared by several test
runs, each with its own range); unset: any port the system gives."""


# Ports this process handed out lately: a port is free when picked, but the daemon binds it
# only once it runs, and ``start_swarm`` picks every daemon's two ports before starting any. A
# second pick of the same one (6 picks among a worker's 1,000 ports: ~1.5 % a swarm) left a
# daemon "Address already in use".
_GIVEN: deque[int] = deque(maxlen=256)
_GIVEN_LOCK = threading.Lock()


def free_port() -> int:
    """A loopback port nothing listens on, and not one this process handed out lately."""
    with _GIVEN_LOCK:
        port = _pick_port()
        _GIVEN.append(port)
        return port


def _pick_port() -> int:
    span = os.environ.get(PORTS_ENV)
    if span:
        low, _, high = span.partition("-")
        ports = list(range(int(low), int(high) + 1))
        random.shuffle(ports)
        for port in ports:
            if port in _GIVEN:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
        raise RuntimeError(f"no free port in {PORTS_ENV}={span}")
    for _ in range(64):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _GIVEN:
            return port
    raise RuntimeError("the system gave only ports this process handed out lately")


class DaemonProcess:
    """One ``atomd run`` subprocess with its own data folder, ports and log file."""

    def __init__(
        self,
        data_dir: Path,
        *,
        env: dict[str, str] | None = None,
        extra_args: list[str] | None = None,
        tls: bool = True,
    ) -> None:
        self.data_dir = data_dir
        self.control_port = free_port()
        self.listen_port = free_port()
        self.url = f"http://127.0.0.1:{self.control_port}"
        # The peer plane speaks TLS unless told not to (here or by ATOMD_PEER_TLS in env).
        off = (env or {}).get("ATOMD_PEER_TLS", "true").strip().lower() in ("0", "false", "no")
        self.tls = tls and not off and "--no-peer-tls" not in (extra_args or [])
        scheme = "https" if self.tls else "http"
        self.peer_url = f"{scheme}://127.0.0.1:{self.listen_port}"
        # The daemon refuses unknown ATOMD_* variables: pass on none of the caller's.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("ATOMD_")}
        self.env.update(env or {})
        self.extra_args = extra_args or []
        self.proc: subprocess.Popen[str] | None = None
        self._terminated_at: float | None = None
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
            "--parent-pid", str(os.getpid()),
            *([] if self.tls or "--no-peer-tls" in self.extra_args else ["--no-peer-tls"]),
            *self.extra_args,
        ]  # fmt: skip

    @property
    def headers(self) -> dict[str, str]:
        token = self.env.get("ATOMD_CONTROL_TOKEN")
        return {"Authorization": f"Bearer {token}"} if token else {}

    @property
    def name(self) -> str:
        return self.data_dir.name

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, wait: bool = True) -> DaemonProcess:
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        # The launcher thread that forks must outlive the child (PDEATHSIG follows the
        # thread): every launcher here starts daemons from its main thread.
        with self.log_path.open("a") as log:
            self.proc = subprocess.Popen(
                self.args,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
                preexec_fn=die_with_parent(os.getpid()),
            )
        check_interrupts()
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float | None = None) -> float:
        """Wait for ``GET /readyz`` to answer 200; return the seconds it took. Raises
        ``RuntimeError`` at once if the process exits, and past ``timeout`` (default
        ``READY_TIMEOUT``) naming what it waited for and the last answer."""
        timeout = READY_TIMEOUT if timeout is None else timeout
        t0 = time.monotonic()
        last = "no answer yet"
        assert self.proc is not None, "start() first"
        while time.monotonic() - t0 < timeout:
            check_interrupts()
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"daemon {self.name} (pid {self.proc.pid}) exited with code "
                    f"{self.proc.returncode} before it was ready; its log "
                    f"{self.log_path}:\n{self.log()[-4000:]}"
                )
            try:
                r = httpx.get(self.url + "/readyz", headers=self.headers, timeout=10)
                if r.status_code == 200:
                    return time.monotonic() - t0
                last = f"{r.status_code} {r.text[:200]}"
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            time.sleep(0.1)
        raise RuntimeError(
            f"daemon {self.name} (pid {self.proc.pid}) was not ready within {timeout:.0f} s: "
            f"GET {self.url}/readyz last answered: {last}; its log {self.log_path}:\n"
            f"{self.log()[-4000:]}"
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(**{"base_url": self.url, "timeout": 10, "headers": self.headers, **kw})

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        """SIGTERM, if it runs (the job checkpoints at its next step boundary)."""
        if self.running() and self._terminated_at is None:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)
            self._terminated_at = time.monotonic()

    def kill(self) -> None:
        if self.running():
            assert self.proc is not None
            self.proc.kill()

    def stop(self, timeout: float = STOP_TIMEOUT) -> str:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout``. Returns what happened,
        in words (``peer1 (pid 123): exited 0 after SIGTERM in 1.2 s``)."""
        if self.proc is None:
            return f"{self.name}: never started"
        who = f"{self.name} (pid {self.proc.pid})"
        if self.proc.poll() is not None and self._terminated_at is None:
            return f"{who}: had already {_ended(self.proc.returncode)}"
        with shielded():  # a second SIGTERM does not leave it running
            self.terminate()
            t0 = self._terminated_at or time.monotonic()
            try:
                code = self.proc.wait(timeout=max(0.0, timeout - (time.monotonic() - t0)))
                return f"{who}: {_ended(code)} after SIGTERM in {time.monotonic() - t0:.1f} s"
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
                return f"{who}: killed (SIGKILL) after {timeout:.0f} s without exiting on SIGTERM"
            finally:
                self._terminated_at = None


def _ended(code: int) -> str:
    """A process's exit in words: ``exited 0``, ``ended by SIGTERM``."""
    if code < 0:
        return f"ended by {signal.Signals(-code).name}"
    return f"exited {code}"


def stop_all(daemons: list[DaemonProcess], timeout: float = STOP_TIMEOUT) -> list[str]:
    """SIGTERM every daemon at once, then wait for each (SIGKILL past ``timeout``); one line
    per daemon saying what happened."""
    with shielded():
        for d in daemons:
            d.terminate()
        return [d.stop(timeout) for d in daemons]


def wait_until(predicate: Any, *, timeout: float, interval: float = 0.1, what: str = "") -> float:
    """Poll ``predicate`` until truthy; return the seconds it took (TimeoutError past timeout,
    naming ``what`` was awaited)."""
    t0 = time.monotonic()
    while True:
        check_interrupts()
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


def start_swarm(
    root: Path, n: int, *, started: list[DaemonProcess] | None = None, **kw: Any
) -> list[DaemonProcess]:
    """``n`` daemons, the first the seed of the others, started concurrently, all ready.

    Each is appended to ``started`` (when given) before it is started, so a caller that is
    interrupted half-way knows what to stop, and stops them itself. Without ``started``, a
    start that fails here stops every daemon it started before the error goes on.

    They share this machine's cores: each gets its share of torch threads, since OpenMP
    threads spinning against each other make every daemon many times slower."""
    threads = max(1, (os.cpu_count() or 1) // n)
    kw["env"] = {"OMP_NUM_THREADS": str(threads), **kw.get("env", {})}
    ds = [] if started is None else started
    mine: list[DaemonProcess] = []
    try:
        seed = DaemonProcess(root / "peer0", **kw)
        for d in (seed, *(
            DaemonProcess(root / f"peer{i}", extra_args=["--peer", seed.peer_url], **kw)
            for i in range(1, n)
        )):  # fmt: skip
            ds.append(d)
            mine.append(d)
        seed.start()
        for d in mine[1:]:
            d.start(wait=False)
        for d in mine[1:]:
            d.wait_ready()
    except BaseException:
        if started is None:
            stop_all(mine)
        raise
    return mine
