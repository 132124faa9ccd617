"""What counts against a sender of deltas: the strikes the exchange reports to membership,
which quarantines a sender after enough of them (``atomd.p2p.quarantine``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from atomd.errors import WireError
from atomd.sync.job_peers import JobPeers

if TYPE_CHECKING:  # torch loads with the first swarm job, not when the daemon starts
    from atomd.sync.state import MergeReport

# Refusals of a signed frame that count against its sender: what no honest peer of the job
# sends. Staleness, replays and clocks do not count.
STRIKING_WIRE_ERRORS = frozenset({"wrong_codec", "wrong_shape", "non_finite"})


class SenderJudgment:
    """Passes each judged contribution of another peer on to the membership's ``judge``."""

    def __init__(self, peers: JobPeers) -> None:
        self.peers = peers

    async def merge(self, merge: MergeReport, own_id: str) -> None:
        """Every delta of a peer other than ``own_id`` (this one) that a merge applied (a
        strike if clipped hard), and every refusal the merge counts as a strike."""
        for a in merge.applied:
            if a.sender != own_id:
                await self.peers.judge(a.sender, a.strike, a.note)
        for r in merge.refused:
            if r.strike:
                await self.peers.judge(r.sender, True, r.reason)

    async def refused_frame(self, signer: str, error: WireError) -> None:
        """A frame signed by ``signer`` was refused: a strike if no honest peer sends it."""
        if error.reason in STRIKING_WIRE_ERRORS:
            await self.peers.judge(signer, True, str(error))
