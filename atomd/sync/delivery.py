"""Sending this peer's frames: each round's to the peers the round targets, a newcomer's
catch-up on the recent rounds it missed, and the job's final average.

One delivery at a time per job: the uplink's buffer takes one frame after another (see
``uplink.UPLOAD_STAGGER_S``), and each peer gets this peer's rounds in order.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from atomd.logs import get_logger
from atomd.p2p.signing import MAX_BODY_S
from atomd.sync.job_peers import PeerRef, RoundPeers
from atomd.sync.job_table import JobTable
from atomd.sync.records import RoundRecords, Row
from atomd.sync.uplink import Uplink
from atomd.telemetry import Telemetry

if TYPE_CHECKING:  # torch loads with the first swarm job, not when the daemon starts
    from atomd.sync.runner import RoundOut
    from atomd.sync.state import MergeReport

log = get_logger(__name__)

# The final average's frame waits for the job's round in flight (``deliver_average``) for at
# most this share of the time the others wait for it, and at most this long.
AVERAGE_WAITS_FOR_ROUND = 0.25
AVERAGE_ROUND_WAIT_S = 15.0
# This peer's last frames, kept to send to a peer that starts training the job after they went
# out (``RoundDelivery.catch_up``): the round's and the job's max_staleness before it (older
# ones are refused as stale anyway), at most KEPT_FRAME_BYTES in all (a large model's frames
# are large).
KEPT_FRAME_BYTES = 64 << 20


@dataclass
class KeptFrame:
    """One of this peer's recent frames, and the peers it has gone to (or was refused by)."""

    round: int
    frame: bytes
    every: int
    tried: set[str]


class KeptFrames:
    """Per job, this peer's last frames, oldest first, for the peers that start training the
    job after they went out."""

    def __init__(self) -> None:
        self._kept: dict[str, deque[KeptFrame]] = {}

    def keep(self, out: RoundOut, tried: set[str], limit: int) -> None:
        """Keep the round's frame, sent to ``tried``; at most ``limit`` frames (and
        KEPT_FRAME_BYTES) of the job are kept."""
        kept = self._kept.setdefault(out.job_id, deque())
        kept.append(KeptFrame(out.outgoing.round, out.frame, out.every, tried))
        while kept and (len(kept) > limit or sum(len(k.frame) for k in kept) > KEPT_FRAME_BYTES):
            kept.popleft()

    def before(self, job_id: str, round: int) -> list[KeptFrame]:
        """The kept frames of rounds before ``round``, oldest first."""
        return [k for k in self._kept.get(job_id, ()) if k.round < round]

    def missed(self, job_id: str, before: int, targets: Sequence[PeerRef]) -> set[str]:
        """The ``targets`` that a kept frame of a round before ``before`` has not gone to."""
        kept = self.before(job_id, before)
        return {p.id for p in targets if any(p.id not in k.tried for k in kept)}

    def release(self, job_id: str) -> None:
        """The job no longer trains here."""
        self._kept.pop(job_id, None)


class RoundDelivery:
    """Delivers this peer's frames of each job through the ``Uplink`` and records them."""

    def __init__(
        self,
        *,
        uplink: Uplink,
        round_peers: RoundPeers,
        jobs: JobTable,
        records: RoundRecords,
        telemetry: Telemetry,
        record_merge: Callable[[str, MergeReport], Awaitable[None]],
    ) -> None:
        self.uplink = uplink
        self.round_peers = round_peers
        self.jobs = jobs
        self.records = records
        self.telemetry = telemetry
        self.record_merge = record_merge
        self.kept = KeptFrames()
        # job -> held while a frame is on its way to the job's peers: one delivery at a time
        self._delivering: dict[str, asyncio.Lock] = {}

    def release(self, job_id: str) -> None:
        """The job no longer trains here."""
        self.kept.release(job_id)
        self._delivering.pop(job_id, None)

    def _keep(self, out: RoundOut, tried: set[str]) -> None:
        """Keep the round's frame for ``catch_up``: this round's and the max_staleness before
        it (a peer at this round takes them)."""
        max_staleness = self.jobs.max_staleness(out.job_id)
        self.kept.keep(out, tried, max_staleness + 1 if max_staleness is not None else 0)

    async def deliver(self, out: RoundOut) -> None:
        """Send one round's frame to the round's targets (``RoundPeers.targets``) once the
        round before has gone; record what happened, and tell the plugin how long the frame
        took to reach them (its cadence's traffic time). A round has gone when every upload is
        done, or those left are to peers no longer training the job (``Uplink.gone``): an
        upload stuck on a peer that answers nothing goes on in that peer's lane, holding up
        neither the next round nor the other peers. What the round's merge did is recorded
        once the uploads are done (the database's time is not the link's), on every path: its
        strikes count whatever happened to the uploads."""
        targets = self.round_peers.targets(out.job_id, out.outgoing.round)
        arrived: list[float] = []  # time.monotonic() of each accepted upload
        # Who is first turns with the round, so that no peer always gets the frame last.
        turn = out.outgoing.round % len(targets) if targets else 0
        order = targets[turn:] + targets[:turn]
        # A peer that started training since older rounds went out gets them first, oldest
        # first, then this one: while it fetches the swarm's state it keeps only the newest
        # frames that come (``FrameAdmission``), and this round's, were it sent before the
        # older ones, would be the one it drops (its anchor would then lack that delta).
        late = self.kept.missed(out.job_id, out.outgoing.round, order)
        order = [p for p in order if p.id not in late] + [p for p in order if p.id in late]
        self._keep(out, {p.id for p in order})  # before any await: see ``catch_up``
        # The trainer hands over a round only once the last one has gone (one round in
        # flight), except its last round at the end of the job: sent while the round before
        # is still on its way, it could reach a receiver first, which would then end its job
        # without the earlier delta. Hence the lock.
        lock = self._delivering.setdefault(out.job_id, asyncio.Lock())
        await lock.acquire()
        told = False

        def delivered() -> None:  # the next round may go, and close; -1: nothing measured
            nonlocal told
            if told:
                return
            told = True
            lock.release()
            plugin = self.jobs.plugins.get(out.job_id)
            if plugin is None:
                return
            traffic = max(arrived) - out.handed_at if arrived else -1.0
            plugin.delivered(out.outgoing.round, traffic)
            if traffic >= 0:
                self.telemetry.round_traffic_seconds.observe(traffic)

        async def catch_up(peer: PeerRef) -> None:
            if peer.id in late:
                await self.catch_up(out.job_id, out.outgoing.round, peer,
                                    ratio_of=out.outgoing.raw_bytes)  # fmt: skip

        try:
            errors = await self.uplink.upload_all(
                out.job_id, out.frame, order, arrived, before=catch_up, delivered=delivered
            )
        finally:
            delivered()
            await self.record_merge(out.job_id, out.merge)
        rows = [
            Row(out.outgoing.round, "sent", p.id, len(out.frame), None, error is None, error,
                out.every)
            for p, error in zip(order, errors, strict=True)
        ]  # fmt: skip
        await self.records.record(out.job_id, rows, ratio_of=out.outgoing.raw_bytes)

    async def catch_up(self, job_id: str, before: int, peer: PeerRef, *, ratio_of: int) -> None:
        """Send this peer's recent frames of rounds before ``before`` that have not gone to
        ``peer`` (it started training the job after they went out), oldest first, and record
        them; in ``peer``'s lane, before the frame of round ``before``. (A round's frame is
        kept with the peers it goes to before its delivery waits for anything, and a delivery
        catches up only on older rounds, so none sends a newer round's frame to a peer that
        round left out on purpose.)

        A round's frame goes to the peers training the job when it closes; one that starts a
        moment later (the job's spec reaches the daemons by gossip, and they start one after
        another) never got it, and its anchor would then lack a delta every other anchor
        holds, for good. The newcomer merges them as late deltas; one that took the swarm's
        state refuses what that state holds already (as a duplicate or a stale round: no
        strike)."""
        for k in self.kept.before(job_id, before):
            if peer.id in k.tried:
                continue
            k.tried.add(peer.id)
            error = await self.uplink.upload(job_id, k.frame, peer, [])
            row = Row(k.round, "sent", peer.id, len(k.frame), None, error is None, error, k.every)
            await self.records.record(job_id, [row], ratio_of=ratio_of)

    async def deliver_average(self, job_id: str, frame: bytes, timeout_s: float) -> None:
        """Send the job's average frame (``atomd.sync.average``) to every peer that has the
        job, each upload within ``timeout_s`` (as long as the peers wait for it), tried once:
        a retry would come after they stopped waiting. The frame is sized for the measured
        link (many times a round's), and its uploads share that link: under a round's timeout
        they time out just short of done on a slow link (measured, see research/). Not a
        round: nothing is recorded in ``sync_rounds``, the cadence is not told.

        It waits for the job's round in flight like a round (one delivery at a time; in each
        peer's lane after a round stuck on it): the job's last round is handed over just
        before it, and sharing the link with a frame many times its size, that round would
        reach the others late enough that a peer following the rounds could declare the
        sender dead (its pings starved on the same link) and end its job without that delta.
        But only for a part of the time the others wait for it (``AVERAGE_WAITS_FOR_ROUND``,
        at most AVERAGE_ROUND_WAIT_S): a round stuck on a silent peer (2 x 30 s) would
        otherwise make the share miss every peer's wait; then it goes beside that round. The
        uploads get what is left of ``timeout_s``."""
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
            # Every peer with the job, whatever a round targets: each one averages.
            order = list(self.round_peers.peers.job_peers(job_id))
            left = max(0.0, bound - (time.monotonic() - started))
            errors = await self.uplink.upload_all(
                job_id, frame, order, [], attempts=1, lane_wait_s=left, deadline=deadline
            )
        finally:
            if held:
                lock.release()
        failed = [f"{p.id}: {e}" for p, e in zip(order, errors, strict=True) if e is not None]
        log.info("job %s: average frame (%d bytes) sent to %d of %d peer(s) in %.1f s%s", job_id,
                 len(frame), len(order) - len(failed), len(order), time.monotonic() - started,
                 f"; failed: {'; '.join(failed)}" if failed else "")  # fmt: skip
