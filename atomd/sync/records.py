"""The record of every delta sent or received: ``sync_rounds`` rows and the metrics."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from atomd.db import repo
from atomd.logs import get_logger
from atomd.telemetry import Telemetry

log = get_logger(__name__)

# Frames refused from one sender that are recorded a row each in REFUSAL_WINDOW_S
# (``RefusalRows``).
REFUSAL_ROWS = 30
REFUSAL_WINDOW_S = 60.0
REFUSAL_SENDERS = 256  # (job, sender) windows kept before those of past minutes are pruned


@dataclass(frozen=True)
class Row:
    """One delta sent or received, as ``sync_rounds`` records it."""

    round: int
    direction: str
    peer_id: str
    bytes: int
    staleness: int | None
    applied: bool
    reason: str | None
    every: int | None = None  # steps the sender's round lasted


class RefusalRows:
    """Whether a frame refused from a sender gets a row in the job's rounds: at most
    REFUSAL_ROWS a minute a sender (each is still counted in /metrics), so that a member
    sending junk frames, refused without a strike, does not write a row each without end."""

    def __init__(self) -> None:
        # (job, sender) -> (start of its minute, refused frames recorded in it)
        self.windows: dict[tuple[str, str], tuple[float, int]] = {}

    def may_record(self, job_id: str, signer: str) -> bool:
        """Count one refused frame of ``signer``: whether it gets a row."""
        now = time.monotonic()
        if len(self.windows) > REFUSAL_SENDERS:  # senders of past windows go
            self.windows = {k: v for k, v in self.windows.items() if now - v[0] < REFUSAL_WINDOW_S}
        start, n = self.windows.get((job_id, signer), (now, 0))
        if now - start >= REFUSAL_WINDOW_S:
            start, n = now, 0
        self.windows[(job_id, signer)] = (start, n + 1)
        if n == REFUSAL_ROWS:
            log.warning("job %s: more than %d frames of %s refused this minute; the rest are "
                        "counted, not recorded", job_id, REFUSAL_ROWS, signer)  # fmt: skip
        return n < REFUSAL_ROWS


class RoundRecords:
    """The one place a delta sent or received is written down; also what is known of each
    received frame until its merge reports it (its size and its sender's round length)."""

    def __init__(
        self,
        *,
        sessions: async_sessionmaker[AsyncSession],
        telemetry: Telemetry,
        codec_of: Callable[[str], str],
    ) -> None:
        self.sessions = sessions
        self.telemetry = telemetry
        self.codec_of = codec_of
        self.refusals = RefusalRows()
        # (job, sender, round) -> (frame bytes, the sender's round length in steps): recorded
        # when the plugin merges the delta.
        self.received: dict[tuple[str, str, int], tuple[int, int | None]] = {}

    def note_received(
        self, job_id: str, sender: str, round: int, size: int, every: int | None
    ) -> None:
        """A frame of ``sender`` for ``round`` is queued for the job's next merge."""
        self.received[(job_id, sender, round)] = (size, every)

    def forget_received(self, job_id: str, sender: str, round: int) -> None:
        """That frame will never be merged (pushed out of the inbox): nothing to record."""
        self.received.pop((job_id, sender, round), None)

    def merged_row(
        self,
        job_id: str,
        sender: str,
        round: int,
        staleness: int | None,
        applied: bool,
        reason: str | None,
    ) -> Row:
        """The row of a received delta a merge applied or refused."""
        size, every = self.received.pop((job_id, sender, round), (0, None))
        return Row(round, "received", sender, size, staleness, applied, reason, every)

    def drop_sender(self, peer_id: str) -> None:
        """Forget what is noted of ``peer_id``'s frames (their deltas leave the inboxes)."""
        for key in [k for k in self.received if k[1] == peer_id]:
            del self.received[key]

    def release(self, job_id: str) -> None:
        """The job no longer trains here."""
        for key in [k for k in self.received if k[0] == job_id]:
            del self.received[key]

    async def refused_frame(self, job_id: str, signer: str, size: int, error: str) -> None:
        """A frame of ``signer`` refused before it was queued: a row (within ``RefusalRows``),
        or only counted."""
        if self.refusals.may_record(job_id, signer):
            row = Row(-1, "received", signer, size, None, False, error)
            await self.record(job_id, [row], ratio_of=0)
        else:
            self.telemetry.rounds.labels("received", "false").inc()

    async def record(self, job_id: str, rows: Sequence[Row], *, ratio_of: int) -> None:
        """Write ``rows`` down (``sync_rounds``, metrics). ``ratio_of``: the fp32 bytes each
        row's ``bytes`` is compared with."""
        if not rows:
            return
        codec = self.codec_of(job_id)
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
