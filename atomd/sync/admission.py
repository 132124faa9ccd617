"""Receiving peers' frames: each is checked whole, off the event loop, before it is queued in
the job's plugin inbox; one that comes while the job still fetches its state is kept, bounded,
and checked once the job's plugin is attached."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from atomd.errors import AtomdError, NotFoundError, PeerAuthError, WireError
from atomd.logs import get_logger
from atomd.sync.job_peers import JobPeers, RoundPeers
from atomd.sync.job_table import JobTable
from atomd.sync.judgment import SenderJudgment
from atomd.sync.records import RoundRecords
from atomd.telemetry import Telemetry

if TYPE_CHECKING:  # torch loads with the first swarm job, not when the daemon starts
    from torch import Tensor

    from atomd.sync.replay import ReplayGuard
    from atomd.sync.runner import SyncPlugin
    from atomd.sync.wire import DeltaFrame

log = get_logger(__name__)

FEED_CHUNK = 1 << 20  # bytes handed to the decoder at a time
# Frames kept per sender while the job fetches its state (the oldest goes first), and senders:
# the inbox's bounds (``runner.Inbox``).
EARLY_PER_SENDER = 4
EARLY_MAX_SENDERS = 256
# ... and their bytes in all, in the largest frames the job takes (each about its fp32 model).
EARLY_MAX_FRAMES = 8


class EarlyFrames:
    """Per job and sender, the frames that came before the job's plugin was attached."""

    def __init__(self) -> None:
        # job -> sender -> bodies, oldest first
        self.frames: dict[str, dict[str, deque[bytes]]] = {}

    def keep(self, job_id: str, signer: str, body: bytes, max_bytes: int) -> None:
        """Keep ``body``: at most EARLY_PER_SENDER of each sender, EARLY_MAX_SENDERS senders
        and ``max_bytes`` in all (the sender holding the most gives its oldest up first)."""
        senders = self.frames.setdefault(job_id, {})
        q = senders.get(signer)
        if q is None:
            if len(senders) >= EARLY_MAX_SENDERS:
                raise NotFoundError(f"job {job_id} is not training here yet")
            q = senders[signer] = deque(maxlen=EARLY_PER_SENDER)
        q.append(body)
        held = {who: sum(map(len, kept)) for who, kept in senders.items()}
        while sum(held.values()) > max_bytes:
            most = max(held, key=held.__getitem__)
            held[most] -= len(senders[most].popleft())
            if not senders[most]:
                del senders[most], held[most]

    def take(self, job_id: str) -> dict[str, deque[bytes]]:
        """The frames kept for ``job_id``, now forgotten here."""
        return self.frames.pop(job_id, {})


class FrameAdmission:
    """Checks the frames that arrive and queues them in their job's plugin inbox."""

    def __init__(
        self,
        *,
        peers: JobPeers,
        trains: Callable[[str], bool],
        jobs: JobTable,
        round_peers: RoundPeers,
        records: RoundRecords,
        judgment: SenderJudgment,
        telemetry: Telemetry,
    ) -> None:
        self.peers = peers
        self.trains = trains
        self.jobs = jobs
        self.round_peers = round_peers
        self.records = records
        self.judgment = judgment
        self.telemetry = telemetry
        self.early = EarlyFrames()
        self._replay_guard: ReplayGuard | None = None

    async def receive(self, job_id: str, body: bytes, signer: str) -> int:
        """Check and queue one frame for the job's plugin; returns its size. Raises
        ``WireError`` (recorded) or ``NotFoundError``. Nothing reaches the model unless every
        check passed."""
        why = self.peers.exclusion(signer)
        if why is not None:  # refused before anything is decoded; counted, not recorded a row
            self.telemetry.rounds.labels("received", "false").inc()
            raise PeerAuthError(f"peer {signer} is {why}", status=403)
        if not self.jobs.expected(job_id) or not self.trains(job_id):
            raise NotFoundError(f"not training job {job_id} here")
        plugin = self.jobs.plugins.get(job_id)
        if plugin is None or plugin.state is None:  # checked once the plugin is attached
            return self._keep_early(job_id, signer, body)
        return await self.accept(job_id, plugin, body, signer)

    def _keep_early(self, job_id: str, signer: str, body: bytes) -> int:
        """Keep a frame that came while the job fetches its state, to be checked once it is
        attached (``drain_early``): lost, its delta would be in every anchor but this one's.
        Only from a known member (keys are free: fresh keys would take every place), and at
        most EARLY_MAX_FRAMES frames' worth of bytes in all (``EarlyFrames``)."""
        if self.peers.public_key(signer) is None:
            raise WireError("unknown_sender", f"sender {signer} is not a known peer")
        cap = EARLY_MAX_FRAMES * self.jobs.max_frame_bytes(job_id)
        self.early.keep(job_id, signer, body, cap)
        return len(body)

    async def drain_early(self, job_id: str) -> None:
        """The frames kept while the job fetched its state, checked and queued as if they came
        now (its plugin is attached; the state it took refuses the deltas it holds already)."""
        senders = self.early.take(job_id)
        plugin = self.jobs.plugins.get(job_id)
        if plugin is None or plugin.state is None:
            return
        kept = 0
        for signer, bodies in senders.items():
            for body in bodies:
                if self.peers.exclusion(signer) is not None:
                    break
                try:
                    await self.accept(job_id, plugin, body, signer, fresh=False)
                    kept += 1
                except AtomdError as e:
                    log.info("a frame from %s kept during the state transfer: %s", signer, e)
        if kept:
            log.info("job %s: %d frame(s) that came during the state transfer queued", job_id,
                     kept)  # fmt: skip

    async def accept(
        self, job_id: str, plugin: SyncPlugin, body: bytes, signer: str, *, fresh: bool = True
    ) -> int:
        """Check one frame whole (off the loop) and queue it in ``plugin``'s inbox. ``fresh``:
        it came just now (not kept during a state transfer), so its sender is alive now."""
        from atomd.sync.frame_decoder import FrameDecoder, check_codec, decode_tensors
        from atomd.sync.intake import Contribution
        from atomd.sync.replay import ReplayGuard

        codec = plugin.spec.codec
        if self._replay_guard is None:
            self._replay_guard = ReplayGuard()
        decoder = FrameDecoder(
            job_id=job_id,
            public_key_of=self.peers.public_key,
            expected_shapes=plugin.expected_shapes,
            max_bytes=self.jobs.max_frame_bytes(job_id),
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
            await self.records.refused_frame(job_id, signer, len(body), str(e))
            await self.judgment.refused_frame(signer, e)
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
        self.records.note_received(job_id, frame.sender, frame.round, frame.wire_bytes, every)
        if frame.cadence is not None:
            plugin.heard(frame.sender, frame.cadence.period_s)
        if frame.final:
            self.round_peers.finished(job_id, frame.sender, frame.base_version)
        c = Contribution(frame.sender, frame.round, frame.base_version, tensors, every)
        out = plugin.inbox.put(c)
        if out is not None:  # never merged, so never reported: its record goes too
            self.records.forget_received(job_id, out.sender, out.round)
            if out is c:
                log.warning("inbox of job %s full: a delta from %s dropped", job_id, signer)
        return frame.wire_bytes
