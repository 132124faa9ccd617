"""Which members train which job, as heard from their adverts and their delta frames.

``Trainers`` answers the delta exchange (``atomd.sync.job_peers.JobPeers``) which peers train
a job, the dashboard with their loss curves, and a restarted daemon with the donors of its
job once membership can tell.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from atomd.config import Settings
from atomd.errors import PeerRequestError
from atomd.p2p import paths
from atomd.p2p.client import PeerClient
from atomd.p2p.membership import Member, Membership, PeerState
from atomd.p2p.messages import ProgressCurve
from atomd.p2p.quarantine import Quarantine

CURVE_TIMEOUT_S = 3.0  # one peer's loss curve, for the dashboard
# Peers asked for their loss curves at each dashboard refresh: the first heard training the
# job. Keys are free with the swarm secret alone, and 4,096 of them advertising the job make
# a refresh cost ~50 s of the event loop and 146 MB of JSON when all are asked.
MAX_CURVE_PEERS = 32
DONORS_TIMEOUT_S = 30.0  # a restarted daemon waits at most this long to hear who trains a job
# Members that count as training a job they were heard training (``Trainers.job_peers``).
LIVE_STATES: frozenset[PeerState] = frozenset({"alive", "suspect"})


class Trainers:
    """The job each known member was last heard training, and when."""

    def __init__(
        self,
        *,
        settings: Settings,
        membership: Membership,
        quarantine: Quarantine,
        client: PeerClient,
    ) -> None:
        self.settings = settings
        self.membership = membership
        self.quarantine = quarantine
        self.client = client
        self.joined = asyncio.Event()  # joined a swarm once, or there is nobody to join
        # job id -> peer id -> when we last heard that peer train it (monotonic seconds); a
        # known member's newest job only (``trains``)
        self._job_peers: dict[str, dict[str, float]] = {}
        self._job_of: dict[str, str] = {}  # peer id -> the job it was last heard training
        self._heard: set[str] = set()  # every member a message came from since we started

    def heard_from(self, sender: str) -> None:
        """A membership message came from ``sender`` (it says which job its sender trains)."""
        if self.membership.get(sender) is not None:  # bounded by the members we know
            self._heard.add(sender)

    def job_peers(self, job_id: str) -> list[Member]:
        """Live members heard training ``job_id`` recently (this daemon excluded).

        A *suspect* member counts as live here: suspicion is one missed probe, and on a full
        link (a slow upload busy with delta frames, whose queue delays the probe's answer) a
        training peer is suspected again and again. Leaving it out of the round would stop
        sending it deltas and drop its deltas from the round's count, each time (measured at
        256 kbit/s, 4 daemons: peers suspected every ~30 s, one declared dead for 45 s). Only
        ``dead`` (suspicion not refuted in time) and ``left`` take a member out."""
        window = max(15.0, 30 * self.settings.gossip_interval)
        now = time.monotonic()
        heard = self._job_peers.get(job_id, {})
        out = []
        for pid, at in tuple(heard.items()):  # the trainer thread calls this too
            m = self.membership.get(pid)
            fresh = now - at <= window
            live = m is not None and m is not self.membership.me and m.state in LIVE_STATES
            # A quarantined or banned member is neither sent deltas nor asked for state.
            if fresh and live and m is not None and not self.quarantine.excluded(pid):
                out.append(m)
        return out

    def heard(self, job_id: str, peer_id: str) -> None:
        """A delta frame of ``job_id`` signed by ``peer_id`` came from it and passed the frame's
        checks (the exchange says so): the member is alive and trains the job, as its next
        probe and advert would say, which a settled swarm then need not send (``Swim``)."""
        m = self.membership.get(peer_id)
        if m is None or m is self.membership.me or m.state not in LIVE_STATES:
            return  # bounded by the members we know; a dead one must rejoin first
        self.membership.heard(peer_id)
        self._heard.add(peer_id)
        self.trains(job_id, peer_id)

    def trains(self, job_id: str, peer_id: str) -> None:
        """``peer_id`` was heard training ``job_id`` just now (its advert, or its frame). A
        peer trains one job at a time, and only known members count (``job_peers``): so this
        holds at most one entry a member, however many job ids a member advertises."""
        if self.membership.get(peer_id) is None:
            return
        before = self._job_of.get(peer_id)
        if before is not None and before != job_id:
            others = self._job_peers.get(before, {})
            others.pop(peer_id, None)
            if not others:
                self._job_peers.pop(before, None)
        self._job_of[peer_id] = job_id
        self._job_peers.setdefault(job_id, {})[peer_id] = time.monotonic()

    async def peer_curves(
        self, job_id: str
    ) -> tuple[list[tuple[Member, ProgressCurve | str]], int]:
        """The loss curve of ``job_id`` from the first ``MAX_CURVE_PEERS`` live peers heard
        training it, asked at once (each within ``CURVE_TIMEOUT_S``), for a peer that did not
        answer why; and how many more train it (not asked)."""
        peers = self.job_peers(job_id)
        asked, left_out = peers[:MAX_CURVE_PEERS], max(0, len(peers) - MAX_CURVE_PEERS)

        async def one(m: Member) -> tuple[Member, ProgressCurve | str]:
            try:
                curve = await self.client.get(
                    m.url, paths.job_progress(job_id), ProgressCurve, target=m.id,
                    timeout=CURVE_TIMEOUT_S,
                )  # fmt: skip
            except PeerRequestError as e:
                return m, str(e)[:300]
            return m, curve

        return list(await asyncio.gather(*(one(m) for m in asked))), left_out

    def job_donors(self, job_id: str) -> list[str]:
        """The URLs of the live members heard training ``job_id`` (``job_peers``)."""
        return [m.url for m in self.job_peers(job_id)]

    async def settled_donors(
        self, job_id: str, *, give_up: Callable[[], bool], timeout: float = DONORS_TIMEOUT_S
    ) -> list[str]:
        """The donors of ``job_id`` once membership can tell, for a daemon that has just
        started: once it has joined (or has nobody to join), as soon as one live member says it
        trains the job, or once every live member has sent us a message (each carries the job
        its sender trains) and none does. Empty if ``give_up()`` (the daemon stops);
        ``timeout`` bounds the wait on seeds and members that never answer."""
        deadline = time.monotonic() + timeout
        while not give_up():
            if self.joined.is_set():
                donors = self.job_donors(job_id)
                live = {m.id for m in self.membership.others("alive")}
                if donors or live <= self._heard or time.monotonic() >= deadline:
                    return donors
            elif time.monotonic() >= deadline:
                return []
            await asyncio.sleep(0.1)
        return []
