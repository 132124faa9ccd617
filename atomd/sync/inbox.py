"""Decoded deltas waiting for the trainer thread's next look (the event loop puts them)."""

from __future__ import annotations

import collections
import threading

from atomd.sync.intake import Contribution


class Inbox:
    """Decoded deltas waiting for the next round boundary (loop puts, trainer takes).

    Bounded per sender: at most ``per_sender`` deltas of one sender wait (its oldest goes when
    it sends more), and at most ``max_senders`` senders have deltas waiting (a new sender's
    delta is refused when all are taken), so one member sending many frames cannot push out
    the other peers' deltas. An honest peer sends one delta per round."""

    def __init__(self, per_sender: int = 4, max_senders: int = 256) -> None:
        if per_sender < 1 or max_senders < 1:
            raise ValueError("per_sender and max_senders must be >= 1")
        self.per_sender = per_sender
        self.max_senders = max_senders
        self._items: dict[str, collections.deque[Contribution]] = {}
        self._lock = threading.Lock()
        self.dropped = 0  # deltas pushed out or refused by the bounds

    def put(self, c: Contribution) -> Contribution | None:
        """Queue ``c``. Returns the delta that leaves instead, if one does: ``c`` itself when
        it is refused (too many senders waiting), or the sender's oldest, pushed out."""
        with self._lock:
            q = self._items.get(c.sender)
            if q is None:
                if len(self._items) >= self.max_senders:
                    self.dropped += 1
                    return c
                q = self._items[c.sender] = collections.deque(maxlen=self.per_sender)
            out = q[0] if len(q) == q.maxlen else None
            if out is not None:
                self.dropped += 1
            q.append(c)
            return out

    def take(self) -> list[Contribution]:
        with self._lock:
            items = [c for q in self._items.values() for c in q]
            self._items.clear()
        return items

    def senders(self, base_version: int) -> set[str]:
        """The senders of the deltas waiting on base version ``base_version``."""
        with self._lock:
            return {c.sender for q in self._items.values() for c in q
                    if c.base_version == base_version}  # fmt: skip

    def drop_sender(self, sender: str) -> int:
        """Forget what ``sender`` has waiting (it was quarantined); how many deltas that was."""
        with self._lock:
            q = self._items.pop(sender, None)
        return len(q) if q else 0

    def __len__(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._items.values())
