"""DeltaExchange: a round's frame goes to every peer training the job, frames that arrive are
checked before they are queued, and both are recorded (real SQLite; the peer client is a fake)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from atomd.db import migrate, repo
from atomd.db.connection import make_engine, make_sessionmaker
from atomd.errors import NotFoundError, PeerRequestError, WireError
from atomd.p2p.identity import Identity
from atomd.spec import JobSpec, lr_at
from atomd.sync import average
from atomd.sync.exchange import DeltaExchange
from atomd.sync.job_peers import PeerRef
from atomd.sync.uplink import RETRY_DELAY_S
from atomd.telemetry import Telemetry
from tests.conftest import fake_engine
from tests.polling import until

JOB = "a" * 32


@dataclass(frozen=True)
class Peer:
    id: str
    url: str


@dataclass
class FakeClient:
    """Records uploads; answers each url with the statuses given, in turn (None: accepted)."""

    answers: dict[str, list[int | None]] = field(default_factory=dict)
    posts: list[tuple[str, str, int]] = field(default_factory=list)
    timeouts: list[float] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)

    async def post_bytes(
        self, url: str, path: str, body: bytes, reply: Any, *, target: str, timeout: float
    ) -> Any:
        self.posts.append((url, path, len(body)))
        self.bodies.append(body)
        self.timeouts.append(timeout)
        queue = self.answers.get(url, [])
        status = queue.pop(0) if queue else None
        if status is not None:
            raise PeerRequestError(f"{url}{path}: {status}", status=status if status else None)
        return {}


@dataclass
class FakePeers:
    peers: list[Peer]
    keys: dict[str, str] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)
    judged: list[tuple[str, bool]] = field(default_factory=list)
    heard_from: list[tuple[str, str]] = field(default_factory=list)

    def job_peers(self, job_id: str) -> Sequence[PeerRef]:
        return self.peers

    def public_key(self, peer_id: str) -> str | None:
        return self.keys.get(peer_id)

    def exclusion(self, peer_id: str) -> str | None:
        return self.excluded.get(peer_id)

    def heard(self, job_id: str, peer_id: str) -> None:
        self.heard_from.append((job_id, peer_id))

    async def judge(self, sender: str, strike: bool, reason: str | None) -> None:
        self.judged.append((sender, strike))


@dataclass
class Training:
    job: str | None = JOB

    def trains(self, job_id: str) -> bool:
        return job_id == self.job


@pytest.fixture
async def sessions(tmp_path: Path) -> AsyncIterator[Any]:
    db = tmp_path / "atomd.db"
    await asyncio.to_thread(migrate.upgrade, db)
    engine = make_engine(db)
    s = make_sessionmaker(engine)
    async with s() as session, session.begin():
        await repo.create_job(session, job_id=JOB, spec={}, out_dir="/x", scope="swarm")
    yield s
    await engine.dispose()


def exchange(sessions: Any, client: FakeClient, peers: FakePeers) -> DeltaExchange:
    ex = DeltaExchange(
        identity=Identity.generate(),
        client=cast(Any, client),
        peers=peers,
        sessions=sessions,
        telemetry=Telemetry(),
    )
    ex.jobs = Training()
    return ex


def attach(ex: DeltaExchange) -> Any:
    """A plugin closing a round every step: the fake peers send no deltas, and no round is
    held for theirs (the hold has its own tests in test_sync_runner.py)."""
    plugin = ex.plugin(JOB, JobSpec(sync={"codec": "fp32", "every": 1}))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    plugin.attach(fake_engine(model))
    plugin.schedule.previous_open = lambda: False
    return plugin


def frames_of(sessions: Any, sender: Identity, steps: int) -> list[bytes]:
    """The frames ``sender``'s own exchange sends after each of ``steps`` steps (every=1, the
    test model's shape), signed with its identity."""
    theirs = exchange(sessions, FakeClient(), FakePeers([]))
    theirs.identity = sender
    sent: list[Any] = []
    mine = attach(theirs)
    mine.send = sent.append
    for step in range(1, steps + 1):
        mine.after_step(step)
    return [o.frame for o in sent]


async def rounds(sessions: Any) -> list[Any]:
    async with sessions() as s:
        return list(await repo.list_rounds(s, job_id=JOB, limit=100))


@contextlib.asynccontextmanager
async def running(ex: DeltaExchange) -> AsyncIterator[None]:
    task = asyncio.create_task(ex.run())
    await asyncio.sleep(0)  # its TaskGroup is up
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_the_robust_rule_weighs_longer_rounds_by_the_jobs_schedule(sessions: Any) -> None:
    """The exchange hands each job's plugin the job's learning rate at each step, which its
    robust rule weighs a longer round by (``robust.Screen._longer``)."""
    spec = JobSpec(max_steps=600, warmup_steps=50, sync={"codec": "fp32", "every": 1})
    plugin = exchange(sessions, FakeClient(), FakePeers([])).plugin(JOB, spec)
    plugin.attach(fake_engine(torch.nn.Linear(4, 3)))
    screen = plugin.state.screen
    assert screen is not None and screen.lr is not None
    assert [screen.lr(s) for s in (0, 49, 300, 599)] == [lr_at(spec, s) for s in (0, 49, 300, 599)]


async def test_a_round_goes_to_every_peer_and_is_recorded_once_per_peer(sessions: Any) -> None:
    a, b, c = Peer("p" * 32, "http://a"), Peer("q" * 32, "http://b"), Peer("r" * 32, "http://c")
    # a: accepted; b: a network error, then accepted (one retry); c: refused, never retried.
    client = FakeClient(answers={"http://b": [0], "http://c": [409]})
    ex = exchange(sessions, client, FakePeers([a, b, c]))
    plugin = attach(ex)

    async def three_rows() -> bool:
        return len(await rounds(sessions)) == 3

    async with running(ex):
        plugin.after_step(1)  # a round boundary (every=1): the frame goes to the loop
        await until(three_rows, "a row per peer")
    assert sorted(url for url, _, _ in client.posts) == ["http://a", "http://b", "http://b",
                                                          "http://c"]  # fmt: skip
    assert {path for _, path, _ in client.posts} == {f"/p2p/v1/jobs/{JOB}/deltas"}
    by_peer = {r.peer_id: r for r in await rounds(sessions)}
    assert by_peer[a.id].applied and by_peer[b.id].applied
    assert not by_peer[c.id].applied and "409" in (by_peer[c.id].reason or "")
    assert {r.direction for r in by_peer.values()} == {"sent"}
    assert by_peer[a.id].bytes == client.posts[0][2]
    assert by_peer[a.id].compression_ratio == pytest.approx(15 * 4 / by_peer[a.id].bytes)


async def test_a_peer_that_starts_training_later_gets_the_rounds_it_missed(
    sessions: Any,
) -> None:
    """A round's frame goes to the peers training the job when it closes; one that starts a
    moment later is sent the recent frames it missed (at most max_staleness of them), once,
    oldest first and before the round's own: while it fetches the swarm's state it keeps the
    newest frames that come, and the round's own, sent first, was the one it dropped."""
    a, b = Peer("p" * 32, "http://a"), Peer("q" * 32, "http://b")
    client = FakeClient()
    peers = FakePeers([a])
    ex = exchange(sessions, client, peers)
    plugin = ex.plugin(JOB, JobSpec(sync={"codec": "fp32", "every": 1, "max_staleness": 2}))
    torch.manual_seed(0)
    plugin.attach(fake_engine(torch.nn.Linear(4, 3)))
    plugin.schedule.previous_open = lambda: False  # a round a step: none held for a's deltas
    round_of: dict[bytes, int] = {}
    keep = ex.delivery.kept.keep

    def keeping(out: Any, tried: set[str], limit: int) -> None:
        round_of[out.frame] = out.outgoing.round
        keep(out, tried, limit)

    ex.delivery.kept.keep = keeping  # type: ignore[method-assign]

    def rows_of(n: int) -> Any:
        async def check() -> bool:
            return len(await rounds(sessions)) >= n

        return check

    async with running(ex):
        for step in (1, 2, 3):  # rounds 0-2 go to a alone
            plugin.after_step(step)
            await until(rows_of(step), f"round {step - 1} sent")
        peers.peers = [a, b]  # b starts training the job
        plugin.after_step(4)  # round 3 goes to both; b then gets rounds 1 and 2 (not 0: stale)
        await until(rows_of(7), "round 3 and the catch-up recorded")
        plugin.after_step(5)  # round 4: nothing to catch up any more
        await until(rows_of(9), "round 4 sent")
    sent = [(r.peer_id, r.round) for r in sorted(await rounds(sessions), key=lambda r: r.id)]
    assert [rnd for pid, rnd in sent if pid == a.id] == [0, 1, 2, 3, 4]
    assert [rnd for pid, rnd in sent if pid == b.id] == [1, 2, 3, 4]
    assert [url for url, _, _ in client.posts].count("http://b") == 4
    to_b = [round_of[body] for (url, _, _), body in zip(client.posts, client.bodies, strict=True)
            if url == "http://b"]  # fmt: skip
    assert to_b == [1, 2, 3, 4]  # the order they went in


@dataclass
class SlowClient:
    """Answers each upload after ``delay[url]`` seconds (forever: never); records when each
    started and how many were in flight at once."""

    delay: dict[str, float]
    started: dict[str, float] = field(default_factory=dict)
    in_flight: int = 0
    most_in_flight: int = 0
    log: list[tuple[str, bytes]] = field(default_factory=list)  # (url, frame) as each starts

    async def post_bytes(
        self, url: str, path: str, body: bytes, reply: Any, *, target: str, timeout: float
    ) -> Any:
        self.started[url] = asyncio.get_running_loop().time()
        self.log.append((url, body))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay.get(url, 0.0))
        finally:
            self.in_flight -= 1
        return {}


async def test_a_rounds_uploads_go_one_after_another_and_a_silent_peer_costs_the_pace(
    sessions: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One at a time, a round's frames do not leave as one burst that overflows a slow
    uplink's buffer; a peer that does not answer holds the next upload only for the frame's
    time at the rate measured so far (``Uplink.pace``), not for its timeout nor the stagger."""
    from atomd.sync import uplink

    monkeypatch.setattr(uplink, "UPLOAD_STAGGER_S", 5.0)
    peers = [Peer(ch * 32, f"http://{ch}") for ch in "pqr"]
    client = SlowClient(delay={"http://p": 0.05, "http://q": 0.05, "http://r": 0.05})
    ex = exchange(sessions, cast(Any, client), FakePeers(peers))
    plugin = attach(ex)

    async def rows(n: int) -> bool:
        return len(await rounds(sessions)) == n

    async with running(ex):
        plugin.after_step(1)  # round 0: nothing measured yet, each waits for its answer
        await until(lambda: rows(3), "round 0 sent to all three")
        assert client.most_in_flight == 1
        first = min(client.started, key=lambda u: client.started[u])
        # The next round: another peer goes first; now no peer answers: each upload holds
        # the next for the pace the answers of round 0 measured (~0.05 s), far below the
        # stagger.
        client.started.clear()
        client.delay = dict.fromkeys(client.delay, 3600.0)
        plugin.after_step(2)
        await until(lambda: len(client.started) == 3, "round 1 to all three")
        assert min(client.started, key=lambda u: client.started[u]) != first
        t = sorted(client.started.values())
        assert all(0.04 <= b - a < 2.5 for a, b in itertools.pairwise(t))


async def test_each_peer_gets_this_peers_rounds_in_order(sessions: Any) -> None:
    """One delivery at a time: a round handed over while the last one's frame is still on its
    way (the job's last round does not wait for it) goes out after it, so that no receiver
    gets round r + 1 before round r (one that does can end its job without the earlier delta,
    its anchor 2.3 % from the others': 4 real daemons at 256 kbit/s)."""
    peers = [Peer(ch * 32, f"http://{ch}") for ch in "pq"]
    client = SlowClient(delay={"http://p": 0.3, "http://q": 0.01})
    ex = exchange(sessions, cast(Any, client), FakePeers(peers))
    plugin = attach(ex)  # every = 1: a round at each step, whatever is in flight

    async with running(ex):
        plugin.after_step(1)  # round 0: p first (slow), then q
        plugin.after_step(2)  # round 1: q first
        await until(lambda: len(client.log) == 4, "both rounds to both peers")
        await until(lambda: client.in_flight == 0, "all answered")
    rounds_sent = list(dict.fromkeys(body for _, body in client.log))  # round 0's went first
    assert len(rounds_sent) == 2
    for url in ("http://p", "http://q"):
        assert [body for u, body in client.log if u == url] == rounds_sent, url
    assert client.most_in_flight == 1


@pytest.mark.parametrize("dead_again", [False, True])
async def test_a_peer_that_answers_nothing_holds_up_nobody_once_it_is_dead(
    sessions: Any, dead_again: bool
) -> None:
    """A stopped daemon (SIGSTOP) answers no upload until its timeout (2 x 30 s). Once its
    membership declares it dead, the round counts as gone and the next one goes. Alive again,
    it gets the next round after the one still stuck on it, in order, or, dead again by then,
    not at all. (Were the rounds to wait behind the stuck upload, every peer's would: a
    72-step round at all three others of ``atomd bench swarm``'s sigstop scenario.)"""
    p, q = (Peer(ch * 32, f"http://{ch}") for ch in "pq")
    client = SlowClient(delay={"http://p": 1.5, "http://q": 0.01})
    peers = FakePeers([p, q])
    ex = exchange(sessions, cast(Any, client), peers)
    plugin = attach(ex)  # every = 1: a round at each step
    loop = asyncio.get_running_loop()

    async with running(ex):
        plugin.after_step(1)  # round 0: p first (stuck), then q after the stagger
        await until(lambda: len(client.log) == 2, "round 0 to both")
        assert plugin.schedule.in_flight is not None  # p's upload holds the round
        peers.peers = [q]  # p is dead
        await until(lambda: plugin.schedule.in_flight is None, "round 0 gone")
        peers.peers = [p, q]  # p refuted: alive again
        plugin.after_step(2)  # round 1: q first, then p once its round 0 is done
        await until(lambda: len(client.log) == 3, "round 1 to q")
        assert loop.time() - client.started["http://p"] < 1.5  # p's round 0 still hangs
        if dead_again:
            peers.peers = [q]
        await until(lambda: plugin.schedule.in_flight is None, "round 1 gone")

        async def recorded() -> bool:  # the round's rows go once all its uploads are done
            return sum(r.direction == "sent" for r in await rounds(sessions)) == 4

        await until(recorded, "every upload recorded")
    to_p = [body for url, body in client.log if url == "http://p"]
    to_q = [body for url, body in client.log if url == "http://q"]
    assert to_p == to_q[:1] if dead_again else to_p == to_q
    sent = {(r.round, r.peer_id[0]): r for r in await rounds(sessions) if r.direction == "sent"}
    assert ("no longer trains" in (sent[(1, "p")].reason or "")) is dead_again


async def test_the_average_frame_waits_for_the_round_in_flight(sessions: Any) -> None:
    """The final average's frame (25x a round's at a slow link) goes after the job's last
    round, not beside it on the same uplink: shared with it, the last round can reach a peer
    following the rounds 11 s late, after it has ended its job."""
    average = b"the average"
    rounds_in_flight_at_average: list[int] = []

    @dataclass
    class Watching(SlowClient):
        async def post_bytes(self, url: str, path: str, body: bytes, *a: Any, **kw: Any) -> Any:
            if body == average:
                rounds_in_flight_at_average.append(self.in_flight - len(self.averaging))
                self.averaging.append(url)
            return await super().post_bytes(url, path, body, *a, **kw)

        averaging: list[str] = field(default_factory=list)

    peers = [Peer(ch * 32, f"http://{ch}") for ch in "pq"]
    client = Watching(delay={"http://p": 0.3, "http://q": 0.01})
    ex = exchange(sessions, cast(Any, client), FakePeers(peers))
    plugin = attach(ex)

    async with running(ex):
        plugin.after_step(1)  # the last round: p first (slow), then q
        plugin.send_average(average, 30.0)  # handed over at once, as finish() does
        await until(lambda: len(client.log) == 4, "round and average to both")
        await until(lambda: client.in_flight == 0, "all answered")
    assert rounds_in_flight_at_average == [0, 0]
    for url in ("http://p", "http://q"):
        assert [body == average for u, body in client.log if u == url] == [False, True]


async def test_a_round_stuck_on_a_silent_peer_holds_the_average_only_for_a_while(
    sessions: Any,
) -> None:
    """The average waits for the round in flight a quarter of the time the others wait for it
    at most: a round whose upload to a silent peer takes its full timeout would otherwise make
    the share miss every other peer's wait. Then it goes beside that round."""
    from atomd.sync.delivery import AVERAGE_WAITS_FOR_ROUND

    average = b"the average"
    peers = [Peer(ch * 32, f"http://{ch}") for ch in "pq"]
    client = SlowClient(delay={"http://p": 1000.0, "http://q": 0.01})  # p never answers
    ex = exchange(sessions, cast(Any, client), FakePeers(peers))
    plugin = attach(ex)
    wait_s = 2.0  # what the others wait for the share

    async with running(ex):
        plugin.after_step(1)  # the last round: p first, silent; q after the stagger
        handed = asyncio.get_running_loop().time()
        plugin.send_average(average, wait_s)
        got = ("http://q", average)
        await until(lambda: got in client.log, "the average to q")
        took = asyncio.get_running_loop().time() - handed
        assert client.in_flight >= 1  # p's round still hangs
    assert AVERAGE_WAITS_FOR_ROUND * wait_s <= took < wait_s


def test_the_pace_is_a_frames_time_at_the_fastest_recent_rate(sessions: Any) -> None:
    """Before any upload is measured the stagger; then the frame's size over the fastest of
    the last RATE_SAMPLES rates, never above the stagger."""
    from atomd.sync.uplink import RATE_SAMPLES, UPLOAD_STAGGER_S

    ex = exchange(sessions, FakeClient(), FakePeers([]))
    assert ex.uplink.pace(10_000) == UPLOAD_STAGGER_S
    ex.uplink.rates.extend([1_000.0, 4_000.0, 2_000.0])
    assert ex.uplink.pace(2_000) == pytest.approx(0.5)
    assert ex.uplink.pace(10**9) == UPLOAD_STAGGER_S
    ex.uplink.rates.extend([100.0] * RATE_SAMPLES)  # the fast ones aged out
    assert ex.uplink.pace(20) == pytest.approx(0.2)


async def test_received_frames_are_checked_queued_and_recorded(sessions: Any) -> None:
    sender = Identity.generate()
    peers = FakePeers([Peer(sender.peer_id, "http://s")], {sender.peer_id: sender.public_key_hex})
    ex = exchange(sessions, FakeClient(), peers)
    plugin = attach(ex)
    frame, later = frames_of(sessions, sender, 2)  # its own exchange's: same model shape

    size = await ex.receive(JOB, frame, sender.peer_id)
    assert size == len(frame) and len(plugin.inbox) == 1
    assert peers.heard_from == [(JOB, sender.peer_id)]  # membership need not probe it now
    with pytest.raises(WireError, match="replayed"):
        await ex.receive(JOB, frame, sender.peer_id)
    with pytest.raises(WireError, match="bad_signature"):  # signed by one, sent by another
        await ex.receive(JOB, later, "f" * 32)
    assert peers.heard_from == [(JOB, sender.peer_id)], "only a frame that passed is heard"
    refused = [r for r in await rounds(sessions) if not r.applied]
    assert len(refused) == 2 and all(r.round == -1 for r in refused)

    async def merged() -> bool:
        return any(r.applied and r.direction == "received" for r in await rounds(sessions))

    async with running(ex):  # merged at the next step: recorded as received, with its size
        plugin.after_step(2)
        await until(merged, "the merge recorded")
    (row,) = [r for r in await rounds(sessions) if r.applied and r.direction == "received"]
    assert (row.direction, row.peer_id, row.bytes, row.round) == (
        "received",
        sender.peer_id,
        len(frame),
        0,
    )

    ex.jobs = Training(job=None)  # no longer training it: nothing is queued
    with pytest.raises(NotFoundError):
        await ex.receive(JOB, frame, sender.peer_id)
    ex.jobs = Training()
    ex.release(JOB)
    assert ex.max_frame_bytes(JOB) == 0
    with pytest.raises(NotFoundError):
        await ex.receive(JOB, frame, sender.peer_id)


async def test_frames_that_come_during_the_state_transfer_are_kept_and_checked_after(
    sessions: Any,
) -> None:
    """A joining or restarted peer's plugin exists before its state has come, and the others
    already send it their frames: lost, those deltas would be in every anchor but its own.
    They are kept (the newest EARLY_PER_SENDER of each sender), then checked and queued once
    the plugin is attached; garbage is refused then, as it would have been at once."""
    from atomd.sync.admission import EARLY_PER_SENDER

    sender, other_sender = Identity.generate(), Identity.generate()
    keys = {i.peer_id: i.public_key_hex for i in (sender, other_sender)}
    peers = FakePeers([Peer(sender.peer_id, "http://s")], keys)
    ex = exchange(sessions, FakeClient(), peers)
    spec = JobSpec(sync={"codec": "fp32", "every": 1})
    plugin = ex.plugin(JOB, spec)  # not attached: the job is fetching its state
    assert ex.max_frame_bytes(JOB) > 0  # bounded from the spec before the model exists
    frames = frames_of(sessions, sender, EARLY_PER_SENDER + 2)
    for f in frames:
        assert await ex.receive(JOB, f, sender.peer_id) == len(f)
    assert await ex.receive(JOB, b"garbage", other_sender.peer_id) == len(b"garbage")
    assert len(plugin.inbox) == 0 and not await rounds(sessions)

    async with running(ex):
        torch.manual_seed(0)
        plugin.attach(fake_engine(torch.nn.Linear(4, 3)))

        async def queued() -> bool:
            return len(plugin.inbox) == EARLY_PER_SENDER

        async def refused_garbage() -> bool:
            return any(not r.applied for r in await rounds(sessions))

        await until(queued, "the kept frames queued")
        await until(refused_garbage, "the garbage refused")
    got = sorted(c.round for c in plugin.inbox.take())
    assert got == list(range(len(frames) - EARLY_PER_SENDER, len(frames)))  # the newest
    assert peers.heard_from == []  # kept frames say nothing of their sender now
    refused = [r for r in await rounds(sessions) if not r.applied]
    assert [(r.peer_id, r.round) for r in refused] == [(other_sender.peer_id, -1)]
    # Released (the transfer failed, or the job ended) before it was attached: nothing kept.
    ex.release(JOB)
    ex.plugin(JOB, spec)
    await ex.receive(JOB, frames[0], sender.peer_id)
    ex.release(JOB)
    assert not ex.admission.early.frames and ex.max_frame_bytes(JOB) == 0


async def test_only_members_frames_are_kept_during_the_state_transfer_and_boundedly(
    sessions: Any,
) -> None:
    """What a peer keeps while it fetches its state is checked only once it is attached, so
    only a known member's body is kept (keys are free: fresh keys would take every place, and
    the members' frames would then be refused and their deltas lost), and all the bodies
    kept hold at most EARLY_MAX_FRAMES of the largest frames the job takes; over that, the
    sender holding the most gives up its oldest."""
    from atomd.sync.admission import EARLY_MAX_FRAMES, EARLY_PER_SENDER

    members = [Identity.generate() for _ in range(3)]
    keys = {i.peer_id: i.public_key_hex for i in members}
    ex = exchange(sessions, FakeClient(), FakePeers([Peer(i.peer_id, "u") for i in members], keys))
    ex.plugin(JOB, JobSpec(sync={"codec": "fp32", "every": 1}))  # fetching its state
    with pytest.raises(WireError, match="unknown_sender"):
        await ex.receive(JOB, b"junk", Identity.generate().peer_id)
    big = ex.max_frame_bytes(JOB)
    for _ in range(EARLY_PER_SENDER):
        for i in members:
            assert await ex.receive(JOB, bytes(big), i.peer_id) == big
    kept = ex.admission.early.frames[JOB]
    assert sum(len(b) for q in kept.values() for b in q) <= EARLY_MAX_FRAMES * big
    assert sorted(len(q) for q in kept.values()) == [2, 3, 3]  # 12 would be 1.5x the bound
    assert await ex.receive(JOB, b"small", members[0].peer_id) == 5  # a small one still fits
    ex.release(JOB)


async def test_a_senders_refused_frames_are_recorded_at_most_so_many_a_minute(
    sessions: Any,
) -> None:
    """A refused frame is recorded a row in the job's rounds, but a member sending junk frames
    (refused without a strike) wrote a row each without end: REFUSAL_ROWS a minute a sender
    are recorded, the rest counted only."""
    from atomd.sync.records import REFUSAL_ROWS

    junk, other = Identity.generate(), Identity.generate()
    keys = {i.peer_id: i.public_key_hex for i in (junk, other)}
    ex = exchange(sessions, FakeClient(), FakePeers([Peer(junk.peer_id, "j")], keys))
    attach(ex)
    for _ in range(REFUSAL_ROWS + 5):
        with pytest.raises(WireError):
            await ex.receive(JOB, b"ATD1junk", junk.peer_id)
    with pytest.raises(WireError):
        await ex.receive(JOB, b"ATD1junk", other.peer_id)
    rows = await rounds(sessions)
    assert [r.peer_id for r in rows].count(junk.peer_id) == REFUSAL_ROWS
    assert [r.peer_id for r in rows].count(other.peer_id) == 1
    start, n = ex.records.refusals.windows[(JOB, junk.peer_id)]
    ex.records.refusals.windows[(JOB, junk.peer_id)] = (
        start - 60,
        n,
    )  # a minute on: recorded again
    with pytest.raises(WireError):
        await ex.receive(JOB, b"ATD1junk", junk.peer_id)
    assert [r.peer_id for r in await rounds(sessions)].count(junk.peer_id) == REFUSAL_ROWS + 1


async def test_a_member_forwarding_anothers_frame_does_not_make_it_a_replay(
    sessions: Any,
) -> None:
    """Every peer of a job receives every other's frames. One re-posting another's frame is
    refused before the replay guard records it, so the sender's own upload, a moment later,
    is still taken (checked after, it was refused as a replay: its delta lost there)."""
    honest, hostile = Identity.generate(), Identity.generate()
    keys = {i.peer_id: i.public_key_hex for i in (honest, hostile)}
    ex = exchange(sessions, FakeClient(), FakePeers([Peer(honest.peer_id, "h")], keys))
    plugin = attach(ex)
    (f,) = frames_of(sessions, honest, 1)
    with pytest.raises(WireError, match="bad_signature"):
        await ex.receive(JOB, f, hostile.peer_id)
    assert await ex.receive(JOB, f, honest.peer_id) == len(f)
    assert len(plugin.inbox) == 1


async def test_frames_that_come_while_the_trainer_loads_are_kept_for_its_plugin(
    sessions: Any,
) -> None:
    """A restarted daemon resumes its job and loads torch (seconds on a busy machine) before
    the job's plugin exists; the others already send it their rounds. From ``expect`` on they
    are kept, and queued once the plugin is attached. A job nobody expects still gets 404."""
    sender = Identity.generate()
    keys = {sender.peer_id: sender.public_key_hex}
    ex = exchange(sessions, FakeClient(), FakePeers([Peer(sender.peer_id, "http://s")], keys))
    spec = JobSpec(sync={"codec": "fp32", "every": 1})
    (frame,) = frames_of(sessions, sender, 1)

    assert ex.max_frame_bytes(JOB) == 0
    with pytest.raises(NotFoundError):  # not expected: refused before anything is kept
        await ex.receive(JOB, frame, sender.peer_id)
    ex.expect(JOB, spec)
    assert ex.max_frame_bytes(JOB) > 0  # the peer plane bounds the body from the spec
    assert await ex.receive(JOB, frame, sender.peer_id) == len(frame)
    assert JOB not in ex.job_table.plugins and not await rounds(sessions)

    plugin = ex.plugin(JOB, spec)  # torch is loaded; then the state transfer
    async with running(ex):
        torch.manual_seed(0)
        plugin.attach(fake_engine(torch.nn.Linear(4, 3)))

        async def queued() -> bool:
            return len(plugin.inbox) == 1

        await until(queued, "the frame kept while the trainer loaded queued")
    assert [c.sender for c in plugin.inbox.take()] == [sender.peer_id]
    # Released before its plugin existed (the job failed to start): nothing kept, 404 again.
    ex.release(JOB)
    ex.expect(JOB, spec)
    await ex.receive(JOB, frame, sender.peer_id)
    ex.release(JOB)
    assert not ex.admission.early.frames and ex.max_frame_bytes(JOB) == 0
    with pytest.raises(NotFoundError):
        await ex.receive(JOB, frame, sender.peer_id)


def _ours_and_theirs(sessions: Any) -> tuple[Identity, FakePeers, DeltaExchange, Any, Any]:
    """Our exchange with its job's plugin, and another peer's plugin (its own exchange, signed
    by ``sender``, whom ours knows as its only peer)."""
    sender = Identity.generate()
    peers = FakePeers([Peer(sender.peer_id, "http://s")], {sender.peer_id: sender.public_key_hex})
    ex = exchange(sessions, FakeClient(), peers)
    plugin = attach(ex)
    other = exchange(sessions, FakeClient(), FakePeers([]))
    other.identity = sender
    return sender, peers, ex, plugin, attach(other)


async def test_a_peers_final_delta_takes_it_out_of_the_job(sessions: Any) -> None:
    """A peer done with the job says so in its last frame: nobody waits for its deltas after
    that round (it no longer counts among the job's peers), but it is still sent the later
    rounds' frames (it follows them to the end) for as long as it has the job."""
    sender, peers, ex, plugin, theirs = _ours_and_theirs(sessions)
    sent: list[Any] = []
    theirs.send = sent.append
    theirs.after_step(1)
    theirs.finish(2, threading.Event())  # alone there: no wait; its last frame says final
    assert [o.final for o in sent] == [False, True]
    await ex.receive(JOB, sent[0].frame, sender.peer_id)
    assert plugin.n_peers(0) == 2
    await ex.receive(JOB, sent[1].frame, sender.peer_id)  # its last: on base version 1
    assert len(plugin.inbox) == 2  # its deltas still count
    # It takes part in the rounds up to its last (it still waits for their deltas), no more.
    assert (plugin.n_peers(1), plugin.n_peers(2)) == (2, 1)
    client = cast(FakeClient, ex.client)
    async with running(ex):
        plugin.after_step(1)  # round 0, on base version 0: sent to it
        plugin.after_step(2)  # base version 1: its last round
        plugin.after_step(3)  # base version 2: it follows the round, so it is sent it too
        await until(lambda: len(client.posts) >= 3, "three uploads")
        await until(lambda: plugin.schedule.in_flight is None, "the round delivered")
        peers.peers = []  # it has ended the job (its advert says so): sent nothing more
        plugin.after_step(4)
        delivered = "the last round delivered"
        await until(lambda: plugin.schedule.in_flight is None, delivered)
        await asyncio.sleep(0.1)
    assert len(client.posts) == 3, client.posts


async def test_an_average_frame_is_kept_apart_from_the_deltas_and_sent_without_a_round(
    sessions: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job's final average travels in a frame of its own: received, it never enters the
    round inbox (it is kept for the average); sent, it goes to every peer with the job and is
    not recorded as a round."""
    from atomd.sync.guard import LossGuard

    sender, _, ex, plugin, theirs = _ours_and_theirs(sessions)
    frames: list[bytes] = []
    assert theirs.state is not None
    theirs.send = lambda out: frames.append(out.frame)
    waits: list[float] = []
    theirs.send_average = lambda frame, wait_s: (frames.append(frame), waits.append(wait_s))
    theirs.finishers = lambda: ["a-peer-that-never-answers"]
    theirs.guard = LossGuard(theirs.state, lambda: 0.0)
    theirs.spec = theirs.spec.model_copy(update={"final_wait_s": 0.1})
    monkeypatch.setattr(average, "UPLOAD_S", 0.1)  # the wait for the silent finisher's share
    theirs.after_step(1)
    theirs.finish(2, threading.Event())  # round 0, its last round 1, then its average frame
    assert len(frames) == 3
    # its uploads may take as long as the others wait for it: final_wait_s plus its budget
    assert waits == [pytest.approx(0.2, abs=0.05)]
    for frame in frames:
        await ex.receive(JOB, frame, sender.peer_id)
    assert len(plugin.inbox) == 2  # the two deltas
    (share,) = plugin.averages.on(2)  # made on its anchor after its last round
    assert share.sender == sender.peer_id and set(share.tensors) == {"weight", "bias"}
    with pytest.raises(WireError, match="replayed"):
        await ex.receive(JOB, frames[2], sender.peer_id)

    client = cast(FakeClient, ex.client)
    client.answers["http://s"] = [0]  # the link fails it: tried once, not again
    before = await rounds(sessions)
    async with running(ex):
        assert plugin.send_average is not None
        plugin.send_average(frames[2], 77.0)  # the exchange's own: to every peer with the job
        await until(lambda: len(client.posts) == 1, "the upload")
        await asyncio.sleep(2 * RETRY_DELAY_S)  # where a round's frame would be retried
    assert client.posts == [("http://s", f"/p2p/v1/jobs/{JOB}/deltas", len(frames[2]))]
    assert client.timeouts == [pytest.approx(77.0, abs=0.5)]  # what is left of it, not a
    # round's UPLOAD_TIMEOUT_S
    assert len(await rounds(sessions)) == len(before)


async def test_a_silent_peer_stops_counting_in_the_rounds_and_counts_again_when_it_sends(
    sessions: Any,
) -> None:
    """A peer listed as training the job whose deltas no merge applies (it sends nothing:
    broken, or a hostile silent member; or only what is refused) counts in the rounds'
    average (``n_peers``) for SILENT_ROUNDS + max_staleness rounds, then no more; it is still
    sent every frame; its next applied delta counts it again. A refused delta, or one
    clipped hard enough to be a strike, does not."""
    from atomd.sync.job_peers import SILENT_ROUNDS
    from atomd.sync.state import AppliedDelta, MergeReport, RefusedDelta

    loud, quiet = Peer("l" * 32, "http://l"), Peer("q" * 32, "http://q")
    ex = exchange(sessions, FakeClient(), FakePeers([loud, quiet]))
    plugin = attach(ex)
    grace = SILENT_ROUNDS + plugin.spec.max_staleness

    def applied(version: int, peer: Peer, strike: bool = False) -> MergeReport:
        return MergeReport(version, applied=[AppliedDelta(peer.id, 0, 0, 1.0, strike=strike)])

    assert plugin.n_peers(0) == 3  # both listed, neither silent yet
    await ex.record_merge(JOB, applied(1, loud))  # the loud one's delta merged in round 1
    assert plugin.n_peers(grace) == 3
    assert plugin.n_peers(grace + 1) == 2  # the quiet one: silent now, the loud one not yet
    assert plugin.n_peers(grace + 2) == 1
    assert [p.id for p in ex.round_peers.training(JOB, grace + 2)] == [
        loud.id,
        quiet.id,
    ]  # still sent to
    await ex.record_merge(JOB, applied(grace + 2, quiet))  # it counts again
    assert plugin.n_peers(grace + 2) == 2
    assert plugin.n_peers(2 * grace + 2) == 2 and plugin.n_peers(2 * grace + 3) == 1
    # Refused, or applied as a strike: the loud one stays silent.
    refused = MergeReport(2 * grace + 3, refused=[RefusedDelta(loud.id, 5, "stale")])
    await ex.record_merge(JOB, refused)
    await ex.record_merge(JOB, applied(2 * grace + 3, loud, strike=True))
    assert plugin.n_peers(2 * grace + 3) == 1


async def test_a_received_delta_carries_the_steps_its_frame_says_its_round_lasted(
    sessions: Any,
) -> None:
    """The robust rule raises its clip bound for a delta of a longer round than this peer's
    own (``Screen.judge``'s ``every``): the steps come from the frame's cadence to the
    contribution the merge judges (None where the frame says nothing)."""
    from atomd.sync.codecs import make_codec
    from atomd.sync.wire import encode_frame

    sender = Identity.generate()
    peers = FakePeers([Peer(sender.peer_id, "http://s")], {sender.peer_id: sender.public_key_hex})
    ex = exchange(sessions, FakeClient(), peers)
    plugin = ex.plugin(JOB, JobSpec(sync={"codec": "fp32", "every": 1}))
    torch.manual_seed(0)
    plugin.attach(fake_engine(torch.nn.Linear(4, 3)))
    tensors = [(n, make_codec("fp32").encode(torch.full(s, 0.01)))
               for n, s in plugin.expected_shapes.items()]  # fmt: skip
    for rnd, cadence in ((0, {"period_s": 2.0, "every": 6}), (1, None)):
        frame = encode_frame(identity=sender, job_id=JOB, round=rnd, base_version=rnd,
                             tensors=tensors, cadence=cadence)  # fmt: skip
        await ex.receive(JOB, frame, sender.peer_id)
    assert [(c.round, c.every) for c in plugin.inbox.take()] == [(0, 6), (1, None)]


async def test_quarantined_senders_and_other_codecs_are_refused(sessions: Any) -> None:
    """A frame in another codec than the job's is refused (a strike), and nothing
    from a quarantined member is decoded at all."""
    from atomd.errors import PeerAuthError
    from atomd.sync.codecs import make_codec
    from atomd.sync.wire import encode_frame

    sender = Identity.generate()
    peers = FakePeers([Peer(sender.peer_id, "http://s")], {sender.peer_id: sender.public_key_hex})
    ex = exchange(sessions, FakeClient(), peers)
    plugin = ex.plugin(JOB, JobSpec(sync={"codec": "topk", "every": 1}))
    torch.manual_seed(0)
    plugin.attach(fake_engine(torch.nn.Linear(4, 3)))
    dense = [(n, make_codec("fp32").encode(torch.full(s, 5.0)))
             for n, s in plugin.expected_shapes.items()]  # fmt: skip
    frame = encode_frame(identity=sender, job_id=JOB, round=0, base_version=0, tensors=dense)
    with pytest.raises(WireError, match="wrong_codec"):
        await ex.receive(JOB, frame, sender.peer_id)
    assert peers.judged == [(sender.peer_id, True)] and len(plugin.inbox) == 0
    assert peers.heard_from == []
    peers.excluded[sender.peer_id] = "quarantined here: 3 strikes"
    with pytest.raises(PeerAuthError, match="quarantined") as e:
        await ex.receive(JOB, b"not even a frame", sender.peer_id)
    assert e.value.status == 403
    # The sender is refused before the job is looked up: a job that has finished (or was never
    # here) does not turn the refusal into a 404.
    with pytest.raises(PeerAuthError, match="quarantined") as e:
        await ex.receive("another-job", b"not even a frame", sender.peer_id)
    assert e.value.status == 403
    assert len([r for r in await rounds(sessions) if not r.applied]) == 1, "only the first"


async def test_the_traffic_time_is_the_links_not_the_databases(
    sessions: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the round's merge did is written after the uploads: a slow database (a busy
    machine's SQLite) must not count as link time, or the cadence would space the rounds and
    shrink the frames for nothing. It is still written, also when an upload fails."""
    peers = [Peer(ch * 32, f"http://{ch}") for ch in "pq"]
    client = SlowClient(delay={"http://p": 0.02, "http://q": 0.02})
    ex = exchange(sessions, cast(Any, client), FakePeers(peers))
    plugin = attach(ex)
    recorded: list[int] = []
    traffic: list[float] = []
    record_merge = ex.record_merge

    async def slow_record(job_id: str, merge: Any) -> None:
        await asyncio.sleep(0.5)
        await record_merge(job_id, merge)
        recorded.append(len(recorded))

    delivered = plugin.delivered
    monkeypatch.setattr(ex, "record_merge", slow_record)
    monkeypatch.setattr(plugin, "delivered", lambda rnd, s: (traffic.append(s), delivered(rnd, s)))
    async with running(ex):
        plugin.after_step(1)
        await until(lambda: len(recorded) == 1, "the merge recorded")
        assert len(traffic) == 1 and 0 <= traffic[0] < 0.4
        # /metrics: each upload until its answer (two peers), and the round's traffic time.
        sample = ex.telemetry.registry.get_sample_value
        assert sample("atomd_sync_upload_seconds_count") == 2
        assert 0.04 <= (sample("atomd_sync_upload_seconds_sum") or 0) < 0.4
        assert sample("atomd_sync_round_traffic_seconds_count") == 1
        assert sample("atomd_sync_round_traffic_seconds_sum") == pytest.approx(traffic[0])
        client.delay = {"http://p": -1.0}  # asyncio.sleep(-1) returns at once; q below fails

        async def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("a bug in the client")

        monkeypatch.setattr(client, "post_bytes", broken)
        plugin.after_step(2)
        await until(lambda: len(recorded) == 2, "recorded though uploads failed")


async def test_frames_pushed_out_of_the_inbox_leave_no_record_behind(sessions: Any) -> None:
    """A member sends 12 frames of distinct rounds: the inbox keeps its newest 4, and the
    exchange forgets the 8 it pushed out (they will never be merged, so never reported):
    what it keeps per frame stays bounded by the inbox's bound (not one record a frame, for
    the life of the job)."""
    sender = Identity.generate()
    peers = FakePeers([Peer(sender.peer_id, "http://s")], {sender.peer_id: sender.public_key_hex})
    ex = exchange(sessions, FakeClient(), peers)
    plugin = attach(ex)
    for f in frames_of(sessions, sender, 12):  # rounds 0..11
        await ex.receive(JOB, f, sender.peer_id)
    assert len(plugin.inbox) == 4 and plugin.inbox.dropped == 8
    assert len(ex.records.received) == 4
    ex.drop_sender(sender.peer_id)  # quarantined: its waiting frames and their records go
    assert len(plugin.inbox) == 0 and len(ex.records.received) == 0


async def test_a_restored_state_counts_the_peers_from_its_own_version(sessions: Any) -> None:
    """``attach`` asks who is counted on version 0, before a restarted peer's (or a joiner's)
    checkpoint sets the state's version hundreds of rounds on: every peer then read as silent
    since round 0, and the first round after counted this peer alone and committed its whole
    delta, which the others never do (4 real daemons, SIGKILL: anchors 5.2e-3 apart, run
    fh). Silence counts from the restored version."""
    from atomd.sync.job_peers import SILENT_ROUNDS

    peers = [Peer("a" * 32, "http://a"), Peer("b" * 32, "http://b")]
    ex = exchange(sessions, FakeClient(), FakePeers(peers))
    plugin = attach(ex)
    assert plugin.n_peers(0) == 3
    assert plugin.state is not None
    saved = plugin.state_tensors()
    version = 109
    saved[next(k for k in saved if k.endswith("version"))] = torch.tensor(version)
    assert version > SILENT_ROUNDS + plugin.spec.max_staleness
    assert plugin.load_state_tensors(saved)
    assert plugin.state.version == version
    assert plugin.n_peers(version) == 3  # was 1: both "silent since round 0"
