"""The trainer-thread side of delta exchange for one job.

After every optimizer step the trainer calls ``after_step``. At a round boundary (every H steps,
H fixed or picked by the ``Cadence``) the plugin takes whatever deltas have arrived (the inbox,
filled by the event loop), merges them with this peer's own delta through ``SyncState``
(compress, outer step, reset the replica), encodes this peer's delta as a signed frame and hands
it to the loop to send (``exchange.DeltaExchange``). Between boundaries, deltas that have arrived
are absorbed at once (``SyncState.absorb``): the replica moves by as much as the swarm's
estimate does and keeps what it trained. The trainer never waits for the network.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from atomd.errors import SwarmMovedOnError
from atomd.logs import get_logger
from atomd.p2p.identity import Identity
from atomd.spec import SyncSpec
from atomd.sync import average
from atomd.sync.cadence import Cadence, FrameSize
from atomd.sync.guard import LossGuard
from atomd.sync.state import Contribution, MergeReport, Outgoing, SyncState
from atomd.sync.wire import encode_frame

if TYPE_CHECKING:
    from torch import Tensor

    from atomd.data.dataset import Batch
    from atomd.train.engine import StepEngine

log = get_logger(__name__)

STATE_PREFIX = "sync."
# A round's frame counts as in flight at most this long (its uploads give up well before: two
# attempts of 30 s), so a frame the loop never got cannot hold the next round back for good.
MAX_IN_FLIGHT_S = 90.0
# Alone (no other peer trains the job) a round has nobody to tell: the automatic cadence closes
# one only every ALONE_EVERY steps, so that a lone peer does not pay for rounds every step.
ALONE_EVERY = 50
# The automatic cadence merges deltas of closed rounds after the step they arrive in, unless the
# next boundary is less than ABSORB_AHEAD steps away: then they wait for it and it merges them in
# the same guarded pass as the round's own delta (one probe pass, ``guard``, instead of two). At
# H=2 (a free link) that is every delta. Until 2026-12-03 they also waited, mid-round, for the
# last closed round to be complete or for 4 steps: at a slow link (H ~6, a frame reaching its
# third receiver ~2 s after it leaves) the replicas trained on the swarm's model of several
# steps before, and 4 real daemons at 256 kbit/s ended at 1.837-1.838 (gain 0.35; merged after
# the next step: 1.798, 0.53; bench/results-swarm-256kbit-no-defer-2026-12-03am.json).
ABSORB_AHEAD = 2
# In phase: a round that is due while this peer's previous round still misses deltas is held
# (training goes on) for at most max(H, HOLD_MIN) more steps.
HOLD_MIN = 2


@dataclass(frozen=True)
class RoundOut:
    """What one round boundary produced, for the loop to send and record."""

    job_id: str
    step: int
    frame: bytes
    outgoing: Outgoing
    merge: MergeReport
    every: int  # steps this round lasted
    handed_at: float  # time.monotonic() when it left the trainer
    final: bool = False  # this peer's last delta for the job


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


class SyncPlugin:
    """Plugged into a ``Trainer``: a round every H steps (``spec.every``, or the ``Cadence``'s
    when it is "auto"), deltas absorbed as they arrive in between."""

    def __init__(
        self,
        *,
        job_id: str,
        spec: SyncSpec,
        identity: Identity,
        counted: Callable[[int], Collection[str]],
        send: Callable[[RoundOut], None],
        absorbed: Callable[[str, MergeReport], None] | None = None,
        send_average: Callable[[bytes, float], None] | None = None,
        finishers: Callable[[], Collection[str]] | None = None,
        training: Callable[[int], Collection[str]] | None = None,
        total_steps: int | None = None,
        lr: Callable[[int], float] | None = None,
    ) -> None:
        """``counted``: the ids of the other peers whose deltas the round on a base version
        waits for (``n_peers``: they and this one);
        ``send``: hand a round's frame to the loop; ``absorbed``: deltas merged between
        boundaries (job id, report), for the records; ``send_average``: hand the job's average
        frame to the loop, with the seconds its uploads may take (``average``; None: no final
        average); ``finishers``: the other live peers of
        the job that have sent their last delta (whose average frames ``finish`` waits for);
        ``training``: the ids of the other live peers training the job in the round on a base
        version, silent ones included (None: none); ``total_steps``: the job's, so that the
        last round takes the steps left when fewer than H are (None: unknown);
        ``lr``: the job's learning rate at each (0-based) step, by which the robust rule weighs
        a longer round than this peer's (``robust.Screen``; None: by its steps)."""
        self.job_id = job_id
        self.spec = spec
        self.identity = identity
        self.counted = counted
        self.send = send
        self.absorbed = absorbed
        self.send_average = send_average
        self._finishers = finishers or (lambda: ())
        self._training = training or (lambda base_version: ())
        self.inbox = Inbox()
        self.averages = average.Averages()  # the others' average frames (loop puts)
        self.average_s = 0.0  # time spent on the final average (sending, waiting, combining)
        self.average_used: int | None = None  # the others' shares in the average candidate
        self.state: SyncState | None = None
        self.engine: StepEngine | None = None
        self.guard: LossGuard | None = None
        # The loss the job's final model is chosen by (``guard_with``); the guard's probe if None.
        self.final_probe: Callable[[], float] | None = None
        self.excluded: Callable[[str], bool] = lambda _sender: False
        """Senders whose deltas leave every merge (quarantined or banned; set by the node)."""
        self.on_attached: Callable[[], None] = lambda: None
        """Called on the trainer thread once ``attach`` has built the state (the exchange then
        checks the frames that came before)."""
        self.on_restored: Callable[[], None] = lambda: None
        """Called on the trainer thread once a checkpoint's sync state replaced the fresh one,
        whose version (0) was the base of every question asked before."""
        self.cadence = Cadence(None if spec.every == "auto" else spec.every)
        self.busy_s = 0.0  # trainer-thread time in sync work (closing rounds, merging deltas)
        self.wait_s = 0.0  # trainer-thread time blocked waiting for other peers' deltas
        self.held_steps = 0  # steps a due round was held for the previous round's deltas
        self.followed = 0  # rounds of the others merged after this peer's last (``_follow``)
        self.follow_s = 0.0  # the time that took
        self.final_model: str | None = None  # "swarm" or "own": what the job ended on
        self.may_retake = False
        """Whether this peer, far behind the swarm, ends its trainer to take the swarm's state
        again (``_moved_on``): set by the job manager, which does that, a bounded number of
        times a job."""
        self._deferred: list[Contribution] = []  # received, left for the next boundary
        self._last_step = 0
        self._round_start: int | None = None  # the step the current round started at
        self._round_work = 0.0  # trainer-thread sync time spent on the current round
        # The round whose frame is still being uploaded, when it left the trainer, its bytes.
        self._in_flight: tuple[int, float, int] | None = None
        self._frame = FrameSize()  # what a frame weighs, from the last one sent
        self._last_step_end: float | None = None
        self._n_logged = 0  # the last round's n_peers (logged when it changes)
        self._attached_at = time.monotonic()  # the job's time here, for the average's budget
        self.total_steps = total_steps
        self.lr = lr

    def attach(self, engine: StepEngine) -> None:
        """Build the anchor from the engine's live parameters (host masters when swapping)."""
        self.engine = engine
        self._attached_at = time.monotonic()
        engine.settle()
        self.state = SyncState.of_engine(
            engine, self.spec, peer_id=self.identity.peer_id, lr=self.lr
        )
        self._swarm_adam(self.n_peers(self.state.version))
        self.on_attached()

    def _swarm_adam(self, n_peers: int) -> None:
        """The steps until the next boundary average with ``n_peers`` peers' (this one included,
        counted on the round's base version): AdamW normalises them by the swarm's second
        moment (``SyncSpec.swarm_adam``). Called with the engine settled."""
        assert self.engine is not None
        self.engine.set_peers(max(1, n_peers) if self.spec.swarm_adam else 1)

    def guard_with(
        self, probe_batches: Sequence[Batch], final_batches: Sequence[Batch] | None = None
    ) -> None:
        """Guard every merge with the replica's loss on ``probe_batches`` (forward only): a
        merge after which it jumps is rolled back and its culprit refused (``LossGuard``),
        before the next step and before any checkpoint is written from the replica. The job's
        final model is chosen on ``final_batches`` (more windows: a choice made once, between
        models much closer to each other than a jump), or on the probe without them."""
        if self.state is None or self.engine is None or self.state.screen is None:
            return
        engine, batches = self.engine, list(probe_batches)
        self.guard = LossGuard(self.state, lambda: engine.evaluate(batches))
        if final_batches is not None:
            final = list(final_batches)
            self.final_probe = lambda: engine.evaluate(final)

    def n_peers(self, base_version: int) -> int:
        """Peers (this one included) that take part in the round on ``base_version``."""
        return 1 + len(self.counted(base_version))

    def _missing(self, base_version: int, *, queued: bool = False) -> set[str]:
        """The counted peers whose delta of round ``base_version`` is not in yet: not merged,
        held, nor refused as one that will not come again (``SyncState.senders_in``), and with
        ``queued`` not waiting in the inbox or for the boundary either. Who, not how many (a
        review of 2026-12-06: by count, a delta of a peer no longer counted, or one sent
        twice, took the place of a missing one, and the round closed without it)."""
        assert self.state is not None
        here = self.state.senders_in(base_version)
        if queued:
            here |= self.inbox.senders(base_version)
            here |= {c.sender for c in self._deferred if c.base_version == base_version}
        return {p for p in self.counted(base_version) if p not in here and not self.excluded(p)}

    def _inbox(self) -> list[Contribution]:
        items, self._deferred = [*self._deferred, *self.inbox.take()], []
        if self.state is not None:
            self.state.drop_excluded(self.excluded)
        return [c for c in items if not self.excluded(c.sender)]

    def _settle(self) -> None:
        """Before the live parameters are read or moved: the engine's updates must be in them
        (a swap engine's host optimizer runs on a worker thread, its device optimizer waits for
        the next load) and it must not reuse layers it holds from before."""
        if self.engine is not None:
            self.engine.settle()

    @property
    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        assert self.state is not None
        return {n: tuple(t.shape) for n, t in self.state.anchor.items()}

    @property
    def version(self) -> int:
        return self.state.version if self.state is not None else 0

    def after_step(self, step: int) -> None:
        """At a round boundary close the round; in between absorb what has arrived, and close
        the round early when the swarm has moved two rounds on (others' deltas of the round
        after this peer's current one are in): a slower peer keeps the swarm's pace of rounds
        with fewer steps per round, instead of falling behind until its deltas are refused as
        stale and the others' pile up here.

        A boundary comes H steps after the last one (``_round_due``): the fixed ``sync.every``,
        or with ``"auto"`` the cadence's H once the previous round's frame has left (one round in
        flight); held while the previous round misses a delta, so a peer ahead falls back in
        step."""
        state = self.state
        if state is None:
            return
        t0 = time.perf_counter()
        if self._last_step_end is not None:
            self.cadence.step(t0 - self._last_step_end)
        if self._round_start is None:
            self._round_start = step - 1
        self._last_step = step
        if self.guard is not None:
            self.guard.stepped()
        try:
            self._moved_on(step)
            held = self.held_steps
            if not self._round_due(step):
                self._absorb(defer=self._defer(step))
                if not self._catch_up(step):
                    return
                self.held_steps = held  # closed after all: not a step held
            self._boundary(step)
        finally:
            self._last_step_end = time.perf_counter()
            self._count(self._last_step_end - t0)

    def _moved_on(self, step: int) -> None:
        """Raise ``SwarmMovedOnError`` (with ``may_retake``) when the swarm's newest rounds are
        further ahead than any delta this peer can merge (the lower median of the senders'
        claims, ``rounds_behind``, beyond the ``ahead`` bound of ``SyncState``): the rounds it
        missed meanwhile (it was stopped, or dead to the others, who sent it nothing) are
        nowhere to be had, and closing its rounds early to catch up (``_catch_up``) would put it
        back in step with an anchor that lacks them, parted from theirs for good. A daemon
        stopped for 20 s at 40 % of a 4-peer job (``atomd bench swarm``, sigstop, run ew) came
        back 36 rounds behind and ended 0.11 worse than the others (settled anchors 0.47 apart);
        a peer that restarts takes the swarm's state, and so does this one. So too, however
        near, a peer that closed rounds alone after it had been with the swarm and finds the
        swarm a round past its own (``SyncState.parted_alone``: its link was cut)."""
        assert self.state is not None
        if not self.may_retake:
            return
        behind = self.state.rounds_behind(capped=False)
        if behind - 1 > max(1, self.spec.max_staleness):
            why = "more than its deltas can bridge"
        elif self.state.parted_alone():  # cut off from the swarm a while (``parted_alone``)
            why = "after rounds it closed alone"
        else:
            return
        raise SwarmMovedOnError(
            f"the swarm has closed {behind - 1} round(s) past this peer's round "
            f"{self.state.version}, {why}: taking the swarm's state",
            step,
        )

    def _catch_up(self, step: int) -> bool:
        """Close the round before its H steps? When the swarm is two rounds on (see
        ``after_step``); with the automatic cadence also when this peer is the last of the round:
        every other peer's delta of it is in. That keeps the peers in phase (a peer that joined
        or resumed late closes its rounds right after the others' instead of a round behind, where
        its deltas would reach them after they committed the round)."""
        assert self.state is not None
        behind = self.state.rounds_behind()
        if self.cadence.auto:
            if self._uploading():
                return False
            if behind < 2:
                version = self.state.version
                return self.n_peers(version) > 1 and not self._missing(version)
        elif behind < 2:
            return False
        log.info("step %d: the swarm has closed %d rounds this peer has not; closing "
                 "round %d early", step, behind, self.state.round)  # fmt: skip
        return True

    def _every(self) -> int:
        """H of the current round (automatic cadence)."""
        every = self.cadence.every()
        if self.n_peers(self.version) <= 1:
            every = max(every, ALONE_EVERY)
        return every

    def _defer(self, step: int) -> bool:
        """Whether deltas of closed rounds wait for the boundary: with the automatic cadence
        when it is less than ABSORB_AHEAD steps away (a fixed H merges them after every step)."""
        if self.cadence.fixed is not None or self._round_start is None or self.state is None:
            return False
        return self._every() - (step - self._round_start) < ABSORB_AHEAD

    def _round_due(self, step: int) -> bool:
        """H steps after the last round closed: the fixed ``sync.every`` or the automatic
        cadence's (which also waits for the previous frame to leave); a short last round is
        left to ``finish``. Either way a due round is held while the previous round still
        misses a delta (``_previous_open``), for at most max(H, HOLD_MIN) more steps: a peer
        ahead of the others falls back in step with them. Until 2026-12-06 a fixed H closed
        at every multiple of H, and a peer ahead stayed ahead: the first peer of a job, a
        round or more on before the joiners had loaded, took their deltas stale and they
        refused its as ahead (the crash test of tests/integration/test_sync.py, 3 real
        daemons at H=5 on a busy machine: [100, 60, 69] steps, a peer that never merged one
        of the others')."""
        assert self._round_start is not None
        fixed = self.cadence.fixed
        if fixed is None and self._uploading():
            return False
        every, elapsed = fixed or self._every(), step - self._round_start
        if elapsed < every or self._last_round_takes(step, every, elapsed):
            return False
        if elapsed < every + max(every, HOLD_MIN) and self._previous_open():
            self.held_steps += 1
            return False
        return True

    def _last_round_takes(self, step: int, every: int, elapsed: int) -> bool:
        """Fewer than H steps are left after ``step`` (the round ``elapsed``
        steps long): the job's last round (``finish``) takes them, if it then holds at most 2H
        steps (the robust screen's allowance for a longer round), rather than a round now and
        a final one of a step or two right after it, two frames on the link just when the
        others wait for the last deltas (4 real daemons at 256 kbit/s: a peer's rounds at
        steps 599 and 600, then a 6.3 s wait). Rule 3 (``_catch_up``) still closes in phase."""
        if self.total_steps is None:
            return False
        left = self.total_steps - step
        return 0 < left < every and elapsed + left <= 2 * every

    def _previous_open(self) -> bool:
        """In phase: this peer's previous round still misses a delta of a peer training the
        job. Closing the next round now would commit it without that delta (and the delta,
        arriving later, would count a round late): a peer ahead of the others trains on a
        little longer instead, so that its rounds close just after theirs. Never a wait.

        So too when the peers training the job are two rounds or more behind it
        (``rounds_ahead``): their deltas of its previous round are not even on their way, and,
        stale here, they do not make them count among the peers it waits for."""
        assert self.state is not None
        last = self.state.version - 1
        if last < 0:
            return False
        among = [p for p in self._training(last) if not self.excluded(p)]
        if self.state.rounds_ahead(among) >= 2:
            return True
        return bool(self._missing(last, queued=True))  # none counted: nothing to wait for

    def _fit_fraction(self) -> None:
        """With the automatic cadence and a sparse codec: send the share of entries (at most
        the spec's ``topk_fraction``) whose frame fits the link at a round every LINK_EVERY
        steps (``Cadence.frame_budget``; docs/cadence.md), once a frame has been measured."""
        state = self.state
        budget = self.cadence.frame_budget()
        if state is None or state.fraction is None or budget is None:
            return
        fraction = self._frame.fit(self.spec.topk_fraction, budget, state.payload_estimate)
        if fraction is not None and fraction != state.fraction:
            log.info("the link fits frames of %.0f bytes: sending %.3g%% of the entries",
                     budget, 100 * fraction)  # fmt: skip
            state.set_fraction(fraction)

    def _uploading(self) -> bool:
        """The previous round's frame is still on its way (one round in flight at most)."""
        flight = self._in_flight
        return flight is not None and time.monotonic() - flight[1] < MAX_IN_FLIGHT_S

    def _count(self, seconds: float) -> None:
        self.busy_s += seconds
        self._round_work += seconds

    def delivered(self, round: int, seconds: float) -> None:
        """The loop: round ``round``'s frame has reached every peer it could, in ``seconds``
        (since it left the trainer); negative when it reached none: the round is done, but
        there is nothing to measure."""
        flight = self._in_flight
        nbytes = flight[2] if flight is not None and flight[0] == round else 0
        if seconds >= 0:
            self.cadence.traffic(seconds, nbytes)
        if flight is not None and flight[0] == round:
            self._in_flight = None

    def heard(self, peer: str, period_s: float) -> None:
        """The loop: another peer's proposed round period, from its frame."""
        self.cadence.heard(peer, period_s)

    def stats(self) -> dict[str, Any]:
        """The cadence in force and the trainer's time in sync, for progress reports."""
        view = self.cadence.view()
        return {
            "every": view.every,
            "period_s": None if view.period_s is None else round(view.period_s, 4),
            "auto": int(view.auto),
            "rounds": self.version,
            "busy_s": round(self.busy_s, 4),
            "wait_s": round(self.wait_s, 4),
            "held_steps": self.held_steps,
            "probes": self.guard.probes if self.guard is not None else 0,
            # The share of entries a sparse codec sends now (None: dense; docs/cadence.md).
            "fraction": self.state.fraction if self.state is not None else None,
            **({"final_model": self.final_model} if self.final_model is not None else {}),
            **(
                {
                    "average_shares": self.average_used,
                    "average_s": round(self.average_s, 4),
                    # How many of this peer's last models its share was the mean of: the last.
                    "average_tail": 1,
                }
                if self.average_used is not None
                else {}
            ),
            **(
                {"followed": self.followed, "follow_s": round(self.follow_s, 4)}
                if self.followed
                else {}
            ),
        }

    def _absorb(self, *, defer: bool = False) -> None:
        """Merge what has arrived since the last look (between boundaries). ``defer``: the
        deltas that would move the replica (of rounds this peer has closed) wait for a later
        merge (``_defer`` says when); those of rounds it has not closed are only held."""
        if self.state is None or not (len(self.inbox) or (self._deferred and not defer)):
            return
        inbox = self._inbox()
        if defer:
            version = self.state.version
            self._deferred = [c for c in inbox if c.base_version < version]
            inbox = [c for c in inbox if c.base_version >= version]
            if not inbox:
                return
        self._settle()
        self._report(self.guard.absorb(inbox) if self.guard else self.state.absorb(inbox))

    def _report(self, merge: MergeReport) -> None:
        """Hand a merge made between boundaries to the loop (recorded, strikes counted)."""
        if self.absorbed is not None and (merge.applied or merge.refused):
            self.absorbed(self.job_id, merge)

    def before_snapshot(self) -> bool:
        """A peer is about to take this state (it joins the job, or restarts). When no other
        peer's delta was merged here within ``max_staleness`` rounds and none waits, the round
        closes now as a peer's alone does, committing the whole replica (what top-k has not sent
        yet included): the anchor the other peer starts from is this peer's model, not the few
        entries top-k has sent of it. A joiner announces itself before it fetches, so it counts
        in the rounds from then on and they commit top-k's share only: early in training (the
        rounds move the model most and top-k sends least of them) the anchor it took was near
        the initial weights (test_hostile: a joiner's first validation at 5.3, untrained 5.5).
        Nobody else holds a delta of the rounds this one commits whole, so the anchors agree.
        True if it closed the round."""
        state = self.state
        if state is None or len(self.inbox) or self._deferred or not state.alone_in_fact():
            return False
        log.info("a peer takes this state: closing round %d whole (no other peer's delta "
                 "merged here lately)", state.round)  # fmt: skip
        self._timed_boundary(self._last_step, alone=True)
        return True

    def _boundary(self, step: int, *, final: bool = False, alone: bool = False) -> None:
        assert self.state is not None
        self._settle()
        inbox = self._inbox()
        n_peers = 1 if alone else max(1, self.n_peers(self.state.version))
        # Alone in the round, its whole delta commits at once (``SyncState.prepare``), unless
        # peers that have sent their last delta follow its rounds: they commit what it sends a
        # round later, and so must it, or its anchor leaves theirs (4 real daemons: the last
        # one's anchor ended 2.6 % from the others', 0.01-0.24 % between them; its model the
        # worst of the four).
        # Nor when the swarm has deltas of this round or later in: a peer catching up after a
        # state transfer counted only itself on its first round's version (the others' deltas
        # of it came with the snapshot) and committed its whole delta, residual included, which
        # nobody else holds (4 real daemons, run dy: its settled anchor 0.44 % from theirs).
        whole = alone or (
            n_peers == 1 and not self._finishers() and self.state.rounds_behind() == 0
        )
        if n_peers != self._n_logged:  # membership as this peer sees it: rare, worth a line
            log.info("rounds from version %d: %d peer(s) train the job (were %d)",
                     self.state.version, n_peers, self._n_logged)  # fmt: skip
            self._n_logged = n_peers
        self._fit_fraction()
        # Steps this round lasted (at least 1: a consolidation round repeats the last step).
        every = max(1, step - (self._round_start if self._round_start is not None else step - 1))
        # Closed early (catching up with the swarm): the others' deltas of the round hold H.
        short = (self.cadence.fixed or self._every()) / every
        close = self.guard.round_boundary if self.guard is not None else self.state.round_boundary
        out = close(
            inbox, n_peers=n_peers, steps_short=short, whole=whole, steps=every,
            first=step - every,
        )  # fmt: skip
        self._swarm_adam(self.n_peers(self.state.version))  # the next round's peers
        # The frame carries this peer's own proposal, not the swarm's period: a peer that sent
        # the largest period it heard would echo every peer's past proposals back to them, and
        # one slow round's proposal would then circulate, kept fresh, for the rest of the job.
        proposal = self.cadence.proposal() if self.cadence.auto else None
        frame = encode_frame(
            identity=self.identity,
            job_id=self.job_id,
            round=out.round,
            base_version=out.base_version,
            tensors=out.tensors,
            cadence=None if proposal is None else {"period_s": proposal, "every": every},
            final=final,
        )
        merge = self.state.last_merge
        log.info(
            "round %d at step %d (%d steps): merged %d delta(s), refused %d; sending %d bytes "
            "(%.0fx)", out.round, step, every, len(merge.applied), len(merge.refused),
            len(frame), out.wire_ratio,
        )  # fmt: skip
        if self._round_work > 0:
            self.cadence.round_work(self._round_work)
        self._round_work = 0.0
        self._round_start = step
        fraction = self.state.fraction  # zstd keeps ~0.7 of top-k's payload at 1 %
        raw = None if fraction is None else self.state.payload_estimate(fraction)
        self._frame.measured(len(frame), out.payload_bytes, raw)
        handed_at = time.monotonic()
        self._in_flight = (out.round, handed_at, len(frame))
        self.send(RoundOut(self.job_id, step, frame, out, merge, every, handed_at, final))

    def finish(self, step: int, stop: threading.Event) -> None:
        """Instead of ``after_step`` after the job's last step: close the last round (also when
        H does not divide the steps), then absorb the other peers' last deltas as they arrive,
        for at most ``final_wait_s`` (less if ``stop`` is set or every live peer's is in).

        Then ``consolidate_rounds`` rounds without training: each sends what the codec has not
        sent yet of this peer's progress (the replica minus the start point) and waits for the
        others' deltas of the round. From the last boundary on the outer step is the plain
        average (``SyncState.average_from_now``), so the mean of the peers' models stays where
        it is while their differences (the unsent residuals) shrink, and the final models
        converge to the average of them all. A round whose deltas do not all arrive ends it.

        Without consolidation rounds, the final average (``atomd.sync.average``): this peer
        sends the others its model beyond its settled anchor, waits for theirs, and the job may end
        on the anchor plus the mean of them all."""
        if self.state is None:
            return
        self._last_rounds(step, stop)
        if not stop.is_set():
            self._end_on_the_better_model(self._final_average(stop))

    def _last_rounds(self, step: int, stop: threading.Event) -> None:
        assert self.state is not None
        if self.spec.consolidate_rounds:  # every peer switches at its last boundary
            self.state.average_from_now()
        # Without consolidation this is our last delta: the others stop waiting for us.
        self._timed_boundary(step, final=not self.spec.consolidate_rounds)
        if not self._await_round(stop, "last deltas"):
            return
        if not self.spec.consolidate_rounds:
            self._follow(stop)
        for done in range(self.spec.consolidate_rounds):
            if stop.is_set() or self.n_peers(self.version) <= 1:  # alone: nothing to agree on
                return
            self._timed_boundary(step)
            if not self._await_round(stop, f"consolidation round {done + 1}"):
                return
        if self.spec.consolidate_rounds:
            log.info("consolidated in %d rounds", self.spec.consolidate_rounds)

    def _follow(self, stop: threading.Event) -> None:
        """After this peer's last delta: merge the rounds the others still train (``SyncState.
        follow``), each once all of its deltas are in, until no other peer trains a round
        this one has not closed (each frame of a last delta says so), for at most
        ``final_wait_s`` in all. Peers of a swarm take their steps at their own speeds, so
        the fastest reaches the last step first: 4 real daemons, the fastest 7 s (~20 steps,
        several rounds) before the others, ended on a model of the swarm those rounds behind
        theirs (probe 1.7245 against 1.684) and kept its own, the worst of the four (val
        1.745 against 1.735-1.741; docs/notes/issue-14.md). Not counted as waiting on the
        network (``wait_s``): the others' training is what it waits for (``follow_s``)."""
        assert self.state is not None
        deadline = time.monotonic() + self.spec.final_wait_s
        started = time.perf_counter()
        try:
            while not stop.is_set():
                version = self.state.version
                if self.n_peers(version) <= 1:
                    return
                missing = self._until_in(version, stop, deadline)
                if missing:
                    others = self.n_peers(version) - 1
                    if not stop.is_set():
                        log.info("following round %d: %d of %d other peers' deltas in; "
                                 "not waiting longer", version, others - len(missing),
                                 others)  # fmt: skip
                    return
                self._settle()
                inbox = self._inbox()
                if self.guard is not None:
                    followed = self.guard.follow(inbox)
                else:
                    followed = self.state.follow(inbox)
                self._report(self.state.last_merge)
                if not followed:
                    return
                self.followed += 1
        finally:
            self.follow_s += time.perf_counter() - started
            if self.followed:
                log.info("followed the swarm's last %d round(s) in %.1f s",
                         self.followed, self.follow_s)  # fmt: skip

    def _final_average(self, stop: threading.Event) -> dict[str, Tensor] | None:
        """Send this peer's share of the final average, wait for the others' (every peer that
        has sent its last delta, for at most ``final_wait_s`` plus this peer's own upload
        budget), and return the average candidate, or None when there is none (alone, turned
        off, nothing came)."""
        state, spec = self.state, self.spec
        if (
            state is None
            or self.guard is None  # nothing to judge the candidate by
            or self.send_average is None
            or not spec.final_average
            or spec.consolidate_rounds
            or not self._finishers()
        ):
            return None
        started = time.perf_counter()
        try:
            self._settle()
            version = state.version
            reference = state.settled()  # the same at every peer that merged the same deltas
            own = state.unsent_from(reference)
            rate = self.cadence.rate()
            budget_s = average.upload_budget_s(time.monotonic() - self._attached_at)
            sized = average.encode_share(
                own,
                state.codec_at if spec.codec == "topk" and state.fraction is not None else None,
                state.codec,
                floor=state.fraction or 1.0,
                budget_bytes=None if rate is None else budget_s * rate,
                overhead=self._frame.overhead or 0,
            )
            frame = encode_frame(
                identity=self.identity,
                job_id=self.job_id,
                round=state.round,
                base_version=version,
                tensors=list(sized.tensors.items()),
                average=True,
            )
            log.info("final average: sending %d bytes (%s) of this peer's model beyond the "
                     "anchor", len(frame), sized.codec)  # fmt: skip
            # Waited for until the deadline, also once membership loses them: the shares'
            # uploads fill a slow link and its pings time out (4 real daemons at 256 kbit/s:
            # each saw the others dead meanwhile, stopped waiting, and ended with no share).
            due = set(self._finishers())
            wait_s = spec.final_wait_s + budget_s  # the others wait as long for this share
            self.send_average(frame, wait_s)
            deadline = time.monotonic() + wait_s
            while not stop.is_set():
                due |= set(self._finishers())
                missing = due - self.averages.senders()
                if not missing:
                    break
                if time.monotonic() >= deadline:
                    log.info("final average: no frame from %d peer(s); not waiting longer",
                             len(missing))  # fmt: skip
                    break
                stop.wait(0.05)
            shares = [s for s in self.averages.on(version) if not self.excluded(s.sender)]
            if not shares:
                return None
            combined = average.combine(reference, sized.decoded(), shares, fill_from=own)
            for sender, why in combined.left_out:
                log.warning("final average: the share of %s left out: %s", sender, why)
            self.average_used = len(combined.used)
            return combined.model
        finally:
            self.average_s += time.perf_counter() - started

    def _end_on_the_better_model(self, averaged: dict[str, Tensor] | None = None) -> None:
        """The job's final model: the swarm's, this peer's own, or the average of the peers'
        (``averaged``, when there is one), whichever the probe prefers.

        After the last round the replica is the swarm's model (the start point: the anchor with
        every delta in, the same at every peer once all last deltas have arrived) plus this
        peer's own progress that the codec has not sent. Where rounds were frequent that residue
        is a peer's recent noise and the swarm's model is the better one (4 real daemons at a
        round every 2 steps: replicas 1.742-1.752, the anchors 1.736-1.740; `atomd bench
        sync` at H=2: 1.7245 against 1.7200). Where they were rare it holds most of what a
        peer learned (`atomd bench sync` at H=50: replicas 1.955, anchor 3.918). A loss on fixed
        validation windows decides (forward only, once per job, for two or three models): the
        trainer's ``final_batches``, four times the guard's probe. The models are close: on run
        bs's final models (256 kbit/s) each peer's average candidate beat its own by 0.004-0.031
        on the benchmark's 320 windows, and the per-window differences put a standard error of
        0.003-0.0045 on the guard's 16 windows (one peer's -0.0011 +- 0.0038, a coin flip),
        0.0016-0.0023 on 64."""
        state, guard = self.state, self.guard
        if state is None or guard is None:
            return
        self._settle()
        judge = self.final_probe or guard.probe
        own = judge()
        kept = {name: p.detach().clone() for name, p in state.params.items()}
        state.reset_replica()
        probes = {"own": own, "swarm": judge()}
        if averaged is not None:
            _load(state.params, averaged)
            probes["average"] = judge()
        # The swarm's model wins ties (the same at every peer), then the average.
        self.final_model = min(("swarm", "average", "own"), key=lambda m: probes.get(m, math.inf))
        if self.final_model == "own":
            _load(state.params, kept)
        elif self.final_model == "swarm" and averaged is not None:
            state.reset_replica()
        log.info("final model: %s (probe loss: %s)",
                 {"swarm": "the swarm's", "own": "this peer's own",
                  "average": "the average of the peers'"}[self.final_model],
                 ", ".join(f"{m} {v:.4f}" for m, v in probes.items()))  # fmt: skip

    def _timed_boundary(self, step: int, *, final: bool = False, alone: bool = False) -> None:
        t0 = time.perf_counter()
        self._boundary(step, final=final, alone=alone)
        self.busy_s += time.perf_counter() - t0

    def _await_round(self, stop: threading.Event, what: str) -> bool:
        """Absorb the other peers' deltas of the round just closed as they arrive, for at most
        ``final_wait_s``; True once every live peer's is in."""
        assert self.state is not None
        last = self.state.version - 1
        if self.n_peers(last) <= 1:  # alone: its own round is committed already
            return True
        deadline = time.monotonic() + self.spec.final_wait_s
        started = time.perf_counter()
        try:
            missing = self._until_in(last, stop, deadline)
            if missing:
                want = self.n_peers(last)
                log.info("%s: %d of %d peers' deltas in; not waiting longer", what,
                         want - len(missing), want)  # fmt: skip
            return not missing
        finally:
            self.wait_s += time.perf_counter() - started

    def _until_in(self, base_version: int, stop: threading.Event, deadline: float) -> set[str]:
        """Absorb the deltas that arrive until every counted peer's of round ``base_version``
        is in, ``stop`` is set or ``deadline`` (monotonic) passes; those still missing then."""
        while True:
            self._absorb()
            missing = self._missing(base_version)
            if not missing or stop.is_set() or time.monotonic() >= deadline:
                return missing
            stop.wait(0.05)

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
        self.on_restored()
        return True

    def adopt(self, donor: str | None = None) -> None:
        """After taking another peer's state (a join or a restart): train on from the donor's
        model, sending only what this peer trains from it, with none of the donor's error
        feedback (``SyncState.adopt``; ``donor``: its peer id, where the transfer knows it).

        The donor's replica also holds the part of its progress the codec has not sent yet,
        and the donor sends that part over its next rounds. A joiner that sent it too made
        every anchor count it twice (``python -m atomd_bench join``: two simulated peers,
        top-k 1%, the joiner taking the donor's state at step 20 of 120 at H=5, mean val 3.034
        against 2.888 from the swarm's estimate); one that trained from the swarm's estimate
        (the anchor plus the deltas in) instead started far behind where rounds are rare, and
        a restarted daemon refused every donor's state as far worse than the members measured
        (``SyncState.adopt``). It keeps the donor's unsent progress apart (not sent) until the
        donor's own deltas carry it."""
        if self.state is None:
            return
        self._settle()
        self.state.adopt(donor)
        if self.guard is not None:
            self.guard.forget()


def _load(params: Mapping[str, Tensor], tensors: Mapping[str, Tensor]) -> None:
    """Copy ``tensors`` into the live parameters ``params`` (same names), in place."""
    import torch

    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[name].reshape(p.shape))
