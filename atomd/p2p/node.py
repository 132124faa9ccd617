"""The swarm member of one daemon: membership over signed HTTP, records, job propagation.

``SwarmNode.run()`` lives in the daemon's TaskGroup. It joins through the seeds (or any peer
remembered in SQLite), runs the SWIM protocol, records every state change of a peer in the
``peers`` and ``events`` tables, and carries the daemon's swarm job on every message so that
free peers join it. It is also the ``SwarmLink`` the job manager uses to announce jobs, stop
them swarm-wide and fetch state from donors.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from atomd.config import Settings
from atomd.db import repo
from atomd.errors import AtomdError, NotFoundError, PeerAuthError, PeerRequestError, WireError
from atomd.jobs import JobManager
from atomd.logs import Repeated, get_logger
from atomd.p2p import paths
from atomd.p2p.client import PeerClient
from atomd.p2p.identity import Identity
from atomd.p2p.membership import Member, Membership, PeerState, Swim, SwimConfig, Update
from atomd.p2p.messages import (
    Ack,
    Announce,
    DeltaAccepted,
    Gossip,
    JobAdvert,
    JoinReply,
    PingReq,
    PingReqReply,
    StopJob,
)
from atomd.p2p.quarantine import Quarantine, Verdict
from atomd.p2p.signing import Admission, RequestVerifier
from atomd.p2p.transfer import fetch_state
from atomd.rejections import Rejections
from atomd.spec import JobSpec
from atomd.telemetry import Telemetry

if TYPE_CHECKING:  # the delta exchange loads torch with the first swarm job, not at start
    from torch import Tensor

    from atomd.sync.runner import RoundOut, SyncPlugin
    from atomd.sync.state import MergeReport
    from atomd.sync.wire import DeltaFrame, ReplayGuard

log = get_logger(__name__)

SEND_TIMEOUT_S = 3.0  # a job announcement or stop to one peer
REJECTIONS_FLUSH_S = 60.0
# Refusals of a signed frame that count against its sender (quarantine): what no honest peer
# of the job sends. Staleness, replays and clocks do not count.
STRIKING_WIRE_ERRORS = frozenset(
    {"wrong_codec", "wrong_shape", "non_finite"}
)  # a job announcement or stop to one peer


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
        return await self.client.post(
            url, paths.JOIN, msg, JoinReply, target=target, timeout=timeout
        )

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
        jobs: JobManager,
    ) -> None:
        self.settings = settings
        self.identity = identity
        self.sessions = sessions
        self.telemetry = telemetry
        self.jobs = jobs
        self.admission = Admission.from_settings(settings)
        self.client = PeerClient(identity, self.admission)
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
                suspect_timeout=settings.suspect_timeout,
                ping_timeout=max(0.5, min(2.0, 2 * settings.gossip_interval)),
                indirect_timeout=max(0.75, min(3.0, 3 * settings.gossip_interval)),
            ),
        )
        self.swim.advert = self._advert
        self._repeated = Repeated(log)  # "alone", "join": logged once, then at a backoff
        self.swim.on_message = self._on_message
        self._changes: asyncio.Queue[tuple[Update, PeerState | None]] = asyncio.Queue()
        self._tg: asyncio.TaskGroup | None = None
        self._lan: list[str] = []
        # job id -> peer id -> when we last heard that peer train it (monotonic seconds)
        self._job_peers: dict[str, dict[str, float]] = {}
        self.plugins: dict[str, SyncPlugin] = {}
        self._replay_guard: ReplayGuard | None = None
        self._received_bytes: dict[tuple[str, str, int], int] = {}
        self._liars: set[str] = set()  # donor URLs whose state transfer lied: not asked again

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

    async def load_bans(self) -> None:
        """The operator's bans, from the database (at start)."""
        async with self.sessions() as s:
            bans = await repo.list_bans(s)
        self.quarantine.set_bans({b.public_key: b.reason for b in bans})

    async def ban(self, public_key: str, reason: str) -> None:
        """Ban a key (persisted): refused on the peer plane, out of every merge and transfer."""
        async with self.sessions() as s, s.begin():
            await repo.add_ban(s, public_key=public_key, reason=reason)
            await repo.add_event(s, kind="peer.banned", message=f"key {public_key}: {reason}")
        self.quarantine.ban(public_key, reason)
        for m in self.membership.all():
            if m.public_key == public_key:
                for plugin in self.plugins.values():
                    plugin.inbox.drop_sender(m.id)

    async def unban(self, public_key: str) -> bool:
        """Lift a ban (and a quarantine of that key); False if the key was not banned."""
        async with self.sessions() as s, s.begin():
            found = await repo.remove_ban(s, public_key=public_key)
            await repo.add_event(s, kind="peer.unbanned", message=f"key {public_key}")
        self.quarantine.unban(public_key)
        return found

    def verdict(self, peer_id: str) -> Verdict | None:
        """Why this daemon takes nothing from ``peer_id`` now (banned, quarantined), or None."""
        return self.quarantine.verdict(peer_id)

    async def _judged(self, merge: MergeReport) -> None:
        """Count the merge's strikes (see ``atomd.p2p.quarantine``)."""
        for a in merge.applied:
            await self._judge(a.sender, a.strike, a.note)
        for r in merge.refused:
            if r.strike:
                await self._judge(r.sender, True, r.reason)

    async def _judge(self, sender: str, strike: bool, reason: str | None) -> None:
        """One judged contribution of ``sender``; quarantine it (recorded) when its strikes
        reach the limit."""
        if sender == self.peer_id:
            return
        verdict = self.quarantine.judged(sender, strike, reason)
        if verdict is None:
            return
        log.warning("peer %s quarantined: %s", sender, verdict.reason)
        for plugin in self.plugins.values():
            plugin.inbox.drop_sender(sender)
        async with self.sessions() as s, s.begin():
            await repo.add_event(s, kind="peer.quarantined", peer_id=sender, message=verdict.reason)

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Join, then probe and record until cancelled."""
        try:
            await self.load_bans()
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
        """Once a minute: one event for the requests refused since, and the events table cut
        to ``events_keep`` rows."""
        while True:
            await asyncio.sleep(REJECTIONS_FLUSH_S)
            try:
                await self.flush_rejections()
            except Exception:  # the records must not end the daemon
                log.exception("could not record refused requests")

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
        return JobAdvert.model_validate(advert) if advert else None

    def _on_message(self, sender: str, msg: Gossip) -> None:
        advert = msg.job
        if advert is None:
            return
        self._job_peers.setdefault(advert.id, {})[sender] = time.monotonic()
        if self.settings.auto_join and not self.quarantine.excluded(sender):
            member = self.membership.get(sender)
            donors = [member.url] if member is not None else []
            # Other members that train the same job are donors too, should this one fail.
            offer = advert.model_dump(mode="json")
            self.jobs.offer(offer, donors + self._donors_besides(sender))

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

    def announce(self, advert: dict[str, Any]) -> None:
        """Tell every live peer about a new swarm job now (gossip would in a few periods)."""
        msg = Announce(sender=self.membership.me.update(), job=JobAdvert.model_validate(advert))
        for m in self.membership.others("alive"):
            self._spawn(self._send(m, paths.ANNOUNCE, msg), f"announce-{m.id[:8]}")

    def broadcast_stop(self, job_id: str) -> None:
        msg = StopJob(sender=self.membership.me.update())
        for m in self.membership.others("alive", "suspect"):
            self._spawn(self._send(m, paths.job_stop(job_id), msg), f"stop-{m.id[:8]}")

    async def _send(self, m: Member, path: str, msg: Announce | StopJob) -> None:
        try:
            await self.client.post(m.url, path, msg, Ack, target=m.id, timeout=SEND_TIMEOUT_S)
        except PeerRequestError as e:
            log.info("%s%s failed: %s", m.url, path, e)

    async def fetch_state(
        self, job_id: str, donors: list[str], root: Path, *, max_file_bytes: int | None = None
    ) -> int | None:
        return await fetch_state(
            self.client, donors, job_id, root, max_file_bytes=max_file_bytes, liars=self._liars
        )

    # -- delta exchange ---------------------------------------------------------------------------

    def job_peers(self, job_id: str) -> list[Member]:
        """Live members heard training ``job_id`` recently (this daemon excluded)."""
        window = max(15.0, 30 * self.settings.gossip_interval)
        now = time.monotonic()
        heard = self._job_peers.get(job_id, {})
        out = []
        for pid, at in tuple(heard.items()):  # the trainer thread calls this too
            m = self.membership.get(pid)
            fresh = now - at <= window
            live = m is not None and m is not self.membership.me and m.state == "alive"
            # A quarantined or banned member is neither sent deltas nor asked for state.
            if fresh and live and m is not None and not self.quarantine.excluded(pid):
                out.append(m)
        return out

    def job_donors(self, job_id: str) -> list[str]:
        return [m.url for m in self.job_peers(job_id)]

    def sync_plugin(self, job_id: str, spec: JobSpec) -> SyncPlugin:
        """The trainer-thread side of the delta exchange of one job, wired to this node."""
        from atomd.sync.runner import SyncPlugin

        loop = asyncio.get_running_loop()

        def send(out: RoundOut) -> None:  # called on the trainer thread
            loop.call_soon_threadsafe(self._spawn, self._deliver(out), f"round-{out.step}")

        def absorbed(job: str, merge: MergeReport) -> None:  # the trainer thread, too
            loop.call_soon_threadsafe(self._spawn, self._record_merge(job, merge), "absorbed")

        plugin = SyncPlugin(
            job_id=job_id,
            spec=spec.sync,
            identity=self.identity,
            n_peers=lambda: 1 + len(self.job_peers(job_id)),
            send=send,
            absorbed=absorbed,
        )
        plugin.excluded = self.quarantine.excluded
        self.plugins[job_id] = plugin
        return plugin

    def _codec(self, job_id: str) -> str:
        """The delta codec of a job this node trains ("?" once it no longer does)."""
        plugin = self.plugins.get(job_id)
        return plugin.spec.codec if plugin else "?"

    async def _deliver(self, out: RoundOut) -> None:
        """Send one round's frame to every peer training the job; record what happened."""
        raw = out.outgoing.raw_bytes
        codec = self._codec(out.job_id)
        await self._record_merge(out.job_id, out.merge)
        targets = self.job_peers(out.job_id)

        async def one(m: Member) -> tuple[Member, str | None]:
            path = paths.job_deltas(out.job_id)
            for attempt in range(2):
                try:
                    await self.client.post_bytes(
                        m.url, path, out.frame, DeltaAccepted, target=m.id, timeout=30.0
                    )
                    return m, None
                except PeerRequestError as e:
                    if e.status is not None and 400 <= e.status < 500:
                        return m, str(e)  # refused: retrying the same frame cannot help
                    if attempt == 1:
                        return m, str(e)
                    await asyncio.sleep(0.5)
            return m, "unreachable"

        results = await asyncio.gather(*(one(m) for m in targets))
        async with self.sessions() as s, s.begin():
            for m, error in results:
                await repo.add_round(
                    s, job_id=out.job_id, round=out.outgoing.round, direction="sent",
                    peer_id=m.id, bytes=len(out.frame), codec=codec,
                    compression_ratio=raw / len(out.frame), staleness=None,
                    applied=error is None, reason=error,
                )  # fmt: skip
                if error is None:
                    self.telemetry.bytes_sent.inc(len(out.frame))
                self.telemetry.rounds.labels("sent", str(error is None).lower()).inc()

    async def _record_merge(self, job_id: str, merge: MergeReport) -> None:
        """Record what a merge did with the deltas it was given (applied, or why not), and
        count its strikes."""
        await self._judged(merge)
        plugin = self.plugins.get(job_id)
        codec = self._codec(job_id)
        raw = plugin.state.numel * 4 if plugin is not None and plugin.state is not None else 0
        rows = [(a.sender, a.round, a.staleness, True, a.note) for a in merge.applied] + [
            (r.sender, r.round, None, False, r.reason) for r in merge.refused
        ]
        if not rows:
            return
        async with self.sessions() as s, s.begin():
            for sender, rnd, staleness, applied, reason in rows:
                size = self._received_bytes.pop((job_id, sender, rnd), 0)
                await repo.add_round(
                    s, job_id=job_id, round=rnd, direction="received", peer_id=sender,
                    bytes=size, codec=codec, compression_ratio=raw / size if size else 0.0,
                    staleness=staleness, applied=applied, reason=reason,
                )  # fmt: skip
                self.telemetry.rounds.labels("received", str(applied).lower()).inc()

    def max_frame_bytes(self, job_id: str) -> int:
        plugin = self.plugins.get(job_id)
        if plugin is None or plugin.state is None:
            return 0
        # Every codec is at most fp32-sized; headroom for framing and the header.
        return int(plugin.state.numel * 4 * 1.05) + (2 << 20)

    async def receive_delta(self, job_id: str, body: bytes, signer: str) -> int:
        """Check and queue one frame for the next round boundary; raises WireError (recorded)
        or NotFoundError. Nothing reaches the model unless every check passed."""
        from atomd.sync.state import Contribution
        from atomd.sync.wire import FrameDecoder, ReplayGuard, check_codec, decode_tensors

        plugin = self.plugins.get(job_id)
        if plugin is None or plugin.state is None or self.jobs.advert() is None:
            raise NotFoundError(f"not training job {job_id} here")
        verdict = self.quarantine.verdict(signer)
        if verdict is not None:  # refused before anything is decoded; not recorded per frame
            self.telemetry.rounds.labels("received", "false").inc()
            raise PeerAuthError(
                f"peer {signer} is {verdict.kind} here: {verdict.reason}", status=403
            )
        codec = plugin.spec.codec
        if self._replay_guard is None:
            self._replay_guard = ReplayGuard()
        decoder = FrameDecoder(
            job_id=job_id,
            public_key_of=lambda pid: m.public_key if (m := self.membership.get(pid)) else None,
            expected_shapes=plugin.expected_shapes,
            max_bytes=self.max_frame_bytes(job_id),
            seen=self._replay_guard,
        )

        def decode() -> tuple[DeltaFrame, dict[str, Tensor]]:
            for i in range(0, len(body), 1 << 20):
                decoder.feed(body[i : i + (1 << 20)])
            frame = decoder.finish()
            if frame.sender != signer:
                raise WireError("bad_signature", f"frame of {frame.sender} sent by {signer}")
            check_codec(frame, codec)
            return frame, decode_tensors(frame, plugin.expected_shapes)

        try:
            frame, tensors = await asyncio.to_thread(decode)
        except WireError as e:
            async with self.sessions() as s, s.begin():
                await repo.add_round(
                    s, job_id=job_id, round=-1, direction="received", peer_id=signer,
                    bytes=len(body), codec=plugin.spec.codec, compression_ratio=0.0,
                    staleness=None, applied=False, reason=str(e),
                )  # fmt: skip
            self.telemetry.rounds.labels("received", "false").inc()
            if e.reason in STRIKING_WIRE_ERRORS:  # signed by a member: no honest peer sends it
                await self._judge(signer, True, str(e))
            raise
        self._received_bytes[(job_id, frame.sender, frame.round)] = frame.wire_bytes
        self.telemetry.bytes_received.inc(frame.wire_bytes)
        if not plugin.inbox.put(
            Contribution(frame.sender, frame.round, frame.base_version, tensors)
        ):
            log.warning("inbox of job %s full: a delta from %s dropped", job_id, signer)
        return frame.wire_bytes
