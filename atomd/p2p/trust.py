"""Whom this daemon takes deltas and state from: the operator's bans and the quarantines.

``Trust`` wraps the in-memory ``Quarantine`` (``atomd.p2p.quarantine``) with its records: a
ban, an unban and a quarantine are written to the database (tables ``peer_bans``,
``peer_quarantines``, and an event each), and ``restore`` puts them back at start, so a
restart lifts none.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from atomd.db import repo
from atomd.db.schemas import BanRecord, QuarantineRecord
from atomd.logs import get_logger
from atomd.p2p.membership import Membership
from atomd.p2p.quarantine import Quarantine, Verdict

log = get_logger(__name__)


class Trust:
    """Bans and quarantines of the members of one swarm, kept in memory and in the database."""

    def __init__(
        self,
        *,
        membership: Membership,
        sessions: async_sessionmaker[AsyncSession],
        on_excluded: Callable[[str], None],
    ) -> None:
        """``on_excluded`` is called with a peer id quarantined or banned."""
        self.membership = membership
        self.sessions = sessions
        self.on_excluded = on_excluded
        self.quarantine = Quarantine(key_of=self._key_of)

    def _key_of(self, peer_id: str) -> str | None:
        m = self.membership.get(peer_id)
        return m.public_key if m is not None else None

    def banned_reason(self, public_key: str) -> str | None:
        """Why the peer plane refuses ``public_key`` (banned here), or None."""
        if not self.quarantine.is_banned_key(public_key):
            return None
        return "its key is banned by this daemon's operator (atomd unban to lift it)"

    def restore(self, bans: Sequence[BanRecord], held: Sequence[QuarantineRecord]) -> None:
        """The operator's bans and the quarantines still running, as read from the database."""
        self.quarantine.set_bans({b.public_key: b.reason for b in bans})
        for q in held:
            self.quarantine.restore(q.peer_id, q.public_key, q.reason, q.until.timestamp())

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
        if sender == self.membership.me.id:
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
