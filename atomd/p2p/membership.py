"""Swarm membership, SWIM-style (Das et al. 2002) with incarnation numbers.

``Membership`` is the state and its merge rules (no I/O). ``Swim`` runs the protocol over a
``Transport``: every period it probes one member (round-robin over a shuffled list) with a
direct ping; if that fails it asks up to ``indirect_k`` others to ping it (ping-req); if those
fail too the member becomes *suspect*, and *dead* when it has not refuted within
``suspect_timeout``. Every message piggybacks recent membership updates (gossip), each
retransmitted about ``3 * log2(n + 1)`` times. A member that hears it is suspected refutes by
raising its incarnation. A daemon that stops says *left* to everyone directly.

Incarnations start from the wall clock in milliseconds, so a restarted daemon (same id) always
outranks what the swarm remembers of its previous life.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from atomd.logs import get_logger

log = get_logger(__name__)

PeerState = Literal["alive", "suspect", "dead", "left"]
_RANK: dict[str, int] = {"alive": 0, "suspect": 1, "dead": 2, "left": 3}


@dataclass(frozen=True)
class Update:
    """One piece of gossip: what a member is, as of an incarnation."""

    id: str
    url: str
    public_key: str
    state: PeerState
    incarnation: int

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "url": self.url,
            "public_key": self.public_key,
            "state": self.state,
            "incarnation": self.incarnation,
        }

    @classmethod
    def from_json(cls, d: Any) -> Update:
        if not isinstance(d, dict) or d.get("state") not in _RANK:
            raise ValueError(f"malformed membership update: {d!r}")
        return cls(
            id=str(d["id"]),
            url=str(d["url"]),
            public_key=str(d["public_key"]),
            state=d["state"],
            incarnation=int(d["incarnation"]),
        )


@dataclass
class Member:
    id: str
    url: str
    public_key: str
    state: PeerState
    incarnation: int
    first_seen: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.time)  # wall clock of last direct contact
    state_since: float = field(default_factory=time.monotonic)
    rtt_ms: float | None = None

    def update(self) -> Update:
        return Update(self.id, self.url, self.public_key, self.state, self.incarnation)


def supersedes(new: Update, old: Member) -> bool:
    """SWIM's ordering: a higher incarnation wins; at equal incarnation the graver state wins
    (alive < suspect < dead < left). Only the member itself raises its incarnation."""
    if new.incarnation != old.incarnation:
        return new.incarnation > old.incarnation
    return _RANK[new.state] > _RANK[old.state]


class Membership:
    """The members this daemon knows, itself included, and the gossip it still has to spread."""

    def __init__(
        self,
        me: Update,
        *,
        on_change: Callable[[Member, PeerState | None], None] | None = None,
    ) -> None:
        self.me = Member(me.id, me.url, me.public_key, "alive", me.incarnation)
        self.members: dict[str, Member] = {}
        self.on_change = on_change
        self._gossip: dict[str, tuple[Update, int]] = {}  # id -> (update, sends left)
        self._enqueue(self.me.update())

    # -- queries -----------------------------------------------------------------------------

    def get(self, peer_id: str) -> Member | None:
        return self.me if peer_id == self.me.id else self.members.get(peer_id)

    def others(self, *states: PeerState) -> list[Member]:
        wanted = states or ("alive", "suspect")
        return [m for m in self.members.values() if m.state in wanted]

    def all(self) -> list[Member]:
        return [self.me, *sorted(self.members.values(), key=lambda m: m.id)]

    def snapshot(self) -> list[Update]:
        return [m.update() for m in self.all()]

    # -- gossip ------------------------------------------------------------------------------

    def _retransmits(self) -> int:
        return max(3, math.ceil(3 * math.log2(len(self.members) + 2)))

    def _enqueue(self, u: Update) -> None:
        self._gossip[u.id] = (u, self._retransmits())

    def gossip(self, limit: int = 16) -> list[Update]:
        """Updates to piggyback on the next message, least-sent first."""
        items = sorted(self._gossip.values(), key=lambda x: -x[1])[:limit]
        for u, left in items:
            if left <= 1:
                self._gossip.pop(u.id, None)
            else:
                self._gossip[u.id] = (u, left - 1)
        return [u for u, _ in items]

    # -- merging -----------------------------------------------------------------------------

    def apply(self, u: Update, *, direct: bool = False) -> bool:
        """Merge one update; True if it changed what we know. ``direct``: it came from the
        member itself (it is alive and reachable now)."""
        if u.id == self.me.id:
            if u.state in ("suspect", "dead") and u.incarnation >= self.me.incarnation:
                self.refute(u.incarnation)
            return False
        known = self.members.get(u.id)
        if known is None:
            if u.state in ("dead", "left") and not direct:
                return False  # hearsay about a stranger who is gone: nothing to add
            member = Member(u.id, u.url, u.public_key, u.state, u.incarnation)
            self.members[u.id] = member
            self._enqueue(u)
            self._changed(member, None)
            return True
        if direct:
            known.last_seen = time.time()
        if not supersedes(u, known):
            return False
        before = known.state
        known.url, known.public_key = u.url, u.public_key or known.public_key
        known.incarnation = u.incarnation
        if u.state != before:
            known.state = u.state
            known.state_since = time.monotonic()
        self._enqueue(known.update())
        if u.state != before:
            self._changed(known, before)
        return True

    def refute(self, incarnation: int) -> None:
        """Someone suspects us: outrank that with a higher incarnation, alive."""
        self.me.incarnation = max(self.me.incarnation, incarnation) + 1
        self._enqueue(self.me.update())
        log.info("refuting a suspicion: incarnation %d", self.me.incarnation)

    def mark(self, peer_id: str, state: PeerState) -> bool:
        """Our own verdict about another member, at its current incarnation."""
        m = self.members.get(peer_id)
        if m is None or m.state == state:
            return False
        return self.apply(replace(m.update(), state=state))

    def _changed(self, m: Member, before: PeerState | None) -> None:
        log.info("peer %s (%s): %s -> %s", m.id[:12], m.url, before or "new", m.state)
        if self.on_change is not None:
            self.on_change(m, before)


class Transport(Protocol):
    """How ``Swim`` reaches other members (signed HTTP in the daemon, in-memory in tests).
    Every call raises on failure or timeout."""

    async def ping(self, url: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]: ...
    async def ping_req(
        self, url: str, payload: dict[str, Any], timeout: float
    ) -> dict[str, Any]: ...
    async def join(self, url: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]: ...
    async def leave(self, url: str, payload: dict[str, Any], timeout: float) -> None: ...


@dataclass(frozen=True)
class SwimConfig:
    period: float = 0.5
    """Seconds between probes."""
    ping_timeout: float = 1.0
    indirect_timeout: float = 1.5
    indirect_k: int = 3
    suspect_timeout: float = 5.0
    join_timeout: float = 3.0
    leave_timeout: float = 1.0


class Swim:
    """The protocol loop and the handlers for incoming messages."""

    def __init__(self, membership: Membership, transport: Transport, config: SwimConfig) -> None:
        self.m = membership
        self.transport = transport
        self.config = config
        self.join_errors: dict[str, str] = {}  # url -> why the last join through it failed
        self._order: list[str] = []
        self.extra: Callable[[], dict[str, Any]] = dict
        """Extra fields every message carries (the daemon adds its active job)."""
        self.on_extra: Callable[[str, dict[str, Any]], None] = lambda _peer, _extra: None
        """Called with (sender id, message) for every message received."""

    # -- messages ----------------------------------------------------------------------------

    def _message(self) -> dict[str, Any]:
        return {
            "from": self.m.me.update().to_json(),
            "updates": [u.to_json() for u in self.m.gossip()],
            **self.extra(),
        }

    def receive(self, msg: dict[str, Any]) -> str:
        """Merge a message's sender and gossip; return the sender id."""
        sender = Update.from_json(msg.get("from"))
        self.m.apply(sender, direct=True)
        for raw in msg.get("updates", [])[:256]:
            self.m.apply(Update.from_json(raw))
        self.on_extra(sender.id, msg)
        return sender.id

    # -- incoming ----------------------------------------------------------------------------

    def handle_ping(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.receive(msg)
        return self._message()

    async def handle_ping_req(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.receive(msg)
        target = self.m.get(str(msg.get("target", "")))
        ok = False
        if target is not None and target is not self.m.me:
            ok = await self._ping(target, self.config.ping_timeout)
        return {**self._message(), "ok": ok}

    def handle_join(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.receive(msg)
        return {**self._message(), "members": [u.to_json() for u in self.m.snapshot()]}

    def handle_leave(self, msg: dict[str, Any]) -> None:
        sender = Update.from_json(msg.get("from"))
        self.m.apply(replace(sender, state="left"), direct=True)

    # -- outgoing ----------------------------------------------------------------------------

    async def _ping(self, target: Member, timeout: float) -> bool:
        t0 = time.perf_counter()
        try:
            reply = await self.transport.ping(target.url, self._message(), timeout)
            self.receive(reply)
        except Exception as e:  # any failure to get a valid answer is a missed ping
            log.debug("ping %s failed: %s", target.id[:12], e)
            return False
        target.rtt_ms = (time.perf_counter() - t0) * 1000
        target.last_seen = time.time()
        return True

    async def _ping_req(self, via: Member, target: Member) -> bool:
        try:
            payload = {**self._message(), "target": target.id}
            reply = await self.transport.ping_req(via.url, payload, self.config.indirect_timeout)
            self.receive(reply)
            return bool(reply.get("ok"))
        except Exception as e:
            log.debug("ping-req via %s failed: %s", via.id[:12], e)
            return False

    def _next_target(self) -> Member | None:
        candidates = {m.id for m in self.m.others("alive", "suspect")}
        self._order = [i for i in self._order if i in candidates]
        if not self._order:
            self._order = list(candidates)
            random.shuffle(self._order)
        while self._order:
            m = self.m.get(self._order.pop())
            if m is not None and m.state in ("alive", "suspect"):
                return m
        return None

    async def probe(self, target: Member) -> None:
        if await self._ping(target, self.config.ping_timeout):
            # A suspect that answers is not cleared here: only the member itself can refute, by
            # raising its incarnation once our gossip tells it it is suspected.
            return
        helpers = [m for m in self.m.others("alive") if m.id != target.id]
        helpers = random.sample(helpers, min(self.config.indirect_k, len(helpers)))
        if helpers:
            results = await asyncio.gather(*(self._ping_req(h, target) for h in helpers))
            if any(results):
                return
        if target.state == "alive":
            self.m.mark(target.id, "suspect")

    def expire_suspects(self) -> None:
        now = time.monotonic()
        for m in self.m.others("suspect"):
            if now - m.state_since >= self.config.suspect_timeout:
                self.m.mark(m.id, "dead")

    async def run(self) -> None:
        """Probe forever, one member per period."""
        while True:
            started = time.monotonic()
            target = self._next_target()
            if target is not None:
                await self.probe(target)
            self.expire_suspects()
            await asyncio.sleep(max(0.0, self.config.period - (time.monotonic() - started)))

    async def join(self, urls: list[str]) -> bool:
        """Join through the first of ``urls`` that answers; True if one did. Why each of the
        others failed is in ``join_errors`` (url -> reason) until the next call."""
        self.join_errors = {}
        for url in urls:
            if url.rstrip("/") == self.m.me.url:
                continue
            try:
                reply = await self.transport.join(url, self._message(), self.config.join_timeout)
                self.receive(reply)
                for raw in reply.get("members", []):
                    self.m.apply(Update.from_json(raw))
            except Exception as e:
                self.join_errors[url] = str(e) or type(e).__name__
                log.debug("could not join through %s: %s", url, e)
                continue
            log.info("joined the swarm through %s: %d members", url, len(self.m.members) + 1)
            return True
        return False

    async def leave(self) -> None:
        """Tell every live member we are leaving (best effort, bounded in time)."""
        self.m.me.state = "left"
        targets = self.m.others("alive", "suspect")
        msg = self._message()
        msg["from"] = replace(self.m.me.update(), state="left").to_json()

        async def one(m: Member) -> None:
            try:
                await self.transport.leave(m.url, msg, self.config.leave_timeout)
            except Exception as e:
                log.debug("leave to %s failed: %s", m.id[:12], e)

        await asyncio.gather(*(one(m) for m in targets))
