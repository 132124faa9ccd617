"""LAN discovery over real mDNS, inside two network namespaces this test creates and removes.

Traffic stays on the test's own isolated network: namespaces ``a`` and ``b`` joined by a veth
pair (10.231.N.1 and .2), nothing else attached. Namespace ``a`` runs a peer of swarm s1;
``b`` runs a peer of s1 and one of s2. The s1 peers must find each other; the s2 peer must
be found by neither and find neither, although it sees their adverts (it says so at debug).
Skipped without root, without ``ip``, or where ``ip netns add`` is refused.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.polling import wait_for

# About 2.5 s end to end (measured), so not marked slow.
# Several training daemons: one such test at a time under `make test`'s two workers.
pytestmark = [pytest.mark.timeout(120), pytest.mark.xdist_group("swarm")]

REPO = Path(__file__).resolve().parents[2]
DISCOVERY_DEADLINE_S = 15.0
STOP_TIMEOUT_S = 10.0
IP_TIMEOUT_S = 10.0

# One peer: announce, print every on_found as a JSON line, stop cleanly on SIGTERM. Debug logs
# (what was ignored and why) go to stderr. Bounded by its own lifetime limit too.
PEER_SCRIPT = """
import asyncio, json, logging, signal, sys, time

from atomd.p2p.discovery import LanDiscovery

swarm, peer_id, url, lifetime = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr,
                    format="%(asctime)s %(levelname)s %(name)s: %(message)s")
logging.getLogger("zeroconf").setLevel(logging.INFO)
t0 = time.monotonic()

def emit(**event):
    print(json.dumps({"t": round(time.monotonic() - t0, 3), **event}), flush=True)

def on_found(pid, found_url):
    emit(event="found", peer_id=pid, url=found_url)

async def main():
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with await LanDiscovery.create(swarm=swarm, peer_id=peer_id, url=url,
                                         on_found=on_found):
        emit(event="ready")
        try:
            await asyncio.wait_for(stop.wait(), lifetime)
        except TimeoutError:
            emit(event="lifetime over")
    emit(event="closed")

asyncio.run(main())
"""


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False
    )


def _ip_ok(*args: str) -> None:
    result = _ip(*args)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


@dataclass
class Lan:
    """Two namespaces joined by a veth pair: ``a`` has ``addr_a``, ``b`` has ``addr_b``."""

    ns_a: str
    ns_b: str
    addr_a: str
    addr_b: str
    created: list[str] = field(default_factory=list)


@pytest.fixture
def lan() -> Iterator[Lan]:
    if sys.platform != "linux":
        pytest.skip("network namespaces are Linux-only")
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root")
    if shutil.which("ip") is None:
        pytest.skip("iproute2 'ip' is not installed")
    tag = secrets.token_hex(3)
    subnet = f"10.231.{secrets.randbelow(256)}"
    net = Lan(f"atomd-zc-{tag}-a", f"atomd-zc-{tag}-b", f"{subnet}.1", f"{subnet}.2")
    try:
        for ns in (net.ns_a, net.ns_b):
            result = _ip("netns", "add", ns)
            if result.returncode != 0:
                pytest.skip(f"'ip netns add' failed: {result.stderr.strip()}")
            net.created.append(ns)
        # Create the veth pair from inside ``a``: nothing ever appears in the host namespace.
        _ip_ok(
            *("-n", net.ns_a, "link", "add", "zc0", "type", "veth"),
            *("peer", "name", "zc1", "netns", net.ns_b),
        )
        for ns, dev, addr in ((net.ns_a, "zc0", net.addr_a), (net.ns_b, "zc1", net.addr_b)):
            _ip_ok("-n", ns, "link", "set", "lo", "up")
            _ip_ok("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip_ok("-n", ns, "link", "set", dev, "up")
            _ip_ok("-n", ns, "route", "add", "224.0.0.0/4", "dev", dev)
        yield net
    finally:
        for ns in net.created:  # removing a namespace removes its end of the veth pair
            _ip("netns", "del", ns)


@dataclass
class Peer:
    name: str
    swarm: str
    peer_id: str
    url: str
    proc: subprocess.Popen[bytes]
    out: Path
    err: Path

    def events(self) -> list[dict[str, Any]]:
        lines = self.out.read_text().splitlines()
        # The last line may be half written; only whole lines count.
        return [json.loads(line) for line in lines if line.endswith("}")]

    def found(self) -> dict[str, dict[str, Any]]:
        return {e["peer_id"]: e for e in self.events() if e["event"] == "found"}

    def log(self) -> str:
        return self.err.read_text()


@pytest.fixture
def peers(lan: Lan, tmp_path: Path) -> Iterator[Any]:
    """Factory of peer processes in the namespaces; all are stopped (then killed) at the end."""
    script = tmp_path / "peer.py"
    script.write_text(PEER_SCRIPT)
    started: list[Peer] = []

    def start(name: str, ns: str, addr: str, swarm: str, port: int) -> Peer:
        peer_id = f"{name}-{secrets.token_hex(8)}"
        url = f"http://{addr}:{port}"
        out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
        with out.open("wb") as fout, err.open("wb") as ferr:
            proc = subprocess.Popen(
                [
                    *("ip", "netns", "exec", ns, sys.executable, str(script)),
                    *(swarm, peer_id, url, str(DISCOVERY_DEADLINE_S * 4)),
                ],
                cwd=REPO,
                stdout=fout,
                stderr=ferr,
            )
        peer = Peer(name, swarm, peer_id, url, proc, out, err)
        started.append(peer)
        return peer

    try:
        yield start
    finally:
        for p in started:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        for p in started:
            try:
                p.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait(timeout=STOP_TIMEOUT_S)


def _wait(predicate: Any, *, deadline: float, what: str, peers: list[Peer]) -> None:
    """``wait_for`` until ``deadline``, failing at once if a peer exits, with every peer's log."""

    def holds() -> bool:
        for p in peers:
            if p.proc.poll() is not None:
                raise AssertionError(f"{p.name} exited early ({p.proc.returncode}):\n{p.log()}")
        return bool(predicate())

    try:
        wait_for(holds, timeout=max(0.0, deadline - time.monotonic()), what=what)
    except AssertionError as e:
        logs = "\n".join(f"--- {p.name}\n{p.log()[-3000:]}" for p in peers)
        raise AssertionError(f"{e}\n{logs}") from None


def test_peers_of_one_swarm_find_each_other_and_only_each_other(lan: Lan, peers: Any) -> None:
    t0 = time.monotonic()
    a = peers("a-s1", lan.ns_a, lan.addr_a, "s1", 7071)
    b = peers("b-s1", lan.ns_b, lan.addr_b, "s1", 7071)
    c = peers("b-s2", lan.ns_b, lan.addr_b, "s2", 7072)
    everyone = [a, b, c]
    deadline = t0 + DISCOVERY_DEADLINE_S

    _wait(
        lambda: b.peer_id in a.found() and a.peer_id in b.found(),
        deadline=deadline,
        what="the s1 peers to find each other",
        peers=everyone,
    )
    found_after = time.monotonic() - t0
    assert a.found()[b.peer_id]["url"] == b.url
    assert b.found()[a.peer_id]["url"] == a.url

    # Proof that the swarm filter ran (not that adverts were merely slow): each side saw the
    # other swarm's adverts and said why it ignored them.
    def other_swarm_ignored() -> bool:
        return (
            all(f"ignoring {p.peer_id}" in c.log() for p in (a, b))
            and f"ignoring {c.peer_id}" in a.log()
            and f"ignoring {c.peer_id}" in b.log()
        )

    _wait(
        other_swarm_ignored,
        deadline=deadline,
        what="every peer to see and ignore the other swarm's adverts",
        peers=everyone,
    )

    for p in everyone:
        p.proc.send_signal(signal.SIGTERM)
    for p in everyone:
        assert p.proc.wait(timeout=STOP_TIMEOUT_S) == 0, p.log()
        assert p.events()[-1]["event"] == "closed"

    assert set(a.found()) == {b.peer_id}
    assert set(b.found()) == {a.peer_id}
    assert c.found() == {}
    # Each peer is reported once, however many times it announced itself.
    for p in (a, b):
        assert sum(e["event"] == "found" for e in p.events()) == 1
    sys.stderr.write(
        f"mDNS discovery in netns: both s1 peers found after {found_after:.2f}s "
        f"(a: {a.found()[b.peer_id]['t']}s, b: {b.found()[a.peer_id]['t']}s after start)\n"
    )


def test_daemons_without_seeds_form_a_swarm_over_mdns(lan: Lan, tmp_path: Path) -> None:
    """Two real ``atomd run --zeroconf`` daemons, one per namespace, no seeds: one swarm."""
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    procs: list[subprocess.Popen[bytes]] = []
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATOMD_")}
    try:
        for ns, addr, name in ((lan.ns_a, lan.addr_a, "a"), (lan.ns_b, lan.addr_b, "b")):
            args = [
                "ip", "netns", "exec", ns, sys.executable, "-m", "atomd", "run",
                "--data-dir", str(tmp_path / name), "--control", "127.0.0.1:7070",
                "--listen", f"{addr}:7071", "--advertise", f"https://{addr}:7071",
                "--device", "cpu", "--zeroconf", "--swarm", "lan-test",
            ]  # fmt: skip
            log = (tmp_path / f"{name}.log").open("wb")
            procs.append(subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT))

        def view(ns: str) -> dict[str, str]:
            out = subprocess.run(
                ["ip", "netns", "exec", ns, "curl", "-sf", "http://127.0.0.1:7070/v1/peers"],
                capture_output=True, timeout=5, check=False,
            )  # fmt: skip
            if out.returncode != 0:
                return {}
            return {p["url"]: p["state"] for p in json.loads(out.stdout)}

        want = {f"https://{lan.addr_a}:7071": "alive", f"https://{lan.addr_b}:7071": "alive"}
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            if view(lan.ns_a) == want and view(lan.ns_b) == want:
                break
            time.sleep(0.5)
        else:
            logs = "\n".join((tmp_path / f"{n}.log").read_text() for n in "ab")
            raise AssertionError(f"no swarm over mDNS: {view(lan.ns_a)} {view(lan.ns_b)}\n{logs}")
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
