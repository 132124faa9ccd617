"""Where the swarm's rounds are, as the deltas a peer receives claim them.

``SwarmPace`` keeps each sender's newest claimed round, the senders whose delta of a round
came and will not come again, and whether this peer, once with the swarm, was cut off and
found the swarm gone on without it. ``SyncPlugin`` closes rounds early, holds them, or takes
the swarm's state again by what it says.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection

from atomd.sync.robust import lower_median

# A round claimed further ahead than this counts for nothing in ``rounds_behind``: no honest
# peer runs that far ahead of a live swarm (a joiner takes the donor's version).
MAX_CLAIM_AHEAD = 64
# A sender's claim counts in ``rounds_ahead`` while it sent a delta within this many of this
# peer's rounds: a peer that stopped sending (gone) holds nobody back for long.
CLAIM_FRESH_ROUNDS = 8


class SwarmPace:
    """The rounds the other peers claim, and who will not send a round's delta again."""

    def __init__(self, peer_id: str, max_staleness: int) -> None:
        self.peer_id = peer_id
        self.max_staleness = max_staleness
        # sender -> the newest base version it sent (any delta but one refused as a strike),
        # and this peer's version when it last sent one
        self.claims: dict[str, tuple[int, int]] = {}
        # base version -> senders whose delta of that round came and was refused as too far
        # ahead, or as stale for this peer's last round, or by the robust rule
        self.gone: dict[int, set[str]] = {}
        # Whether this peer, once together with the swarm, closed max_staleness rounds merging
        # none of the others' deltas (cut off), and whether the first delta after that came
        # from a swarm that went on past it (parted).
        self.cut_off = False
        self.parted = False

    def reset(self) -> None:
        """Forget every claim (a state was loaded)."""
        self.claims, self.gone = {}, {}

    def note(self, sender: str, base_version: int, version: int) -> None:
        """Remember the newest round ``sender`` claims, and that it is sending now."""
        newest = max(base_version, self.claims.get(sender, (-1, 0))[0])
        self.claims[sender] = (newest, version)
        if self.cut_off and sender != self.peer_id:
            # The first word from the others after a while alone: from a swarm that went on
            # without this peer (its round past this one's), or from peers that took this
            # peer's state or were gone themselves (the episode ends).
            self.parted = self.parted or base_version > version
            self.cut_off = self.parted

    def refused(self, sender: str, base_version: int, reason: str, version: int) -> None:
        """A delta was refused for ``reason`` (not a strike): note its sender as gone from the
        round when that is a round a hold might wait for and the delta will not come again:
        too far ahead (yet not beyond the claims that count), or stale for this peer's last
        round (``max_staleness`` 0)."""
        if reason.startswith("ahead"):
            again = base_version > version + MAX_CLAIM_AHEAD
        else:
            again = not (reason.startswith("stale") and base_version == version - 1)
        if not again:
            self.mark_gone(base_version, sender)

    def mark_gone(self, base_version: int, sender: str) -> None:
        self.gone.setdefault(base_version, set()).add(sender)

    def gone_in(self, base_version: int) -> set[str]:
        return self.gone.get(base_version, set())

    def closed(self, version: int, *, together: bool, only_own: bool) -> None:
        """This peer moved on to ``version``: note whether it is cut off (it merged other
        peers' deltas once, none lately) and forget claims and refusals too old to matter."""
        if together and only_own:
            self.cut_off = True
        floor = version - self.max_staleness
        fresh = version - CLAIM_FRESH_ROUNDS
        self.claims = {p: (b, at) for p, (b, at) in self.claims.items() if at >= fresh}
        self.gone = {b: s for b, s in self.gone.items() if b >= min(floor, version - 1)}

    def forget(self, excluded: Callable[[str], bool]) -> None:
        """Drop the claims of senders now ``excluded``: they no longer pace this peer."""
        self.claims = {p: c for p, c in self.claims.items() if not excluded(p)}

    def rounds_behind(self, version: int, *, capped: bool = True) -> int:
        """Rounds the swarm has closed that this peer (at ``version``) has not, from the newest
        round each sender has claimed (stale ones left out): 0 when the lower median claim is
        older than this peer's current round, 1 when it is the current round, 2 when the next,
        ... The median, so that one member's claim cannot set the pace; claims more than
        ``MAX_CLAIM_AHEAD`` rounds ahead count for nothing when ``capped``."""
        floor = version - self.max_staleness
        top = version + MAX_CLAIM_AHEAD if capped else math.inf
        claims = [b for b, _ in self.claims.values() if floor <= b <= top]
        if not claims:
            return 0
        return max(0, int(lower_median([float(b) for b in claims])) - version + 1)

    def rounds_ahead(self, version: int, among: Collection[str]) -> int:
        """Rounds this peer has closed past the swarm: the lower median of the newest round
        each of ``among`` (the peers training the job now) claims, if it sent a delta within
        the last ``CLAIM_FRESH_ROUNDS`` rounds (one that did not counts as in step), and this
        peer's own last round: 0 when that is this peer's last round, 1 when the round before
        (a delta in flight), 2 when they are a round behind, ... With its own round in the
        median one member's claim moves it only in a swarm of two.

        A peer far ahead of the others holds its rounds for theirs (``SyncPlugin``) instead of
        counting them silent; they, the majority, do not chase it (``rounds_behind``)."""
        top = version + MAX_CLAIM_AHEAD
        claims = {p: b for p, (b, _) in self.claims.items() if p in among and b <= top}
        mine = version - 1
        unknown = sum(1 for p in set(among) if p not in claims)
        values = [*claims.values(), *[mine] * (unknown + 1)]
        return max(0, mine - int(lower_median([float(b) for b in values])))
