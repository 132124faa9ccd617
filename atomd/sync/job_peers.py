"""Who a swarm job's rounds involve: the peers the exchange sends to, waits for and follows.

The membership (``atomd.p2p.node.SwarmNode``) says which live peers train a job; the
exchange sees it through ``JobPeers`` and the job manager through ``TrainingJobs``.
``RoundPeers`` adds what the rounds themselves tell: which peers have sent their last delta
(they train no more) and which have gone silent (no delta of theirs applied for a while).
``round_targets`` is the one place that decides which peers a round's frame goes to.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

# Rounds, beyond the job's max_staleness, after which a peer none of whose deltas a merge
# applied stops counting among the peers a round waits for (``RoundPeers.counted``).
SILENT_ROUNDS = 2


class PeerRef(Protocol):
    """A peer as the exchange sees it."""

    @property
    def id(self) -> str: ...
    @property
    def url(self) -> str: ...


class JobPeers(Protocol):
    """Which peers train a job (the membership: ``atomd.p2p.node.SwarmNode``)."""

    def job_peers(self, job_id: str) -> Sequence[PeerRef]:
        """Live peers heard training ``job_id`` recently, this daemon excluded."""
        ...

    def public_key(self, peer_id: str) -> str | None:
        """The Ed25519 public key (hex) of a known peer, None if unknown."""
        ...

    def exclusion(self, peer_id: str) -> str | None:
        """Why this daemon takes no delta from ``peer_id`` now (quarantined or banned: see
        ``atomd.p2p.quarantine``), or None."""
        ...

    def heard(self, job_id: str, peer_id: str) -> None:
        """A frame of ``job_id`` signed by ``peer_id`` came from it just now and passed the
        frame's checks (signature, codec, shapes, finite values; not yet the robust rule): it
        is alive and trains the job (membership need not probe it meanwhile)."""
        ...

    async def judge(self, sender: str, strike: bool, reason: str | None) -> None:
        """One judged contribution of ``sender`` (``strike``: refused or clipped hard, or a
        frame no honest peer sends); enough strikes quarantine it."""
        ...


class TrainingJobs(Protocol):
    """Whether this daemon trains a swarm job now (the job manager: ``atomd.jobs``)."""

    def trains(self, job_id: str) -> bool: ...


def round_targets(members: Sequence[PeerRef], round: int) -> list[PeerRef]:
    """The peers that round ``round``'s frame goes to, out of the job's live ``members``.

    Every member: also one that has sent its last delta, which follows the rounds the others
    still train (``JobEnding._follow``) until it ends the job. This is the one decision point
    for sending to a bounded group of peers a round instead (gossip averaging)."""
    del round  # every round goes to every member
    return list(members)


class RoundPeers:
    """Per job, the live members seen through its rounds: who still trains, who finished,
    and who a round waits for (not silent)."""

    def __init__(self, peers: JobPeers) -> None:
        self.peers = peers
        # job -> peer -> the base version of its last delta for the job: it trains no more and
        # counts in no later round's average, but is still sent the frames of the rounds the
        # others train (it follows them until it ends the job).
        self._finished: dict[str, dict[str, int]] = {}
        # job -> peer -> the round its silence counts from: the base version at which it was
        # first counted, raised by every merge here that applied a delta of it (``counted``).
        self._counted_from: dict[str, dict[str, int]] = {}

    def targets(self, job_id: str, round: int) -> list[PeerRef]:
        """The peers round ``round``'s frame goes to (``round_targets``)."""
        return round_targets(self.peers.job_peers(job_id), round)

    def live_ids(self, job_id: str) -> set[str]:
        """The ids of the live peers training ``job_id`` now."""
        return {p.id for p in self.peers.job_peers(job_id)}

    def finished(self, job_id: str, peer_id: str, base_version: int) -> None:
        """``peer_id`` sent its last delta for ``job_id``, on ``base_version``."""
        self._finished.setdefault(job_id, {})[peer_id] = base_version

    def training(self, job_id: str, base_version: int) -> list[PeerRef]:
        """The peers of ``job_id`` in its round on ``base_version``: live, and not done with the
        job before that round (a peer's last delta says which round was its last)."""
        last = self._finished.get(job_id, {})
        return [
            p for p in self.peers.job_peers(job_id) if last.get(p.id, base_version) >= base_version
        ]

    def finishers(self, job_id: str) -> list[str]:
        """The live peers of ``job_id`` that have sent their last delta for it."""
        last = self._finished.get(job_id, {})
        return [p.id for p in self.peers.job_peers(job_id) if p.id in last]

    def counted(self, job_id: str, base_version: int, max_staleness: int) -> list[PeerRef]:
        """The peers whose deltas the round on ``base_version`` waits for (``n_peers``; a round
        is the mean of the deltas it gets, whoever is counted: ``SyncState._close``): those
        training it (``training``) that are not silent. A peer is silent once
        ``SILENT_ROUNDS`` + max_staleness rounds have passed here without a delta of it that
        a merge applied (refused ones, stale ones and ones clipped hard enough to count as a
        strike do not count), counted from the later of the round it was first counted in and
        the merge that applied its newest. It is still sent every frame; it counts again with
        its next applied delta. Counted by the adverts alone, a member that trains but sends
        nothing (broken, or hostile), or nothing a merge takes, would make every round wait
        for one more delta; so would a killed peer until membership declares it dead."""
        grace = SILENT_ROUNDS + max_staleness
        since = self._counted_from.setdefault(job_id, {})
        return [
            p
            for p in self.training(job_id, base_version)
            if base_version - since.setdefault(p.id, base_version) <= grace
        ]

    def applied(self, job_id: str, version: int, senders: Iterable[str]) -> None:
        """A merge here, at ``version``, applied a delta of each of ``senders``: their silence
        counts from ``version`` on."""
        since = self._counted_from.setdefault(job_id, {})
        for sender in senders:
            since[sender] = max(version, since.get(sender, version))

    def forget_counted(self, job_id: str) -> None:
        """Silence counts afresh (the job's state was restored at another version). A dict's
        pop: atomic, as ``counted``'s own writes from the trainer thread."""
        self._counted_from.pop(job_id, None)

    def release(self, job_id: str) -> None:
        """The job no longer trains here."""
        self._finished.pop(job_id, None)
        self._counted_from.pop(job_id, None)
