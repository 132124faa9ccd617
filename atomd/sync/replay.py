"""The replay guard: the frames a peer accepted recently, so that none is taken twice."""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict

from atomd.errors import WireError
from atomd.sync.wire import MAX_AGE_S


class ReplayGuard:
    """Frames accepted recently, by (job, sender, round, base_version) and by signature.

    Holds at most ``max_entries``; when full the oldest goes early, and since a replay of it could
    then pass, every frame of its sender created no later than it is refused too. The floor is
    per sender: with one floor for all, a member that sent ``max_entries`` frames dated a minute
    ahead would have every honest frame of the next minute refused as a replay. A sender's
    floor is forgotten once it is older than ``max_age_s`` (the decoders' limit: a frame created
    before it is refused as stale anyway), so floors do not pile up."""

    def __init__(self, *, max_entries: int = 10_000, max_age_s: float = MAX_AGE_S) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        # key -> (signature, created_at); insertion order is acceptance order.
        self._frames: OrderedDict[tuple[str, str, int, int], tuple[str, float]] = OrderedDict()
        self._signatures: set[str] = set()
        self._floor: dict[str, float] = {}  # sender -> created_at of its newest forgotten early
        # Decoders may finish in worker threads; check-and-record must be atomic.
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._frames)

    def record(
        self,
        *,
        job_id: str,
        sender: str,
        round: int,
        base_version: int,
        signature: str,
        created_at: float,
        now: float | None = None,
    ) -> None:
        """Remember a frame; ``WireError("replayed")`` if it, or its key, may have been seen."""
        key = (job_id, sender, round, base_version)
        with self._lock:
            if key in self._frames or signature in self._signatures:
                raise WireError(
                    "replayed",
                    f"a frame from {sender} for round {round}, base version {base_version} "
                    "was already received; expected each (round, base version) once",
                )
            floor = self._floor.get(sender, -math.inf)
            if created_at <= floor:
                raise WireError(
                    "replayed",
                    f"cannot rule out a replay of a frame of {sender} created at "
                    f"{created_at:.6f} (too many recent frames); expected one created after "
                    f"{floor:.6f}",
                )
            self._frames[key] = (signature, created_at)
            self._signatures.add(signature)
            if len(self._frames) > self.max_entries:
                (_, old_sender, _, _), (old_sig, old_at) = self._frames.popitem(last=False)
                self._signatures.discard(old_sig)
                self._floor[old_sender] = max(self._floor.get(old_sender, -math.inf), old_at)
                if len(self._floor) > self.max_entries:
                    horizon = (time.time() if now is None else now) - self.max_age_s
                    self._floor = {p: t for p, t in self._floor.items() if t >= horizon}
