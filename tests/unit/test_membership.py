"""SWIM membership over an in-memory network: merge rules, detection, refutation, leave."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from atomd.p2p.membership import Member, Membership, Swim, SwimConfig, Update, supersedes

FAST = SwimConfig(
    period=0.02, ping_timeout=0.05, indirect_timeout=0.08, suspect_timeout=0.3, join_timeout=0.2
)


def upd(i: str, state: str = "alive", inc: int = 1) -> Update:
    return Update(i, f"mem://{i}", "k" + i, state, inc)  # type: ignore[arg-type]


def test_ordering_of_updates() -> None:
    m = Member("a", "u", "k", "suspect", 5)
    assert supersedes(upd("a", "alive", 6), m)  # refutation: higher incarnation
    assert not supersedes(upd("a", "alive", 5), m)  # same incarnation: suspicion stands
    assert supersedes(upd("a", "dead", 5), m)
    assert not supersedes(upd("a", "dead", 4), m)
    assert supersedes(upd("a", "left", 5), Member("a", "u", "k", "dead", 5))


def test_suspicion_of_self_is_refuted() -> None:
    ms = Membership(upd("me", inc=10))
    ms.apply(upd("me", "suspect", 10))
    assert ms.me.incarnation == 11 and ms.me.state == "alive"
    assert any(u.id == "me" and u.incarnation == 11 for u in ms.gossip())
    ms.apply(upd("me", "dead", 3))  # stale: ignored
    assert ms.me.incarnation == 11


def test_hearsay_about_gone_strangers_adds_nothing_and_changes_are_reported() -> None:
    seen: list[tuple[str, str | None, str]] = []
    ms = Membership(upd("me"), on_change=lambda m, before: seen.append((m.id, before, m.state)))
    assert not ms.apply(upd("x", "dead"))
    assert ms.get("x") is None
    assert ms.apply(upd("y"))
    assert ms.mark("y", "suspect") and ms.mark("y", "dead")
    assert not ms.mark("y", "dead")
    assert seen == [("y", None, "alive"), ("y", "alive", "suspect"), ("y", "suspect", "dead")]


def test_gossip_is_retransmitted_a_bounded_number_of_times() -> None:
    ms = Membership(upd("me"))
    ms.apply(upd("a"))
    counts = 0
    for _ in range(100):
        counts += sum(1 for u in ms.gossip() if u.id == "a")
    assert 3 <= counts <= 20


class Net:
    """An in-memory network of Swim nodes; a node in ``down`` answers nothing."""

    def __init__(self) -> None:
        self.nodes: dict[str, Swim] = {}
        self.down: set[str] = set()
        self.tasks: dict[str, asyncio.Task[None]] = {}

    def _node(self, url: str) -> Swim:
        name = url.removeprefix("mem://")
        if name in self.down or name not in self.nodes:
            raise ConnectionError(f"{name} unreachable")
        return self.nodes[name]

    async def ping(self, url: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        await asyncio.sleep(0)
        return self._node(url).handle_ping(payload)

    async def ping_req(self, url: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        return await asyncio.wait_for(self._node(url).handle_ping_req(payload), timeout)

    async def join(self, url: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        return self._node(url).handle_join(payload)

    async def leave(self, url: str, payload: dict[str, Any], timeout: float) -> None:
        self._node(url).handle_leave(payload)

    async def start(self, name: str, seeds: list[str], inc: int = 1) -> Swim:
        swim = Swim(Membership(upd(name, inc=inc)), self, FAST)
        self.nodes[name] = swim
        self.down.discard(name)
        await swim.join([f"mem://{s}" for s in seeds])
        self.tasks[name] = asyncio.create_task(swim.run())
        return swim

    def kill(self, name: str) -> None:
        self.down.add(name)
        self.tasks.pop(name).cancel()

    async def close(self) -> None:
        for t in self.tasks.values():
            t.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)


def states(swim: Swim) -> dict[str, str]:
    return {m.id: m.state for m in swim.m.all()}


async def until(cond: Any, timeout: float = 5.0) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


@pytest.fixture
async def net() -> Any:
    n = Net()
    yield n
    await n.close()


async def test_swarm_forms_from_one_seed_and_detects_a_crash(net: Net) -> None:
    names = [f"n{i}" for i in range(6)]
    await net.start(names[0], [])
    for name in names[1:]:
        await net.start(name, [names[0]])
    everyone_alive = {n: "alive" for n in names}
    await until(lambda: all(states(net.nodes[n]) == everyone_alive for n in names))

    net.kill("n0")  # the seed dies: the rest carry on and agree it is dead
    rest = names[1:]
    await until(lambda: all(states(net.nodes[n])["n0"] == "dead" for n in rest))
    assert all(states(net.nodes[n])[m] == "alive" for n in rest for m in rest)


async def test_false_suspicion_is_refuted(net: Net) -> None:
    for name, seeds in (("a", []), ("b", ["a"]), ("c", ["a"])):
        await net.start(name, seeds)
    await until(lambda: all(len(net.nodes[n].m.others()) == 2 for n in "abc"))
    inc = net.nodes["c"].m.me.incarnation
    net.nodes["a"].m.mark("c", "suspect")  # a wrongly suspects c
    await until(lambda: net.nodes["c"].m.me.incarnation > inc)
    await until(lambda: all(states(net.nodes[n])["c"] == "alive" for n in "ab"))


async def test_leave_is_immediate_and_a_restart_is_welcomed_back(net: Net) -> None:
    for name, seeds in (("a", []), ("b", ["a"]), ("c", ["a"])):
        await net.start(name, seeds)
    await until(lambda: all(len(net.nodes[n].m.others()) == 2 for n in "abc"))
    await net.nodes["c"].leave()
    net.kill("c")
    assert states(net.nodes["a"])["c"] == "left" and states(net.nodes["b"])["c"] == "left"
    # The same id comes back with a higher incarnation (wall clock at start in the daemon).
    await net.start("c", ["b"], inc=2)
    await until(lambda: all(states(net.nodes[n])["c"] == "alive" for n in "ab"))


async def test_join_skips_dead_seeds(net: Net) -> None:
    await net.start("a", [])
    b = await net.start("b", ["gone", "a"])
    assert "a" in states(b)
    lone = Swim(Membership(upd("z")), net, FAST)
    assert not await lone.join(["mem://gone"])


def test_malformed_updates_are_refused() -> None:
    with pytest.raises(ValueError, match="malformed"):
        Update.from_json({"id": "x", "state": "zombie"})
    with pytest.raises(ValueError, match="malformed"):
        Update.from_json("nope")
