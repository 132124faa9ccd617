"""The swarm's records in this daemon's database: peers, their changes, refused requests.

``PeerRecords`` writes each membership change as a ``peers`` row and an event, in order;
refreshes the live members' round-trip and last-seen times; counts the requests the peer
plane refused (``atomd.rejections``) and records them once a minute; and keeps the events
table and the jobs' rounds and progress within their retention (``atomd.db.retention``).
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from atomd.config import Settings
from atomd.db import repo
from atomd.db.retention import Pruned, prune_jobs
from atomd.errors import AtomdError, PeerAuthError
from atomd.logs import get_logger
from atomd.p2p.membership import Member, Membership, PeerState, Update
from atomd.rejections import Rejections
from atomd.telemetry import Telemetry

log = get_logger(__name__)

REJECTIONS_FLUSH_S = 60.0
# At shutdown the peers recorder finishes its write and the queued ones within this long.
RECORD_DRAIN_S = 3.0
LAST_SEEN_S = 5.0  # how often the live members' round-trip and last-seen times are written


class PeerRecords:
    """Membership changes, last-seen times and refused requests, written to the database."""

    def __init__(
        self,
        *,
        settings: Settings,
        sessions: async_sessionmaker[AsyncSession],
        telemetry: Telemetry,
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.telemetry = telemetry
        self.rejections = Rejections()  # refused requests of both planes, counted
        self.membership: Membership | None = None  # set by ``watch``
        self._changes: asyncio.Queue[tuple[Update, PeerState | None]] = asyncio.Queue()
        # When the last pass over the jobs' records began (``prune_records``); None: never.
        self._pruned_at: datetime | None = None

    def watch(self, membership: Membership) -> None:
        """Record the changes of ``membership`` from now on."""
        self.membership = membership
        membership.on_change = self.on_change

    def _members(self) -> Membership:
        assert self.membership is not None, "PeerRecords.watch was not called"
        return self.membership

    def on_change(self, m: Member, before: PeerState | None) -> None:
        """A member changed state (``Membership.on_change``): queued to be recorded."""
        self._changes.put_nowait((m.update(), before))
        self.telemetry.peers_alive.set(len(self._members().others("alive")))

    async def record_changes(self) -> None:
        """Each membership change as a peer row and an event, in order. Cancelled (the daemon
        stops), the write under way finishes and those queued are written, for at most
        RECORD_DRAIN_S: the changes of a swarm stopping together come just then, and a write
        cut off would leave them out."""
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
        except Exception as e:  # a record that cannot be written must not end the daemon
            log.exception("could not record peer %s: %s -> %s: %s", u.id, before, u.state, e)

    async def _record_change(self, u: Update, before: PeerState | None) -> None:
        m = self._members().get(u.id)
        async with self.sessions() as s, s.begin():
            await repo.upsert_peer(
                    s, peer_id=u.id, url=u.url, public_key=u.public_key, state=u.state,
                    incarnation=u.incarnation, rtt_ms=m.rtt_ms if m else None,
                )  # fmt: skip
            await repo.add_event(
                    s, kind=f"peer.{u.state}", peer_id=u.id,
                    message=f"{before or 'new'} -> {u.state} ({u.url})",
                )  # fmt: skip

    async def refresh_last_seen(self) -> None:
        """Round-trip times and last-seen times, every few seconds (not on every ping)."""
        while True:
            await asyncio.sleep(LAST_SEEN_S)
            alive = self._members().others("alive")
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

    async def keep_tidy(self) -> None:
        """Once a minute: one event for the requests refused since, the events table cut to
        ``events_keep`` rows, and the jobs' rounds and progress to theirs (``prune_records``).
        A failing pass is logged and the next minute tries again: the records must not end
        the daemon."""
        while True:
            await asyncio.sleep(REJECTIONS_FLUSH_S)
            await self.flush_rejections_logged()
            try:
                await self.prune_records()
            except Exception as e:
                log.exception("could not prune the jobs' rounds and progress: %s", e)

    async def flush_rejections_logged(self) -> None:
        """``flush_rejections``, a failure logged with its reason (the count is lost)."""
        try:
            await self.flush_rejections()
        except Exception as e:
            log.exception("could not record refused requests: %s", e)

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
        """One event for the requests refused since the last flush; the events table cut to
        ``events_keep`` rows."""
        summary = self.rejections.flush()
        async with self.sessions() as s, s.begin():
            if summary is not None:
                message, data = summary
                await repo.add_event(s, kind="auth.rejected", message=message, data=data)
            await repo.prune_events(s, keep=self.settings.events_keep)
