"""SWIM membership over an in-memory network: merge rules, detection, refutation, leave."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from types import SimpleNamespace
from typing import Any

import pytest

from atomd.errors import MessageError
from atomd.p2p.identity import Identity
from atomd.p2p.membership import Member, Membership, Swim, SwimConfig, Update, supersedes
from atomd.p2p.messages import (
    MAX_COUNTER,
    Gossip,
    JoinReply,
    PingReq,
    PingReqReply,
    ProgressCurve,
    parse,
    record_problem,
    sign_record,
)
from atomd.p2p.trainers import MAX_CURVE_PEERS, Trainers
from tests.polling import until

FAST = SwimConfig(
    period=0.02, settled_period=0.02, ping_timeout=0.05, indirect_timeout=0.08,
    suspect_timeout=0.3, join_timeout=0.2,
)  # fmt: skip
# A settled swarm probes 5x less often; anything unsettled brings back FAST's pace.
SETTLING = dataclasses.replace(FAST, settled_period=0.1)


IDS: dict[str, Identity] = {}


def ident(name: str) -> Identity:
    """One identity per test name ("a", "me", "n3"), made once."""
    return IDS.setdefault(name, Identity.generate())


def pid(name: str) -> str:
    return ident(name).peer_id


def url(name: str) -> str:
    return f"http://{name}.mem"


def upd(name: str, state: str = "alive", inc: int = 1, signed: bool = True) -> Update:
    """A record of member ``name``; its own alive/left records are signed by its key."""
    i = ident(name)
    u = Update(id=i.peer_id, url=url(name), public_key=i.public_key_hex, state=state,  # type: ignore[arg-type]
               incarnation=inc)  # fmt: skip
    return sign_record(u, i, "default") if signed and state in ("alive", "left") else u


def test_ordering_of_updates() -> None:
    m = Member(pid("a"), "u", "k", "suspect", 5)
    assert supersedes(upd("a", "alive", 6), m)  # refutation: higher incarnation
    assert not supersedes(upd("a", "alive", 5), m)  # same incarnation: suspicion stands
    assert supersedes(upd("a", "dead", 5), m)
    assert not supersedes(upd("a", "dead", 4), m)
    assert supersedes(upd("a", "left", 5), Member(pid("a"), "u", "k", "dead", 5))


def test_suspicion_of_self_is_refuted() -> None:
    ms = Membership(upd("me", inc=10))
    ms.apply(upd("me", "suspect", 10))
    assert ms.me.incarnation == 11 and ms.me.state == "alive"
    assert any(u.id == pid("me") and u.incarnation == 11 for u in ms.gossip())
    ms.apply(upd("me", "dead", 3))  # stale: ignored
    assert ms.me.incarnation == 11


def test_a_suspicion_no_life_of_this_daemon_could_have_signed_is_not_refuted() -> None:
    """Suspicions are unsigned hearsay, so anyone can say one. One at the largest counter would
    make the victim refute to a counter no record can hold: every later ping, answer and join
    reply of it would raise. A suspicion beyond what a previous life of
    this daemon could have signed (its clock, plus a day) is ignored; one a previous life
    could have (a clock set back across a restart) is still outranked."""
    me = ident("victim")
    ms = Membership(upd("victim", inc=int(time.time() * 1000)), identity=me)
    before = ms.me.incarnation
    for lie in (MAX_COUNTER, int(time.time() * 1000) + 2 * 86_400_000):
        ms.apply(upd("victim", "suspect", lie))
        assert ms.me.incarnation == before
    Gossip(sender=ms.me.update(), updates=ms.gossip())  # it can still speak
    earlier_life = before + 3_600_000  # an hour ahead of this life's start
    ms.apply(upd("victim", "dead", earlier_life))
    assert ms.me.incarnation == earlier_life + 1 and ms.me.state == "alive"


def test_the_members_kept_are_bounded() -> None:
    """Keys are free, and gossip adds any member whose record its own key signed: one member
    gossiping 64 fresh records a ping would grow every daemon's table without end (1,152
    members in 18 pings). At ``max_known`` a new member takes the place of
    the one dead or gone the longest; with none, one heard from itself takes the place of the
    one not heard from directly for the longest; one only gossiped about is refused."""
    ms = Membership(upd("me"), max_known=4)
    for name in ("k0", "k1", "k2", "k3"):
        assert ms.apply(upd(name))
    assert ms.mark(pid("k1"), "dead")
    assert ms.apply(upd("k4"))  # k1, dead, makes room
    assert ms.get(pid("k1")) is None and len(ms.members) == 4
    assert not ms.apply(upd("k5"))  # gossip about a stranger, and nobody to forget
    assert ms.get(pid("k5")) is None and len(ms.members) == 4
    ms.members[pid("k0")].last_seen -= 60  # the longest not heard from directly
    assert ms.apply(upd("k5"), direct=True)
    assert ms.get(pid("k0")) is None and ms.get(pid("k5")) is not None
    assert len(ms.members) == 4


def test_hearsay_about_gone_strangers_adds_nothing_and_changes_are_reported() -> None:
    seen: list[tuple[str, str | None, str]] = []
    ms = Membership(upd("me"), on_change=lambda m, before: seen.append((m.id, before, m.state)))
    assert not ms.apply(upd("x", "dead"))
    assert ms.get(pid("x")) is None
    assert ms.apply(upd("y"))
    assert ms.mark(pid("y"), "suspect") and ms.mark(pid("y"), "dead")
    assert not ms.mark(pid("y"), "dead")
    y = pid("y")
    assert seen == [(y, None, "alive"), (y, "alive", "suspect"), (y, "suspect", "dead")]


def test_gossip_is_retransmitted_a_bounded_number_of_times() -> None:
    ms = Membership(upd("me"))
    ms.apply(upd("a"))
    counts = 0
    for _ in range(100):
        counts += sum(1 for u in ms.gossip() if u.id == pid("a"))
    assert 3 <= counts <= 20


def wire(msg: Gossip, model: type[Any]) -> Any:
    """What the receiver parses: the message through its JSON form, as over HTTP."""
    return parse(model, msg.to_bytes())


class Net:
    """An in-memory network of Swim nodes; a node in ``down`` answers nothing."""

    def __init__(self) -> None:
        self.nodes: dict[str, Swim] = {}
        self.down: set[str] = set()
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.pings = 0
        self.probes: list[tuple[str, str]] = []  # (sender, target) of every ping

    def _node(self, address: str) -> Swim:
        name = address.removeprefix("http://").removesuffix(".mem")
        if name in self.down or name not in self.nodes:
            raise ConnectionError(f"{name} unreachable")
        return self.nodes[name]

    async def ping(self, address: str, target: str, msg: Gossip, timeout: float) -> Gossip:
        self.pings += 1
        self.probes.append((msg.sender.id, target))
        await asyncio.sleep(0)
        return self._node(address).handle_ping(wire(msg, Gossip))

    async def ping_req(
        self, address: str, target: str, msg: PingReq, timeout: float
    ) -> PingReqReply:
        node = self._node(address)
        return await asyncio.wait_for(node.handle_ping_req(wire(msg, PingReq)), timeout)

    async def join(
        self, address: str, target: str | None, msg: Gossip, timeout: float
    ) -> JoinReply:
        return self._node(address).handle_join(wire(msg, Gossip))

    async def leave(self, address: str, target: str, msg: Gossip, timeout: float) -> None:
        self._node(address).handle_leave(wire(msg, Gossip))

    async def start(
        self, name: str, seeds: list[str], inc: int = 1, config: SwimConfig = FAST
    ) -> Swim:
        swim = Swim(Membership(upd(name, inc=inc), identity=ident(name)), self, config)
        self.nodes[name] = swim
        self.down.discard(name)
        await swim.join([url(s) for s in seeds])
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
    """Member states by test name."""
    names = {ident(n).peer_id: n for n in IDS}
    return {names[m.id]: m.state for m in swim.m.all()}


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
    net.nodes["a"].m.mark(pid("c"), "suspect")  # a wrongly suspects c
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


async def test_a_member_held_dead_that_speaks_again_is_told_and_refutes(net: Net) -> None:
    """A daemon stopped (SIGSTOP) past the suspect timeout comes back after the swarm has
    stopped gossiping its death: the first member it pings tells it, it refutes, and every
    member holds it alive again."""
    for name, seeds in (("a", []), ("b", ["a"]), ("c", ["a"])):
        await net.start(name, seeds)
    await until(lambda: all(len(net.nodes[n].m.others()) == 2 for n in "abc"))
    c = net.nodes["c"]
    inc = c.m.me.incarnation
    net.kill("c")  # stopped: it answers nothing and runs nothing, and keeps its state
    await until(lambda: all(states(net.nodes[n])["c"] == "dead" for n in "ab"))
    # Until the gossip of its death is spent at a and b (retransmitted a bounded number of times).
    await until(lambda: not any(net.nodes[n].m.has_news() for n in "ab"))
    assert states(c)["a"] == states(c)["b"] == "alive"  # it missed all of it
    net.down.discard("c")
    net.tasks["c"] = asyncio.create_task(c.run())  # continued
    await until(lambda: all(states(net.nodes[n])["c"] == "alive" for n in "ab"))
    assert c.m.me.incarnation > inc


async def test_join_skips_dead_seeds(net: Net) -> None:
    await net.start("a", [])
    b = await net.start("b", ["gone", "a"])
    assert "a" in states(b)
    lone = Swim(Membership(upd("z")), net, FAST)
    assert not await lone.join([url("gone")])


def test_the_pace_is_fast_while_anything_is_unsettled() -> None:
    swim = Swim(Membership(upd("me")), Net(), SwimConfig(period=0.5, settled_period=1.5))

    def drain() -> None:
        while swim.m.has_news():
            swim.m.gossip()

    assert swim.unsettled() == "news" and swim.pace() == 0.5  # our own record, to spread
    drain()
    assert swim.unsettled() is None and swim.pace() == 1.5
    swim.m.apply(upd("a"))  # a new member
    assert swim.unsettled() == "news" and swim.pace() == 0.5
    drain()
    assert swim.pace() == 1.5
    swim.probe_soon(pid("a"))  # hearsay: someone suspects a
    assert swim.unsettled() == "probe soon" and swim.pace() == 0.5
    assert swim._next_target() is not None and swim.pace() == 1.5
    swim.m.mark(pid("a"), "suspect")
    drain()
    assert swim.unsettled() == "suspect" and swim.pace() == 0.5  # until refuted or dead
    swim.m.mark(pid("a"), "dead")
    drain()
    assert swim.unsettled() is None and swim.pace() == 1.5


async def test_a_settled_swarm_probes_at_the_settled_pace_and_still_finds_a_crash(
    net: Net,
) -> None:
    for name, seeds in (("a", []), ("b", ["a"]), ("c", ["a"])):
        await net.start(name, seeds, config=SETTLING)
    await until(lambda: all(len(net.nodes[n].m.others()) == 2 for n in "abc"))
    await until(lambda: all(net.nodes[n].unsettled() is None for n in "abc"))
    net.pings = 0
    t0 = time.monotonic()
    await asyncio.sleep(1.0)
    # At most one probe a settled period each (plus the one due at the start): 33, where the
    # fast pace would send 150. A slow machine only sends fewer.
    assert net.pings <= 3 * ((time.monotonic() - t0) / SETTLING.settled_period + 1)
    net.kill("c")
    await until(lambda: all(states(net.nodes[n])["c"] == "dead" for n in "ab"))


def test_the_turn_of_a_member_heard_lately_passes_without_a_probe_while_settled() -> None:
    swim = Swim(Membership(upd("me")), Net(), SwimConfig(heard_window=5.0))
    for name in ("a", "b"):
        swim.m.apply(upd(name))
    a, b = swim.m.get(pid("a")), swim.m.get(pid("b"))
    swim.m.heard(pid("a"))
    swim.m.heard(pid("me"))  # this daemon is no member of its own: nothing
    assert swim.m.me.heard_at == -math.inf

    def cycle(skip_heard: bool = True) -> list[Member | None]:
        """Each member's turn once: a fresh round-robin cycle."""
        swim._order = []
        return [swim._next_target(skip_heard=skip_heard) for _ in range(2)]

    # a's turn passes (no probe, and no other member probed in its place: each keeps its
    # share of probes); b, not heard, is probed as before.
    got = cycle()
    assert got.count(None) == 1 and b in got and swim.skipped == 1
    assert None not in cycle(skip_heard=False)  # unsettled: probed at the pace, heard or not
    swim.probe_soon(pid("a"))  # someone suspects a: probed at once, heard or not
    assert swim._next_target(skip_heard=True) is a
    swim.m.heard(pid("b"))
    assert cycle() == [None, None]  # every member heard: no probe this cycle
    swim.m.mark(pid("b"), "suspect")  # a suspect is probed until it refutes or is dead
    assert b in cycle()
    assert a is not None
    a.heard_at -= 5.0  # heard too long ago
    assert a in cycle()


async def test_a_settled_swarm_whose_frames_flow_sends_no_probes_and_still_finds_a_crash(
    net: Net,
) -> None:
    """On a slow uplink the probes and their answers would take a share of the line while
    delta frames, which say the same, flow anyway. News is still spread at the pace."""
    config = dataclasses.replace(SETTLING, heard_window=1.0)
    for name, seeds in (("a", []), ("b", ["a"]), ("c", ["a"])):
        await net.start(name, seeds, config=config)
    await until(lambda: all(len(net.nodes[n].m.others()) == 2 for n in "abc"))
    sending = set("abc")

    async def frames() -> None:  # every peer's delta frames reach the others
        while True:
            for s in sending:
                for r in set("abc") - {s}:
                    net.nodes[r].m.heard(pid(s))
            await asyncio.sleep(0.02)

    task = asyncio.create_task(frames())
    try:
        await until(lambda: all(net.nodes[n].unsettled() is None for n in "abc"))
        net.probes.clear()
        await asyncio.sleep(1.0)
        assert net.probes == []  # at the settled pace without frames: ~30 (the test above)
        assert all(net.nodes[n].skipped > 0 for n in "abc")
        a = net.nodes["a"]
        a.m.refute(a.m.me.incarnation)  # news of a (a new incarnation): spread at the pace
        others = {pid("b"), pid("c")}
        await until(lambda: any(s == pid("a") and t in others for s, t in net.probes))
        sending.discard("c")
        net.kill("c")  # its frames stop: probed again in its turn, found dead
        await until(lambda: all(states(net.nodes[n])["c"] == "dead" for n in "ab"))
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("state", "zombie", "state: Input should be"),
        ("incarnation", MAX_COUNTER + 1, "incarnation: Input should be less than"),
        ("incarnation", 2**63, "incarnation: Input should be less than"),
        ("incarnation", -1, "incarnation: Input should be greater"),
        ("incarnation", "5", "incarnation: Input should be a valid integer"),
        ("incarnation", True, "incarnation: Input should be a valid integer"),
        ("id", "x", "id: String should match"),
        ("url", "http://user:pw@host:1", "url: Value error, a peer URL holds no credentials"),
        ("url", "file:///etc/passwd", "url: Value error, expected http"),
        ("url", "http://h/" + "a" * 300, "url: Value error, expected a printable ASCII URL"),
        ("public_key", "AB" * 32, "public_key: String should match"),
        ("extra", 1, "extra: Extra inputs are not permitted"),
    ],
)
def test_malformed_records_are_refused(field: str, value: Any, why: str) -> None:
    good = upd("a").model_dump(mode="json")
    record = {**good, field: value}
    with pytest.raises(MessageError, match=f"malformed MemberRecord: {why}"):
        parse(Update, record)
    assert parse(Update, good) == upd("a")


def test_gossip_carries_at_most_64_updates() -> None:
    msg = {"from": upd("a").model_dump(mode="json"), "updates": [upd("b").model_dump()] * 65}
    with pytest.raises(MessageError, match="updates: List should have at most 64"):
        parse(Gossip, msg)


def test_claims_about_a_member_come_only_from_that_member() -> None:
    """Gossip to A that B has left, at a huge incarnation, with the attacker's URL and key,
    must not make A list B as left with them."""
    probes: list[str] = []
    ms = Membership(upd("me"), identity=ident("me"), on_hearsay=probes.append)
    assert ms.apply(upd("b", inc=5))
    b, evil = ident("b"), ident("evil")
    huge = MAX_COUNTER
    lies = [
        upd("b", "left", huge, signed=False),  # unsigned: nobody's word
        Update(id=b.peer_id, url="http://evil.example", public_key=evil.public_key_hex,
               state="left", incarnation=huge),  # another key under b's id
        sign_record(  # the attacker signs with its own key: the id is not its key's
            Update(id=evil.peer_id, url="http://evil.example", public_key=evil.public_key_hex,
                   state="alive", incarnation=huge), evil, "default",
        ).model_copy(update={"id": b.peer_id}),
        upd("b", "alive", huge).model_copy(update={"url": "http://evil.example"}),  # altered
        upd("b", "left", huge).model_copy(update={"signature": None}),
    ]  # fmt: skip
    for lie in lies:
        assert not ms.apply(lie)
    assert ms.refused == len(lies)
    m = ms.get(b.peer_id)
    assert m is not None and (m.state, m.url, m.public_key, m.incarnation) == (
        "alive", url("b"), b.public_key_hex, 5
    )  # fmt: skip
    # Suspicion or death from others: a probe of our own, nothing else.
    assert not ms.apply(upd("b", "dead", huge)) and not ms.apply(upd("b", "suspect", 5))
    assert probes == [b.peer_id, b.peer_id] and ms.get(b.peer_id).state == "alive"  # type: ignore[union-attr]
    assert not ms.apply(upd("b", "dead", 4)), "older than what we know: not even a probe"
    assert len(probes) == 2
    # The member itself may move (a signed record, higher incarnation) and may leave.
    assert not ms.apply(upd("b", "alive", 6).model_copy(update={"url": "http://b2.mem"}))
    moved = sign_record(
        Update(id=b.peer_id, url="http://b2.mem", public_key=b.public_key_hex, state="alive",
               incarnation=7), b, "default",
    )  # fmt: skip
    assert ms.apply(moved) and ms.get(b.peer_id).url == "http://b2.mem"  # type: ignore[union-attr]
    assert ms.apply(upd("b", "left", 7)) and ms.get(b.peer_id).state == "left"  # type: ignore[union-attr]


def test_a_record_from_another_swarm_is_not_believed() -> None:
    ms = Membership(upd("me"), identity=ident("me"), swarm="blue")
    assert not ms.apply(upd("b"))  # signed for swarm "default"
    u = sign_record(upd("b", signed=False), ident("b"), "blue")
    assert ms.apply(u)


def test_own_records_are_signed_and_gossip_carries_members_own_records() -> None:
    ms = Membership(upd("me", inc=3), identity=ident("me"))
    me = ms.me.update()
    assert me.signature is not None and record_problem(me, "default") is None
    ms.apply(upd("me", "suspect", 3))  # refute: a new signed record at a higher incarnation
    again = ms.me.update()
    assert again.incarnation == 4 and record_problem(again, "default") is None
    assert ms.apply(upd("b"))
    ms.mark(pid("b"), "suspect")  # our own verdict: gossiped unsigned, as an opinion
    said = {u.id: u for u in ms.snapshot()}
    assert said[pid("b")].state == "suspect" and said[pid("b")].signature is None
    left = ms.leaving()
    assert left.state == "left" and record_problem(left, "default") is None


async def test_hearsay_makes_the_receiver_probe_not_believe(net: Net) -> None:
    for name, seeds in (("a", []), ("b", ["a"]), ("c", ["a"])):
        await net.start(name, seeds)
    await until(lambda: all(len(net.nodes[n].m.others()) == 2 for n in "abc"))
    a = net.nodes["a"]
    a.m.apply(upd("b", "dead", MAX_COUNTER))  # a lie at the largest incarnation
    await until(lambda: pid("b") not in a._urgent)  # probed first, and b answered
    assert states(a)["b"] == "alive"
    assert all(states(net.nodes[n])["b"] == "alive" for n in "ac")


def test_a_suspect_member_still_trains_the_job_a_dead_one_does_not() -> None:
    """On a full slow link a training peer is suspected again and again (its probe answers
    queue behind delta frames): it stays in the job's round (sent deltas, its deltas counted)
    until it is declared dead."""
    me = SimpleNamespace(state="alive")
    members = {p: SimpleNamespace(id=p, state="alive") for p in ("a", "b", "c", "d")}
    fake = SimpleNamespace(
        settings=SimpleNamespace(gossip_interval=0.5),
        membership=SimpleNamespace(me=me, get=members.get),
        quarantine=SimpleNamespace(excluded=lambda pid: pid == "d"),
        _job_peers={"j": dict.fromkeys(members, time.monotonic())},
    )
    members["b"].state = "suspect"
    members["c"].state = "dead"
    got = [m.id for m in Trainers.job_peers(fake, "j")]  # type: ignore[arg-type]
    assert got == ["a", "b"]  # d is quarantined


def test_a_frame_heard_says_its_sender_is_alive_and_trains_the_job() -> None:
    """The exchange tells membership of every delta frame that passed its checks: the sender
    trains the job (``job_peers``) even when no advert of it came lately (probes skipped)."""
    m = Membership(upd("me"))
    m.apply(upd("a"))
    fake = SimpleNamespace(
        settings=SimpleNamespace(gossip_interval=0.5), membership=m, _job_peers={}, _heard=set(),
        quarantine=SimpleNamespace(excluded=lambda _pid: False), _job_of={},
    )  # fmt: skip
    fake.trains = lambda job, peer: Trainers.trains(fake, job, peer)  # type: ignore[arg-type]
    assert Trainers.job_peers(fake, "j") == []  # type: ignore[arg-type]
    before = time.monotonic()
    for name in ("a", "stranger", "me"):  # only a member, not this daemon, is heard
        Trainers.heard(fake, "j", pid(name))  # type: ignore[arg-type]
    assert [p.id for p in Trainers.job_peers(fake, "j")] == [pid("a")]  # type: ignore[arg-type]
    assert fake._heard == {pid("a")} and m.members[pid("a")].heard_at >= before


def test_who_trains_what_holds_one_job_a_known_member() -> None:
    """A member advertising a fresh job id on every message, or a stranger's advert, adds no
    entry that stays: a peer trains one job at a time, and only members count (else one entry
    a message would be kept for good)."""
    m = Membership(upd("me"))
    m.apply(upd("a"))
    fake = SimpleNamespace(membership=m, _job_peers={}, _job_of={})
    for i in range(100):
        Trainers.trains(fake, f"job{i}", pid("a"))  # type: ignore[arg-type]
        Trainers.trains(fake, f"job{i}", pid("stranger"))  # type: ignore[arg-type]
    assert list(fake._job_peers) == ["job99"] and list(fake._job_peers["job99"]) == [pid("a")]


async def test_a_dashboard_refresh_asks_a_bounded_number_of_peers_for_curves() -> None:
    """Every dashboard refresh (each 2 s) asks the job's peers for their loss curves. With the
    swarm secret alone keys are free: a member that advertises the job under 4,096 keys would
    make each refresh ask 4,096 peers for up to 402 points each, parsed and sent on to the
    browser (measured: ~50 s of the event loop, 146 MB of JSON a refresh).
    Only the first MAX_CURVE_PEERS heard training it are asked; the rest are counted."""
    members = [SimpleNamespace(id=f"{i:032x}", url=f"https://m{i}") for i in range(4096)]
    asked: list[str] = []

    async def get(url: str, path: str, reply: Any, **kw: Any) -> ProgressCurve:
        asked.append(url)
        return ProgressCurve(points=[])

    fake = SimpleNamespace(client=SimpleNamespace(get=get), job_peers=lambda _job: members)
    answers, left_out = await Trainers.peer_curves(fake, "j")  # type: ignore[arg-type]
    assert asked == [m.url for m in members[:MAX_CURVE_PEERS]]
    assert [m.id for m, _ in answers] == [m.id for m in members[:MAX_CURVE_PEERS]]
    assert left_out == 4096 - MAX_CURVE_PEERS


def _restarted(live: list[str], donors: dict[str, str]) -> Any:
    """What ``Trainers.settled_donors`` reads: the live members, who trains the job, whom
    we heard from and whether we have joined."""
    node = SimpleNamespace(joined=asyncio.Event(), _heard=set(), live=live)
    node.membership = SimpleNamespace(others=lambda *_: [SimpleNamespace(id=p) for p in node.live])
    node.job_donors = lambda _job: [donors[p] for p in sorted(node._heard) if p in donors]
    return node


async def _settle(node: Any, **kw: Any) -> tuple[list[str], float]:
    t0 = time.monotonic()
    got = await Trainers.settled_donors(node, "j", give_up=kw.pop("give_up", lambda: False), **kw)
    return got, time.monotonic() - t0


async def test_a_restarted_daemon_waits_to_hear_who_trains_its_job() -> None:
    """Readiness, not a guess: no answer before the join, donors as soon as one is heard."""
    node = _restarted(["a", "b"], {"b": "https://b"})
    task = asyncio.ensure_future(_settle(node))
    await asyncio.sleep(0.3)
    node._heard.add("b")  # heard before the join answered: still waits for the join
    await asyncio.sleep(0.3)
    assert not task.done()
    node.joined.set()
    got, took = await asyncio.wait_for(task, 5)
    assert got == ["https://b"] and took >= 0.6


async def test_no_donor_once_every_live_member_was_heard() -> None:
    node = _restarted(["a", "b"], {})
    node.joined.set()
    task = asyncio.ensure_future(_settle(node))
    node._heard.add("a")
    await asyncio.sleep(0.3)
    assert not task.done()  # b has not spoken yet: it may train the job
    node._heard.add("b")
    got, _ = await asyncio.wait_for(task, 5)
    assert got == []


async def test_waiting_for_donors_is_bounded_and_gives_up_on_shutdown() -> None:
    silent = _restarted(["a"], {"a": "https://a"})  # never joins: unreachable seeds
    got, took = await _settle(silent, timeout=0.5)
    assert got == [] and 0.5 <= took < 3
    silent.joined.set()  # joined, but a never answers
    got, took = await _settle(silent, timeout=0.5)
    assert got == [] and 0.5 <= took < 3
    stopping = asyncio.Event()
    task = asyncio.ensure_future(_settle(silent, give_up=stopping.is_set))
    await asyncio.sleep(0.2)
    stopping.set()
    got, took = await asyncio.wait_for(task, 5)
    assert got == [] and took < 5
