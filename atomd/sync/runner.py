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

import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from atomd.logs import get_logger
from atomd.p2p.identity import Identity
from atomd.spec import SyncSpec
from atomd.sync import average
from atomd.sync.cadence import Cadence, FrameSize
from atomd.sync.ending import JobEnding
from atomd.sync.guard import LossGuard
from atomd.sync.inbox import Inbox
from atomd.sync.intake import Contribution
from atomd.sync.schedule import RoundSchedule
from atomd.sync.state import MergeReport, Outgoing, SyncState
from atomd.sync.wire import encode_frame

if TYPE_CHECKING:
    from torch import Tensor

    from atomd.data.dataset import Batch
    from atomd.train.step_engine import StepEngine

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
    every: int  # steps this round lasted
    handed_at: float  # time.monotonic() when it left the trainer
    final: bool = False  # this peer's last delta for the job


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
        self.finishers = finishers or (lambda: ())
        self.training = training or (lambda base_version: ())
        self.inbox = Inbox()
        self.averages = average.Averages()  # the others' average frames (loop puts)
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
        self.may_retake = False
        """Whether this peer, far behind the swarm, ends its trainer to take the swarm's state
        again (``RoundSchedule.moved_on``): set by the job manager, which does that, a bounded
        number of times a job."""
        self._deferred: list[Contribution] = []  # received, left for the next boundary
        self._last_step = 0
        self._round_work = 0.0  # trainer-thread sync time spent on the current round
        self.frame_size = FrameSize()  # what a frame weighs, from the last one sent
        self._last_step_end: float | None = None
        self._n_logged = 0  # the last round's n_peers (logged when it changes)
        self.attached_at = time.monotonic()  # the job's time here, for the average's budget
        self.total_steps = total_steps
        self.lr = lr
        self.schedule = RoundSchedule(self)  # when rounds close
        self.ending = JobEnding(self)  # what happens after the last step

    def attach(self, engine: StepEngine) -> None:
        """Build the anchor from the engine's live parameters (host masters when swapping)."""
        self.engine = engine
        self.attached_at = time.monotonic()
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

    def missing(self, base_version: int, *, queued: bool = False) -> set[str]:
        """The counted peers whose delta of round ``base_version`` is not in yet: not merged,
        held, nor refused as one that will not come again (``SyncState.senders_in``), and with
        ``queued`` not waiting in the inbox or for the boundary either. Who, not how many: by
        count, a delta of a peer no longer counted, or one sent twice, would take the place of
        a missing one."""
        assert self.state is not None
        here = self.state.senders_in(base_version)
        if queued:
            here |= self.inbox.senders(base_version)
            here |= {c.sender for c in self._deferred if c.base_version == base_version}
        return {p for p in self.counted(base_version) if p not in here and not self.excluded(p)}

    def take_inbox(self) -> list[Contribution]:
        items, self._deferred = [*self._deferred, *self.inbox.take()], []
        if self.state is not None:
            self.state.drop_excluded(self.excluded)
        return [c for c in items if not self.excluded(c.sender)]

    def settle(self) -> None:
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

        A boundary comes H steps after the last one (``RoundSchedule.due``): the fixed
        ``sync.every``, or with ``"auto"`` the cadence's H once the previous round's frame has
        left (one round in flight); held while the previous round misses a delta, so a peer
        ahead falls back in step."""
        state = self.state
        if state is None:
            return
        t0 = time.perf_counter()
        if self._last_step_end is not None:
            self.cadence.step(t0 - self._last_step_end)
        if self.schedule.round_start is None:
            self.schedule.round_start = step - 1
        self._last_step = step
        if self.guard is not None:
            self.guard.stepped()
        try:
            self.schedule.moved_on(step)
            held = self.schedule.held_steps
            if not self.schedule.due(step):
                self.absorb(defer=self.schedule.defer(step))
                if not self.schedule.catch_up(step):
                    return
                self.schedule.held_steps = held  # closed after all: not a step held
            self._boundary(step)
        finally:
            self._last_step_end = time.perf_counter()
            self._count(self._last_step_end - t0)

    def _fit_fraction(self) -> None:
        """With the automatic cadence and a sparse codec: send the share of entries (at most
        the spec's ``topk_fraction``) whose frame fits the link at a round every LINK_EVERY
        steps (``Cadence.frame_budget``; docs/cadence.md), once a frame has been measured."""
        state = self.state
        budget = self.cadence.frame_budget()
        if state is None or state.fraction is None or budget is None:
            return
        fraction = self.frame_size.fit(self.spec.topk_fraction, budget, state.payload_estimate)
        if fraction is not None and fraction != state.fraction:
            log.info("the link fits frames of %.0f bytes: sending %.3g%% of the entries",
                     budget, 100 * fraction)  # fmt: skip
            state.set_fraction(fraction)

    def _count(self, seconds: float) -> None:
        self.busy_s += seconds
        self._round_work += seconds

    def delivered(self, round: int, seconds: float) -> None:
        """The loop: round ``round``'s frame reached every peer it could (``RoundSchedule``)."""
        self.schedule.delivered(round, seconds)

    def heard(self, peer: str, period_s: float) -> None:
        """The loop: another peer's proposed round period, from its frame."""
        self.cadence.heard(peer, period_s)

    def stats(self) -> dict[str, Any]:
        """The cadence in force and the trainer's time in sync, for progress reports."""
        view, end = self.cadence.view(), self.ending
        return {
            "every": view.every,
            "period_s": None if view.period_s is None else round(view.period_s, 4),
            "auto": int(view.auto),
            "rounds": self.version,
            "busy_s": round(self.busy_s, 4),
            "wait_s": round(self.wait_s, 4),
            "held_steps": self.schedule.held_steps,
            "probes": self.guard.probes if self.guard is not None else 0,
            # The share of entries a sparse codec sends now (None: dense; docs/cadence.md).
            "fraction": self.state.fraction if self.state is not None else None,
            **({"final_model": end.final_model} if end.final_model is not None else {}),
            **(
                {
                    "average_shares": end.average_used,
                    "average_s": round(end.average_s, 4),
                }
                if end.average_used is not None
                else {}
            ),
            **(
                {"followed": end.followed, "follow_s": round(end.follow_s, 4)}
                if end.followed
                else {}
            ),
        }

    def absorb(self, *, defer: bool = False) -> None:
        """Merge what has arrived since the last look (between boundaries). ``defer``: the
        deltas that would move the replica (of rounds this peer has closed) wait for a later
        merge (``_defer`` says when); those of rounds it has not closed are only held."""
        if self.state is None or not (len(self.inbox) or (self._deferred and not defer)):
            return
        inbox = self.take_inbox()
        if defer:
            version = self.state.version
            self._deferred = [c for c in inbox if c.base_version < version]
            inbox = [c for c in inbox if c.base_version >= version]
            if not inbox:
                return
        self.settle()
        self.report(self.guard.absorb(inbox) if self.guard else self.state.absorb(inbox))

    def report(self, merge: MergeReport) -> None:
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
        rounds move the model most and top-k sends least of them) the anchor it would take is
        near the initial weights. Nobody else holds a delta of the rounds this one commits
        whole, so the anchors agree. True if it closed the round."""
        state = self.state
        if state is None or len(self.inbox) or self._deferred or not state.alone_in_fact():
            return False
        log.info("a peer takes this state: closing round %d whole (no other peer's delta "
                 "merged here lately)", state.round)  # fmt: skip
        self.timed_boundary(self._last_step, alone=True)
        return True

    def _boundary(self, step: int, *, final: bool = False, alone: bool = False) -> None:
        assert self.state is not None
        self.settle()
        inbox = self.take_inbox()
        n_peers = 1 if alone else max(1, self.n_peers(self.state.version))
        # Alone in the round, its whole delta commits at once (``SyncState.prepare``), unless
        # peers that have sent their last delta follow its rounds: they commit what it sends a
        # round later, and so must it, or its anchor leaves theirs.
        # Nor when the swarm has deltas of this round or later in: a peer catching up after a
        # state transfer counts only itself on its first round's version (the others' deltas
        # of it came with the snapshot), and its whole delta, residual included, would be in
        # no other anchor.
        whole = alone or (n_peers == 1 and not self.finishers() and self.state.rounds_behind() == 0)
        if n_peers != self._n_logged:  # membership as this peer sees it: rare, worth a line
            log.info("rounds from version %d: %d peer(s) train the job (were %d)",
                     self.state.version, n_peers, self._n_logged)  # fmt: skip
            self._n_logged = n_peers
        self._fit_fraction()
        # Steps this round lasted (at least 1: a consolidation round repeats the last step).
        start = self.schedule.round_start
        every = max(1, step - (start if start is not None else step - 1))
        # Closed early (catching up with the swarm): the others' deltas of the round hold H.
        short = (self.cadence.fixed or self.schedule.every()) / every
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
        self.schedule.round_start = step
        fraction = self.state.fraction  # zstd keeps ~0.7 of top-k's payload at 1 %
        raw = None if fraction is None else self.state.payload_estimate(fraction)
        self.frame_size.measured(len(frame), out.payload_bytes, raw)
        handed_at = time.monotonic()
        self.schedule.in_flight = (out.round, handed_at, len(frame))
        self.send(RoundOut(self.job_id, step, frame, out, merge, every, handed_at, final))

    def finish(self, step: int, stop: threading.Event) -> None:
        """Instead of ``after_step`` after the job's last step (``JobEnding.finish``)."""
        self.ending.finish(step, stop)

    def timed_boundary(self, step: int, *, final: bool = False, alone: bool = False) -> None:
        t0 = time.perf_counter()
        self._boundary(step, final=final, alone=alone)
        self.busy_s += time.perf_counter() - t0

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
        which the donor sends over its next rounds: the joiner keeps it apart (not sent) until
        the donor's own deltas carry it, so that no anchor counts it twice."""
        if self.state is None:
            return
        self.settle()
        self.state.adopt(donor)
        if self.guard is not None:
            self.guard.forget()
