"""What the job manager needs from the swarm and from the delta exchange, and where it keeps
them: the daemon links both in after the manager is built (``atomd.daemon``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from atomd.p2p.messages import JobAdvert
from atomd.spec import JobSpec

if TYPE_CHECKING:  # torch loads when the first job trains, not when the daemon starts
    from atomd.p2p.transfer import Fetched
    from atomd.train.trainer import RoundPlugin


class SwarmLink(Protocol):
    """What the job manager needs from the swarm (``atomd.p2p.node.SwarmNode``)."""

    def announce(self, advert: JobAdvert) -> None: ...
    def broadcast_stop(self, job_id: str, run: int = 0) -> None: ...
    def latest_run(self, job_id: str) -> int: ...
    async def fetch_state(
        self,
        job_id: str,
        donors: list[str],
        root: Path,
        *,
        max_file_bytes: int | None = None,
        at_least: int = 0,
    ) -> Fetched | None: ...
    def distrust(self, donor: str) -> None: ...
    async def settled_donors(self, job_id: str, *, give_up: Callable[[], bool]) -> list[str]: ...


class DeltaLink(Protocol):
    """What the job manager needs from the delta exchange (``atomd.sync.exchange``)."""

    def expect(self, job_id: str, spec: JobSpec) -> None:
        """The job is about to train here: keep its frames until its plugin is attached."""
        ...

    def plugin(self, job_id: str, spec: JobSpec, *, may_retake: bool = False) -> RoundPlugin:
        """The trainer-thread side of the exchange for one swarm job."""
        ...

    def release(self, job_id: str) -> None:
        """The job no longer trains here."""
        ...


@dataclass
class JobLinks:
    """The swarm and the delta exchange (None: this daemon trains local jobs only), and the
    datasets its operator registered by name (name -> local path, ``ATOMD_DATA_NAMES``)."""

    swarm: SwarmLink | None = None
    exchange: DeltaLink | None = None
    data_names: dict[str, str] = field(default_factory=dict)
