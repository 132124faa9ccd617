"""This peer's uploads of a frame to other peers: paced, one after another, each peer's in order.

Every peer has a lane: the frames this peer queued for it, uploaded in the order they were
queued, so that a peer that answers nothing (stopped, asleep) holds up only its own frames.
A frame's uploads to several peers start one after another, ``Uplink.pace`` apart.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from atomd.errors import PeerRequestError
from atomd.logs import get_logger
from atomd.p2p import paths
from atomd.p2p.client import PeerClient
from atomd.p2p.messages import DeltaAccepted
from atomd.sync.job_peers import PeerRef, RoundPeers
from atomd.telemetry import Telemetry

log = get_logger(__name__)

UPLOAD_TIMEOUT_S = 30.0  # one frame to one peer
UPLOAD_ATTEMPTS = 2
RETRY_DELAY_S = 0.5
# A round's frames go to its peers one after another: the next upload starts when the last
# one is answered, or once its bytes should have left this host (the frame's size at the
# fastest rate of the recent uploads, ``Uplink.pace``), or UPLOAD_STAGGER_S after it started,
# whichever comes first. Sent all at once, the frames leave as one burst of (peers x frame)
# bytes, and on a slow uplink (256 kbit/s with half a second of buffer, as `bench swarm`
# emulates a home line with `tc tbf`) the burst overflows the buffer: 5-9 % of the packets
# are dropped, and a loss at the end of a short upload is recovered only by a retransmission
# timeout, so frames take 3-5x their line time. One at a time they fit the buffer. Waiting
# for each answer costs ~40 % more: the answer comes back through the receiver's uplink, full
# of its own frames at the same moment (measured, see research/: 0.58 s an upload for 0.41 s
# of line time). A rate measured over a whole upload (answer included) is below the line's, so
# the paced frames still never crowd the buffer. The stagger bounds what a silent peer costs
# the others.
UPLOAD_STAGGER_S = 1.0
RATE_SAMPLES = 8  # recent uploads whose fastest rate paces the next ones
# How often a delivery looks whether the uploads still under way are all to peers no longer
# training the job (dead or left): then the frame counts as delivered (``Uplink.gone``).
GATE_CHECK_S = 0.5


@dataclass
class Lane:
    """One frame's place in a peer's queue of this peer's frames (``Uplink.lane``):
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


class Uplink:
    """Uploads frames (``POST /p2p/v1/jobs/{id}/deltas``) and measures the rate they leave at."""

    def __init__(
        self, *, client: PeerClient, round_peers: RoundPeers, telemetry: Telemetry
    ) -> None:
        self.client = client
        self.round_peers = round_peers
        self.telemetry = telemetry
        # (job, peer) -> done when the last frame queued for that peer has been uploaded (or
        # given up): each peer gets this peer's frames in order, also those of the rounds
        # after one stuck on it (``lane``)
        self._lanes: dict[tuple[str, str], asyncio.Future[None]] = {}
        # Bytes a second of the recent accepted uploads (this host's uplink, whatever the job).
        self.rates: deque[float] = deque(maxlen=RATE_SAMPLES)

    def release(self, job_id: str) -> None:
        """The job no longer trains here: its lanes are forgotten."""
        for lane in [k for k in self._lanes if k[0] == job_id]:
            del self._lanes[lane]

    def pace(self, nbytes: int) -> float:
        """Seconds between the starts of two uploads of ``nbytes``: their time at the fastest
        recent upload rate, at most UPLOAD_STAGGER_S (that, before any upload is measured)."""
        fastest = max(self.rates, default=0.0)
        return min(UPLOAD_STAGGER_S, nbytes / fastest) if fastest > 0 else UPLOAD_STAGGER_S

    async def upload(
        self,
        job_id: str,
        frame: bytes,
        peer: PeerRef,
        arrived: list[float],
        *,
        timeout_s: float = UPLOAD_TIMEOUT_S,
        attempts: int = UPLOAD_ATTEMPTS,
    ) -> str | None:
        """Upload ``frame`` to ``peer`` within ``timeout_s``, tried at most ``attempts`` times
        (one retry on a network error, none on a refusal): what went wrong (None: accepted;
        its time goes to ``arrived``)."""
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
                    self.rates.append(len(frame) / elapsed)
                return None
            except PeerRequestError as e:
                if e.status is not None and 400 <= e.status < 500:
                    return str(e)  # refused: retrying the same frame cannot help
                if attempt == attempts - 1:
                    return str(e)
                await asyncio.sleep(RETRY_DELAY_S)
        return "unreachable"

    async def upload_all(
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
        """Upload ``frame`` to each of ``order``, starting one after another (``pace``), each
        in that peer's lane (``lane``): after the frames queued for it before, so that every
        peer gets this peer's frames in order, while a peer that answers nothing (stopped,
        asleep) holds up only its own. What went wrong with each (None: accepted); ``arrived``
        gets the time of each accepted upload. ``before(peer)`` runs in the lane first (a
        newcomer's catch-up); ``delivered()`` is called once every upload is done or those
        left are to peers no longer training the job (``gone``), so that a daemon stopped
        with SIGSTOP does not hold every other peer's frames (and the automatic cadence)
        behind its upload; ``lane_wait_s``: the most an upload waits for its lane (None: as
        long as it takes), after which it goes beside; ``deadline`` (monotonic): each upload
        gets what is left of it then, at least 1 s, instead of ``timeout_s``."""
        # Every lane is taken before anything is awaited: in the order the rounds came.
        lanes = [self.lane(job_id, p.id) for p in order]

        async def one(peer: PeerRef, lane: Lane) -> str | None:
            try:
                if lane.previous is not None:
                    try:
                        await asyncio.wait_for(asyncio.shield(lane.previous), lane_wait_s)
                    except TimeoutError:
                        log.info("job %s: a frame goes to %s beside the one still on its way",
                                 job_id, peer.id[:12])  # fmt: skip
                if peer.id not in self.round_peers.live_ids(job_id):
                    return "not sent: it no longer trains the job (dead or left)"
                if before is not None:
                    await before(peer)
                left = timeout_s if deadline is None else max(deadline - time.monotonic(), 1.0)
                return await self.upload(job_id, frame, peer, arrived, timeout_s=left,
                                         attempts=attempts)  # fmt: skip
            finally:
                lane.done()

        pace = self.pace(len(frame))
        uploads: list[asyncio.Task[str | None]] = []
        try:
            async with asyncio.TaskGroup() as tg:
                for p, lane in zip(order, lanes, strict=True):
                    uploads.append(task := tg.create_task(one(p, lane)))
                    await asyncio.wait({task}, timeout=pace)
                if delivered is not None:
                    await self.gone(job_id, order, uploads)
                    delivered()
        finally:  # all done by now; also those whose task was cancelled before it began
            for lane in lanes:
                lane.done()
        return [task.result() for task in uploads]

    def lane(self, job_id: str, peer_id: str) -> Lane:
        """A place in ``peer_id``'s queue of this peer's frames for ``job_id``, after the frame
        queued last; to be marked done once this one has been uploaded or given up."""
        key = (job_id, peer_id)
        previous = self._lanes.get(key)
        future = asyncio.get_running_loop().create_future()
        self._lanes[key] = future
        waits = None if previous is None or previous.done() else previous
        return Lane(self._lanes, key, future, waits)

    async def gone(
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
            if not self.round_peers.live_ids(job_id).intersection(left):
                return
            await asyncio.wait([t for t in uploads if not t.done()], timeout=GATE_CHECK_S)
