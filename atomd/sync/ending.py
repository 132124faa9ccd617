"""What a peer of a swarm job does after its last step, until the job's final model.

``JobEnding.finish`` closes the last round and waits for the other peers' last deltas; then
either consolidation rounds (``sync.consolidate_rounds``: rounds without training in which the
peers send what the codec has not sent yet of their progress), or following the rounds the
others still train and the final average (``atomd.sync.average``). The loss guard's probe then
picks the job's final model: the swarm's, this peer's own, or the average of the peers'.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from atomd.logs import get_logger
from atomd.sync import average
from atomd.sync.wire import encode_frame

if TYPE_CHECKING:
    from torch import Tensor

    from atomd.sync.runner import SyncPlugin

log = get_logger(__name__)


class JobEnding:
    """The end of one peer's job: its last rounds, the final average and the final model, and
    what they took (for progress reports)."""

    def __init__(self, plugin: SyncPlugin) -> None:
        """``plugin``: the job's round driver, whose rounds this closes and absorbs."""
        self._plugin = plugin
        self.followed = 0  # rounds of the others merged after this peer's last (``_follow``)
        self.follow_s = 0.0  # the time that took
        self.average_s = 0.0  # time spent on the final average (sending, waiting, combining)
        self.average_used: int | None = None  # the others' shares in the average candidate
        self.final_model: str | None = None  # "swarm", "own" or "average": what the job ended on

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
        if self._plugin.state is None:
            return
        self._last_rounds(step, stop)
        if not stop.is_set():
            self._end_on_the_better_model(self._final_average(stop))

    def _last_rounds(self, step: int, stop: threading.Event) -> None:
        assert self._plugin.state is not None
        if self._plugin.spec.consolidate_rounds:  # every peer switches at its last boundary
            self._plugin.state.average_from_now()
        # Without consolidation this is our last delta: the others stop waiting for us.
        self._plugin.timed_boundary(step, final=not self._plugin.spec.consolidate_rounds)
        if not self._await_round(stop, "last deltas"):
            return
        if not self._plugin.spec.consolidate_rounds:
            self._follow(stop)
        for done in range(self._plugin.spec.consolidate_rounds):
            alone = self._plugin.n_peers(self._plugin.version) <= 1  # nothing to agree on
            if stop.is_set() or alone:
                return
            self._plugin.timed_boundary(step)
            if not self._await_round(stop, f"consolidation round {done + 1}"):
                return
        if self._plugin.spec.consolidate_rounds:
            log.info("consolidated in %d rounds", self._plugin.spec.consolidate_rounds)

    def _follow(self, stop: threading.Event) -> None:
        """After this peer's last delta: merge the rounds the others still train (``SyncState.
        follow``), each once all of its deltas are in, until no other peer trains a round
        this one has not closed (each frame of a last delta says so), for at most
        ``final_wait_s`` in all. Peers take their steps at their own speeds, so the fastest
        reaches the last step first, and without following would end on a model of the swarm
        those rounds behind theirs. Not counted as waiting on the network (``wait_s``): the
        others' training is what it waits for (``follow_s``)."""
        assert self._plugin.state is not None
        deadline = time.monotonic() + self._plugin.spec.final_wait_s
        started = time.perf_counter()
        try:
            while not stop.is_set():
                version = self._plugin.state.version
                if self._plugin.n_peers(version) <= 1:
                    return
                missing = self._until_in(version, stop, deadline)
                if missing:
                    others = self._plugin.n_peers(version) - 1
                    if not stop.is_set():
                        log.info("following round %d: %d of %d other peers' deltas in; "
                                 "not waiting longer", version, others - len(missing),
                                 others)  # fmt: skip
                    return
                self._plugin.settle()
                inbox = self._plugin.take_inbox()
                if self._plugin.guard is not None:
                    followed = self._plugin.guard.follow(inbox)
                else:
                    followed = self._plugin.state.follow(inbox)
                self._plugin.report(self._plugin.state.last_merge)
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
        state, spec = self._plugin.state, self._plugin.spec
        if (
            state is None
            or self._plugin.guard is None  # nothing to judge the candidate by
            or self._plugin.send_average is None
            or not spec.final_average
            or spec.consolidate_rounds
            or not self._plugin.finishers()
        ):
            return None
        started = time.perf_counter()
        try:
            self._plugin.settle()
            version = state.version
            reference = state.settled()  # the same at every peer that merged the same deltas
            own = state.unsent_from(reference)
            rate = self._plugin.cadence.rate()
            budget_s = average.upload_budget_s(time.monotonic() - self._plugin.attached_at)
            sized = average.encode_share(
                own,
                state.codec_at if spec.codec == "topk" and state.fraction is not None else None,
                state.codec,
                floor=state.fraction or 1.0,
                budget_bytes=None if rate is None else budget_s * rate,
                overhead=self._plugin.frame_size.overhead or 0,
            )
            frame = encode_frame(
                identity=self._plugin.identity,
                job_id=self._plugin.job_id,
                round=state.round,
                base_version=version,
                tensors=list(sized.tensors.items()),
                average=True,
            )
            log.info("final average: sending %d bytes (%s) of this peer's model beyond the "
                     "anchor", len(frame), sized.codec)  # fmt: skip
            # Waited for until the deadline, also once membership loses them: the shares'
            # uploads fill a slow link and its pings time out meanwhile.
            due = set(self._plugin.finishers())
            wait_s = spec.final_wait_s + budget_s  # the others wait as long for this share
            self._plugin.send_average(frame, wait_s)
            deadline = time.monotonic() + wait_s
            while not stop.is_set():
                due |= set(self._plugin.finishers())
                missing = due - self._plugin.averages.senders()
                if not missing:
                    break
                if time.monotonic() >= deadline:
                    log.info("final average: no frame from %d peer(s); not waiting longer",
                             len(missing))  # fmt: skip
                    break
                stop.wait(0.05)
            shares = [
                s for s in self._plugin.averages.on(version) if not self._plugin.excluded(s.sender)
            ]
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
        is a peer's recent noise and the swarm's model is the better one; where they were rare
        it holds most of what a peer learned. A loss on fixed validation windows decides
        (forward only, once per job, for two or three models): the trainer's
        ``final_batches``, more windows than the guard's probe, since the models are close."""
        state, guard = self._plugin.state, self._plugin.guard
        if state is None or guard is None:
            return
        self._plugin.settle()
        judge = self._plugin.final_probe or guard.probe
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

    def _await_round(self, stop: threading.Event, what: str) -> bool:
        """Absorb the other peers' deltas of the round just closed as they arrive, for at most
        ``final_wait_s``; True once every live peer's is in."""
        assert self._plugin.state is not None
        last = self._plugin.state.version - 1
        if self._plugin.n_peers(last) <= 1:  # alone: its own round is committed already
            return True
        deadline = time.monotonic() + self._plugin.spec.final_wait_s
        started = time.perf_counter()
        try:
            missing = self._until_in(last, stop, deadline)
            if missing:
                want = self._plugin.n_peers(last)
                log.info("%s: %d of %d peers' deltas in; not waiting longer", what,
                         want - len(missing), want)  # fmt: skip
            return not missing
        finally:
            self._plugin.wait_s += time.perf_counter() - started

    def _until_in(self, base_version: int, stop: threading.Event, deadline: float) -> set[str]:
        """Absorb the deltas that arrive until every counted peer's of round ``base_version``
        is in, ``stop`` is set or ``deadline`` (monotonic) passes; those still missing then."""
        while True:
            self._plugin.absorb()
            missing = self._plugin.missing(base_version)
            if not missing or stop.is_set() or time.monotonic() >= deadline:
                return missing
            stop.wait(0.05)


def _load(params: Mapping[str, Tensor], tensors: Mapping[str, Tensor]) -> None:
    """Copy ``tensors`` into the live parameters ``params`` (same names), in place."""
    import torch

    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[name].reshape(p.shape))
