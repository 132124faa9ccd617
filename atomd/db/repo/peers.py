"""The peers seen, the banned keys and the quarantined members."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import delete, func, or_, select
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.sql.elements import ColumnElement

from atomd.db.models import (
    PEER_STATES,
    Peer,
    PeerBan,
    PeerQuarantine,
    utcnow,
)
from atomd.db.repo.rows import check_allowed
from atomd.db.schemas import (
    BanRecord,
    PeerRecord,
    QuarantineRecord,
)

# -- peers -----------------------------------------------------------------------------------------


async def upsert_peer(
    s: AsyncSession,
    *,
    peer_id: str,
    url: str,
    public_key: str | None,
    state: str,
    incarnation: int,
    rtt_ms: float | None = None,
) -> PeerRecord:
    """Insert or update a peer. ``first_seen_at`` is set on insert, ``last_seen_at`` always;
    a ``None`` public key or round-trip time keeps the one already known."""
    check_allowed("peer state", state, PEER_STATES)
    if not 0 <= incarnation < 2**63:  # SQLite's INTEGER; the peer plane keeps them below 2^62
        raise ValueError(f"incarnation {incarnation} does not fit a 64-bit integer")
    now = utcnow()
    stmt = sqlite_insert(Peer).values(
        id=peer_id,
        url=url,
        public_key=public_key,
        state=state,
        incarnation=incarnation,
        first_seen_at=now,
        last_seen_at=now,
        rtt_ms=rtt_ms,
    )
    stmt = stmt.on_conflict_do_update(
        index_elements=[Peer.id],
        set_={
            "url": stmt.excluded.url,
            "public_key": func.coalesce(stmt.excluded.public_key, Peer.public_key),
            "state": stmt.excluded.state,
            "incarnation": stmt.excluded.incarnation,
            "last_seen_at": stmt.excluded.last_seen_at,
            "rtt_ms": func.coalesce(stmt.excluded.rtt_ms, Peer.rtt_ms),
        },
    )
    # populate_existing: a Peer the session already loaded must not shadow the new row.
    peer = await s.scalar(stmt.returning(Peer), execution_options={"populate_existing": True})
    assert peer is not None  # an upsert always returns its row
    return PeerRecord.model_validate(peer)


async def list_peers(s: AsyncSession) -> list[PeerRecord]:
    """Every peer ever seen, by id."""
    return [PeerRecord.model_validate(p) for p in await s.scalars(select(Peer).order_by(Peer.id))]


# -- bans --------------------------------------------------------------------------------------


async def add_ban(s: AsyncSession, *, public_key: str, reason: str) -> BanRecord:
    """Ban a key (lowercase hex); banning it again replaces the reason."""
    stmt = sqlite_insert(PeerBan).values(public_key=public_key, reason=reason, created_at=utcnow())
    await s.execute(
        stmt.on_conflict_do_update(index_elements=[PeerBan.public_key], set_={"reason": reason})
    )
    await s.flush()
    ban = await s.get(PeerBan, public_key, populate_existing=True)
    assert ban is not None
    return BanRecord.model_validate(ban)


async def remove_ban(s: AsyncSession, *, public_key: str) -> bool:
    """Lift a ban; False if the key was not banned."""
    result = await s.execute(delete(PeerBan).where(PeerBan.public_key == public_key))
    return bool(getattr(result, "rowcount", 0))


async def list_bans(s: AsyncSession) -> list[BanRecord]:
    return [
        BanRecord.model_validate(b)
        for b in await s.scalars(select(PeerBan).order_by(PeerBan.created_at))
    ]


# -- quarantines -------------------------------------------------------------------------------


async def add_quarantine(
    s: AsyncSession, *, peer_id: str, public_key: str | None, reason: str, until: datetime
) -> QuarantineRecord:
    """Quarantine a member until ``until``; quarantining it again replaces reason and end.
    The quarantines that have ended are deleted here (a write path already), not as they
    are listed: the daemon lists them before its peer plane listens, with reads alone."""
    await s.execute(delete(PeerQuarantine).where(PeerQuarantine.until <= utcnow()))
    values = {"public_key": public_key, "reason": reason, "until": until}
    stmt = sqlite_insert(PeerQuarantine).values(peer_id=peer_id, created_at=utcnow(), **values)
    await s.execute(
        stmt.on_conflict_do_update(index_elements=[PeerQuarantine.peer_id], set_=values)
    )
    await s.flush()
    row = await s.get(PeerQuarantine, peer_id, populate_existing=True)
    assert row is not None
    return QuarantineRecord.model_validate(row)


async def remove_quarantines(
    s: AsyncSession, *, peer_ids: Sequence[str] = (), public_key: str | None = None
) -> int:
    """End the quarantine of these members and of every member with ``public_key``; how many."""
    conds: list[ColumnElement[bool]] = []
    if peer_ids:
        conds.append(PeerQuarantine.peer_id.in_(list(peer_ids)))
    if public_key is not None:
        conds.append(PeerQuarantine.public_key == public_key)
    if not conds:
        return 0
    result = await s.execute(delete(PeerQuarantine).where(or_(*conds)))
    return int(getattr(result, "rowcount", 0) or 0)


async def list_quarantines(
    s: AsyncSession, *, now: datetime | None = None
) -> list[QuarantineRecord]:
    """The quarantines still running at ``now`` (default: now). Reads only
    (``add_quarantine`` deletes those that ended)."""
    now = now or utcnow()
    stmt = select(PeerQuarantine).where(PeerQuarantine.until > now)
    rows = await s.scalars(stmt.order_by(PeerQuarantine.until))
    return [QuarantineRecord.model_validate(q) for q in rows]
