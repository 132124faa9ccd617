"""Swarm membership, SWIM-style (Das et al. 2002) with incarnation numbers.

``Membership`` is the state and its merge rules (no I/O). ``Swim`` runs the protocol over a
``Transport``: every period it probes one member (round-robin over a shuffled list) with a
direct ping; if that fails it asks up to ``indirect_k`` others to ping it (ping-req); if those
fail too the member becomes *suspect*, and *dead* when it has not refuted within
``suspect_timeout``. Every message piggybacks recent membership updates (gossip), each
retransmitted about ``3 * log2(n + 1)`` times. A member that hears it is suspected refutes by
raising its incarnation. A daemon that stops says *left* to everyone directly. While the swarm
is settled, a member whose job traffic (a signed delta frame) came lately is not probed: the
frame said what the probe's answer would (``Membership.heard``, ``SwimConfig.heard_window``).

Incarnations start from the wall clock in milliseconds, so a restarted daemon (same id) always
outranks what the swarm remembers of its previous life.

Claims about a member come from that member: its ``alive`` and ``left`` records,
with their URL and incarnation, are signed by its own key and checked on receipt
(``atomd.p2p.messages.record_problem``); a peer id is the hash of its key, so the key cannot
change either. ``suspect`` and ``dead`` are each daemon's own verdicts, reached by its own
probes; heard from others (unsigned gossip) they only make this daemon probe that member soon
(``on_hearsay``), and they tell the member itself to refute. Nobody can declare another member
dead or left, nor move it to another URL.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from atomd.logs import get_logger
from atomd.p2p.identity import Identity
from atomd.p2p.messages import (
    MAX_MEMBERS,
    Gossip,
    JobAdvert,
    JoinReply,
    MemberRecord,
    MemberState,
    PingReq,
    PingReqReply,
    record_problem,
    sign_record,
)

log = get_logger(__name__)

# The most members a daemon keeps (``Membership._make_room``): four full join replies.
MAX_KNOWN = 4 * MAX_MEMBERS
# How far ahead of this daemon's clock a previous life of it may have dated its incarnation
# (``Membership._refutable``): a clock set back by up to this much across a restart.
INCARNATION_SKEW_MS = 24 * 3600 * 1000

PeerState = MemberState
Update = MemberRecord  # one piece of gossip: what a member is, as of an incarnation
_RANK: dict[str, int] = {"alive": 0, "suspect": 1, "dead": 2, "left": 3}


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
    signed: Update | None = None  # its newest signed (alive or left) record
    heard_at: float = -math.inf  # monotonic: its last signed traffic of a job (``heard``)

    def update(self) -> Update:
        """What we say of it: its own signed record while that is what we believe, otherwise
        our verdict (unsigned, at its incarnation)."""
        s = self.signed
        if s is not None and (s.state, s.incarnation, s.url) == (
            self.state, self.incarnation, self.url
        ):  # fmt: skip
            return s
        return Update(
            id=self.id,
            url=self.url,
            public_key=self.public_key,
            state=self.state,
            incarnation=self.incarnation,
        )


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
        identity: Identity | None = None,
        swarm: str = "default",
        on_change: Callable[[Member, PeerState | None], None] | None = None,
        on_hearsay: Callable[[str], None] | None = None,
        max_known: int = MAX_KNOWN,
    ) -> None:
        """``identity`` signs this daemon's own records (without one they go unsigned, and
        other members will not believe them: tests of the merge rules only); ``max_known``:
        the most members it keeps (``_make_room``)."""
        self.max_known = max_known
        self.me = Member(me.id, me.url, me.public_key, "alive", me.incarnation)
        self.identity = identity
        self.swarm = swarm
        self.members: dict[str, Member] = {}
        self.on_change = on_change
        self.on_hearsay = on_hearsay
        self.refused = 0  # records not believed (bad id, missing or wrong signature)
        self._gossip: dict[str, tuple[Update, int]] = {}  # id -> (update, sends left)
        self._sign_me()
        self._enqueue(self.me.update())

    def _sign_me(self) -> None:
        """Sign this daemon's record as it now is (after any change of its state or
        incarnation)."""
        if self.identity is None:
            return
        me = self.me
        record = Update(id=me.id, url=me.url, public_key=me.public_key, state=me.state,
                        incarnation=me.incarnation)  # fmt: skip
        me.signed = sign_record(record, self.identity, self.swarm)

    def leaving(self) -> Update:
        """Mark this daemon as leaving; its signed *left* record."""
        self.me.state = "left"
        self._sign_me()
        return self.me.update()

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

    def heard(self, peer_id: str) -> None:
        """A delta frame signed by ``peer_id`` came from it and passed the frame's checks
        (signature, codec, shapes, finite values): it is reachable and alive now, as a probe's
        answer would say. Its state is not changed (only its own records raise it from
        suspect), but while such frames flow a settled swarm need not probe it (``Swim``)."""
        m = self.members.get(peer_id)
        if m is not None:
            m.heard_at = time.monotonic()
            m.last_seen = time.time()

    # -- gossip ------------------------------------------------------------------------------

    def _retransmits(self) -> int:
        return max(3, math.ceil(3 * math.log2(len(self.members) + 2)))

    def _enqueue(self, u: Update) -> None:
        self._gossip[u.id] = (u, self._retransmits())

    def has_news(self) -> bool:
        """Updates are still waiting to be piggybacked."""
        return bool(self._gossip)

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
        member itself (it is alive and reachable now).

        A record that is not the member's own word (``record_problem``) is refused; a
        suspicion or death heard from others changes nothing here but asks for a probe."""
        if u.id == self.me.id:
            if u.state in ("suspect", "dead") and self._refutable(u.incarnation):
                self.refute(u.incarnation)
            return False
        problem = record_problem(u, self.swarm)
        if problem is not None:
            self.refused += 1
            log.debug("gossip refused: %s", problem)
            return False
        known = self.members.get(u.id)
        if u.state in ("suspect", "dead"):  # hearsay: only the member's own records count
            live = known is not None and known.state in ("alive", "suspect")
            if (
                live
                and known is not None
                and u.incarnation >= known.incarnation
                and self.on_hearsay
            ):
                self.on_hearsay(u.id)
            return False
        if known is None:
            if u.state == "left" and not direct:
                return False  # a stranger who is gone: nothing to add
            if not self._make_room(direct):
                return False
            member = Member(u.id, u.url, u.public_key, u.state, u.incarnation, signed=u)
            self.members[u.id] = member
            self._enqueue(u)
            self._changed(member, None)
            return True
        if direct:
            known.last_seen = time.time()
        if not supersedes(u, known):
            if direct and u.state == "alive" and known.state in ("suspect", "dead"):
                # It speaks to us, and we hold it suspect or dead at an incarnation its record
                # does not outrank: the gossip that said so may be spent (a daemon stopped for
                # 20 s comes back to a swarm that has stopped saying it is dead, and it stays
                # dead to them for the rest of its job: ``atomd bench swarm`` sigstop). Say it
                # again, on the answer to this very message, so that it refutes.
                self._enqueue(known.update())
            return False
        before = known.state
        known.signed = u
        known.url = u.url
        known.incarnation = u.incarnation
        if u.state != before:
            known.state = u.state
            known.state_since = time.monotonic()
        self._enqueue(known.update())
        if u.state != before:
            self._changed(known, before)
        return True

    def _make_room(self, direct: bool) -> bool:
        """Room for one more member: at ``max_known`` the one dead or gone the longest is
        forgotten; with none, a member heard from itself (``direct``) takes the place of the
        one not heard from directly for the longest, and one only gossiped about is refused.
        Without a bound one member could gossip self-signed records of fresh keys, and every
        daemon would keep them all and probe the URLs they name (1,152 members from one
        sender in 18 messages)."""
        if len(self.members) < self.max_known:
            return True
        gone = [m for m in self.members.values() if m.state in ("dead", "left")]
        if gone:
            victim = min(gone, key=lambda m: m.state_since)
        elif direct:
            victim = min(self.members.values(), key=lambda m: m.last_seen)
        else:
            return False
        del self.members[victim.id]
        self._gossip.pop(victim.id, None)
        log.info("forgot member %s (%s) for a new one: %d known at most", victim.id[:8],
                 victim.state, self.max_known)  # fmt: skip
        return True

    def _refutable(self, incarnation: int) -> bool:
        """A suspicion of this daemon at ``incarnation`` is one to outrank: at its own
        incarnation or above, up to what a previous life of it could have signed (incarnations
        start from the wall clock in ms: now, plus INCARNATION_SKEW_MS for a clock set back
        since). Higher is a lie, and outranking it would take this daemon's incarnation with
        it: a suspicion at the largest counter would make the next one unsignable, and every
        ping and answer of the victim would fail from then on."""
        plausible = max(self.me.incarnation, int(time.time() * 1000) + INCARNATION_SKEW_MS)
        return self.me.incarnation <= incarnation <= plausible

    def refute(self, incarnation: int) -> None:
        """Someone suspects us: outrank that with a higher incarnation, alive."""
        self.me.incarnation = max(self.me.incarnation, incarnation) + 1
        self._sign_me()
        self._enqueue(self.me.update())
        log.info("refuting a suspicion: incarnation %d", self.me.incarnation)

    def mark(self, peer_id: str, state: PeerState) -> bool:
        """Our own verdict about another member (suspect or dead, from our own probes), at its
        current incarnation; gossiped unsigned, as an opinion."""
        m = self.members.get(peer_id)
        if m is None or m.state == state or _RANK[state] < _RANK[m.state]:
            return False
        before = m.state
        m.state = state
        m.state_since = time.monotonic()
        self._enqueue(m.update())
        self._changed(m, before)
        return True

    def _changed(self, m: Member, before: PeerState | None) -> None:
        log.info("peer %s (%s): %s -> %s", m.id[:12], m.url, before or "new", m.state)
        if self.on_change is not None:
            self.on_change(m, before)


class Transport(Protocol):
    """How ``Swim`` reaches other members (signed HTTP in the daemon, in-memory in tests).
    ``target`` is the peer id expected at ``url`` (None: whoever answers there). Every call
    raises on failure or timeout."""

    async def ping(self, url: str, target: str, msg: Gossip, timeout: float) -> Gossip: ...
    async def ping_req(
        self, url: str, target: str, msg: PingReq, timeout: float
    ) -> PingReqReply: ...
    async def join(
        self, url: str, target: str | None, msg: Gossip, timeout: float
    ) -> JoinReply: ...
    async def leave(self, url: str, target: str, msg: Gossip, timeout: float) -> None: ...


@dataclass(frozen=True)
class SwimConfig:
    period: float = 0.5
    """Seconds between probes while anything is unsettled (``Swim.unsettled``)."""
    settled_period: float = 1.5
    """Seconds between probes while membership is settled. SWIM's per-member traffic is at most
    one probe a period whatever the swarm's size, so this is what an idle swarm costs each
    peer; a change is spread, and a suspect is settled, at ``period``. A dead member is found by
    one of its n-1 probers within about ``settled_period`` (each probes it once in n-1
    periods), plus ``heard_window`` if its frames flowed until it died."""
    ping_timeout: float = 1.0
    indirect_timeout: float = 1.5
    indirect_k: int = 3
    suspect_timeout: float = 5.0
    heard_window: float = 3.0
    """While membership is settled, a member whose job traffic was heard (``Membership.heard``)
    within this many seconds is not probed: its frames say what the probe's answer would.
    On a slow uplink the probes and their answers (each ~2 kB: signed headers, the sender's
    record, the job's advert) took a tenth of the line while delta frames flowed every few
    seconds anyway. 0 probes everyone at the pace as before."""
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
        self._urgent: dict[str, None] = {}  # members others suspect: probed first (ordered set)
        if self.m.on_hearsay is None:
            self.m.on_hearsay = self.probe_soon
        self.advert: Callable[[], JobAdvert | None] = lambda: None
        """The job every message carries (the daemon's swarm job)."""
        self.on_message: Callable[[str, Gossip], None] = lambda _peer, _msg: None
        """Called with (sender id, message) for every message received."""
        self.skipped = 0  # probes not sent: the member's job traffic was heard lately

    # -- messages ----------------------------------------------------------------------------

    def message(self) -> Gossip:
        return Gossip(sender=self.m.me.update(), updates=self.m.gossip(), job=self.advert())

    def receive(self, msg: Gossip) -> str:
        """Merge a message's sender and gossip; return the sender id."""
        self.m.apply(msg.sender, direct=True)
        for u in msg.updates:
            self.m.apply(u)
        self.on_message(msg.sender.id, msg)
        return msg.sender.id

    # -- incoming ----------------------------------------------------------------------------

    def handle_ping(self, msg: Gossip) -> Gossip:
        self.receive(msg)
        return self.message()

    async def handle_ping_req(self, msg: PingReq) -> PingReqReply:
        self.receive(msg)
        target = self.m.get(msg.target)
        ok = False
        if target is not None and target is not self.m.me:
            ok = await self._ping(target, self.config.ping_timeout)
        m = self.message()
        return PingReqReply(sender=m.sender, updates=m.updates, job=m.job, ok=ok)

    def handle_join(self, msg: Gossip) -> JoinReply:
        self.receive(msg)
        m = self.message()
        members = self.m.snapshot()[:MAX_MEMBERS]
        return JoinReply(sender=m.sender, updates=m.updates, job=m.job, members=members)

    def handle_leave(self, msg: Gossip) -> None:
        """The member's own signed *left* record (anything else is ignored)."""
        if msg.sender.state == "left":
            self.m.apply(msg.sender, direct=True)

    # -- outgoing ----------------------------------------------------------------------------

    async def _ping(self, target: Member, timeout: float) -> bool:
        t0 = time.perf_counter()
        try:
            reply = await self.transport.ping(target.url, target.id, self.message(), timeout)
            if reply.sender.id != target.id:
                raise ValueError(f"{reply.sender.id} answered for {target.id}")
            self.receive(reply)
        except Exception as e:  # any failure to get a valid answer is a missed ping
            log.debug("ping %s failed: %s", target.id[:12], e)
            return False
        target.rtt_ms = (time.perf_counter() - t0) * 1000
        target.last_seen = time.time()
        return True

    async def _ping_req(self, via: Member, target: Member) -> bool:
        try:
            m = self.message()
            msg = PingReq(sender=m.sender, updates=m.updates, job=m.job, target=target.id)
            reply = await self.transport.ping_req(
                via.url, via.id, msg, self.config.indirect_timeout
            )
            self.receive(reply)
            return reply.ok
        except Exception as e:
            log.debug("ping-req via %s failed: %s", via.id[:12], e)
            return False

    def probe_soon(self, peer_id: str) -> None:
        """Someone says ``peer_id`` is suspect or dead: see for ourselves at the next period."""
        if peer_id in self.m.members:  # bounded by the members we know
            self._urgent[peer_id] = None

    def _next_target(self, *, skip_heard: bool = False) -> Member | None:
        """The member to probe next: one someone suspects first, then round-robin. With
        ``skip_heard``, the turn of a member heard within ``heard_window`` passes without a
        probe (None): each member is still probed at most once in n-1 periods by each peer, so
        a member that sends no frames (an idle peer, one of another job) is not probed by
        every peer every period instead."""
        while self._urgent:
            pid = next(iter(self._urgent))
            del self._urgent[pid]
            m = self.m.get(pid)
            if m is not None and m is not self.m.me and m.state in ("alive", "suspect"):
                return m
        candidates = {m.id for m in self.m.others("alive", "suspect")}
        self._order = [i for i in self._order if i in candidates]
        lately = time.monotonic() - self.config.heard_window
        if not self._order:
            self._order = list(candidates)
            random.shuffle(self._order)
        while self._order:
            m = self.m.get(self._order.pop())
            if m is None or m.state not in ("alive", "suspect"):
                continue
            if skip_heard and m.state == "alive" and m.heard_at > lately:
                self.skipped += 1  # its turn passes: each member keeps its share of probes
                return None
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

    def unsettled(self) -> str | None:
        """Why probes should come at the fast ``period`` now, or None: news to spread, a member
        to probe soon, or a suspect to settle."""
        if self.m.has_news():
            return "news"
        if self._urgent:
            return "probe soon"
        if self.m.others("suspect"):
            return "suspect"
        return None

    def pace(self) -> float:
        """Seconds between probes now: ``period`` while unsettled, else ``settled_period``."""
        return self.config.settled_period if self.unsettled() is None else self.config.period

    async def run(self) -> None:
        """Probe one member per ``pace()`` (none when the turn is a member heard lately, see
        ``_next_target``), looking every ``period`` whether one is due (so news is acted on
        within a fast period even after a settled one began)."""
        last_probe = -math.inf
        while True:
            started = time.monotonic()
            if started - last_probe >= self.pace() - 1e-3:
                last_probe = started
                target = self._next_target(skip_heard=self.unsettled() is None)
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
                reply = await self.transport.join(
                    url, None, self.message(), self.config.join_timeout
                )
                self.receive(reply)
                for u in reply.members:
                    self.m.apply(u)
            except Exception as e:
                self.join_errors[url] = str(e) or type(e).__name__
                log.debug("could not join through %s: %s", url, e)
                continue
            log.info("joined the swarm through %s: %d members", url, len(self.m.members) + 1)
            return True
        return False

    async def leave(self) -> None:
        """Tell every live member we are leaving (best effort, bounded in time)."""
        left = self.m.leaving()
        targets = self.m.others("alive", "suspect")
        msg = self.message().model_copy(update={"sender": left})

        async def one(m: Member) -> None:
            try:
                await self.transport.leave(m.url, m.id, msg, self.config.leave_timeout)
            except Exception as e:
                log.debug("leave to %s failed: %s", m.id[:12], e)

        await asyncio.gather(*(one(m) for m in targets))
