"""Where the swarm benchmark's daemons live: one network namespace each, or loopback.

``Namespaces`` (root, Linux, iproute2): a hub namespace holding a bridge, and one namespace per
peer joined to it by a veth pair; nothing is attached to the host's own network, so the
benchmark's traffic never leaves its namespaces. Each peer's veth counts the bytes it sends and
receives (membership, deltas, state transfers: everything on the wire), and ``tc ... tbf`` on
it limits the peer's upload when asked. This kernel may lack ``sch_netem``: delay is emulated
only where ``netem`` exists, and ``netem`` says which (``probe_netem``).

The control API of each daemon listens on 127.0.0.1 inside its namespace; the benchmark reaches
it from a thread that has entered that namespace (``call``), so control traffic never crosses a
veth and never counts as the peer's.

``Loopback``: every daemon on 127.0.0.1 of the host, no byte counters, no rate limits.

Namespaces are named ``atomd-sw<pid>-...`` after the benchmark's process: ``close`` removes its
own on every way out, and ``sweep_stale`` removes those of benchmark processes that died
before they could (SIGKILL).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import re
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from atomd.launch import free_port, shielded

T = TypeVar("T")

IP_TIMEOUT_S = 10.0
CLONE_NEWNET = 0x40000000
PREFIX = "atomd-sw"
CONTROL_PORT = 7070  # inside each namespace: every daemon can use the same ports
PEER_PORT = 7071


@dataclass(frozen=True)
class LinkBytes:
    """Bytes a peer's link carried: sent by the peer (tx) and received (rx)."""

    tx: int
    rx: int


class Network(Protocol):
    """Where peer ``i`` runs and how to reach it."""

    mode: str

    def control(self, i: int) -> str:
        """host:port of peer i's control API (reached through ``call``)."""
        ...

    def listen(self, i: int) -> str:
        """host:port of peer i's peer plane."""
        ...

    def command(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run as peer i (inside its namespace)."""
        ...

    def call(self, i: int, fn: Callable[[], T]) -> T:
        """Run ``fn`` with peer i's network (its control API is on its 127.0.0.1)."""
        ...

    def counters(self, i: int) -> LinkBytes | None:
        """Bytes on peer i's link so far (None where links are not counted)."""
        ...

    def close(self) -> None: ...


class Loopback:
    """Every peer on the host's loopback, on ports of its own."""

    mode = "loopback"

    def __init__(self, n: int) -> None:
        self._ports = [(free_port(), free_port()) for _ in range(n)]

    def control(self, i: int) -> str:
        return f"127.0.0.1:{self._ports[i][0]}"

    def listen(self, i: int) -> str:
        return f"127.0.0.1:{self._ports[i][1]}"

    def command(self, i: int, argv: list[str]) -> list[str]:
        return argv

    def call(self, i: int, fn: Callable[[], T]) -> T:
        return fn()

    def counters(self, i: int) -> LinkBytes | None:
        return None

    def close(self) -> None:
        pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(  # its own session: a Ctrl-C or a signal to the group does not cut it
        ["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False,
        start_new_session=True,
    )  # fmt: skip
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


def _enter(name: str) -> None:
    """Move the calling thread into network namespace ``name`` (for a worker thread only)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name}")
    finally:
        os.close(fd)


def namespaces_available() -> str | None:
    """None if this process can build namespaces, else why not."""
    if not os.path.exists("/proc/self/ns/net"):
        return "not Linux (no network namespaces)"
    if os.geteuid() != 0:
        return "not root"
    try:
        r = _ip("netns", "list", check=False)
    except FileNotFoundError:
        return "iproute2 'ip' is not installed"
    return None if r.returncode == 0 else f"'ip netns' failed: {r.stderr.strip()}"


def sweep_stale() -> list[str]:
    """Remove namespaces left by benchmark processes that no longer exist; returns them."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = re.fullmatch(rf"{PREFIX}(\d+)-[\w-]+", name)
        if m is None:
            continue
        pid = int(m.group(1))
        try:
            os.kill(pid, 0)
            continue  # its owner still runs
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        _ip("netns", "del", name, check=False)
        removed.append(name)
    return removed


@dataclass
class Namespaces:
    """A hub with a bridge and one namespace per peer, each on a veth to the hub.

    ``upload_kbit``: a tbf rate limit on every peer's egress (its upload), None for none."""

    n: int
    upload_kbit: int | None = None
    mode: str = "netns"
    created: list[str] = field(default_factory=list)
    _threads: dict[int, ThreadPoolExecutor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        tag = f"{PREFIX}{os.getpid()}-{random.randrange(16**4):04x}"
        self.hub = f"{tag}-hub"
        self.names = [f"{tag}-p{i}" for i in range(self.n)]
        self.subnet = f"10.{random.randrange(200, 250)}.{random.randrange(256)}"
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        _ip("netns", "add", self.hub)
        self.created.append(self.hub)
        _ip("-n", self.hub, "link", "set", "lo", "up")
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for i, ns in enumerate(self.names):
            _ip("netns", "add", ns)
            self.created.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            # Made in the hub, one end moved into the peer's namespace: never on the host.
            _ip("-n", self.hub, "link", "add", f"h{i}", "type", "veth",
                "peer", "name", "v0", "netns", ns)  # fmt: skip
            _ip("-n", self.hub, "link", "set", f"h{i}", "master", "br0")
            _ip("-n", self.hub, "link", "set", f"h{i}", "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "v0")
            _ip("-n", ns, "link", "set", "v0", "up")
            if self.upload_kbit is not None:
                self._limit(ns, self.upload_kbit)

    @staticmethod
    def _limit(ns: str, kbit: int) -> None:
        """Token bucket on the peer's egress: its upload rate. Burst 50 ms of the rate (at
        least a few frames of 1.5 kB), queue at most 500 ms."""
        burst = max(4096, kbit * 1000 // 8 // 20)
        r = subprocess.run(
            ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "v0", "root", "tbf",
             "rate", f"{kbit}kbit", "burst", str(burst), "latency", "500ms"],
            capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False,
        )  # fmt: skip
        if r.returncode != 0:
            raise RuntimeError(f"tc tbf in {ns}: {r.stderr.strip()}")

    def cut(self, i: int, *, cut: bool) -> None:
        """Cut peer i's link at the hub (its port of the bridge down: nothing reaches it or
        leaves it, and no connection is refused: they time out), or join it again."""
        _ip("-n", self.hub, "link", "set", f"h{i}", "down" if cut else "up")

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def control(self, i: int) -> str:
        return f"127.0.0.1:{CONTROL_PORT}"

    def listen(self, i: int) -> str:
        return f"{self.address(i)}:{PEER_PORT}"

    def command(self, i: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[i], *argv]

    def call(self, i: int, fn: Callable[[], T]) -> T:
        pool = self._threads.get(i)
        if pool is None:
            pool = self._threads[i] = ThreadPoolExecutor(
                max_workers=1, initializer=_enter, initargs=(self.names[i],)
            )
        return pool.submit(fn).result()

    def counters(self, i: int) -> LinkBytes | None:
        out = _ip("-n", self.names[i], "-s", "-j", "link", "show", "dev", "v0").stdout
        stats: dict[str, Any] = json.loads(out)[0]["stats64"]
        return LinkBytes(tx=int(stats["tx"]["bytes"]), rx=int(stats["rx"]["bytes"]))

    def probe_netem(self) -> str | None:
        """None if ``netem`` (delay) works here, else tc's answer."""
        r = subprocess.run(
            ["ip", "netns", "exec", self.hub, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
             "delay", "1ms"],
            capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False,
        )  # fmt: skip
        if r.returncode != 0:
            return r.stderr.strip() or f"tc exited {r.returncode}"
        subprocess.run(
            ["ip", "netns", "exec", self.hub, "tc", "qdisc", "del", "dev", "lo", "root"],
            capture_output=True, timeout=IP_TIMEOUT_S, check=False,
        )  # fmt: skip
        return None

    def close(self) -> None:
        """Remove every namespace made here (their veths go with them); idempotent, and not
        cut short by a second signal (``shielded``)."""
        with shielded():
            for pool in self._threads.values():
                pool.shutdown(wait=False, cancel_futures=True)
            self._threads.clear()
            for ns in reversed(self.created):
                with contextlib.suppress(subprocess.SubprocessError, OSError):
                    _ip("netns", "del", ns, check=False)
            self.created.clear()
