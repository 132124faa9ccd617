"""Who this daemon no longer takes deltas from: quarantined members and banned keys.

A *strike* is a contribution the robust merge refused or clipped hard (``atomd.sync.robust``),
or that the loss guard rolled back (``atomd.sync.guard``): something no honest peer sends.
A member with ``strikes`` strikes among its last ``window`` judged contributions is
*quarantined* for ``hold_s`` seconds: its frames are refused before they are decoded, its
deltas leave every merge, it is neither sent deltas nor asked for state, and ``/v1/peers``
shows it with the reason. After the hold it starts again with a clean record (a broken peer
that was fixed comes back by itself; a hostile one is quarantined again after ``strikes`` more).
Quarantines are persisted by the node (table ``peer_quarantines``) and ``restore``d at start:
a restart does not lift one, nor extend it.

A *ban* is the operator's: by public key, persisted (table ``peer_bans``), until unbanned. A
banned key is refused on the whole peer plane (403 before any body is read). Unbanning also
ends a quarantine of that key.

Thread-safe: the trainer thread reports strikes, the event loop asks.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

STRIKES = 3
WINDOW = 10
HOLD_S = 3600.0
MAX_TRACKED = 4096  # members with a record: the oldest are forgotten past this


@dataclass(frozen=True)
class Verdict:
    """Why a member is excluded: ``kind`` "banned" or "quarantined", and the reason."""

    kind: str
    reason: str
    until: float | None  # unix time a quarantine ends (None: a ban, until unbanned)


class Quarantine:
    """Strike records by peer id, the quarantined, and the banned keys."""

    def __init__(
        self,
        *,
        strikes: int = STRIKES,
        window: int = WINDOW,
        hold_s: float = HOLD_S,
        key_of: Callable[[str], str | None] = lambda _pid: None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``key_of``: the public key (hex) of a peer id, so that a ban by key reaches it."""
        if not 1 <= strikes <= window:
            raise ValueError(f"need 1 <= strikes <= window, got {strikes}, {window}")
        self.strikes = strikes
        self.window = window
        self.hold_s = hold_s
        self.key_of = key_of
        self.clock = clock
        self._lock = threading.Lock()
        self._records: dict[str, deque[bool]] = {}
        self._last_reason: dict[str, str] = {}
        self._held: dict[str, Verdict] = {}  # peer id -> quarantine
        self._held_key: dict[str, str] = {}  # peer id -> its key when quarantined (if known)
        self._banned: dict[str, str] = {}  # public key -> reason

    # -- the merge's reports -------------------------------------------------------------------

    def judged(self, peer_id: str, strike: bool, reason: str | None = None) -> Verdict | None:
        """Record one judged contribution of ``peer_id``; the new quarantine if this strike
        puts it there, else None."""
        with self._lock:
            if peer_id in self._held:
                return None
            record = self._records.setdefault(peer_id, deque(maxlen=self.window))
            record.append(strike)
            if strike and reason:
                self._last_reason[peer_id] = reason
            if len(self._records) > MAX_TRACKED:
                oldest = next(iter(self._records))
                self._records.pop(oldest, None)
                self._last_reason.pop(oldest, None)
            n = sum(record)
            if n < self.strikes:
                return None
            last = self._last_reason.get(peer_id, "refused")
            verdict = Verdict(
                "quarantined",
                f"{n} of its last {len(record)} deltas refused or clipped hard "
                f"(last: {last[:200]})",
                self.clock() + self.hold_s,
            )
            self._held[peer_id] = verdict
            key = self.key_of(peer_id)
            if key is not None:
                self._held_key[peer_id] = key
            self._records.pop(peer_id, None)
            return verdict

    def restore(self, peer_id: str, public_key: str | None, reason: str, until: float) -> None:
        """A quarantine as stored (at start): it runs until ``until`` (unix time), as before."""
        with self._lock:
            self._held[peer_id] = Verdict("quarantined", reason, until)
            if public_key is not None:
                self._held_key[peer_id] = public_key
            self._records.pop(peer_id, None)

    def held_key(self, peer_id: str) -> str | None:
        """The key of a quarantined member (as known when it was quarantined), or None."""
        with self._lock:
            return self._held_key.get(peer_id)

    # -- the operator's ------------------------------------------------------------------------

    def set_bans(self, bans: dict[str, str]) -> None:
        """Every banned key (lowercase hex) with its reason, as stored."""
        with self._lock:
            self._banned = dict(bans)

    def ban(self, public_key: str, reason: str) -> None:
        with self._lock:
            self._banned[public_key] = reason

    def unban(self, public_key: str) -> list[str]:
        """Lift a ban, and end any quarantine of a member with that key; the members whose
        quarantine ended."""
        with self._lock:
            self._banned.pop(public_key, None)
            ended = [p for p in self._held if public_key in (self.key_of(p), self._held_key.get(p))]
            for pid in ended:
                del self._held[pid]
                self._held_key.pop(pid, None)
                self._records.pop(pid, None)
            return ended

    def is_banned_key(self, public_key: str) -> bool:
        return public_key in self._banned

    # -- questions -----------------------------------------------------------------------------

    def verdict(self, peer_id: str) -> Verdict | None:
        """Why ``peer_id`` is excluded now (banned or quarantined), or None."""
        key = self.key_of(peer_id)
        with self._lock:
            if key is not None and key in self._banned:
                return Verdict("banned", self._banned[key] or "banned by the operator", None)
            v = self._held.get(peer_id)
            if v is None:
                return None
            if v.until is not None and self.clock() >= v.until:
                del self._held[peer_id]
                self._held_key.pop(peer_id, None)
                return None
            return v

    def excluded(self, peer_id: str) -> bool:
        return self.verdict(peer_id) is not None
