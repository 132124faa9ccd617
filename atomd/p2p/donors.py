"""The state of a running job fetched from its donors, and the donors that lied.

``Donors`` fetches the newest state of a job from the first donor that delivers it whole
(``atomd.p2p.transfer``), checks the donor's signed manifest against the member at its URL,
counts the donor as training the job from then on, and adds what the job's other members
last measured, for the joiner's check of the state.
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

from atomd.p2p.client import PeerClient
from atomd.p2p.membership import Membership
from atomd.p2p.trainers import Trainers
from atomd.p2p.transfer import Fetched, fetch_state

# Validation losses of the job's other members (the donor aside) a joiner needs before it
# checks a fetched state against them: of two, the higher median is the larger, so one lying
# member cannot lower it below an honest one's.
CLAIM_QUORUM = 2


class Donors:
    """State transfer from the members that train a job; the donors not asked again."""

    def __init__(self, *, client: PeerClient, membership: Membership, trainers: Trainers) -> None:
        self.client = client
        self.membership = membership
        self.trainers = trainers
        self._liars: set[str] = set()  # donor URLs whose state transfer lied: not asked again

    async def fetch_state(
        self,
        job_id: str,
        donors: list[str],
        root: Path,
        *,
        max_file_bytes: int | None = None,
        at_least: int = 0,
    ) -> Fetched | None:
        """The newest state of ``job_id`` from the first donor that delivers it whole, with what
        the job's other members last measured (``Fetched.claimed_val``: the higher median of
        their newest validation losses, from at least CLAIM_QUORUM of them: one lying member
        cannot lower it, and so cannot have an honest donor's state refused)."""
        got = await fetch_state(
            self.client, donors, job_id, root, max_file_bytes=max_file_bytes,
            liars=self._liars, key_at=self._key_at, at_least=at_least,
        )  # fmt: skip
        if got is None:
            return None
        # The donor trains the job (it served its live state): counted in the rounds from now
        # on. A restarted peer whose membership has not yet heard any member train it would
        # count itself alone, and a peer alone commits its whole delta where the others commit
        # what it sends (measured with 4 real daemons killed and restarted: settled anchors
        # 0.0097 apart).
        url = got.donor.rstrip("/")
        donor = next((m for m in self.membership.others("alive", "suspect") if m.url == url), None)
        if donor is not None:
            self.trainers.trains(job_id, donor.id)
            got = dataclasses.replace(got, donor_id=donor.id)
        answers, _ = await self.trainers.peer_curves(job_id)
        claims = [
            last
            for m, curve in answers
            if m.url != url and not isinstance(curve, str)
            for last in [
                next((p.val_loss for p in reversed(curve.points) if p.val_loss is not None), None)
            ]
            if last is not None
        ]
        if len(claims) < CLAIM_QUORUM:
            return got
        return dataclasses.replace(got, claimed_val=statistics.median_high(claims))

    def distrust(self, donor: str) -> None:
        """A state ``donor`` gave was refused (``DonorStateError``): it is not asked again."""
        self._liars.add(donor)

    def _key_at(self, url: str, signer: str) -> tuple[str, str] | None:
        """The member ``signer`` if it is at the donor URL: (peer id, public key), for its
        signed manifest (``transfer.KeyAt``)."""
        m = self.membership.get(signer)
        if m is None or m is self.membership.me or m.url != url.rstrip("/"):
            return None
        return m.id, m.public_key
