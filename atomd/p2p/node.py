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
import logging
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from atomd.config import Settings
from atomd.db import repo
from atomd.errors import PeerAuthError, PeerRequestError
from atomd.logs import Repeated, get_logger
from atomd.p2p.auth import Admission, PeerClient, RequestVerifier
from atomd.p2p.identity import Identity
from atomd.p2p.membership import Member, Membership, PeerState, Swim, SwimConfig, Update
from atomd.p2p.transfer import fetch_state
from atomd.telemetry import Telemetry

log = get_logger(__name__)


class SwarmJobs(Protocol):
    """What the swarm needs from the job manager (``atomd.jobs.JobManager``)."""

    def advert(self) -> dict[str, Any] | None:
        """The swarm job this daemon trains, as told to peers (None if none)."""
        ...

    def offer(self, advert: dict[str, Any], donors: list[str]) -> None:
        """A peer trains ``advert``: join it if free."""
        ...

    async def stop_from_peer(self, job_id: str, peer_id: str) -> None: ...
    async def live_state(self, job_id: str, at_least: int) -> bool:
        """Checkpoint the live state of a job trained here for a joining peer, if it is at
        step ``at_least`` or later (``NotFoundError`` if it is younger)."""
        ...

    def job_dir(self, job_id: str) -> Path: ...


class HttpTransport:
    """SWIM's messages as signed JSON POSTs to ``/p2p/v1/...``."""

    def __init__(self, client: PeerClient) -> None:
        self.client = client

    async def _post(self, url: str, path: str, payload: dict[str, Any], timeout: float) -> Any:
        reply = await self.client.post_json(url, path, payload, timeout=timeout)
        if not isinstance(reply, dict):
            raise PeerRequestError(f"{url}{path}: expected a JSON object")
        return reply

    async def ping(self, url: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        reply: dict[str, Any] = await self._post(url, "/p2p/v1/ping", payload, timeout)
        return reply

    async def ping_req(self, url: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        reply: dict[str, Any] = await self._post(url, "/p2p/v1/ping-req", payload, timeout)
        return reply

    async def join(self, url: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        reply: dict[str, Any] = await self._post(url, "/p2p/v1/join", payload, timeout)
        return reply

    async def leave(self, url: str, payload: dict[str, Any], timeout: float) -> None:
        await self._post(url, "/p2p/v1/leave", payload, timeout)


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
        self.client = PeerClient(identity, self.admission, timeout=5.0)
        self.verifier = RequestVerifier(self.admission)
        me = Update(
            id=identity.peer_id,
            url=settings.advertise_url,
            public_key=identity.public_key_hex,
            state="alive",
            # Wall-clock milliseconds: a restart always outranks our previous life.
            incarnation=int(time.time() * 1000),
        )
        self.membership = Membership(me, on_change=self._on_change)
        self.swim = Swim(
            self.membership,
            HttpTransport(self.client),
            SwimConfig(
                period=settings.gossip_interval,
                suspect_timeout=settings.suspect_timeout,
                ping_timeout=max(0.5, min(2.0, 2 * settings.gossip_interval)),
                indirect_timeout=max(0.75, min(3.0, 3 * settings.gossip_interval)),
            ),
        )
        self.swim.extra = self._extra
        self._repeated = Repeated(log)  # "alone", "join": logged once, then at a backoff
        self.swim.on_extra = self._on_message
        self._changes: asyncio.Queue[tuple[Update, PeerState | None]] = asyncio.Queue()
        self._tg: asyncio.TaskGroup | None = None
        self._lan: list[str] = []
        # job id -> peer id -> when we last heard that peer train it (monotonic seconds)
        self._job_peers: dict[str, dict[str, float]] = {}

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Join, then probe and record until cancelled."""
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                tg.create_task(self._record_changes(), name="peers-recorder")
                tg.create_task(self._refresh_last_seen(), name="peers-last-seen")
                await self._join_once()
                tg.create_task(self.swim.run(), name="swim")
                tg.create_task(self._rejoin_when_alone(), name="rejoin")
        finally:
            self._tg = None
            await self.client.aclose()

    async def leave(self) -> None:
        """Say *left* to every live peer (bounded: about one second)."""
        await self.swim.leave()

    def lan_found(self, peer_id: str, url: str) -> None:
        """A peer of our swarm seen on the LAN (zeroconf): a join candidate."""
        if self.membership.get(peer_id) is None and url not in self._lan:
            self._lan.append(url)

    async def _candidates(self) -> list[str]:
        urls = list(self.settings.seeds)
        async with self.sessions() as s:
            known = await repo.list_peers(s)
        known.sort(key=lambda p: p.last_seen_at, reverse=True)
        urls += [p.url for p in known if p.id != self.peer_id and p.state != "left"]
        urls += self._lan
        me = self.membership.me.url
        return [u for u in dict.fromkeys(u.rstrip("/") for u in urls) if u != me]

    async def _join_once(self) -> bool:
        candidates = await self._candidates()
        if not candidates:
            self._repeated.log(
                "alone", logging.INFO, "no seeds and no known peers: a swarm of one for now"
            )
            return False
        self._repeated.clear("alone")
        if await self.swim.join(candidates):
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
        while True:
            u, before = await self._changes.get()
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

    async def record_rejection(self, path: str, client: str, error: PeerAuthError) -> None:
        async with self.sessions() as s, s.begin():
            await repo.add_event(
                s, kind="auth.rejected", message=f"{error.status} {path} from {client}: {error}"
            )

    def peers(self) -> list[dict[str, Any]]:
        """Every member we know, this daemon first, for ``GET /v1/peers``."""
        out = []
        for m in self.membership.all():
            me = m is self.membership.me
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
                }
            )
        return out

    # -- jobs across the swarm ----------------------------------------------------------------

    def _extra(self) -> dict[str, Any]:
        advert = self.jobs.advert()
        return {"job": advert} if advert else {}

    def _on_message(self, sender: str, msg: dict[str, Any]) -> None:
        advert = msg.get("job")
        if isinstance(advert, dict) and isinstance(advert.get("id"), str):
            self._job_peers.setdefault(advert["id"], {})[sender] = time.monotonic()
        if isinstance(advert, dict) and self.settings.auto_join:
            member = self.membership.get(sender)
            donors = [member.url] if member is not None else []
            # Other members that train the same job are donors too, should this one fail.
            self.jobs.offer(advert, donors + self._donors_besides(sender))

    def _donors_besides(self, sender: str) -> list[str]:
        return [m.url for m in self.membership.others("alive") if m.id != sender]

    def _spawn(self, coro: Any, name: str) -> None:
        if self._tg is None:
            coro.close()
            return
        self._tg.create_task(coro, name=name)

    def announce(self, advert: dict[str, Any]) -> None:
        """Tell every live peer about a new swarm job now (gossip would in a few periods)."""
        msg = {"from": self.membership.me.update().to_json(), "job": advert}
        for m in self.membership.others("alive"):
            self._spawn(self._send(m.url, "/p2p/v1/jobs/announce", msg), f"announce-{m.id[:8]}")

    def broadcast_stop(self, job_id: str) -> None:
        msg = {"from": self.membership.me.update().to_json()}
        for m in self.membership.others("alive", "suspect"):
            self._spawn(self._send(m.url, f"/p2p/v1/jobs/{job_id}/stop", msg), f"stop-{m.id[:8]}")

    async def _send(self, url: str, path: str, msg: dict[str, Any]) -> None:
        try:
            await self.client.post_json(url, path, msg, timeout=3.0)
        except PeerRequestError as e:
            log.info("%s%s failed: %s", url, path, e)

    async def fetch_state(
        self, job_id: str, donors: list[str], root: Path, at_least: int
    ) -> int | None:
        return await fetch_state(self.client, donors, job_id, root, at_least=at_least)

    # -- which peers train a job (for the delta exchange, ``atomd.sync.exchange``) -------------

    def job_peers(self, job_id: str) -> list[Member]:
        """Live members heard training ``job_id`` recently (this daemon excluded)."""
        window = max(15.0, 30 * self.settings.gossip_interval)
        now = time.monotonic()
        heard = self._job_peers.get(job_id, {})
        out = []
        for pid, at in tuple(heard.items()):  # the trainer thread calls this too
            m = self.membership.get(pid)
            fresh = now - at <= window
            if fresh and m is not None and m is not self.membership.me and m.state == "alive":
                out.append(m)
        return out

    def job_donors(self, job_id: str) -> list[str]:
        return [m.url for m in self.job_peers(job_id)]

    def public_key(self, peer_id: str) -> str | None:
        m = self.membership.get(peer_id)
        return m.public_key if m is not None else None
