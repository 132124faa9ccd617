"""Jobs across the swarm: the adverts members carry on every message, and swarm-wide stops.

Every membership message carries the job its sender trains, as an advert its origin signed.
``JobGossip`` checks each advert, offers its job to the job manager (a free daemon joins it),
keeps the latest run each origin signed, and tells a member that trains a job stopped
swarm-wide again, with the origin's signed stop. It also sends this daemon's own
announcements and stops to the other members, and keeps the origins' signed stops heard
here (recorded as ``STOP_HEARD`` events) to pass on.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from atomd.config import Settings
from atomd.db import repo
from atomd.db.schemas import EventRecord, ProgressPoint
from atomd.errors import MessageError, PeerRequestError
from atomd.logs import Repeated, get_logger
from atomd.p2p import paths
from atomd.p2p.client import PeerClient
from atomd.p2p.identity import Identity
from atomd.p2p.membership import Member, Membership
from atomd.p2p.messages import (
    Ack,
    Announce,
    Gossip,
    JobAdvert,
    StopJob,
    StopNotice,
    advert_forgery,
    sign_advert,
    sign_stop,
    stop_forgery,
)
from atomd.p2p.quarantine import Quarantine
from atomd.p2p.trainers import Trainers

log = get_logger(__name__)

SEND_TIMEOUT_S = 3.0  # a job announcement or stop to one peer
RESTOP_S = 10.0  # a straggler that missed a swarm-wide stop is told again at most this often
MAX_TOLD_STOPPED = 1024  # (peer, job) pairs remembered for RESTOP_S
MAX_STOP_NOTICES = 1024  # origins' signed stops kept to pass on (the oldest go first)
RUNS_A_TELLER = 8  # jobs' latest runs kept of those one member told us of
STOP_HEARD = "job.stop_heard"  # the event that keeps an origin's signed stop across a restart

Spawn = Callable[[Coroutine[Any, Any, None], str], None]


class SwarmJobs(Protocol):
    """What the swarm needs from the job manager (``atomd.jobs.JobManager``)."""

    def advert(self) -> JobAdvert | None:
        """The swarm job this daemon trains, as told to peers (None if none)."""
        ...

    def offer(self, advert: JobAdvert, donors: list[str]) -> None:
        """A peer trains ``advert``: join it if free."""
        ...

    async def stop_from_peer(
        self, job_id: str, peer_id: str, via: str | None = None, run: int | None = None
    ) -> None:
        """The origin ``peer_id`` stopped ``job_id`` swarm-wide (``via``: the member that
        passed its signed stop on; ``run``: the run it signed, and those before)."""
        ...

    def stopped_swarm_wide(self, job_id: str) -> int | None:
        """The run of ``job_id`` this daemon started and stopped on every peer, or None."""
        ...

    def trains(self, job_id: str) -> bool:
        """Whether this daemon trains swarm job ``job_id`` now."""
        ...

    def run_of(self, job_id: str) -> int | None:
        """The run of ``job_id`` this daemon trains now (None: it does not train it)."""
        ...

    async def had(self, job_id: str) -> bool:
        """Whether this daemon has a record of ``job_id`` (trains it, or trained it once)."""
        ...

    async def newer_run(self, advert: JobAdvert) -> None:
        """The origin signed a later run of a job, in ``advert``: the copy trained here goes
        on in that run."""
        ...

    async def live_state(self, job_id: str, at_least: int = 0) -> bool:
        """Checkpoint the live state of a job trained here for a joining peer, if it is at
        step ``at_least`` or later (``NotFoundError`` if it is younger)."""
        ...

    def job_dir(self, job_id: str) -> Path: ...
    async def progress_curve(self, job_id: str, points: int) -> list[ProgressPoint]:
        """The job's loss curve on this daemon (``NotFoundError`` for a job unknown here)."""
        ...


class JobGossip:
    """The adverts and stops of swarm jobs, heard from members and sent to them."""

    def __init__(
        self,
        *,
        settings: Settings,
        identity: Identity,
        sessions: async_sessionmaker[AsyncSession],
        membership: Membership,
        client: PeerClient,
        quarantine: Quarantine,
        trainers: Trainers,
        jobs: SwarmJobs,
        spawn: Spawn,
        repeated: Repeated,
    ) -> None:
        """``spawn`` runs a send in the node's task group; ``repeated`` logs a repeated
        condition once, then at a backoff."""
        self.settings = settings
        self.identity = identity
        self.sessions = sessions
        self.membership = membership
        self.client = client
        self.quarantine = quarantine
        self.trainers = trainers
        self.jobs = jobs
        self._spawn = spawn
        self._repeated = repeated
        self._told_stopped: dict[tuple[str, str], float] = {}  # (peer, job) -> when
        # job id -> its origin's signed stop, heard from the origin or passed on by a member,
        # and when (monotonic seconds)
        self._stop_notices: dict[str, tuple[StopNotice, float]] = {}
        # job id -> the latest run its origin signed in an advert heard here, and the member
        # that first told us of the job (the newest MAX_STOP_NOTICES jobs', at most
        # RUNS_A_TELLER a member): a joiner takes no earlier run
        self._runs: dict[str, tuple[int, str]] = {}

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    def restore(self, heard: Sequence[EventRecord]) -> None:
        """The origins' stops members passed on (``STOP_HEARD`` events, newest first), as read
        from the database: a restart still passes them on. One that does not parse, or that
        its origin did not sign, is left out."""
        before = time.monotonic() - RESTOP_S - 1  # heard before this start
        for e in reversed(heard):  # the oldest first, as they were heard
            try:
                notice = StopNotice.model_validate(e.data or {})
            except ValidationError:
                continue
            if stop_forgery(notice, notice.job_id, self.settings.swarm) is None:
                self._keep_stop(notice, before)

    def advert(self) -> JobAdvert | None:
        """The job this daemon trains, as carried on its membership messages (None: none)."""
        advert = self.jobs.advert()
        return self._sealed(advert) if advert else None

    def _sealed(self, a: JobAdvert) -> JobAdvert:
        """``a`` as told to peers: signed here if this daemon started the job; a joined
        job's carries its origin's signature (``JobManager.advert``)."""
        return sign_advert(a, self.identity, self.settings.swarm) if a.origin == self.peer_id else a

    def on_message(self, sender: str, msg: Gossip) -> None:
        """A membership message from ``sender``, with the job it trains (if any)."""
        self.trainers.heard_from(sender)
        advert = msg.job
        if advert is None:
            return
        forged = advert_forgery(advert, self.settings.swarm)
        if forged is not None:  # neither joined nor counted as training the job
            self._repeated.log("forged-advert", logging.WARNING, "peer %s: %s", sender, forged)
            return
        latest = self._run_heard(advert, sender)
        held = self._stop_notices.get(advert.id)
        if (
            held is not None
            and sender == advert.origin
            and advert.run == held[0].run
            and time.monotonic() - held[1] > RESTOP_S
        ):  # the origin trains the run it stopped: it resumed it, with a daemon that does not
            # sign runs (a message it sent before its stop may come after it)
            del self._stop_notices[advert.id]
        notice = self.stop_notice(advert.id, advert.origin)
        if notice is not None and notice.run >= advert.run:
            self._tell_stopped(sender, notice)  # a straggler: it missed the stop (not joined)
            return
        # (A stop of a run before the advert's is kept for the stragglers of that run.)
        self.trainers.trains(advert.id, sender)
        ours = self.jobs.run_of(advert.id)
        if ours is not None and advert.run > ours:  # the origin resumed it: ours goes on in it
            self._spawn(self.jobs.newer_run(advert), "newer-run")
        if advert.run < latest:
            return  # an earlier run's (a straggler's): a joiner joins the latest it heard of
        if self.settings.auto_join and not self.quarantine.excluded(sender):
            member = self.membership.get(sender)
            donors = [member.url] if member is not None else []
            # Other members that train the same job are donors too, should this one fail.
            self.jobs.offer(advert, donors + self._donors_besides(sender))

    def _run_heard(self, advert: JobAdvert, sender: str) -> int:
        """Record the run of a job's origin-signed ``advert`` that ``sender`` told us; the
        latest heard before it (-1: none). Any key is the origin of the jobs it makes up: a
        member's adverts of such jobs push out its own older ones only, past RUNS_A_TELLER."""
        held = self._runs.pop(advert.id, None)
        latest, teller = held if held is not None else (-1, sender)
        if sender == advert.origin:
            teller = sender  # the origin's own: no member's made-up jobs push it out
        if held is None or held[1] != teller:
            told = [j for j, (_, t) in self._runs.items() if t == teller]
            for j in told[: max(0, len(told) - RUNS_A_TELLER + 1)]:
                del self._runs[j]
        self._runs[advert.id] = (max(latest, advert.run), teller)  # the newest last
        while len(self._runs) > MAX_STOP_NOTICES:
            del self._runs[next(iter(self._runs))]
        return latest

    def latest_run(self, job_id: str) -> int:
        """The latest run of ``job_id`` its origin signed in an advert heard here (-1: none)."""
        held = self._runs.get(job_id)
        return -1 if held is None else held[0]

    def _donors_besides(self, sender: str) -> list[str]:
        return [
            m.url
            for m in self.membership.others("alive")
            if m.id != sender and not self.quarantine.excluded(m.id)
        ]

    def announce(self, advert: JobAdvert) -> None:
        """Tell every live peer about a new swarm job now (gossip would in a few periods)."""
        msg = Announce(sender=self.membership.me.update(), job=self._sealed(advert))
        for m in self.membership.others("alive"):
            self._spawn(self._send(m, paths.ANNOUNCE, msg), f"announce-{m.id[:8]}")

    def stop_notice(self, job_id: str, origin: str | None = None) -> StopNotice | None:
        """The signed stop of ``job_id`` (of ``origin``) to tell a peer that still trains it:
        ours if we started the job and stopped it swarm-wide, else its origin's as a member
        passed it on to us (``stop_from_peer``), or None."""
        if origin == self.peer_id:
            run = self.jobs.stopped_swarm_wide(job_id)
            if run is not None:
                return sign_stop(job_id, self.identity, self.settings.swarm, run)
        held = self._stop_notices.get(job_id)
        return None if held is None else held[0]

    async def stop_from_peer(self, job_id: str, peer_id: str, notice: StopNotice | None) -> None:
        """A stop of ``job_id`` from peer ``peer_id``: its origin's own, or the origin's signed
        ``notice`` passed on (kept, to pass on in turn). ``MessageError`` for a notice its
        origin did not sign for this job in this swarm; the job manager refuses a stop from
        any other than the origin (``JobManager.stop_from_peer``)."""
        if notice is None:
            await self.jobs.stop_from_peer(job_id, peer_id)
            return
        forged = stop_forgery(notice, job_id, self.settings.swarm)
        if forged is not None:
            raise MessageError(forged)
        if notice.origin == self.peer_id:
            return  # our own job: whether it is stopped is ours to say (we may have resumed it)
        held = self._stop_notices.get(job_id)
        new = held is None or notice.run > held[0].run
        # Kept only for a job this daemon trains or trained: any key is the origin of the
        # jobs it makes up, and their stops would push out the others' (kept, and recorded,
        # a row each). The members that trained a job tell its stragglers.
        if new and (held is not None or self.jobs.trains(job_id) or await self.jobs.had(job_id)):
            async with self.sessions() as s, s.begin():  # recorded first: kept across a restart
                await repo.add_event(
                    s, kind=STOP_HEARD, job_id=job_id, peer_id=peer_id,
                    message=f"run {notice.run} stopped by its origin {notice.origin}",
                    data=notice.model_dump(mode="json"),
                )  # fmt: skip
            self._keep_stop(notice, time.monotonic())
        elif held is not None and held[0] == notice:
            self._keep_stop(notice, time.monotonic())  # heard again: the newest
        via = None if peer_id == notice.origin else peer_id
        await self.jobs.stop_from_peer(job_id, notice.origin, via, notice.run)

    def _keep_stop(self, notice: StopNotice, at: float) -> None:
        """Keep an origin's signed stop heard at ``at`` (monotonic seconds) to pass on, unless
        the one held of its job ends a later run. The newest MAX_STOP_NOTICES jobs' are kept."""
        held = self._stop_notices.get(notice.job_id)
        if held is not None and held[0].run > notice.run:
            return  # the stop of a later run ends more
        self._stop_notices.pop(notice.job_id, None)
        self._stop_notices[notice.job_id] = (notice, at)  # the newest last
        while len(self._stop_notices) > MAX_STOP_NOTICES:
            del self._stop_notices[next(iter(self._stop_notices))]

    def _tell_stopped(self, peer_id: str, notice: StopNotice) -> None:
        """``peer_id`` trains a job stopped swarm-wide: it missed the stop (asleep, cut off,
        or down while it went out) and would train on alone to the end. Tell it again with
        the origin's signed stop, at most every RESTOP_S (its every message carries the job),
        whether we are the origin or a member that heard the stop (the origin may be gone)."""
        now = time.monotonic()
        job_id = notice.job_id
        key = (peer_id, job_id)
        if now - self._told_stopped.get(key, -math.inf) < RESTOP_S:
            return
        member = self.membership.get(peer_id)
        if member is None:
            return
        if len(self._told_stopped) >= MAX_TOLD_STOPPED:  # keep those told within RESTOP_S
            for k, at in list(self._told_stopped.items()):
                if now - at >= RESTOP_S:
                    del self._told_stopped[k]
            if len(self._told_stopped) >= MAX_TOLD_STOPPED:
                return  # told that many within RESTOP_S: the next advert asks again
        self._told_stopped[key] = now
        log.info("peer %s still trains job %s, stopped swarm-wide by %s: telling it again",
                 peer_id[:12], job_id, notice.origin[:12])  # fmt: skip
        self._send_stop([member], notice)

    def broadcast_stop(self, job_id: str, run: int = 0) -> None:
        """Stop ``job_id`` (up to ``run``) on every live or suspect member, signed here."""
        notice = sign_stop(job_id, self.identity, self.settings.swarm, run)
        self._send_stop(self.membership.others("alive", "suspect"), notice)

    def _send_stop(self, members: Iterable[Member], notice: StopNotice) -> None:
        job_id = notice.job_id
        msg = StopJob(sender=self.membership.me.update(), notice=notice)
        for m in members:
            self._spawn(self._send(m, paths.job_stop(job_id), msg), f"stop-{m.id[:8]}")

    async def _send(self, m: Member, path: str, msg: Announce | StopJob) -> None:
        try:
            await self.client.post(m.url, path, msg, Ack, target=m.id, timeout=SEND_TIMEOUT_S)
        except PeerRequestError as e:
            log.info("%s%s failed: %s", m.url, path, e)
