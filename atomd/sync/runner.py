"""The trainer-thread side of delta exchange for one job.

Every ``every`` steps the trainer calls ``after_step``: the plugin takes whatever deltas have
arrived (the inbox, filled by the event loop), merges them with this peer's own delta through
``SyncState`` (compress, outer step, reset the replica), encodes this peer's delta as a signed
frame and hands it to the loop to send. The trainer never waits for the network: deltas that
arrive late are merged at a later boundary (weighted by their staleness).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from atomd.logs import get_logger
from atomd.p2p.identity import Identity
from atomd.spec import SyncSpec
from atomd.sync.state import Contribution, MergeReport, Outgoing, SyncState
from atomd.sync.wire import encode_frame

if TYPE_CHECKING:
    from torch import Tensor

    from atomd.train.engine import StepEngine

log = get_logger(__name__)

STATE_PREFIX = "sync."


@dataclass(frozen=True)
class RoundOut:
    """What one round boundary produced, for the loop to send and record."""

    job_id: str
    step: int
    frame: bytes
    outgoing: Outgoing
    merge: MergeReport


class Inbox:
    """Decoded deltas waiting for the next round boundary (loop puts, trainer takes)."""

    def __init__(self, limit: int = 64) -> None:
        self._items: collections.deque[Contribution] = collections.deque(maxlen=limit)
        self._lock = threading.Lock()

    def put(self, c: Contribution) -> None:
        with self._lock:
            self._items.append(c)

    def take(self) -> list[Contribution]:
        with self._lock:
            items = list(self._items)
            self._items.clear()
        return items

    def __len__(self) -> int:
        return len(self._items)


class SyncPlugin:
    """Plugged into a ``Trainer``: rounds every ``spec.every`` steps."""

    def __init__(
        self,
        *,
        job_id: str,
        spec: SyncSpec,
        identity: Identity,
        n_peers: Callable[[], int],
        send: Callable[[RoundOut], None],
    ) -> None:
        self.job_id = job_id
        self.spec = spec
        self.identity = identity
        self.n_peers = n_peers
        self.send = send
        self.inbox = Inbox()
        self.state: SyncState | None = None

    def attach(self, engine: StepEngine) -> None:
        """Build the anchor from the engine's live parameters (host masters when swapping)."""
        params = {n: p for n, p in engine.model.named_parameters()}
        self.state = SyncState(params, self.spec, peer_id=self.identity.peer_id)

    @property
    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        assert self.state is not None
        return {n: tuple(t.shape) for n, t in self.state.anchor.items()}

    @property
    def version(self) -> int:
        return self.state.version if self.state is not None else 0

    def after_step(self, step: int) -> None:
        if self.state is None or step % self.spec.every:
            return
        inbox = self.inbox.take()
        out = self.state.round_boundary(inbox, n_peers=max(1, self.n_peers()))
        frame = encode_frame(
            identity=self.identity,
            job_id=self.job_id,
            round=out.round,
            base_version=out.base_version,
            tensors=out.tensors,
        )
        merge = self.state.last_merge
        log.info(
            "round %d at step %d: merged %d delta(s), refused %d; sending %d bytes (%.0fx)",
            out.round, step, len(merge.applied), len(merge.refused), len(frame), out.wire_ratio,
        )  # fmt: skip
        self.send(RoundOut(self.job_id, step, frame, out, merge))

    def state_tensors(self) -> dict[str, Tensor]:
        if self.state is None:
            return {}
        return {STATE_PREFIX + k: v for k, v in self.state.state_tensors().items()}

    def load_state_tensors(self, tensors: dict[str, Tensor]) -> bool:
        """Restore from a checkpoint's state tensors; False if it holds no sync state."""
        mine = {k[len(STATE_PREFIX) :]: v for k, v in tensors.items() if k.startswith(STATE_PREFIX)}
        if not mine or self.state is None:
            return False
        self.state.load_state_tensors(mine)
        return True

    def adopt(self) -> None:
        """After taking another peer's state: train from the swarm's anchor, send none of the
        donor's unsent residual (it is the donor's to send), so nothing is counted twice."""
        if self.state is None:
            return
        self.state.feedback.load_state_tensors({})
        self.state.reset_replica()
