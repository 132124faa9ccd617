"""Refused requests: counted per source, rate-limited, recorded as one aggregated event a minute.

A row per refused request would let an outsider grow the events table without bound (5,000
unsigned requests: 5,000 rows of up to 8 KB). A refusal costs a few counters in memory instead:
``Rejections.refused`` counts it by (plane, status, source); ``flush`` turns what was counted
since the last flush into one ``auth.rejected`` event (the totals and the 20 busiest sources),
and the daemon calls it once a minute. A source refused more than ``burst`` times, refilled at
``rate`` per second, is answered 429 before anything else is looked at (``retry_after``) until
it slows down.

Memory is bounded: at most ``max_sources`` sources are tracked (the least recently refused are
forgotten first). Event-loop only (no locks).
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

BURST = 30.0
RATE = 5.0  # refusals per second a source may keep up without being limited
MAX_SOURCES = 4096
TOP_SOURCES = 20


@dataclass
class _Bucket:
    tokens: float
    at: float


class Rejections:
    """Per-source limits and aggregated counts of refused requests."""

    def __init__(
        self,
        *,
        burst: float = BURST,
        rate: float = RATE,
        max_sources: int = MAX_SOURCES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.burst = burst
        self.rate = rate
        self.max_sources = max_sources
        self.clock = clock
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self._counts: Counter[tuple[str, int]] = Counter()  # (plane, status) -> n
        self._sources: Counter[str] = Counter()
        self._examples: dict[tuple[str, int], str] = {}  # one reason per (plane, status)
        self.limited_total = 0

    def _bucket(self, source: str) -> _Bucket:
        now = self.clock()
        b = self._buckets.get(source)
        if b is None:
            b = self._buckets[source] = _Bucket(self.burst, now)
            while len(self._buckets) > self.max_sources:
                self._buckets.popitem(last=False)
        else:
            b.tokens = min(self.burst, b.tokens + (now - b.at) * self.rate)
            b.at = now
            self._buckets.move_to_end(source)
        return b

    def retry_after(self, source: str) -> float | None:
        """Seconds ``source`` must wait (it was refused too often), or None."""
        b = self._buckets.get(source)
        if b is None:
            return None
        b = self._bucket(source)
        if b.tokens >= 1.0:
            return None
        self.limited_total += 1
        return (1.0 - b.tokens) / self.rate

    def refused(self, plane: str, source: str, status: int, reason: str) -> None:
        """Count one refusal (it takes a token of the source's bucket)."""
        b = self._bucket(source)
        b.tokens = max(0.0, b.tokens - 1.0)
        key = (plane, status)
        self._counts[key] += 1
        if len(self._sources) < self.max_sources or source in self._sources:
            self._sources[source] += 1
        self._examples.setdefault(key, reason[:200])

    def flush(self) -> tuple[str, dict[str, Any]] | None:
        """What was refused since the last flush, as (message, data) for one event; None if
        nothing was. Resets the counts (not the rate limits)."""
        if not self._counts:
            return None
        total = sum(self._counts.values())
        by = {f"{plane} {status}": n for (plane, status), n in sorted(self._counts.items())}
        top = dict(self._sources.most_common(TOP_SOURCES))
        examples = {f"{p} {s}": r for (p, s), r in self._examples.items()}
        message = (
            f"{total} request(s) refused: "
            + ", ".join(f"{k} x{n}" for k, n in by.items())
            + f"; from {len(self._sources)} source(s)"
        )
        self._counts.clear()
        self._sources.clear()
        self._examples.clear()
        return message, {"counts": by, "sources": top, "examples": examples}
