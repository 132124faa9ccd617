"""Driving a job: its trainer runs on the one trainer thread, off the event loop, and the loop
follows it, records what it reports, asks it for live-state checkpoints that joining peers
fetch, and reacts to how it ends (finished, stopped, failed, or a swarm state to take again)."""

from __future__ import annotations

import asyncio
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from atomd.db import repo
from atomd.errors import AtomdError, NotFoundError
from atomd.jobs.active import ActiveJob
from atomd.jobs.admission import local_data
from atomd.jobs.donor_state import RETAKES
from atomd.jobs.trainer_thread import load_training_modules, lower_thread_priority, train_blocking
from atomd.logs import get_logger
from atomd.train.checkpoint import checkpoint_root, remove_partial

if TYPE_CHECKING:  # torch loads when the first job trains, not when the daemon starts
    from atomd.jobs.manager import JobManager
    from atomd.train.trainer import TrainSummary

log = get_logger("atomd.jobs")

# How long a peer that asks for this daemon's live state waits for the trainer to checkpoint
# at its next step boundary, before it gets the newest checkpoint on disk instead.
LIVE_STATE_TIMEOUT_S = 30.0
# At most one live-state checkpoint per job this often (``live_state``); a peer asking sooner
# gets the one written last. Each costs ~6 model sizes of disk writes, and any member may ask.
LIVE_STATE_EVERY_S = 30.0


class JobDriver:
    """Runs the jobs of ``jobs`` (its manager) one at a time on the trainer thread
    (``executor``, at the priority ``trainer_nice`` lowers it to), and asks the running
    trainer for its live state (``live_state``)."""

    def __init__(self, jobs: JobManager, trainer_nice: int) -> None:
        self.jobs = jobs
        self.executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="atomd-trainer",
            initializer=lower_thread_priority,
            initargs=(trainer_nice,),
        )

    def hash_pending(self, a: ActiveJob) -> bool:
        """A swarm job started here whose spec has no data hash yet: its data is hashed off
        the loop before its trainer is built, and only then announced (``pin_data``)."""
        return (
            self.jobs.swarm is not None and a.scope == "swarm" and a.origin == self.jobs.peer_id
            and a.spec.data_sha256 is None
        )  # fmt: skip

    async def drive(self, active: ActiveJob) -> None:
        """Train ``active`` to its end and record that end; the daemon is free afterwards."""
        jobs = self.jobs
        loop = asyncio.get_running_loop()
        try:
            # torch and the trainer load off the loop (seconds on a busy machine), before
            # anything below imports them on it.
            await asyncio.to_thread(load_training_modules)
            left = await asyncio.to_thread(remove_partial, checkpoint_root(active.out_dir))
            if left:
                log.info("job %s: removed %d half-written folder(s) a crash left: %s",
                         active.id, len(left), ", ".join(left))  # fmt: skip
            if self.hash_pending(active):
                await self.pin_data(active)
            while True:  # again with another donor while the trainer refuses a donor's state
                if active.scope == "swarm" and jobs.swarm is not None:
                    if jobs.exchange is not None and active.plugin is None:
                        # first: the kept frames wait for its state
                        active.plugin = jobs.exchange.plugin(
                            active.id, active.spec, may_retake=active.retakes < RETAKES
                        )
                    if not await jobs.donor_state.take(active):
                        return
                    from atomd.train.trainer import SnapshotRequests

                    active.snapshots = SnapshotRequests()
                train = functools.partial(
                    train_blocking, active, loop, device=jobs.device, peer_id=jobs.peer_id,
                    data_names=jobs.data_names,
                )  # fmt: skip
                fut = loop.run_in_executor(self.executor, train)
                await self.follow(active, fut)
                if await jobs.donor_state.moved_on(active, fut):
                    continue
                if not await jobs.donor_state.donor_refused(active, fut):
                    break
            await self.finish(active, fut)
        finally:
            jobs.release(active)
            if jobs.active is None and not jobs.closing:
                jobs.telemetry.job_state.state("none")

    async def live_state(self, job_id: str, at_least: int = 0) -> bool:
        """Checkpoint the live state of ``job_id`` at the trainer's next step boundary, for a
        peer joining the job (so it starts from the swarm's current model, not from the last
        checkpoint on disk). True once written; False when this daemon does not train the job
        or the trainer did not get there within ``LIVE_STATE_TIMEOUT_S``. ``NotFoundError``
        when the job trains here but is not yet at step ``at_least``, or its swarm has closed
        no round yet: the anchor is still the initial weights, and a joiner that starts from
        them at round 0 agrees with it (a state transfer costs ~6 model sizes: weights, AdamW
        moments, sync state)."""
        a = self.jobs.active
        if a is None or a.id != job_id or a.snapshots is None or a.stop_event.is_set():
            return False
        if a.step < at_least:
            raise NotFoundError(
                f"job {job_id} is at step {a.step} here; no state from step {at_least} on yet"
            )
        if a.plugin is not None and a.plugin.version == 0:
            raise NotFoundError(
                f"job {job_id} has closed no round here yet: start from its initial weights"
            )
        if time.monotonic() - a.live_at < LIVE_STATE_EVERY_S:
            # Written moments ago: that one serves (a member asking in a loop would otherwise
            # make the trainer write ~6 model sizes at every step).
            log.info("job %s: live state written %.0f s ago; serving it", job_id,
                     time.monotonic() - a.live_at)  # fmt: skip
            return False
        fut = a.snapshots.ask()
        try:
            step = await asyncio.wait_for(asyncio.wrap_future(fut), LIVE_STATE_TIMEOUT_S)
        except (TimeoutError, RuntimeError) as e:
            fut.cancel()
            log.info("job %s: no live state for a peer (%s); serving the newest checkpoint",
                     job_id, e or "timed out")  # fmt: skip
            return False
        a.live_at = time.monotonic()
        log.info("job %s: live state at step %d checkpointed for a peer", job_id, step)
        return True

    async def follow(self, active: ActiveJob, fut: asyncio.Future[TrainSummary]) -> None:
        """Record what the trainer reports until it has returned and said everything."""
        while not fut.done() or not active.queue.empty():
            getter = asyncio.ensure_future(active.queue.get())
            waiting: set[asyncio.Future[Any]] = {fut, getter}
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                continue
            items = [getter.result()]
            while not active.queue.empty():
                items.append(active.queue.get_nowait())
            await self.jobs.recorder.record_when_room(active, items)

    async def finish(self, active: ActiveJob, fut: asyncio.Future[TrainSummary]) -> None:
        """Record how the trainer ended: its summary's state, or failed with the reason."""
        recorder = self.jobs.recorder
        release = functools.partial(self.jobs.release, active)
        try:
            summary = fut.result()
        except AtomdError as e:
            await recorder.set_state(active.id, "failed", str(e), "job.failed", str(e), release)
            return
        except Exception as e:  # a bug, not bad input: keep the traceback in the log
            log.exception("job %s crashed", active.id)
            reason = f"{type(e).__name__}: {e}"
            await recorder.set_state(active.id, "failed", reason, "job.failed", reason, release)
            return
        await recorder.record_end(active, summary.state, summary.step, release)

    async def pin_data(self, active: ActiveJob) -> None:
        """Hash the data of a swarm job started here (off the loop, before its trainer is
        built: the announce waits for it), put the hash into the job's spec (recorded), then
        announce the job: every peer that joins checks its own tokens against it. Data that
        cannot be read is left to the trainer, which fails the job with the reason."""
        from atomd.data.dataset import source_sha256
        from atomd.data.tokenizer import load_tokenizer

        jobs = self.jobs
        spec = local_data(active.spec, jobs.data_names)
        try:
            sha256 = await asyncio.to_thread(
                lambda: source_sha256(spec.data, load_tokenizer(spec.tokenizer), spec.text_field)
            )
        except AtomdError as e:
            log.warning("job %s: data not hashed: %s", active.id, e)
            return
        active.spec = active.spec.model_copy(update={"data_sha256": sha256})
        async with jobs.sessions() as s, s.begin():
            await repo.set_job_spec(s, job_id=active.id, spec=active.spec.model_dump())
            await repo.add_event(
                s, kind="job.data_hash", job_id=active.id,
                message=f"data {active.spec.data[:200]!r} hashes to {sha256}: peers must match it",
            )  # fmt: skip
        advert = jobs.advert()
        if advert is not None and jobs.swarm is not None:
            jobs.swarm.announce(advert)
