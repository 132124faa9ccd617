"""Taking a swarm job's state from a peer that trains it (a donor): before the job trains here,
again when the swarm has moved on past what this copy can merge, and from another donor when
the trainer refuses the state one gave."""

from __future__ import annotations

import asyncio
import functools
import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING

from atomd.aio import unless_set
from atomd.errors import AtomdError, DonorStateError, SwarmMovedOnError
from atomd.jobs.active import ActiveJob
from atomd.jobs.admission import state_file_bound
from atomd.jobs.links import JobLinks
from atomd.jobs.recording import JobRecorder
from atomd.logs import get_logger
from atomd.train.checkpoint import (
    DONATED_FILE,
    checkpoint_dir,
    checkpoint_root,
    checkpoint_step,
    list_checkpoints,
    remove_checkpoints_after,
)

if TYPE_CHECKING:  # torch loads when the first job trains, not when the daemon starts
    from atomd.train.trainer import TrainSummary

log = get_logger("atomd.jobs")

# Donors whose state a joiner refuses (``DonorStateError``) before it gives up on the job.
DONOR_TRIES = 3
# Times a job here takes the swarm's state again after the swarm moved on past what it can
# merge (``SwarmMovedOnError``); beyond that it catches up by closing rounds early.
RETAKES = 3


class SwarmStateTaker:
    """Fetches a swarm job's newest state from its donors through ``links.swarm``, and decides,
    when the trainer ends, whether the job takes a state again. ``release``: frees the daemon
    of a job that ended while it waited (``JobManager.release``)."""

    def __init__(
        self, links: JobLinks, recorder: JobRecorder, release: Callable[[ActiveJob], None]
    ) -> None:
        self.links = links
        self.recorder = recorder
        self.release = release

    async def take(self, active: ActiveJob) -> bool:
        """Before a swarm job trains here: fetch the swarm's newest state from a peer that
        trains it, when that is newer than our own checkpoint (retaking, ``moved_on``: at
        whatever step, our own checkpoints past it removed: they hold the rounds this peer
        closed alone, and a peer cut off trains faster alone). False if the job ended here:
        it failed, or a stop or a shutdown came while it waited for donors or a transfer
        (recorded as the end of a training would be, at its newest checkpoint's step; the
        transfer is cancelled and its partial folder removed, so that a SIGTERM does not wait
        out a transfer of up to 15 minutes)."""
        swarm = self.links.swarm
        assert swarm is not None
        release = functools.partial(self.release, active)
        retake, active.retaking = active.retaking, False
        donors = active.donors
        root = checkpoint_root(active.out_dir)
        own = await asyncio.to_thread(list_checkpoints, root)
        own_step = checkpoint_step(own[0]) if own else 0
        if not donors and active.resume:
            # Restarted: wait until the membership can tell who trains the job now.
            donors = await swarm.settled_donors(active.id, give_up=active.stopping.is_set)
        if active.stopping.is_set():
            await self.recorder.record_end(active, "stopped", own_step, release)
            return False
        if not donors:
            return True
        # A donor whose swarm has closed no round yet answers "no state": the initial weights
        # are the swarm's model then, and the joiner starts from them at round 0 like it.
        at_least = 1 if retake else own_step + 1
        try:
            fetched, got = await unless_set(
                active.stopping,
                swarm.fetch_state(
                    active.id, donors, root, max_file_bytes=state_file_bound(active.spec),
                    at_least=at_least,
                ),
            )  # fmt: skip
        except AtomdError as e:
            if own:  # our own checkpoint still serves: resume from it
                log.warning("job %s: %s; resuming from our own checkpoint", active.id, e)
                return True
            await self.recorder.set_state(
                active.id, "failed", str(e), "job.failed", str(e), release
            )
            return False
        if not fetched:  # a stop or SIGTERM must not wait out a transfer (15 minutes)
            log.info("job %s: stopped; the state transfer is cancelled", active.id)
            await self.recorder.record_end(active, "stopped", own_step, release)
            return False
        if got is not None and retake:
            await asyncio.to_thread(remove_checkpoints_after, root, got.step)
        if got is not None and (retake or got.step >= own_step):
            active.adopt_step, active.claimed_val = got.step, got.claimed_val
            active.adopt_from = got.donor_id
            log.info("job %s continues from the swarm's state at step %d", active.id, got.step)
        return True

    async def moved_on(self, active: ActiveJob, fut: asyncio.Future[TrainSummary]) -> bool:
        """Whether the trainer ended because the swarm has moved on past what it can merge
        (``SwarmMovedOnError``: it was stopped or cut off for a while) and the job should take
        the swarm's state again, as a restarted daemon does: from a peer that trains it now,
        if newer than the checkpoint the trainer wrote as it ended (``take``), with a fresh
        plugin. Up to RETAKES times a job."""
        e = None if fut.cancelled() else fut.exception()
        if not isinstance(e, SwarmMovedOnError) or self.links.swarm is None:
            return False
        active.retakes += 1
        # A fresh plugin at once, before anything is awaited: the frames that come from now
        # on are kept for it until it holds the state (the old one's inbox has no trainer).
        active.plugin = None
        if self.links.exchange is not None:
            active.plugin = self.links.exchange.plugin(
                active.id, active.spec, may_retake=active.retakes < RETAKES
            )
        active.resume, active.donors, active.retaking = True, [], True
        active.adopt_step = active.claimed_val = active.adopt_from = None
        log.warning("job %s: step %d: %s (%d of %d)", active.id, e.step, e, active.retakes,
                    RETAKES)  # fmt: skip
        await self.recorder.event(active.id, "job.retake", f"step {e.step}: {e}")
        return True

    async def donor_refused(self, active: ActiveJob, fut: asyncio.Future[TrainSummary]) -> bool:
        """Whether the trainer refused a state another peer gave (``DonorStateError``) and the
        job should take another: its checkpoint is removed, its donor (the one the checkpoint's
        ``DONATED_FILE`` names: the fetch writes it, the trainer removes it once the state
        passed) is not asked again, up to DONOR_TRIES states."""
        e = None if fut.cancelled() else fut.exception()
        swarm = self.links.swarm
        if not isinstance(e, DonorStateError) or swarm is None:
            return False
        where = checkpoint_dir(checkpoint_root(active.out_dir), e.step)
        named = where / DONATED_FILE
        donor = await asyncio.to_thread(named.read_text) if named.exists() else None
        active.tries += 1
        log.warning("job %s: %s; not asking %s again", active.id, e, donor or "its donor")
        if donor:
            swarm.distrust(donor)
        await asyncio.to_thread(shutil.rmtree, where, True)
        await self.recorder.event(active.id, "job.state_refused", f"{e} (from {donor or 'a peer'})")
        active.donors = [d for d in active.donors if d != donor]
        active.adopt_step = active.claimed_val = active.adopt_from = None
        # The next try gets a fresh plugin, as the first did: this one holds the refused
        # trainer's model and the sync state built on it (a second model beside it on the
        # device), and the refused donor's anchor and round, with the frames queued since.
        active.plugin = None
        return active.tries < DONOR_TRIES
