"""The swarm member of one daemon: membership over signed HTTP, records, job propagation.

``SwarmNode.run()`` lives in the daemon's TaskGroup. It joins through the seeds (or any peer
remembered in SQLite) and runs the SWIM protocol (``atomd.p2p.membership``). It composes the
parts that act on what membership hears:

- ``PeerRecords`` (``atomd.p2p.records``): every state change of a peer in the ``peers`` and
  ``events`` tables, refused requests, retention;
- ``Trust`` (``atomd.p2p.trust``): bans and quarantines, whom deltas and state are taken from;
- ``JobGossip`` (``atomd.p2p.gossip``): the daemon's swarm job carried on every message so
  that free peers join it, announcements and swarm-wide stops;
- ``Trainers`` (``atomd.p2p.trainers``): which members train which job;
- ``Donors`` (``atomd.p2p.donors``): a job's state fetched from the members that train it.

The node is the ``SwarmLink`` the job manager uses to announce jobs, stop them swarm-wide and
fetch state from donors, and the ``JobPeers`` the delta exchange (``atomd.sync.job_peers``)
asks which peers train a job. It reaches the job manager only through the small
``SwarmJobs`` interface (``atomd.p2p.gossip``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from atomd.config import Settings
from atomd.db import repo
from atomd.db.retention import Pruned
from atomd.errors import AtomdError, PeerRequestError
from atomd.logs import Repeated, get_logger
from atomd.p2p import congestion, paths
from atomd.p2p.client import PeerClient
from atomd.p2p.donors import Donors
from atomd.p2p.gossip import MAX_STOP_NOTICES, STOP_HEARD, JobGossip, SwarmJobs
from atomd.p2p.identity import Identity
from atomd.p2p.membership import Member, Membership, Swim, SwimConfig, Update
from atomd.p2p.messages import (
    Ack,
    Gossip,
    JobAdvert,
    JoinReply,
    PingReq,
    PingReqReply,
    ProgressCurve,
    StopNotice,
)
from atomd.p2p.quarantine import Quarantine, Verdict
from atomd.p2p.records import PeerRecords
from atomd.p2p.signing import Admission, RequestVerifier
from atomd.p2p.trainers import Trainers
from atomd.p2p.transfer import Fetched
from atomd.p2p.trust import Trust
from atomd.rejections import Rejections
from atomd.telemetry import Telemetry

log = get_logger(__name__)

LEFT_CANDIDATES = 8  # peers that said they left, knocked at last when (re)joining
REJOIN_S = 2.0  # how often a daemon that knows no live peer knocks again


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
    """Run a background task of the node (a send, a newer run taken on). A failure is logged
    with its traceback and ends that task only: a peer that cannot be told, or a run that
    cannot be taken on now, must not end the daemon."""
    try:
        await coro
    except Exception as e:
        log.exception("task %s failed: %s", name, e)


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
        self.records = PeerRecords(settings=settings, sessions=sessions, telemetry=telemetry)
        me = Update(
            id=identity.peer_id,
            url=settings.advertise_url,
            public_key=identity.public_key_hex,
            state="alive",
            # Wall-clock milliseconds: a restart always outranks our previous life.
            incarnation=int(time.time() * 1000),
        )
        self.membership = Membership(me, identity=identity, swarm=settings.swarm)
        self.records.watch(self.membership)
        self.on_excluded: Callable[[str], None] = lambda _peer_id: None
        """Called with a peer id quarantined or banned (the exchange drops its waiting deltas)."""
        self.trust = Trust(
            membership=self.membership,
            sessions=sessions,
            on_excluded=lambda peer_id: self.on_excluded(peer_id),
        )
        self.verifier = RequestVerifier(
            self.admission, self_id=identity.peer_id, blocked=self.trust.banned_reason
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
        self._repeated = Repeated(log)  # "alone", "join": logged once, then at a backoff
        self.trainers = Trainers(
            settings=settings, membership=self.membership, quarantine=self.quarantine,
            client=self.client,
        )  # fmt: skip
        self.gossip = JobGossip(
            settings=settings, identity=identity, sessions=sessions,
            membership=self.membership, client=self.client, quarantine=self.quarantine,
            trainers=self.trainers, jobs=jobs, spawn=self._spawn, repeated=self._repeated,
        )  # fmt: skip
        self.donors = Donors(client=self.client, membership=self.membership, trainers=self.trainers)
        self.swim.advert = self.gossip.advert
        self.swim.on_message = self.gossip.on_message
        self._tg: asyncio.TaskGroup | None = None
        self._lan: list[str] = []

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    @property
    def quarantine(self) -> Quarantine:
        """Strike records, quarantines and bans in memory (``Trust`` keeps their records)."""
        return self.trust.quarantine

    @property
    def rejections(self) -> Rejections:
        """Refused requests of both planes, counted (``PeerRecords``)."""
        return self.records.rejections

    async def load_records(self) -> None:
        """The operator's bans, the quarantines still running and the origins' stops members
        passed on (``STOP_HEARD``), from the database: a restart lifts none. Called before the
        peer plane listens, so that a banned key is refused from the first answer (``run``
        begins after the daemon is ready, and a restarted daemon must not serve such a key its
        joins and its states meanwhile)."""
        async with self.sessions() as s, s.begin():
            bans = await repo.list_bans(s)
            held = await repo.list_quarantines(s)
            heard = await repo.list_events(s, kind=STOP_HEARD, limit=MAX_STOP_NOTICES)
        self.trust.restore(bans, held)
        self.gossip.restore(heard)

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Join, then probe and record until cancelled (``load_records`` first: the daemon
        calls it before its peer plane listens)."""
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                tg.create_task(self.records.record_changes(), name="peers-recorder")
                tg.create_task(self.records.refresh_last_seen(), name="peers-last-seen")
                tg.create_task(self.records.keep_tidy(), name="rejections")
                await self._join_once()
                tg.create_task(self.swim.run(), name="swim")
                tg.create_task(self._rejoin_when_alone(), name="rejoin")
        finally:
            self._tg = None
            await self.client.aclose()

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        if self._tg is None:
            coro.close()
            return
        self._tg.create_task(_logged(coro, name), name=name)

    async def leave(self) -> None:
        """Say *left* to every live peer (bounded: about one second); record what was refused
        since the last minute's count."""
        await self.swim.leave()
        await self.records.flush_rejections_logged()

    def lan_found(self, peer_id: str, url: str) -> None:
        """A peer of our swarm seen on the LAN (zeroconf): a join candidate."""
        if self.membership.get(peer_id) is None and url not in self._lan:
            self._lan.append(url)

    async def _candidates(self) -> list[str]:
        """Where to knock, in order: the seeds, the remembered peers newest first, the LAN's,
        then up to LEFT_CANDIDATES of those that said they left. A peer that left gracefully
        (a restart, an upgrade) is often back: without them a swarm with no seeds would stay
        apart after every member had restarted gracefully (each recorded the others "left")."""
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
            self.trainers.joined.set()
            return False
        self._repeated.clear("alone")
        if await self.swim.join(candidates):
            self.trainers.joined.set()
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
            await asyncio.sleep(REJOIN_S)
            if not self.membership.others("alive", "suspect"):
                await self._join_once()

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

    def public_key(self, peer_id: str) -> str | None:
        m = self.membership.get(peer_id)
        return m.public_key if m is not None else None

    # -- what the peer plane, the control plane, the job manager and the exchange ask --------

    async def record_rejection(self, path: str, client: str, error: AtomdError) -> None:
        await self.records.record_rejection(path, client, error)

    async def prune_records(self) -> Pruned:
        return await self.records.prune_records()

    async def flush_rejections(self) -> None:
        await self.records.flush_rejections()

    async def ban(self, public_key: str, reason: str) -> None:
        await self.trust.ban(public_key, reason)

    async def unban(self, public_key: str) -> bool:
        return await self.trust.unban(public_key)

    def verdict(self, peer_id: str) -> Verdict | None:
        return self.trust.verdict(peer_id)

    def excluded(self, peer_id: str) -> bool:
        return self.trust.excluded(peer_id)

    def exclusion(self, peer_id: str) -> str | None:
        return self.trust.exclusion(peer_id)

    async def judge(self, sender: str, strike: bool, reason: str | None) -> None:
        await self.trust.judge(sender, strike, reason)

    def announce(self, advert: JobAdvert) -> None:
        self.gossip.announce(advert)

    def broadcast_stop(self, job_id: str, run: int = 0) -> None:
        self.gossip.broadcast_stop(job_id, run)

    def stop_notice(self, job_id: str, origin: str | None = None) -> StopNotice | None:
        return self.gossip.stop_notice(job_id, origin)

    async def stop_from_peer(self, job_id: str, peer_id: str, notice: StopNotice | None) -> None:
        await self.gossip.stop_from_peer(job_id, peer_id, notice)

    def latest_run(self, job_id: str) -> int:
        return self.gossip.latest_run(job_id)

    async def fetch_state(
        self,
        job_id: str,
        donors: list[str],
        root: Path,
        *,
        max_file_bytes: int | None = None,
        at_least: int = 0,
    ) -> Fetched | None:
        return await self.donors.fetch_state(
            job_id, donors, root, max_file_bytes=max_file_bytes, at_least=at_least
        )

    def distrust(self, donor: str) -> None:
        self.donors.distrust(donor)

    def job_peers(self, job_id: str) -> list[Member]:
        return self.trainers.job_peers(job_id)

    def heard(self, job_id: str, peer_id: str) -> None:
        self.trainers.heard(job_id, peer_id)

    def job_donors(self, job_id: str) -> list[str]:
        return self.trainers.job_donors(job_id)

    async def peer_curves(
        self, job_id: str
    ) -> tuple[list[tuple[Member, ProgressCurve | str]], int]:
        return await self.trainers.peer_curves(job_id)

    async def settled_donors(self, job_id: str, *, give_up: Callable[[], bool]) -> list[str]:
        return await self.trainers.settled_donors(job_id, give_up=give_up)
