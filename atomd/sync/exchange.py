"""The loop side of the delta exchange: one ``DeltaExchange`` per daemon, for its swarm job.

A delta's whole path stays in ``atomd.sync``:

1. the trainer thread's ``SyncPlugin`` (``runner``) closes a round and hands the signed frame to
   ``DeltaExchange.send`` (thread-safe);
2. the exchange uploads it to every peer that trains the job (``POST /p2p/v1/jobs/{id}/deltas``,
   one peer after another, paced by the uplink's measured rate, so that the frames do not leave
   as one burst; one retry on a network error, none on a refusal); a peer that starts
   training the job later is sent the recent rounds' frames it missed, oldest first and
   before the round's own (``_catch_up``);
3. on each receiver the peer plane hands the body to ``DeltaExchange.receive``, which checks it
   whole off the event loop (``wire.FrameDecoder``, the replay guard) and queues it in the job's
   plugin inbox; the plugin merges it after the next optimizer step. A frame that comes before
   the job's plugin is attached (a starting or restarted daemon loading torch, ``expect``, then
   fetching the swarm's state) is kept, bounded, and checked once it is (``_drain_early``):
   lost, its delta would be in every anchor but this one's;
4. every delta sent, received, applied or refused is recorded in one place (``_record``).

The exchange depends downward only: on the peer client that signs requests and on two narrow
interfaces, ``JobPeers`` (which live peers train a job, and their keys: the swarm membership)
and ``TrainingJobs`` (whether this daemon still trains a job: the job manager).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from atomd.db import repo
from atomd.errors import AtomdError, NotFoundError, PeerAuthError, PeerRequestError, WireError
from atomd.logs import get_logger
from atomd.model.config import num_parameters
from atomd.p2p import paths
from atomd.p2p.client import PeerClient
from atomd.p2p.identity import Identity
from atomd.p2p.messages import DeltaAccepted
from atomd.p2p.signing import MAX_BODY_S
from atomd.spec import JobSpec, lr_at
from atomd.telemetry import Telemetry

if TYPE_CHECKING:  # torch loads with the first swarm job, not when the daemon starts
    from torch import Tensor

    from atomd.sync.runner import RoundOut, SyncPlugin
    from atomd.sync.state import MergeReport
    from atomd.sync.wire import DeltaFrame, ReplayGuard

log = get_logger(__name__)

UPLOAD_TIMEOUT_S = 30.0  # one frame to one peer
UPLOAD_ATTEMPTS = 2
RETRY_DELAY_S = 0.5
# A round's frames go to its peers one after another: the next upload starts when the last
# one is answered, or once its bytes should have left this host (the frame's size at the
# fastest rate of the recent uploads, ``_pace``), or UPLOAD_STAGGER_S after it started,
# whichever comes first. Sent all at once, the frames leave as one burst of (peers x frame)
# bytes, and on a slow uplink (256 kbit/s with half a second of buffer, as `bench swarm`
# emulates a home line with `tc tbf`) the burst overflows the buffer: 5-9 % of the packets
# were dropped, and a loss at the end of a short upload is recovered only by a retransmission
# timeout, so frames took 3-5x their line time. One at a time they fit the buffer. But waiting
# for each answer cost ~40 % more: the answer comes back through the receiver's uplink, full of
# its own frames at the same moment (bench/results-swarm-256kbit-2026-12-02t.json: 0.58 s an
# upload for 0.41 s of line time). A rate measured over a whole upload (answer included) is
# below the line's, so the paced frames still never crowd the buffer. The stagger bounds what
# a silent peer costs the others.
UPLOAD_STAGGER_S = 1.0
RATE_SAMPLES = 8  # recent uploads whose fastest rate paces the next ones
# The final average's frame waits for the job's round in flight (``_deliver_average``) for at
# most this share of the time the others wait for it, and at most this long.
AVERAGE_WAITS_FOR_ROUND = 0.25
AVERAGE_ROUND_WAIT_S = 15.0
# How often a round's delivery looks whether the uploads still under way are all to peers no
# longer training the job (dead or left): then the round counts as delivered (``_deliver``).
GATE_CHECK_S = 0.5
FEED_CHUNK = 1 << 20  # bytes handed to the decoder at a time
# Rounds, beyond the job's max_staleness, after which a peer none of whose deltas a merge
# applied stops counting among the peers a round waits for (``_counted``).
SILENT_ROUNDS = 2
# Refusals of a signed frame that count against its sender (quarantine): what no honest peer
# of the job sends. Staleness, replays and clocks do not count.
STRIKING_WIRE_ERRORS = frozenset({"wrong_codec", "wrong_shape", "non_finite"})
# Frames kept per sender while the job fetches its state (the oldest goes first), and senders:
# the inbox's bounds (``runner.Inbox``).
EARLY_PER_SENDER = 4
EARLY_MAX_SENDERS = 256
# ... and their bytes in all, in the largest frames the job takes (each about its fp32 model).
EARLY_MAX_FRAMES = 8
# Frames refused from one sender that are recorded a row each in REFUSAL_WINDOW_S
# (``_may_record``).
REFUSAL_ROWS = 30
REFUSAL_WINDOW_S = 60.0
REFUSAL_SENDERS = 256  # (job, sender) windows kept before those of past minutes are pruned
# This peer's last frames, kept to send to a peer that starts training the job after they went
# out (``_catch_up``): the round's and the job's max_staleness before it (older ones are refused
# as stale anyway), at most KEPT_FRAME_BYTES in all (a large model's frames are large).
KEPT_FRAME_BYTES = 64 << 20


class PeerRef(Protocol):
    """A peer as the exchange sees it."""

    @property
    def id(self) -> str: ...
    @property
    def url(self) -> str: ...


class JobPeers(Protocol):
    """Which peers train a job (the membership: ``atomd.p2p.node.SwarmNode``)."""

    def job_peers(self, job_id: str) -> Sequence[PeerRef]:
        """Live peers heard training ``job_id`` recently, this daemon excluded."""
        ...

    def public_key(self, peer_id: str) -> str | None:
        """The Ed25519 public key (hex) of a known peer, None if unknown."""
        ...

    def exclusion(self, peer_id: str) -> str | None:
        """Why this daemon takes no delta from ``peer_id`` now (quarantined or banned: see
        ``atomd.p2p.quarantine``), or None."""
        ...

    def heard(self, job_id: str, peer_id: str) -> None:
        """A frame of ``job_id`` signed by ``peer_id`` came from it just now and passed the
        frame's checks (signature, codec, shapes, finite values; not yet the robust rule): it
        is alive and trains the job (membership need not probe it meanwhile)."""
        ...

    async def judge(self, sender: str, strike: bool, reason: str | None) -> None:
        """One judged contribution of ``sender`` (``strike``: refused or clipped hard, or a
        frame no honest peer sends); enough strikes quarantine it."""
        ...


class TrainingJobs(Protocol):
    """Whether this daemon trains a swarm job now (the job manager: ``atomd.jobs``)."""

    def trains(self, job_id: str) -> bool: ...


@dataclass
class _Lane:
    """One frame's place in a peer's queue of this peer's frames (``DeltaExchange._lane``):
    ``previous`` is done once the frame before it has gone (None: none waits)."""

    lanes: dict[tuple[str, str], asyncio.Future[None]]
    key: tuple[str, str]
    future: asyncio.Future[None]
    previous: asyncio.Future[None] | None

    def done(self) -> None:
        """The frame went, or was given up: the next one may go (an empty queue is forgotten)."""
        if not self.future.done():
            self.future.set_result(None)
        if self.lanes.get(self.key) is self.future:
            del self.lanes[self.key]


@dataclass
class _Kept:
    """One of this peer's recent frames, and the peers it has gone to (or was refused by)."""

    round: int
    frame: bytes
    every: int
    tried: set[str]


@dataclass(frozen=True)
class _Row:
    """One delta sent or received, as ``sync_rounds`` records it."""

    round: int
    direction: str
    peer_id: str
    bytes: int
    staleness: int | None
    applied: bool
    reason: str | None
    every: int | None = None  # steps the sender's round lasted


class DeltaExchange:
    """Sends each round's frame to the job's peers, checks and queues the frames that arrive,
    and records both. ``run()`` lives in the daemon's TaskGroup and owns the uploads."""

    def __init__(
        self,
        *,
        identity: Identity,
        client: PeerClient,
        peers: JobPeers,
        sessions: async_sessionmaker[AsyncSession],
        telemetry: Telemetry,
    ) -> None:
        self.identity = identity
        self.client = client
        self.peers = peers
        self.sessions = sessions
        self.telemetry = telemetry
        self.jobs: TrainingJobs | None = None  # set by the daemon once the job manager exists
        self.plugins: dict[str, SyncPlugin] = {}
        self._replay_guard: ReplayGuard | None = None
        # (job, sender, round) -> (frame bytes, the sender's round length in steps): recorded
        # when the plugin merges the delta.
        self._received: dict[tuple[str, str, int], tuple[int, int | None]] = {}
        # job -> peer -> the base version of its last delta for the job: it trains no more and
        # counts in no later round's average, but is still sent the frames of the rounds the
        # others train (it follows them until it ends the job: ``_deliver``).
        self._finished: dict[str, dict[str, int]] = {}
        # job -> peer -> the round its silence counts from: the base version at which it was
        # first counted, raised by every merge here that applied a delta of it (``_counted``).
        self._counted_from: dict[str, dict[str, int]] = {}
        # job -> its model's parameters (from the spec: frames are bounded before it is built)
        self._numel: dict[str, int] = {}
        # job -> sender -> frames that came before the plugin was attached (``_drain_early``)
        self._early: dict[str, dict[str, deque[bytes]]] = {}
        # (job, sender) -> (start of its minute, refused frames recorded in it): ``_may_record``
        self._refusals: dict[tuple[str, str], tuple[float, int]] = {}
        # job -> this peer's last frames, oldest first (``_catch_up``)
        self._kept: dict[str, deque[_Kept]] = {}
        # job -> held while a round's frame is on its way to the peers training the job: one
        # delivery at a time (``_deliver``)
        self._delivering: dict[str, asyncio.Lock] = {}
        # (job, peer) -> done when the last frame queued for that peer has been uploaded (or
        # given up): each peer gets this peer's frames in order, also those of the rounds
        # after one stuck on it (``_lane``)
        self._lanes: dict[tuple[str, str], asyncio.Future[None]] = {}
        self._tg: asyncio.TaskGroup | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Bytes a second of the recent accepted uploads (this host's uplink, whatever the job).
        self._rates: deque[float] = deque(maxlen=RATE_SAMPLES)

    async def run(self) -> None:
        """Own the uploads and records until cancelled."""
        self._loop = asyncio.get_running_loop()
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                await asyncio.Event().wait()
        finally:
            self._tg = None

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        if self._tg is None:  # not running (yet, or any more): nothing to own it
            coro.close()
            return
        self._tg.create_task(coro, name=name)

    def _from_trainer(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        """Hand a coroutine made on the trainer thread to the loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            coro.close()
            return
        loop.call_soon_threadsafe(self._spawn, coro, name)

    # -- the trainer's side ------------------------------------------------------------------

    def expect(self, job_id: str, spec: JobSpec) -> None:
        """``job_id`` is about to train here: its frames are kept from now on, until its
        plugin is attached (``plugin``) or the job is released. Called before the trainer's
        modules load (seconds on a busy machine), so that a restarted daemon does not refuse
        the frames the others send it meanwhile."""
        self._numel[job_id] = num_parameters(spec.model_shape)

    def plugin(self, job_id: str, spec: JobSpec, *, may_retake: bool = False) -> SyncPlugin:
        """The trainer-thread side of the exchange for one job, wired to this exchange;
        ``may_retake``: it may end the trainer to take the swarm's state again, far behind
        (``SyncPlugin.may_retake``)."""
        from atomd.sync.runner import SyncPlugin

        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        plugin = SyncPlugin(
            job_id=job_id,
            spec=spec.sync,
            identity=self.identity,
            counted=lambda base_version: [p.id for p in self._counted(job_id, base_version)],
            send=lambda out: self._from_trainer(self._deliver(out), f"round-{out.step}"),
            absorbed=lambda job, merge: self._from_trainer(
                self._record_merge(job, merge), "absorbed"
            ),
            send_average=lambda frame, timeout_s: self._from_trainer(
                self._deliver_average(job_id, frame, timeout_s), "average"
            ),
            finishers=lambda: self._finishers(job_id),
            training=lambda base_version: [p.id for p in self._training(job_id, base_version)],
            total_steps=spec.total_steps,
            lr=functools.partial(lr_at, spec),
        )
        plugin.excluded = lambda sender: self.peers.exclusion(sender) is not None
        plugin.may_retake = may_retake
        plugin.on_attached = lambda: self._from_trainer(self._drain_early(job_id), "early")
        # ``attach`` asked who is counted on version 0, before a restart's or a joiner's
        # checkpoint set the state's version (hundreds of rounds on): every peer then read as
        # silent since round 0, and the first round counted this peer alone (``_counted``),
        # committing its whole delta where the others committed what it sent (4 real daemons,
        # SIGKILL and restart: settled anchors 5.2e-3 apart, run fh). Silence counts from the
        # restored version on (a dict's pop: atomic, as ``_counted``'s own writes from the
        # trainer thread).
        plugin.on_restored = functools.partial(self._forget_counted, job_id)
        self.plugins[job_id] = plugin
        self.expect(job_id, spec)  # the same bound, if the manager has not expected it
        return plugin

    def _forget_counted(self, job_id: str) -> None:
        self._counted_from.pop(job_id, None)

    def drop_sender(self, peer_id: str) -> None:
        """``peer_id`` was quarantined or banned: forget its deltas waiting in every inbox
        (those held until a round closes leave at the trainer's next merge: ``_inbox``)."""
        for plugin in self.plugins.values():
            plugin.inbox.drop_sender(peer_id)
        for key in [k for k in self._received if k[1] == peer_id]:
            del self._received[key]

    def _training(self, job_id: str, base_version: int) -> list[PeerRef]:
        """The peers of ``job_id`` in its round on ``base_version``: live, and not done with the
        job before that round (a peer's last delta says which round was its last)."""
        last = self._finished.get(job_id, {})
        return [
            p for p in self.peers.job_peers(job_id) if last.get(p.id, base_version) >= base_version
        ]

    def _finishers(self, job_id: str) -> list[str]:
        """The live peers of ``job_id`` that have sent their last delta for it."""
        last = self._finished.get(job_id, {})
        return [p.id for p in self.peers.job_peers(job_id) if p.id in last]

    def _counted(self, job_id: str, base_version: int) -> list[PeerRef]:
        """The peers whose deltas the round on ``base_version`` waits for (``n_peers``; a round
        is the mean of the deltas it gets, whoever is counted: ``SyncState._close``): those
        training it (``_training``) that are not silent. A peer is silent once
        ``SILENT_ROUNDS`` + max_staleness rounds have passed here without a delta of it that
        a merge applied (refused ones, stale ones and ones clipped hard enough to count as a
        strike do not count), counted from the later of the round it was first counted in and
        the merge that applied its newest. It is still sent every frame; it counts again with
        its next applied delta. Counted by the adverts alone, a member that trains but sends
        nothing (broken, or hostile: issue #15's ``none``), or nothing a merge takes, made
        every round wait for one more delta; so did a SIGKILLed peer until it
        was declared dead (issue #14)."""
        plugin = self.plugins.get(job_id)
        grace = SILENT_ROUNDS + (plugin.spec.max_staleness if plugin is not None else 0)
        since = self._counted_from.setdefault(job_id, {})
        return [
            p
            for p in self._training(job_id, base_version)
            if base_version - since.setdefault(p.id, base_version) <= grace
        ]

    def release(self, job_id: str) -> None:
        """The job no longer trains here: frames for it are refused from now on."""
        self.plugins.pop(job_id, None)
        self._finished.pop(job_id, None)
        self._counted_from.pop(job_id, None)
        self._numel.pop(job_id, None)
        self._early.pop(job_id, None)
        self._kept.pop(job_id, None)
        self._delivering.pop(job_id, None)
        for lane in [k for k in self._lanes if k[0] == job_id]:
            del self._lanes[lane]
        for key in [k for k in self._received if k[0] == job_id]:
            del self._received[key]

    def _codec(self, job_id: str) -> str:
        """The delta codec of a job this daemon trains ("?" once it no longer does)."""
        plugin = self.plugins.get(job_id)
        return plugin.spec.codec if plugin else "?"

    def _model_bytes(self, job_id: str) -> int:
        """The job's model as fp32 bytes (0 when it does not train here)."""
        return self._numel.get(job_id, 0) * 4

    def _pace(self, nbytes: int) -> float:
        """Seconds between the starts of two uploads of ``nbytes``: their time at the fastest
        recent upload rate, at most UPLOAD_STAGGER_S (that, before any upload is measured)."""
        fastest = max(self._rates, default=0.0)
        return min(UPLOAD_STAGGER_S, nbytes / fastest) if fastest > 0 else UPLOAD_STAGGER_S

    async def _deliver(self, out: RoundOut) -> None:
        """Send one round's frame to every peer that has the job (``_upload_all``) once the
        round before has gone; record what happened, and tell the plugin how long the frame
        took to reach them (its cadence's traffic time). A round has gone when every upload is
        done, or those left are to peers no longer training the job (``_delivered``): an
        upload stuck on a peer that answers nothing goes on in that peer's lane, holding up
        neither the next round nor the other peers. What the round's merge did is recorded
        once the uploads are done (the database's time is not the link's), on every path: its
        strikes count whatever happened to the uploads."""
        # Every peer with the job, also one that has sent its last delta: it follows the
        # rounds the others still train (``SyncPlugin._follow``) until it ends the job.
        targets = list(self.peers.job_peers(out.job_id))
        arrived: list[float] = []  # time.monotonic() of each accepted upload
        # Who is first turns with the round, so that no peer always gets the frame last.
        turn = out.outgoing.round % len(targets) if targets else 0
        order = targets[turn:] + targets[:turn]
        # A peer that started training since older rounds went out gets them first, oldest
        # first, then this one: while it fetches the swarm's state it keeps only the newest
        # frames that came (``_keep_early``), and this round's, sent before the older ones, was
        # the first to go (a restarted real daemon lacked two deltas of the round before its
        # state's for good, its anchor 5.7 % from the others', 2026-12-05).
        late = self._missed(out.job_id, out.outgoing.round, order)
        order = [p for p in order if p.id not in late] + [p for p in order if p.id in late]
        self._keep(out, {p.id for p in order})  # before any await: see ``_catch_up``
        # One delivery at a time: the uplink's buffer takes one frame after another (see
        # UPLOAD_STAGGER_S), and each peer gets this peer's rounds in order. The trainer hands
        # over a round only once the last one has gone (one round in flight), except its last
        # round at the end of the job: sent while the round before was still on its way, it
        # reached a receiver first, which then ended its job without the earlier delta (4
        # real daemons at 256 kbit/s, run cb: that peer's anchor 2.3 % from the others').
        lock = self._delivering.setdefault(out.job_id, asyncio.Lock())
        await lock.acquire()
        told = False

        def delivered() -> None:  # the next round may go, and close; -1: nothing measured
            nonlocal told
            if told:
                return
            told = True
            lock.release()
            plugin = self.plugins.get(out.job_id)
            if plugin is None:
                return
            traffic = max(arrived) - out.handed_at if arrived else -1.0
            plugin.delivered(out.outgoing.round, traffic)
            if traffic >= 0:
                self.telemetry.round_traffic_seconds.observe(traffic)

        async def catch_up(peer: PeerRef) -> None:
            if peer.id in late:
                await self._catch_up(out.job_id, out.outgoing.round, peer,
                                     ratio_of=out.outgoing.raw_bytes)  # fmt: skip

        try:
            errors = await self._upload_all(
                out.job_id, out.frame, order, arrived, before=catch_up, delivered=delivered
            )
        finally:
            delivered()
            await self._record_merge(out.job_id, out.merge)
        rows = [
            _Row(out.outgoing.round, "sent", p.id, len(out.frame), None, error is None, error,
                 out.every)
            for p, error in zip(order, errors, strict=True)
        ]  # fmt: skip
        await self._record(out.job_id, rows, ratio_of=out.outgoing.raw_bytes)

    def _missed(self, job_id: str, before: int, targets: Sequence[PeerRef]) -> set[str]:
        """The ``targets`` that a kept frame of a round before ``before`` has not gone to."""
        kept = [k for k in self._kept.get(job_id, ()) if k.round < before]
        return {p.id for p in targets if any(p.id not in k.tried for k in kept)}

    async def _catch_up(self, job_id: str, before: int, peer: PeerRef, *, ratio_of: int) -> None:
        """Send this peer's recent frames of rounds before ``before`` that have not gone to
        ``peer`` (it started training the job after they went out), oldest first, and record
        them; in ``peer``'s lane, before the frame of round ``before``. (A round's frame is
        kept with the peers it goes to before its delivery waits for anything, and a delivery
        catches up only on older rounds, so none sends a newer round's frame to a peer that
        round left out on purpose.)

        A round's frame goes to the peers training the job when it closes; one that starts a
        moment later (the job's spec reaches the daemons by gossip, and they start one after
        another) never got it, and its anchor then lacks a delta every other anchor holds, for
        good: 4 real daemons (run bi) started counting 2, 3, 3 and 3 peers, and three round-0
        deltas reached only one or two of the three others. The newcomer merges them as late
        deltas; one that took the swarm's state refuses what that state holds already (as a
        duplicate or a stale round: no strike)."""
        for k in [k for k in self._kept.get(job_id, ()) if k.round < before]:
            if peer.id in k.tried:
                continue
            k.tried.add(peer.id)
            error = await self._upload(job_id, k.frame, peer, [])
            row = _Row(k.round, "sent", peer.id, len(k.frame), None, error is None, error, k.every)
            await self._record(job_id, [row], ratio_of=ratio_of)

    def _keep(self, out: RoundOut, tried: set[str]) -> None:
        """Keep the round's frame for ``_catch_up``, within the job's bounds."""
        plugin = self.plugins.get(out.job_id)
        # This round's and the max_staleness before it: a peer at this round takes them.
        limit = plugin.spec.max_staleness + 1 if plugin is not None else 0
        kept = self._kept.setdefault(out.job_id, deque())
        kept.append(_Kept(out.outgoing.round, out.frame, out.every, tried))
        while kept and (len(kept) > limit or sum(len(k.frame) for k in kept) > KEPT_FRAME_BYTES):
            kept.popleft()

    async def _upload_all(
        self,
        job_id: str,
        frame: bytes,
        order: Sequence[PeerRef],
        arrived: list[float],
        *,
        timeout_s: float = UPLOAD_TIMEOUT_S,
        attempts: int = UPLOAD_ATTEMPTS,
        before: Callable[[PeerRef], Awaitable[None]] | None = None,
        delivered: Callable[[], None] | None = None,
        lane_wait_s: float | None = None,
        deadline: float | None = None,
    ) -> list[str | None]:
        """Upload ``frame`` to each of ``order``, starting one after another (``_pace``), each
        in that peer's lane (``_lane``): after the frames queued for it before, so that every
        peer gets this peer's frames in order, while a peer that answers nothing (stopped,
        asleep) holds up only its own. What went wrong with each (None: accepted); ``arrived``
        gets the time of each accepted upload. ``before(peer)`` runs in the lane first (a
        newcomer's catch-up); ``delivered()`` is called once every upload is done or those
        left are to peers no longer training the job; ``lane_wait_s``: the most an upload
        waits for its lane (None: as long as it takes), after which it goes beside;
        ``deadline`` (monotonic): each upload gets what is left of it then, at least 1 s,
        instead of ``timeout_s``.

        Until 2026-12-06 a round's delivery ended with its last upload: a daemon stopped with
        SIGSTOP held every other peer's frames behind its upload (30 s, tried twice, for each
        round queued meanwhile), and their automatic cadence waited with them (a 72-step round
        at all three others: ``atomd bench swarm``, sigstop, runs ew and ex)."""
        # Every lane is taken before anything is awaited: in the order the rounds came.
        lanes = [self._lane(job_id, p.id) for p in order]

        async def one(peer: PeerRef, lane: _Lane) -> str | None:
            try:
                if lane.previous is not None:
                    try:
                        await asyncio.wait_for(asyncio.shield(lane.previous), lane_wait_s)
                    except TimeoutError:
                        log.info("job %s: a frame goes to %s beside the one still on its way",
                                 job_id, peer.id[:12])  # fmt: skip
                if peer.id not in {p.id for p in self.peers.job_peers(job_id)}:
                    return "not sent: it no longer trains the job (dead or left)"
                if before is not None:
                    await before(peer)
                left = timeout_s if deadline is None else max(deadline - time.monotonic(), 1.0)
                return await self._upload(job_id, frame, peer, arrived, timeout_s=left,
                                          attempts=attempts)  # fmt: skip
            finally:
                lane.done()

        pace = self._pace(len(frame))
        uploads: list[asyncio.Task[str | None]] = []
        try:
            async with asyncio.TaskGroup() as tg:
                for p, lane in zip(order, lanes, strict=True):
                    uploads.append(task := tg.create_task(one(p, lane)))
                    await asyncio.wait({task}, timeout=pace)
                if delivered is not None:
                    await self._delivered(job_id, order, uploads)
                    delivered()
        finally:  # all done by now; also those whose task was cancelled before it began
            for lane in lanes:
                lane.done()
        return [task.result() for task in uploads]

    def _lane(self, job_id: str, peer_id: str) -> _Lane:
        """A place in ``peer_id``'s queue of this peer's frames for ``job_id``, after the frame
        queued last; to be marked done once this one has been uploaded or given up."""
        key = (job_id, peer_id)
        previous = self._lanes.get(key)
        future = asyncio.get_running_loop().create_future()
        self._lanes[key] = future
        waits = None if previous is None or previous.done() else previous
        return _Lane(self._lanes, key, future, waits)

    async def _delivered(
        self, job_id: str, order: Sequence[PeerRef], uploads: Sequence[asyncio.Task[Any]]
    ) -> None:
        """Until every upload of ``uploads`` (to ``order``) is done, or those left are to peers
        no longer training the job: a stopped daemon answers nothing, and its upload holds
        until it times out (twice ``UPLOAD_TIMEOUT_S``), long after membership declared it
        dead. A suspect peer still counts: on a full link a training peer is suspected again
        and again (``SwarmNode.job_peers``)."""
        while True:
            left = [p.id for p, t in zip(order, uploads, strict=True) if not t.done()]
            if not left:
                return
            live = {p.id for p in self.peers.job_peers(job_id)}
            if not live.intersection(left):
                return
            await asyncio.wait([t for t in uploads if not t.done()], timeout=GATE_CHECK_S)

    async def _upload(
        self,
        job_id: str,
        frame: bytes,
        peer: PeerRef,
        arrived: list[float],
        *,
        timeout_s: float = UPLOAD_TIMEOUT_S,
        attempts: int = UPLOAD_ATTEMPTS,
    ) -> str | None:
        """Upload ``frame`` to ``peer`` within ``timeout_s``, tried at most ``attempts`` times:
        what went wrong (None: accepted; its time goes to ``arrived``)."""
        path = paths.job_deltas(job_id)
        for attempt in range(attempts):
            started = time.monotonic()
            try:
                await self.client.post_bytes(
                    peer.url, path, frame, DeltaAccepted, target=peer.id, timeout=timeout_s
                )
                arrived.append(time.monotonic())
                elapsed = arrived[-1] - started
                self.telemetry.upload_seconds.observe(elapsed)
                self.telemetry.bytes_sent.inc(len(frame))
                if elapsed > 0:
                    self._rates.append(len(frame) / elapsed)
                return None
            except PeerRequestError as e:
                if e.status is not None and 400 <= e.status < 500:
                    return str(e)  # refused: retrying the same frame cannot help
                if attempt == attempts - 1:
                    return str(e)
                await asyncio.sleep(RETRY_DELAY_S)
        return "unreachable"

    async def _deliver_average(self, job_id: str, frame: bytes, timeout_s: float) -> None:
        """Send the job's average frame (``atomd.sync.average``) to every peer that has the
        job, each upload within ``timeout_s`` (as long as the peers wait for it), tried once:
        a retry would come after they stopped waiting. The frame is sized for the measured
        link (many times a round's), and its uploads share that link: under a round's timeout
        all three of a 331 kB share at 256 kbit/s timed out, twice, each ~1 s short of done
        (bench/results-swarm-2026-12-03ba.json). Not a round: nothing is recorded in
        ``sync_rounds``, the cadence is not told.

        It waits for the job's round in flight like a round (one delivery at a time; in each
        peer's lane after a round stuck on it): the job's last round is handed over just
        before it, and shared with a frame 25x its size the last peer training's last round
        took 11 s to reach the others instead of ~1; one that was following the rounds
        meanwhile declared that peer dead (its pings starved on the same link), ended its
        job without that delta, and its settled anchor ended 5 % from the others' (4 real
        daemons at 256 kbit/s, run ce of 2026-12-05). But only for a part of the time the
        others wait for it (``AVERAGE_WAITS_FOR_ROUND``, at most AVERAGE_ROUND_WAIT_S): a
        round stuck on a silent peer (2 x 30 s) would otherwise make the share miss every
        peer's wait; then it goes beside that round. The uploads get what is left of
        ``timeout_s``."""
        started = time.monotonic()
        # No longer than a receiver takes a body (p2p.signing.MAX_BODY_S).
        deadline = started + min(timeout_s, MAX_BODY_S)
        lock = self._delivering.setdefault(job_id, asyncio.Lock())
        bound = min(AVERAGE_ROUND_WAIT_S, AVERAGE_WAITS_FOR_ROUND * timeout_s)
        try:  # wait_for returns the lock when it came even as the bound ran out
            held: bool = await asyncio.wait_for(lock.acquire(), bound)
        except TimeoutError:
            held = False
            log.info("job %s: the average frame goes beside the round still in flight after "
                     "%.0f s", job_id, bound)  # fmt: skip
        try:
            order = list(self.peers.job_peers(job_id))
            left = max(0.0, bound - (time.monotonic() - started))
            errors = await self._upload_all(
                job_id, frame, order, [], attempts=1, lane_wait_s=left, deadline=deadline
            )
        finally:
            if held:
                lock.release()
        failed = [f"{p.id}: {e}" for p, e in zip(order, errors, strict=True) if e is not None]
        log.info("job %s: average frame (%d bytes) sent to %d of %d peer(s) in %.1f s%s", job_id,
                 len(frame), len(order) - len(failed), len(order), time.monotonic() - started,
                 f"; failed: {'; '.join(failed)}" if failed else "")  # fmt: skip

    async def _record_merge(self, job_id: str, merge: MergeReport) -> None:
        """Record what a merge did with the deltas it was given (applied, clipped, or why
        not), and count the strikes against their senders."""

        def row(
            sender: str, rnd: int, staleness: int | None, applied: bool, reason: str | None
        ) -> _Row:
            size, every = self._received.pop((job_id, sender, rnd), (0, None))
            return _Row(rnd, "received", sender, size, staleness, applied, reason, every)

        rows = [row(a.sender, a.round, a.staleness, True, a.note) for a in merge.applied] + [
            row(r.sender, r.round, None, False, r.reason) for r in merge.refused
        ]
        if job_id in self.plugins:  # who still contributes (``_counted``)
            since = self._counted_from.setdefault(job_id, {})
            for a in merge.applied:
                if not a.strike:
                    since[a.sender] = max(merge.version, since.get(a.sender, merge.version))
        await self._record(job_id, rows, ratio_of=self._model_bytes(job_id))
        for a in merge.applied:
            if a.sender != self.identity.peer_id:
                await self.peers.judge(a.sender, a.strike, a.note)
        for r in merge.refused:
            if r.strike:
                await self.peers.judge(r.sender, True, r.reason)

    async def _record(self, job_id: str, rows: Sequence[_Row], *, ratio_of: int) -> None:
        """The one place a delta sent or received is written down (``sync_rounds``, metrics).

        ``ratio_of``: the fp32 bytes each row's ``bytes`` is compared with."""
        if not rows:
            return
        codec = self._codec(job_id)
        async with self.sessions() as s, s.begin():
            for r in rows:
                await repo.add_round(
                    s, job_id=job_id, round=r.round, direction=r.direction, peer_id=r.peer_id,
                    bytes=r.bytes, codec=codec,
                    compression_ratio=ratio_of / r.bytes if r.bytes else 0.0,
                    staleness=r.staleness, applied=r.applied, reason=r.reason, every=r.every,
                )  # fmt: skip
        for r in rows:
            self.telemetry.rounds.labels(r.direction, str(r.applied).lower()).inc()

    # -- the receiving side ------------------------------------------------------------------

    def max_frame_bytes(self, job_id: str) -> int:
        """The largest frame accepted for ``job_id`` (0: not training it here)."""
        raw = self._model_bytes(job_id)
        if raw == 0:
            return 0
        # Every codec is at most fp32-sized; headroom for framing and the header.
        return int(raw * 1.05) + (2 << 20)

    async def receive(self, job_id: str, body: bytes, signer: str) -> int:
        """Check and queue one frame for the job's plugin; returns its size. Raises
        ``WireError`` (recorded) or ``NotFoundError``. Nothing reaches the model unless every
        check passed."""
        why = self.peers.exclusion(signer)
        if why is not None:  # refused before anything is decoded; counted, not recorded a row
            self.telemetry.rounds.labels("received", "false").inc()
            raise PeerAuthError(f"peer {signer} is {why}", status=403)
        if job_id not in self._numel or not (self.jobs and self.jobs.trains(job_id)):
            raise NotFoundError(f"not training job {job_id} here")
        plugin = self.plugins.get(job_id)
        if plugin is None or plugin.state is None:  # checked once the plugin is attached
            return self._keep_early(job_id, signer, body)
        return await self._accept(job_id, plugin, body, signer)

    def _keep_early(self, job_id: str, signer: str, body: bytes) -> int:
        """Keep a frame that came while the job fetches its state, to be checked once it is
        attached (``_drain_early``): only from a known member (a key that only had the swarm
        secret filled every place with junk before, 2026-12-06), at most EARLY_PER_SENDER of
        each, EARLY_MAX_SENDERS senders and EARLY_MAX_FRAMES frames' worth of bytes in all
        (the sender holding the most gives its oldest up first)."""
        if self.peers.public_key(signer) is None:
            raise WireError("unknown_sender", f"sender {signer} is not a known peer")
        senders = self._early.setdefault(job_id, {})
        q = senders.get(signer)
        if q is None:
            if len(senders) >= EARLY_MAX_SENDERS:
                raise NotFoundError(f"job {job_id} is not training here yet")
            q = senders[signer] = deque(maxlen=EARLY_PER_SENDER)
        q.append(body)
        cap = EARLY_MAX_FRAMES * self.max_frame_bytes(job_id)
        held = {who: sum(map(len, kept)) for who, kept in senders.items()}
        while sum(held.values()) > cap:
            most = max(held, key=held.__getitem__)
            held[most] -= len(senders[most].popleft())
            if not senders[most]:
                del senders[most], held[most]
        return len(body)

    def _may_record(self, job_id: str, signer: str) -> bool:
        """Whether a frame refused from ``signer`` gets a row in the job's rounds: at most
        REFUSAL_ROWS a minute a sender (each is still counted in /metrics). A member sending
        junk frames, refused without a strike, wrote a row each, without end (a review of
        2026-12-06)."""
        now = time.monotonic()
        if len(self._refusals) > REFUSAL_SENDERS:  # senders of past windows go
            self._refusals = {
                k: v for k, v in self._refusals.items() if now - v[0] < REFUSAL_WINDOW_S
            }
        start, n = self._refusals.get((job_id, signer), (now, 0))
        if now - start >= REFUSAL_WINDOW_S:
            start, n = now, 0
        self._refusals[(job_id, signer)] = (start, n + 1)
        if n == REFUSAL_ROWS:
            log.warning("job %s: more than %d frames of %s refused this minute; the rest are "
                        "counted, not recorded", job_id, REFUSAL_ROWS, signer)  # fmt: skip
        return n < REFUSAL_ROWS

    async def _drain_early(self, job_id: str) -> None:
        """The frames kept while the job fetched its state, checked and queued as if they came
        now (its plugin is attached; the state it took refuses the deltas it holds already)."""
        senders = self._early.pop(job_id, {})
        plugin = self.plugins.get(job_id)
        if plugin is None or plugin.state is None:
            return
        kept = 0
        for signer, bodies in senders.items():
            for body in bodies:
                if self.peers.exclusion(signer) is not None:
                    break
                try:
                    await self._accept(job_id, plugin, body, signer, fresh=False)
                    kept += 1
                except AtomdError as e:
                    log.info("a frame from %s kept during the state transfer: %s", signer, e)
        if kept:
            log.info("job %s: %d frame(s) that came during the state transfer queued", job_id,
                     kept)  # fmt: skip

    async def _accept(
        self, job_id: str, plugin: SyncPlugin, body: bytes, signer: str, *, fresh: bool = True
    ) -> int:
        """Check one frame whole (off the loop) and queue it in ``plugin``'s inbox. ``fresh``:
        it came just now (not kept during a state transfer), so its sender is alive now."""
        from atomd.sync.state import Contribution
        from atomd.sync.wire import FrameDecoder, ReplayGuard, check_codec, decode_tensors

        codec = plugin.spec.codec
        if self._replay_guard is None:
            self._replay_guard = ReplayGuard()
        decoder = FrameDecoder(
            job_id=job_id,
            public_key_of=self.peers.public_key,
            expected_shapes=plugin.expected_shapes,
            max_bytes=self.max_frame_bytes(job_id),
            seen=self._replay_guard,
            sender=signer,
        )

        def decode() -> tuple[DeltaFrame, dict[str, Tensor]]:
            for i in range(0, len(body), FEED_CHUNK):
                decoder.feed(body[i : i + FEED_CHUNK])
            frame = decoder.finish()  # a frame of another sender than ``signer`` is refused
            check_codec(frame, codec)
            return frame, decode_tensors(frame, plugin.expected_shapes)

        try:
            frame, tensors = await asyncio.to_thread(decode)
        except WireError as e:
            if self._may_record(job_id, signer):
                row = _Row(-1, "received", signer, len(body), None, False, str(e))
                await self._record(job_id, [row], ratio_of=0)
            else:
                self.telemetry.rounds.labels("received", "false").inc()
            if e.reason in STRIKING_WIRE_ERRORS:  # signed by a member: no honest peer sends it
                await self.peers.judge(signer, True, str(e))
            raise
        self.telemetry.bytes_received.inc(frame.wire_bytes)
        if fresh:
            self.peers.heard(job_id, frame.sender)
        if frame.average:  # never a delta: kept apart for the job's final average
            from atomd.sync.average import Share

            # Kept as it travelled (checked: ``tensors`` decoded it), decoded again when used.
            if not plugin.averages.put(Share(frame.sender, frame.base_version, frame.tensors)):
                log.warning("job %s: average frame from %s dropped (too many)", job_id, signer)
            return frame.wire_bytes
        every = frame.cadence.every if frame.cadence is not None else None
        self._received[(job_id, frame.sender, frame.round)] = (frame.wire_bytes, every)
        if frame.cadence is not None:
            plugin.heard(frame.sender, frame.cadence.period_s)
        if frame.final:
            self._finished.setdefault(job_id, {})[frame.sender] = frame.base_version
        c = Contribution(frame.sender, frame.round, frame.base_version, tensors, every)
        out = plugin.inbox.put(c)
        if out is not None:  # never merged, so never reported: its record goes too
            self._received.pop((job_id, out.sender, out.round), None)
            if out is c:
                log.warning("inbox of job %s full: a delta from %s dropped", job_id, signer)
        return frame.wire_bytes
