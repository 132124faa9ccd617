"""The swarm node's records of membership changes, on a real SQLite file."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import pytest

from atomd.config import Settings
from atomd.db import repo
from atomd.p2p.identity import Identity
from atomd.p2p.membership import Member
from atomd.p2p.messages import JobAdvert, job_id_for, sign_stop
from atomd.p2p.node import SwarmNode
from atomd.telemetry import Telemetry
from tests.unit.conftest import Sessions


async def test_changes_queued_at_shutdown_are_recorded(tmp_path: Path, sessions: Sessions) -> None:
    """A swarm stopping together: the others' leaves reach this daemon as it stops, and the
    recorder task is cancelled with changes queued and one being written: they all land."""
    settings = Settings(data_dir=tmp_path, device="cpu")
    node = SwarmNode(settings=settings, identity=Identity.generate(), sessions=sessions,
                     telemetry=Telemetry(), jobs=cast(Any, None))  # fmt: skip
    members = [
        Member(Identity.generate().peer_id, f"https://127.0.0.1:{42000 + i}", "00" * 32, "left", 1)
        for i in range(6)
    ]
    for m in members:
        node.records.on_change(m, "alive")
    recorder = asyncio.create_task(node.records.record_changes())
    await asyncio.sleep(0)  # it takes the first change and starts writing it
    recorder.cancel()
    with pytest.raises(asyncio.CancelledError):
        await recorder
    async with sessions() as s:
        left = await repo.list_events(s, kind="peer.left")
    assert sorted(e.peer_id for e in left) == sorted(m.id for m in members)


async def test_peers_that_left_are_knocked_at_last(tmp_path: Path, sessions: Sessions) -> None:
    """A swarm with no seeds that stopped together recorded every member "left", and no
    member knocked at any other after a restart: it stayed apart. Those that left are now
    join candidates after the seeds, the other remembered peers and the LAN's (at most
    LEFT_CANDIDATES of them, newest first)."""
    from atomd.p2p.node import LEFT_CANDIDATES

    me = Identity.generate()
    settings = Settings(data_dir=tmp_path, device="cpu", seeds=["https://seed:1"])
    node = SwarmNode(settings=settings, identity=me, sessions=sessions,
                     telemetry=Telemetry(), jobs=cast(Any, None))  # fmt: skip
    rows = [("alive", 2), ("dead", 3)] + [("left", 10 + i) for i in range(LEFT_CANDIDATES + 2)]
    for state, port in rows:
        async with sessions() as s, s.begin():
            await repo.upsert_peer(s, peer_id=Identity.generate().peer_id,
                                   url=f"https://127.0.0.1:{port}", public_key=None,
                                   state=state, incarnation=1)  # fmt: skip
    node.lan_found(Identity.generate().peer_id, "https://lan:1")
    got = await node._candidates()
    left = [f"https://127.0.0.1:{10 + i}" for i in range(LEFT_CANDIDATES + 2)][::-1]
    assert got[:2] == ["https://seed:1", "https://127.0.0.1:3"]  # newest first
    assert got[2:4] == ["https://127.0.0.1:2", "https://lan:1"]
    assert got[4:] == left[:LEFT_CANDIDATES]


async def test_a_straggler_is_told_again_at_a_bounded_pace(
    tmp_path: Path, sessions: Sessions, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The origin repeats a swarm-wide stop to a member heard training the job, at most every
    RESTOP_S a (member, job); the pairs it remembers are bounded, and a full memory drops
    only those told longer ago (a review: clearing it all let fresh keys reset every pair)."""
    import time

    from atomd.p2p import gossip as gossip_module

    monkeypatch.setattr(gossip_module, "MAX_TOLD_STOPPED", 2)
    settings = Settings(data_dir=tmp_path, device="cpu")
    node = SwarmNode(settings=settings, identity=Identity.generate(), sessions=sessions,
                     telemetry=Telemetry(), jobs=cast(Any, None))  # fmt: skip
    ids = [Identity.generate() for _ in range(3)]
    for i, who in enumerate(ids):
        node.membership.members[who.peer_id] = Member(
            who.peer_id, f"https://127.0.0.1:{42100 + i}", who.public_key_hex, "alive", 1
        )
    job = job_id_for(node.peer_id)
    stop = sign_stop(job, node.identity, settings.swarm)
    now = time.monotonic()
    node.gossip._tell_stopped(ids[0].peer_id, stop)
    node.gossip._tell_stopped(ids[1].peer_id, stop)
    told = dict(node.gossip._told_stopped)
    node.gossip._tell_stopped(ids[0].peer_id, stop)  # again at once: not told
    assert node.gossip._told_stopped == told
    node.gossip._tell_stopped(ids[2].peer_id, stop)  # full, both told just now: not remembered
    assert (ids[2].peer_id, job) not in node.gossip._told_stopped
    node.gossip._told_stopped[(ids[0].peer_id, job)] = now - gossip_module.RESTOP_S  # long ago
    node.gossip._tell_stopped(ids[2].peer_id, stop)
    assert set(node.gossip._told_stopped) == {(ids[1].peer_id, job), (ids[2].peer_id, job)}


def test_a_stop_is_its_origins_own() -> None:
    """A stop a member passes on counts only as its origin signed it: for this job, in this
    swarm, by the key the job id names. A member cannot stop another's job by signing a stop
    of its own, nor replay a stop of another job or swarm."""
    from atomd.p2p.messages import stop_forgery

    origin, member = Identity.generate(), Identity.generate()
    job, other = job_id_for(origin.peer_id), job_id_for(origin.peer_id)
    stop = sign_stop(job, origin, "s")
    assert stop_forgery(stop, job, "s") is None
    assert "sent to stop job" in str(stop_forgery(stop, other, "s"))
    assert "not signed by its origin" in str(stop_forgery(stop, job, "another swarm"))
    assert "not one the stop's origin" in str(stop_forgery(sign_stop(job, member, "s"), job, "s"))
    lying = stop.model_copy(update={"origin": member.peer_id})
    assert "is not that of key" in str(stop_forgery(lying, job, "s"))
    flipped = ("0" if stop.signature[0] != "0" else "1") + stop.signature[1:]
    forged = stop.model_copy(update={"signature": flipped})
    assert "not signed by its origin" in str(stop_forgery(forged, job, "s"))


class _Jobs:
    """The job manager as the swarm node sees it: what it was told."""

    def __init__(self) -> None:
        self.stops: list[tuple[str, str, str | None, int | None]] = []
        self.newer: list[int] = []  # the runs of newer_run's adverts
        self.training: dict[str, int] = {}  # job id -> its run, trained here now
        self.known: set[str] = set()  # jobs trained here once

    async def stop_from_peer(
        self, job_id: str, peer_id: str, via: str | None = None, run: int | None = None
    ) -> None:
        self.stops.append((job_id, peer_id, via, run))

    def stopped_swarm_wide(self, job_id: str) -> int | None:
        return None

    def trains(self, job_id: str) -> bool:
        return job_id in self.training

    def run_of(self, job_id: str) -> int | None:
        return self.training.get(job_id)

    async def had(self, job_id: str) -> bool:
        return job_id in self.training or job_id in self.known

    async def newer_run(self, advert: JobAdvert) -> None:
        self.newer.append(advert.run)
        self.training[advert.id] = self.newer[-1]

    def offer(self, advert: JobAdvert, donors: list[str]) -> None:
        raise AssertionError("auto_join is off")


def _node(
    tmp_path: Path, sessions: Sessions, members: Sequence[Identity], me: Identity | None = None
) -> tuple[SwarmNode, _Jobs]:
    """A swarm node (auto-join off) that knows ``members`` alive, and its job manager."""
    jobs = _Jobs()
    settings = Settings(data_dir=tmp_path, device="cpu", auto_join=False)
    node = SwarmNode(settings=settings, identity=me or Identity.generate(), sessions=sessions,
                     telemetry=Telemetry(), jobs=cast(Any, jobs))  # fmt: skip
    for i, who in enumerate(members):
        node.membership.members[who.peer_id] = Member(
            who.peer_id, f"https://127.0.0.1:{42200 + i}", who.public_key_hex, "alive", 1
        )
    return node, jobs


def _gossip(origin: Identity, job: str, run: int = 0, swarm: str = "default") -> Any:
    """A message carrying the origin's advert of ``job``'s ``run``."""
    from types import SimpleNamespace

    from atomd.p2p.messages import JobAdvert, sign_advert
    from atomd.spec import JobSpec

    advert = sign_advert(JobAdvert(id=job, spec=JobSpec(), run=run), origin, swarm)
    return cast(Any, SimpleNamespace(job=advert))


async def test_a_member_passes_the_origins_stop_on(
    tmp_path: Path, sessions: Sessions, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member that heard a job's signed stop tells a straggler still training the job, as
    the origin would (the origin may be gone); a forged stop is refused and kept nowhere; a
    stop of our own job is ours to say; the origin heard training the job again (resumed,
    a daemon of before runs), the stop is dropped."""
    from atomd.errors import MessageError
    from atomd.p2p import gossip as gossip_module

    origin, relay, straggler = (Identity.generate() for _ in range(3))
    node, jobs = _node(tmp_path, sessions, [origin, relay, straggler])
    swarm = node.settings.swarm
    job = job_id_for(origin.peer_id)
    stop = sign_stop(job, origin, swarm)
    with pytest.raises(MessageError, match="not signed by its origin"):
        await node.stop_from_peer(job, relay.peer_id, sign_stop(job, origin, "another swarm"))
    assert jobs.stops == [] and node.stop_notice(job) is None

    jobs.known.add(job)  # trained here once
    await node.stop_from_peer(job, relay.peer_id, stop)
    assert jobs.stops == [(job, origin.peer_id, relay.peer_id, 0)]
    assert node.stop_notice(job) == stop
    node.gossip.on_message(straggler.peer_id, _gossip(origin, job))
    assert (straggler.peer_id, job) in node.gossip._told_stopped
    assert job not in node.trainers._job_peers  # not counted as training it

    mine = job_id_for(node.peer_id)
    await node.stop_from_peer(mine, relay.peer_id, sign_stop(mine, node.identity, swarm))
    assert len(jobs.stops) == 1 and node.stop_notice(mine) is None

    node.gossip.on_message(origin.peer_id, _gossip(origin, job))  # sent before its stop
    assert node.stop_notice(job) == stop
    at = node.gossip._stop_notices[job][1]
    with monkeypatch.context() as m:  # RESTOP_S on
        m.setattr(gossip_module.time, "monotonic", lambda: at + gossip_module.RESTOP_S + 1)
        node.gossip.on_message(origin.peer_id, _gossip(origin, job, run=1))  # a later run: kept
        assert node.stop_notice(job) == stop
        node.gossip.on_message(origin.peer_id, _gossip(origin, job))  # resumed, runs unknown to it
    assert node.stop_notice(job) is None


def test_a_stop_and_an_advert_sign_their_run() -> None:
    """The run a stop ends and the run an advert names are the origin's word: changed on the
    way, neither holds. The first run's payloads are those of daemons before runs, so that
    those still believe a job that was never resumed, and its stop."""
    from atomd.p2p.messages import (
        ADVERT_VERSION,
        STOP_VERSION,
        JobAdvert,
        advert_forgery,
        advert_payload,
        sign_advert,
        stop_forgery,
        stop_payload,
    )
    from atomd.spec import JobSpec

    origin = Identity.generate()
    job = job_id_for(origin.peer_id)
    stop = sign_stop(job, origin, "s", run=3)
    assert stop.run == 3 and stop_forgery(stop, job, "s") is None
    for run in (0, 2, 4):
        assert "not signed by its origin" in str(
            stop_forgery(stop.model_copy(update={"run": run}), job, "s")
        )
    fields = (STOP_VERSION, "s", job, origin.peer_id, origin.public_key_hex)
    assert (
        stop_payload(job, origin.peer_id, origin.public_key_hex, "s", 0)
        == "\n".join(fields).encode()
    )
    advert = sign_advert(JobAdvert(id=job, spec=JobSpec(preset="tiny"), run=3), origin, "s")
    assert advert.run == 3 and advert_forgery(advert, "s") is None
    assert advert_forgery(advert.model_copy(update={"run": 4}), "s") is not None
    first = advert.model_copy(update={"run": 0, "signature": None})
    assert advert_payload(first, "s").split(b"\n")[:-1] == [
        ADVERT_VERSION.encode(), b"s", job.encode(), origin.peer_id.encode(),
        origin.public_key_hex.encode(),
    ]  # fmt: skip


async def test_a_kept_stop_ends_no_copy_of_a_later_run(tmp_path: Path, sessions: Sessions) -> None:
    """The replay of a kept stop: an origin stops its job swarm-wide
    and resumes it; a member that kept the old signed stop passed it to every peer that joined
    the new run, and a peer never rejoins a job it had. A member now tells the stop only to a
    peer of the run it ended (or before); it keeps that stop for the stragglers of that run;
    the stop of a later run replaces it, and an earlier one does not replace a later one. What
    it passes to the job manager names the run, which refuses a stop of a run before its own
    (``test_adverts``)."""
    origin, relay, joiner, straggler = (Identity.generate() for _ in range(4))
    node, jobs = _node(tmp_path, sessions, [origin, relay, joiner, straggler])
    job = job_id_for(origin.peer_id)
    swarm = node.settings.swarm
    jobs.known.add(job)
    first = sign_stop(job, origin, swarm, run=0)
    await node.stop_from_peer(job, relay.peer_id, first)
    assert [r for *_, r in jobs.stops] == [0]
    node.gossip.on_message(joiner.peer_id, _gossip(origin, job, 1))  # the origin resumed: run 1
    assert (joiner.peer_id, job) not in node.gossip._told_stopped
    assert joiner.peer_id in [m.id for m in node.job_peers(job)]  # counted as training it
    assert node.stop_notice(job) == first  # kept for the stragglers of run 0
    node.gossip.on_message(origin.peer_id, _gossip(origin, job, 1))  # the origin itself: stays too
    assert node.stop_notice(job) == first
    node.gossip.on_message(straggler.peer_id, _gossip(origin, job, 0))
    assert (straggler.peer_id, job) in node.gossip._told_stopped

    second = sign_stop(job, origin, swarm, run=1)
    await node.stop_from_peer(job, relay.peer_id, second)
    assert node.stop_notice(job) == second and jobs.stops[-1][-1] == 1
    await node.stop_from_peer(job, relay.peer_id, first)  # replayed late: not kept
    assert node.stop_notice(job) == second and jobs.stops[-1][-1] == 0
    node.gossip.on_message(joiner.peer_id, _gossip(origin, job, 1))
    assert (joiner.peer_id, job) in node.gossip._told_stopped


async def test_an_earlier_runs_advert_is_not_joined(tmp_path: Path, sessions: Sessions) -> None:
    """The origin's advert of an earlier run is still signed: a member could hand it to a
    fresh peer, which joined that run and was then ended by the run's kept stop, for good.
    A joiner takes no run earlier than the latest it heard of (a member's made-up jobs push
    out only its own: RUNS_A_TELLER); a copy trained here in an earlier run than an advert's
    goes on in that one (the job manager: ``test_adverts``); and a stop of a job this daemon
    never had is neither kept nor recorded (any key makes up jobs of its own, and their
    stops would push out the others')."""
    from atomd.p2p.gossip import RUNS_A_TELLER, STOP_HEARD

    origin, member, straggler, evil = (Identity.generate() for _ in range(4))
    node, jobs = _node(tmp_path, sessions, [origin, member, straggler, evil])
    offers: list[int] = []
    node.settings.auto_join = True
    jobs.offer = lambda advert, donors: offers.append(  # type: ignore[method-assign]
        advert.run if advert.id == job else -1
    )
    job = job_id_for(origin.peer_id)
    node.gossip.on_message(member.peer_id, _gossip(origin, job, 0))
    node.gossip.on_message(evil.peer_id, _gossip(origin, job, 2))  # told first by evil, then
    node.gossip.on_message(origin.peer_id, _gossip(origin, job, 2))  # by its origin: the origin's
    for _ in range(RUNS_A_TELLER + 1):  # made up, each: they push out evil's own only
        node.gossip.on_message(evil.peer_id, _gossip(evil, job_id_for(evil.peer_id)))
    node.gossip.on_message(straggler.peer_id, _gossip(origin, job, 1))
    assert [r for r in offers if r >= 0] == [0, 2, 2] and node.latest_run(job) == 2
    assert sum(t == evil.peer_id for _, t in node.gossip._runs.values()) == RUNS_A_TELLER
    assert {m.id for m in node.job_peers(job)} == {origin.peer_id, member.peer_id,
                                                   straggler.peer_id}  # fmt: skip
    jobs.training[job] = 0  # trained here, in run 0
    async with asyncio.TaskGroup() as tg:
        node._tg = tg
        node.gossip.on_message(straggler.peer_id, _gossip(origin, job, 1))
        await asyncio.sleep(0)
        node.gossip.on_message(member.peer_id, _gossip(origin, job, 2))
        await asyncio.sleep(0)
        node.gossip.on_message(origin.peer_id, _gossip(origin, job, 2))
    node._tg = None
    assert jobs.newer == [1, 2]  # each time ours is earlier, not only a run heard first

    made_up = job_id_for(evil.peer_id)
    node.gossip.on_message(evil.peer_id, _gossip(evil, made_up))
    await node.stop_from_peer(made_up, evil.peer_id, sign_stop(made_up, evil, "default"))
    assert node.stop_notice(made_up) is None and jobs.stops[-1][0] == made_up
    jobs.known.add(made_up)  # ... unless this daemon trained it
    await node.stop_from_peer(made_up, evil.peer_id, sign_stop(made_up, evil, "default"))
    assert node.stop_notice(made_up) is not None
    async with sessions() as s:
        assert [e.job_id for e in await repo.list_events(s, kind=STOP_HEARD)] == [made_up]


async def test_a_kept_stop_outlives_a_restart(tmp_path: Path, sessions: Sessions) -> None:
    """A member that restarted forgot the origins' stops it had heard, so a straggler that
    woke after that (the origin gone) trained on alone. Each stop a member keeps is recorded
    once (``job.stop_heard``) and read back, checked again: a row whose signature does not
    hold, or that is no stop, is not believed, and a stop of an earlier run than the one held
    of its job is neither kept nor recorded."""
    from atomd.p2p.gossip import STOP_HEARD

    me, origin, relay, straggler = (Identity.generate() for _ in range(4))
    before, jobs = _node(tmp_path, sessions, [origin, relay, straggler], me)
    swarm = before.settings.swarm
    job, other = job_id_for(origin.peer_id), job_id_for(origin.peer_id)
    first, second = (sign_stop(job, origin, swarm, run=r) for r in (0, 1))
    third = sign_stop(other, origin, swarm)
    jobs.known.update((job, other))
    for notice in (second, second, first, third):
        await before.stop_from_peer(notice.job_id, relay.peer_id, notice)
    async with sessions() as s, s.begin():
        heard = await repo.list_events(s, kind=STOP_HEARD)
        assert [(e.job_id, e.peer_id) for e in heard] == [(other, relay.peer_id),
                                                           (job, relay.peer_id)]  # fmt: skip
        lying = {**second.model_dump(mode="json"), "run": 7}
        await repo.add_event(s, kind=STOP_HEARD, message="", job_id=job, data=lying)
        await repo.add_event(s, kind=STOP_HEARD, message="", job_id=job, data={"job_id": "x"})

    after, _ = _node(tmp_path, sessions, [origin, relay, straggler], me)
    await after.load_records()
    assert after.stop_notice(job) == second and after.stop_notice(other) == third
    after.gossip.on_message(straggler.peer_id, _gossip(origin, job, 1))
    assert (straggler.peer_id, job) in after.gossip._told_stopped
    after.gossip.on_message(origin.peer_id, _gossip(origin, job, 1))
    assert after.stop_notice(job) is None  # heard before the restart: the origin resumed it


async def test_a_change_that_cannot_be_recorded_is_logged_with_its_reason(
    tmp_path: Path, sessions: Sessions, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """A peer row that cannot be written is logged with the error, and the recorder goes on
    with the next change: the records must not end the daemon, nor fail silently."""
    settings = Settings(data_dir=tmp_path, device="cpu")
    node = SwarmNode(settings=settings, identity=Identity.generate(), sessions=sessions,
                     telemetry=Telemetry(), jobs=cast(Any, None))  # fmt: skip
    real = node.records._record_change
    broken = Identity.generate().peer_id

    async def record(u: Any, before: Any) -> None:
        if u.id == broken:
            raise RuntimeError("database is locked")
        await real(u, before)

    monkeypatch.setattr(node.records, "_record_change", record)
    fine = Identity.generate().peer_id
    for pid in (broken, fine):
        node.records.on_change(
            Member(pid, "https://127.0.0.1:42000", "00" * 32, "left", 1), "alive"
        )
    recorder = asyncio.create_task(node.records.record_changes())
    try:
        while True:
            async with sessions() as s:
                if await repo.list_events(s, kind="peer.left"):
                    break
            await asyncio.sleep(0.01)
    finally:
        recorder.cancel()
        with pytest.raises(asyncio.CancelledError):
            await recorder
    failed = [r for r in caplog.records if r.name == "atomd.p2p.records"]
    assert [r.getMessage() for r in failed] == [
        f"could not record peer {broken}: alive -> left: database is locked"
    ]
    assert failed[0].exc_info is not None


async def test_a_failing_background_send_is_logged_with_its_reason(
    tmp_path: Path, sessions: Sessions, caplog: Any
) -> None:
    """A task the node spawns (an announcement, a stop, a newer run taken on) that fails is
    logged with its reason and ends that task only."""
    settings = Settings(data_dir=tmp_path, device="cpu")
    node = SwarmNode(settings=settings, identity=Identity.generate(), sessions=sessions,
                     telemetry=Telemetry(), jobs=cast(Any, None))  # fmt: skip
    done = asyncio.Event()

    async def fails() -> None:
        done.set()
        raise ValueError("no such run")

    async with asyncio.TaskGroup() as tg:
        node._tg = tg
        node._spawn(fails(), "newer-run")
        await done.wait()
    node._tg = None
    msgs = [r.getMessage() for r in caplog.records if r.name == "atomd.p2p.node"]
    assert msgs == ["task newer-run failed: no such run"]
