"""The swarm member of one daemon: membership over signed HTTP, records, job propagation.

``SwarmNode.run()`` lives in the daemon's TaskGroup. It joins through the seeds (or any peer
remembered in SQLite), runs the SWIM protocol, records every state change of a peer in the
``peers`` and ``events`` tables, and carries the daemon's swarm job on every message so that
free peers join it. It is also the ``SwarmLink`` the job manager uses to announce jobs, stop
them swarm-wide and fetch state from donors, and the ``JobPeers`` the delta exchange
(``atomd.sync.exchange``) asks which peers train a job. It reaches the job manager only through
the small ``SwarmJobs`` interface.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Callable, Coroutine, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from atomd.config import Settings
from atomd.db import repo
from atomd.db.retention import Pruned, prune_jobs
from atomd.db.schemas import ProgressPoint
from atomd.errors import AtomdError, MessageError, PeerAuthError, PeerRequestError
from atomd.logs import Repeated, get_logger
from atomd.p2p import congestion, paths
from atomd.p2p.client import PeerClient
from atomd.p2p.identity import Identity
from atomd.p2p.membership import Member, Membership, PeerState, Swim, SwimConfig, Update
from atomd.p2p.messages import (
    Ack,
    Announce,
    Gossip,
    JobAdvert,
    JoinReply,
    PingReq,
    PingReqReply,
    ProgressCurve,
    StopJob,
    StopNotice,
    advert_forgery,
    sign_advert,
    sign_stop,
    stop_forgery,
)
from atomd.p2p.quarantine import Quarantine, Verdict
from atomd.p2p.signing import Admission, RequestVerifier
from atomd.p2p.transfer import Fetched, fetch_state
from atomd.rejections import Rejections
from atomd.telemetry import Telemetry

log = get_logger(__name__)

SEND_TIMEOUT_S = 3.0  # a job announcement or stop to one peer
CURVE_TIMEOUT_S = 3.0  # one peer's loss curve, for the dashboard
# Validation losses of the job's other members (the donor aside) a joiner needs before it
# checks a fetched state against them: of two, the higher median is the larger, so one lying
# member cannot lower it below an honest one's.
CLAIM_QUORUM = 2
# Peers asked for their loss curves at each dashboard refresh: the first heard training the
# job. Keys are free with the swarm secret alone, and 4,096 of them advertising the job made
# a refresh cost ~50 s of the event loop and 146 MB of JSON (a review of 2026-12-06).
MAX_CURVE_PEERS = 32
RESTOP_S = 10.0  # a straggler that missed a swarm-wide stop is told again at most this often
MAX_TOLD_STOPPED = 1024  # (peer, job) pairs remembered for RESTOP_S
MAX_STOP_NOTICES = 1024  # origins' signed stops kept to pass on (the oldest go first)
RUNS_A_TELLER = 8  # jobs' latest runs kept of those one member told us of
STOP_HEARD = "job.stop_heard"  # the event that keeps an origin's signed stop across a restart
LEFT_CANDIDATES = 8  # peers that said they left, knocked at last when (re)joining
DONORS_TIMEOUT_S = 30.0  # a restarted daemon waits at most this long to hear who trains a job
REJECTIONS_FLUSH_S = 60.0
# At shutdown the peers recorder finishes its write and the queued ones within this long.
RECORD_DRAIN_S = 3.0
# Members that count as training a job they were heard training (``SwarmNode.job_peers``).
LIVE_STATES: frozenset[PeerState] = frozenset({"alive", "suspect"})


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


class HttpTransport:
    """SWIM's messages as signed JSON POSTs to the peer plane."""

    def __init__(self, client: PeerClient) -> None:
        self.client = client

    async def ping(self, url: str, target: str, msg: Gossip, timeout: float) -> Gossip:
        return await self.client.post(url, paths.PING, msg, Gossip, target=target, timeout=timeout)

    async def ping_req(self, url: str, target: str, msg: PingReq, timeout: float) -> PingReqReply:
        return await self.client.post(
            url, paths.PING_REQ, msg, PingReqReply, target=target, timeout=timeout
        )

    async def join(self, url: str, target: str | None, msg: Gossip, timeout: float) -> JoinReply:
        reply = await self.client.post(
            url, paths.JOIN, msg, JoinReply, target=target, timeout=timeout
        )
        # The peer that answered (its certificate, its /info) must be the one whose signed
        # record the answer carries: a seed speaks for itself only.
        answered = target or self.client.peer_at(url)
        if answered is not None and reply.sender.id != answered:
            raise PeerRequestError(
                f"peer {url}: {paths.JOIN}: the answer carries the record of peer "
                f"{reply.sender.id}, but peer {answered} answered there: refused"
            )
        return reply

    async def leave(self, url: str, target: str, msg: Gossip, timeout: float) -> None:
        await self.client.post(url, paths.LEAVE, msg, Ack, target=target, timeout=timeout)


async def _logged(coro: Coroutine[Any, Any, None], name: str) -> None:
    """Run a background task of the node; a failure is logged, never ends the daemon."""
    try:
        await coro
    except Exception:
        log.exception("task %s failed", name)


class SwarmNode:
    """This daemon as a member of its swarm."""

    def __init__(
        self,
        *,
        settings: Settings,
        identity: Identity,
        sessions: async_sessionmaker[AsyncSession],
        telemetry: Telemetry,
        jobs: SwarmJobs,
    ) -> None:
        self.settings = settings
        self.identity = identity
        self.sessions = sessions
        self.telemetry = telemetry
        self.jobs = jobs
        self.admission = Admission.from_settings(settings)
        self.client = PeerClient(
            identity,
            self.admission,
            tls=settings.peer_tls,
            congestion=congestion.choose(settings.tcp_congestion),
        )
        self.quarantine = Quarantine(key_of=self._key_of)
        self.rejections = Rejections()  # refused requests of both planes, counted
        self.verifier = RequestVerifier(
            self.admission, self_id=identity.peer_id, blocked=self._banned_reason
        )
        me = Update(
            id=identity.peer_id,
            url=settings.advertise_url,
            public_key=identity.public_key_hex,
            state="alive",
            # Wall-clock milliseconds: a restart always outranks our previous life.
            incarnation=int(time.time() * 1000),
        )
        self.membership = Membership(
            me, identity=identity, swarm=settings.swarm, on_change=self._on_change
        )
        self.swim = Swim(
            self.membership,
            HttpTransport(self.client),
            SwimConfig(
                period=settings.gossip_interval,
                settled_period=max(settings.gossip_interval, settings.gossip_settled_interval),
                suspect_timeout=settings.suspect_timeout,
                ping_timeout=max(0.5, min(2.0, 2 * settings.gossip_interval)),
                indirect_timeout=max(0.75, min(3.0, 3 * settings.gossip_interval)),
                heard_window=2 * max(settings.gossip_interval, settings.gossip_settled_interval),
            ),
        )
        self.swim.advert = self._advert
        self._repeated = Repeated(log)  # "alone", "join": logged once, then at a backoff
        self.swim.on_message = self._on_message
        self._changes: asyncio.Queue[tuple[Update, PeerState | None]] = asyncio.Queue()
        self._tg: asyncio.TaskGroup | None = None
        self._lan: list[str] = []
        # When the last pass over the jobs' records began (``prune_records``); None: never.
        self._pruned_at: datetime | None = None
        # job id -> peer id -> when we last heard that peer train it (monotonic seconds); a
        # known member's newest job only (``_trains``)
        self._job_peers: dict[str, dict[str, float]] = {}
        self._job_of: dict[str, str] = {}  # peer id -> the job it was last heard training
        self._heard: set[str] = set()  # every member a message came from since we started
        self._told_stopped: dict[tuple[str, str], float] = {}  # (peer, job) -> when
        # job id -> its origin's signed stop, heard from the origin or passed on by a member,
        # and when (monotonic seconds)
        self._stop_notices: dict[str, tuple[StopNotice, float]] = {}
        # job id -> the latest run its origin signed in an advert heard here, and the member
        # that first told us of the job (the newest MAX_STOP_NOTICES jobs', at most
        # RUNS_A_TELLER a member): a joiner takes no earlier run
        self._runs: dict[str, tuple[int, str]] = {}
        self._joined = asyncio.Event()  # joined a swarm once, or there is nobody to join
        self._liars: set[str] = set()  # donor URLs whose state transfer lied: not asked again
        self.on_excluded: Callable[[str], None] = lambda _peer_id: None
        """Called with a peer id quarantined or banned (the exchange drops its waiting deltas)."""

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    # -- quarantine and bans ------------------------------------------------------------------

    def _key_of(self, peer_id: str) -> str | None:
        m = self.membership.get(peer_id)
        return m.public_key if m is not None else None

    def _banned_reason(self, public_key: str) -> str | None:
        if not self.quarantine.is_banned_key(public_key):
            return None
        return "its key is banned by this daemon's operator (atomd unban to lift it)"

    async def load_records(self) -> None:
        """The operator's bans, the quarantines still running and the origins' stops members
        passed on (``STOP_HEARD``), from the database: a restart lifts none. Called before the
        peer plane listens, so that a banned key is refused from the first answer (``run``
        began after the daemon was ready, and until then a restarted daemon served such a key
        its joins and its states)."""
        async with self.sessions() as s, s.begin():
            bans = await repo.list_bans(s)
            held = await repo.list_quarantines(s)
            heard = await repo.list_events(s, kind=STOP_HEARD, limit=MAX_STOP_NOTICES)
        self.quarantine.set_bans({b.public_key: b.reason for b in bans})
        for q in held:
            self.quarantine.restore(q.peer_id, q.public_key, q.reason, q.until.timestamp())
        before = time.monotonic() - RESTOP_S - 1  # heard before this start
        for e in reversed(heard):  # the oldest first, as they were heard
            try:
                notice = StopNotice.model_validate(e.data or {})
            except ValidationError:
                continue
            if stop_forgery(notice, notice.job_id, self.settings.swarm) is None:
                self._keep_stop(notice, before)

    async def ban(self, public_key: str, reason: str) -> None:
        """Ban a key (persisted): refused on the peer plane, out of every merge and transfer."""
        async with self.sessions() as s, s.begin():
            await repo.add_ban(s, public_key=public_key, reason=reason)
            await repo.add_event(s, kind="peer.banned", message=f"key {public_key}: {reason}")
        self.quarantine.ban(public_key, reason)
        for m in self.membership.all():
            if m.public_key == public_key:
                self.on_excluded(m.id)

    async def unban(self, public_key: str) -> bool:
        """Lift a ban (and a quarantine of that key); False if the key was not banned."""
        ended = self.quarantine.unban(public_key)
        async with self.sessions() as s, s.begin():
            found = await repo.remove_ban(s, public_key=public_key)
            await repo.remove_quarantines(s, peer_ids=ended, public_key=public_key)
            await repo.add_event(s, kind="peer.unbanned", message=f"key {public_key}")
        return found

    def verdict(self, peer_id: str) -> Verdict | None:
        """Why this daemon takes nothing from ``peer_id`` now (banned, quarantined), or None."""
        return self.quarantine.verdict(peer_id)

    def excluded(self, peer_id: str) -> bool:
        """Whether deltas and state are no longer taken from ``peer_id`` (quarantined, banned)."""
        return self.quarantine.excluded(peer_id)

    def exclusion(self, peer_id: str) -> str | None:
        """Why deltas are no longer taken from ``peer_id``, in words, or None."""
        v = self.quarantine.verdict(peer_id)
        return None if v is None else f"{v.kind} here: {v.reason}"

    async def judge(self, sender: str, strike: bool, reason: str | None) -> None:
        """One judged contribution of ``sender``; quarantine it (recorded) when its strikes
        reach the limit."""
        if sender == self.peer_id:
            return
        verdict = self.quarantine.judged(sender, strike, reason)
        if verdict is None:
            return
        log.warning("peer %s quarantined: %s", sender, verdict.reason)
        self.on_excluded(sender)
        until = datetime.fromtimestamp(verdict.until or time.time(), UTC)
        async with self.sessions() as s, s.begin():
            await repo.add_quarantine(
                s,
                peer_id=sender,
                public_key=self.quarantine.held_key(sender),
                reason=verdict.reason,
                until=until,
            )
            await repo.add_event(s, kind="peer.quarantined", peer_id=sender, message=verdict.reason)

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Join, then probe and record until cancelled (``load_records`` first: the daemon
        calls it before its peer plane listens)."""
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                tg.create_task(self._record_changes(), name="peers-recorder")
                tg.create_task(self._refresh_last_seen(), name="peers-last-seen")
                tg.create_task(self._flush_rejections(), name="rejections")
                await self._join_once()
                tg.create_task(self.swim.run(), name="swim")
                tg.create_task(self._rejoin_when_alone(), name="rejoin")
        finally:
            self._tg = None
            await self.client.aclose()

    async def leave(self) -> None:
        """Say *left* to every live peer (bounded: about one second); record what was refused
        since the last minute's count."""
        await self.swim.leave()
        try:
            await self.flush_rejections()
        except Exception:
            log.exception("could not record refused requests")

    def lan_found(self, peer_id: str, url: str) -> None:
        """A peer of our swarm seen on the LAN (zeroconf): a join candidate."""
        if self.membership.get(peer_id) is None and url not in self._lan:
            self._lan.append(url)

    async def _candidates(self) -> list[str]:
        """Where to knock, in order: the seeds, the remembered peers newest first, the LAN's,
        then up to LEFT_CANDIDATES of those that said they left. A peer that left gracefully
        (a restart, an upgrade) is often back: without them a swarm with no seeds stayed apart
        after every member had restarted gracefully (each had recorded the others "left")."""
        urls = list(self.settings.seeds)
        async with self.sessions() as s:
            known = await repo.list_peers(s)
        known = [p for p in known if p.id != self.peer_id]
        known.sort(key=lambda p: p.last_seen_at, reverse=True)
        urls += [p.url for p in known if p.state != "left"]
        urls += self._lan
        urls += [p.url for p in known if p.state == "left"][:LEFT_CANDIDATES]
        me = self.membership.me.url
        return [u for u in dict.fromkeys(u.rstrip("/") for u in urls) if u != me]

    async def _join_once(self) -> bool:
        candidates = await self._candidates()
        if not candidates:
            self._repeated.log(
                "alone", logging.INFO, "no seeds and no known peers: a swarm of one for now"
            )
            self._joined.set()
            return False
        self._repeated.clear("alone")
        if await self.swim.join(candidates):
            self._joined.set()
            self._repeated.clear("join")
            for url, why in self.swim.join_errors.items():  # tried before the one that answered
                log.info("could not join through %s: %s", url, why)
            return True
        reasons = "; ".join(f"{u}: {why}" for u, why in self.swim.join_errors.items())
        self._repeated.log("join", logging.WARNING, "could not join the swarm (%s); retrying",
                           reasons or ", ".join(candidates))  # fmt: skip
        return False

    async def _rejoin_when_alone(self) -> None:
        """While we know no live peer, keep knocking at seeds and remembered peers."""
        while True:
            await asyncio.sleep(2.0)
            if not self.membership.others("alive", "suspect"):
                await self._join_once()

    # -- records -----------------------------------------------------------------------------

    def _on_change(self, m: Member, before: PeerState | None) -> None:
        self._changes.put_nowait((m.update(), before))
        self.telemetry.peers_alive.set(len(self.membership.others("alive")))

    async def _record_changes(self) -> None:
        """Each membership change as a peer row and an event, in order. Cancelled (the daemon
        stops), the write under way finishes and those queued are written, for at most
        RECORD_DRAIN_S: the changes of a swarm stopping together came just then, and a write
        cut off left them out (a helper's flake hunt: 8 of 251 daemon logs, 1-5 changes each)."""
        write: asyncio.Future[None] | None = None
        try:
            while True:
                u, before = await self._changes.get()
                write = asyncio.ensure_future(self._record_change_logged(u, before))
                await asyncio.shield(write)
        except asyncio.CancelledError:
            try:
                async with asyncio.timeout(RECORD_DRAIN_S):
                    if write is not None:
                        await write
                    while not self._changes.empty():
                        await self._record_change_logged(*self._changes.get_nowait())
            except TimeoutError:
                log.warning("stopping: %d peer change(s) not recorded", self._changes.qsize())
            raise

    async def _record_change_logged(self, u: Update, before: PeerState | None) -> None:
        try:
            await self._record_change(u, before)
        except Exception:  # a record that cannot be written must not end the daemon
            log.exception("could not record peer %s: %s -> %s", u.id, before, u.state)

    async def _record_change(self, u: Update, before: PeerState | None) -> None:
        m = self.membership.get(u.id)
        async with self.sessions() as s, s.begin():
            await repo.upsert_peer(
                    s, peer_id=u.id, url=u.url, public_key=u.public_key, state=u.state,
                    incarnation=u.incarnation, rtt_ms=m.rtt_ms if m else None,
                )  # fmt: skip
            await repo.add_event(
                    s, kind=f"peer.{u.state}", peer_id=u.id,
                    message=f"{before or 'new'} -> {u.state} ({u.url})",
                )  # fmt: skip

    async def _refresh_last_seen(self) -> None:
        """Round-trip times and last-seen times, every few seconds (not on every ping)."""
        while True:
            await asyncio.sleep(5.0)
            alive = self.membership.others("alive")
            if not alive:
                continue
            async with self.sessions() as s, s.begin():
                for m in alive:
                    await repo.upsert_peer(
                        s, peer_id=m.id, url=m.url, public_key=m.public_key, state=m.state,
                        incarnation=m.incarnation, rtt_ms=m.rtt_ms,
                    )  # fmt: skip

    async def record_rejection(self, path: str, client: str, error: AtomdError) -> None:
        """Count a refused peer-plane request (aggregated: ``atomd.rejections``)."""
        status = error.status if isinstance(error, PeerAuthError) else 413
        self.rejections.refused("peer", client, status, f"{path[:100]}: {error}")

    async def _flush_rejections(self) -> None:
        """Once a minute: one event for the requests refused since, the events table cut to
        ``events_keep`` rows, and the jobs' rounds and progress to theirs (``prune_records``)."""
        while True:
            await asyncio.sleep(REJECTIONS_FLUSH_S)
            try:
                await self.flush_rejections()
            except Exception:  # the records must not end the daemon
                log.exception("could not record refused requests")
            try:
                await self.prune_records()
            except Exception:
                log.exception("could not prune the jobs' rounds and progress")

    async def prune_records(self) -> Pruned:
        """Each job's rounds cut to ``rounds_keep``, its progress thinned beyond
        ``progress_keep`` (``atomd.db.retention``): every job on the first pass, then those
        active or updated since the last pass began."""
        began = datetime.now(UTC)
        pruned = await prune_jobs(
            self.sessions,
            since=self._pruned_at,
            rounds_keep=self.settings.rounds_keep,
            progress_keep=self.settings.progress_keep,
        )
        self._pruned_at = began
        if pruned.rounds or pruned.progress:  # each minute of a long job: not at INFO
            log.debug(
                "records: %d rounds and %d progress points of %d job(s) deleted in %.2f s",
                pruned.rounds, pruned.progress, pruned.jobs, pruned.seconds,
            )  # fmt: skip
        return pruned

    async def flush_rejections(self) -> None:
        summary = self.rejections.flush()
        async with self.sessions() as s, s.begin():
            if summary is not None:
                message, data = summary
                await repo.add_event(s, kind="auth.rejected", message=message, data=data)
            await repo.prune_events(s, keep=self.settings.events_keep)

    def peers(self) -> list[dict[str, Any]]:
        """Every member we know, this daemon first, for ``GET /v1/peers``."""
        out = []
        for m in self.membership.all():
            me = m is self.membership.me
            verdict = None if me else self.quarantine.verdict(m.id)
            out.append(
                {
                    "id": m.id,
                    "url": m.url,
                    "state": m.state,
                    "incarnation": m.incarnation,
                    "first_seen_at": datetime.fromtimestamp(m.first_seen, UTC),
                    "last_seen_at": datetime.fromtimestamp(time.time() if me else m.last_seen, UTC),
                    "rtt_ms": None if m.rtt_ms is None else round(m.rtt_ms, 3),
                    "is_self": me,
                    "public_key": m.public_key,
                    "excluded": None if verdict is None else verdict.kind,
                    "excluded_reason": None if verdict is None else verdict.reason,
                }
            )
        return out

    # -- jobs across the swarm ----------------------------------------------------------------

    def _advert(self) -> JobAdvert | None:
        advert = self.jobs.advert()
        return self._sealed(advert) if advert else None

    def _sealed(self, a: JobAdvert) -> JobAdvert:
        """``a`` as told to peers: signed here if this daemon started the job; a joined
        job's carries its origin's signature (``JobManager.advert``)."""
        return sign_advert(a, self.identity, self.settings.swarm) if a.origin == self.peer_id else a

    def _on_message(self, sender: str, msg: Gossip) -> None:
        if self.membership.get(sender) is not None:  # bounded by the members we know
            self._heard.add(sender)
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
        ):  # the origin trains the run it stopped: it resumed it, a daemon of before runs (a
            # message it sent before its stop may come after it)
            del self._stop_notices[advert.id]
        notice = self.stop_notice(advert.id, advert.origin)
        if notice is not None and notice.run >= advert.run:
            self._tell_stopped(sender, notice)  # a straggler: it missed the stop (not joined)
            return
        # (A stop of a run before the advert's is kept for the stragglers of that run.)
        self._trains(advert.id, sender)
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

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        if self._tg is None:
            coro.close()
            return
        self._tg.create_task(_logged(coro, name), name=name)

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

    async def fetch_state(
        self,
        job_id: str,
        donors: list[str],
        root: Path,
        *,
        max_file_bytes: int | None = None,
        at_least: int = 0,
    ) -> Fetched | None:
        """The newest state of ``job_id`` from the first donor that delivers it whole, with what
        the job's other members last measured (``Fetched.claimed_val``: the higher median of
        their newest validation losses, from at least CLAIM_QUORUM of them: one lying member
        cannot lower it, and so cannot have an honest donor's state refused)."""
        got = await fetch_state(
            self.client, donors, job_id, root, max_file_bytes=max_file_bytes,
            liars=self._liars, key_at=self._key_at, at_least=at_least,
        )  # fmt: skip
        if got is None:
            return None
        # The donor trains the job (it served its live state): counted in the rounds from now
        # on. A restarted peer whose membership had not yet heard any member train it counted
        # itself alone, and a peer alone commits its whole delta where the others commit what
        # it sends (4 real daemons, SIGKILL: settled anchors 0.0097 apart, run er).
        url = got.donor.rstrip("/")
        donor = next((m for m in self.membership.others("alive", "suspect") if m.url == url), None)
        if donor is not None:
            self._trains(job_id, donor.id)
            got = dataclasses.replace(got, donor_id=donor.id)
        answers, _ = await self.peer_curves(job_id)
        claims = [
            last
            for m, curve in answers
            if m.url != url and not isinstance(curve, str)
            for last in [
                next((p.val_loss for p in reversed(curve.points) if p.val_loss is not None), None)
            ]
            if last is not None
        ]
        if len(claims) < CLAIM_QUORUM:
            return got
        return dataclasses.replace(got, claimed_val=statistics.median_high(claims))

    def distrust(self, donor: str) -> None:
        """A state ``donor`` gave was refused (``DonorStateError``): it is not asked again."""
        self._liars.add(donor)

    def _key_at(self, url: str, signer: str) -> tuple[str, str] | None:
        """The member ``signer`` if it is at the donor URL: (peer id, public key), for its
        signed manifest (``transfer.KeyAt``)."""
        m = self.membership.get(signer)
        if m is None or m is self.membership.me or m.url != url.rstrip("/"):
            return None
        return m.id, m.public_key

    # -- which peers train a job (for the delta exchange, ``atomd.sync.exchange``) -------------

    def job_peers(self, job_id: str) -> list[Member]:
        """Live members heard training ``job_id`` recently (this daemon excluded).

        A *suspect* member counts as live here: suspicion is one missed probe, and on a full
        link (a slow upload busy with delta frames, whose queue delays the probe's answer) a
        training peer is suspected again and again. Leaving it out of the round would stop
        sending it deltas and drop its deltas from the round's count, each time (measured at
        256 kbit/s, 4 daemons: peers suspected every ~30 s, one declared dead for 45 s). Only
        ``dead`` (suspicion not refuted in time) and ``left`` take a member out."""
        window = max(15.0, 30 * self.settings.gossip_interval)
        now = time.monotonic()
        heard = self._job_peers.get(job_id, {})
        out = []
        for pid, at in tuple(heard.items()):  # the trainer thread calls this too
            m = self.membership.get(pid)
            fresh = now - at <= window
            live = m is not None and m is not self.membership.me and m.state in LIVE_STATES
            # A quarantined or banned member is neither sent deltas nor asked for state.
            if fresh and live and m is not None and not self.quarantine.excluded(pid):
                out.append(m)
        return out

    def heard(self, job_id: str, peer_id: str) -> None:
        """A delta frame of ``job_id`` signed by ``peer_id`` came from it and passed the frame's
        checks (the exchange says so): the member is alive and trains the job, as its next
        probe and advert would say, which a settled swarm then need not send (``Swim``)."""
        m = self.membership.get(peer_id)
        if m is None or m is self.membership.me or m.state not in LIVE_STATES:
            return  # bounded by the members we know; a dead one must rejoin first
        self.membership.heard(peer_id)
        self._heard.add(peer_id)
        self._trains(job_id, peer_id)

    def _trains(self, job_id: str, peer_id: str) -> None:
        """``peer_id`` was heard training ``job_id`` just now (its advert, or its frame). A
        peer trains one job at a time, and only known members count (``job_peers``): so this
        holds at most one entry a member (a member advertising a fresh job id on every
        message grew it without end; a review of 2026-12-06)."""
        if self.membership.get(peer_id) is None:
            return
        before = self._job_of.get(peer_id)
        if before is not None and before != job_id:
            others = self._job_peers.get(before, {})
            others.pop(peer_id, None)
            if not others:
                self._job_peers.pop(before, None)
        self._job_of[peer_id] = job_id
        self._job_peers.setdefault(job_id, {})[peer_id] = time.monotonic()

    async def peer_curves(
        self, job_id: str
    ) -> tuple[list[tuple[Member, ProgressCurve | str]], int]:
        """The loss curve of ``job_id`` from the first ``MAX_CURVE_PEERS`` live peers heard
        training it, asked at once (each within ``CURVE_TIMEOUT_S``), for a peer that did not
        answer why; and how many more train it (not asked)."""
        peers = self.job_peers(job_id)
        asked, left_out = peers[:MAX_CURVE_PEERS], max(0, len(peers) - MAX_CURVE_PEERS)

        async def one(m: Member) -> tuple[Member, ProgressCurve | str]:
            try:
                curve = await self.client.get(
                    m.url, paths.job_progress(job_id), ProgressCurve, target=m.id,
                    timeout=CURVE_TIMEOUT_S,
                )  # fmt: skip
            except PeerRequestError as e:
                return m, str(e)[:300]
            return m, curve

        return list(await asyncio.gather(*(one(m) for m in asked))), left_out

    def job_donors(self, job_id: str) -> list[str]:
        return [m.url for m in self.job_peers(job_id)]

    async def settled_donors(
        self, job_id: str, *, give_up: Callable[[], bool], timeout: float = DONORS_TIMEOUT_S
    ) -> list[str]:
        """The donors of ``job_id`` once membership can tell, for a daemon that has just
        started: once it has joined (or has nobody to join), as soon as one live member says it
        trains the job, or once every live member has sent us a message (each carries the job
        its sender trains) and none does. Empty if ``give_up()`` (the daemon stops);
        ``timeout`` bounds the wait on seeds and members that never answer."""
        deadline = time.monotonic() + timeout
        while not give_up():
            if self._joined.is_set():
                donors = self.job_donors(job_id)
                live = {m.id for m in self.membership.others("alive")}
                if donors or live <= self._heard or time.monotonic() >= deadline:
                    return donors
            elif time.monotonic() >= deadline:
                return []
            await asyncio.sleep(0.1)
        return []

    def public_key(self, peer_id: str) -> str | None:
        m = self.membership.get(peer_id)
        return m.public_key if m is not None else None
