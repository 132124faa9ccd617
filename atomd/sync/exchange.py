"""The loop side of the delta exchange: one ``DeltaExchange`` per daemon, for its swarm jobs.

A delta's whole path stays in ``atomd.sync``:

1. the trainer thread's ``SyncPlugin`` (``runner``) closes a round and hands the signed frame to
   the exchange (thread-safe: ``DeltaExchange.plugin`` wires it);
2. ``delivery.RoundDelivery`` sends it to the round's targets (``job_peers.round_targets``:
   every peer that trains the job), through ``uplink.Uplink`` (``POST
   /p2p/v1/jobs/{id}/deltas``, one peer after another, paced by the uplink's measured rate; one
   retry on a network error, none on a refusal); a peer that starts training the job later is
   sent the recent rounds' frames it missed, oldest first and before the round's own;
3. on each receiver the peer plane hands the body to ``DeltaExchange.receive``:
   ``admission.FrameAdmission`` checks it whole off the event loop (``wire.FrameDecoder``, the
   replay guard) and queues it in the job's plugin inbox; the plugin merges it after the next
   optimizer step. A frame that comes before the job's plugin is attached (a starting or
   restarted daemon loading torch, ``expect``, then fetching the swarm's state) is kept,
   bounded, and checked once it is;
4. every delta sent, received, applied or refused is recorded in one place
   (``records.RoundRecords``), and what counts against a sender goes to membership
   (``judgment.SenderJudgment``).

The exchange depends downward only: on the peer client that signs requests and on two narrow
interfaces (``job_peers``), ``JobPeers`` (which live peers train a job, and their keys: the
swarm membership) and ``TrainingJobs`` (whether this daemon still trains a job: the job
manager).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from atomd.p2p.client import PeerClient
from atomd.p2p.identity import Identity
from atomd.spec import JobSpec, lr_at
from atomd.sync.admission import FrameAdmission
from atomd.sync.delivery import RoundDelivery
from atomd.sync.job_peers import JobPeers, RoundPeers, TrainingJobs
from atomd.sync.job_table import JobTable
from atomd.sync.judgment import SenderJudgment
from atomd.sync.records import RoundRecords
from atomd.sync.uplink import Uplink
from atomd.telemetry import Telemetry

if TYPE_CHECKING:  # torch loads with the first swarm job, not when the daemon starts
    from atomd.sync.runner import SyncPlugin
    from atomd.sync.state import MergeReport


class DeltaExchange:
    """Sends each round's frame to the job's peers, checks and queues the frames that arrive,
    and records both. ``run()`` lives in the daemon's TaskGroup and owns the uploads."""

    def __init__(
        self,
        *,
        identity: Identity,
        client: PeerClient,
        peers: JobPeers,
        sessions: async_sessionmaker[AsyncSession],
        telemetry: Telemetry,
    ) -> None:
        self.identity = identity
        self.client = client
        self.peers = peers
        self.telemetry = telemetry
        self.jobs: TrainingJobs | None = None  # set by the daemon once the job manager exists
        self.job_table = JobTable()
        self.round_peers = RoundPeers(peers)
        self.records = RoundRecords(
            sessions=sessions, telemetry=telemetry, codec_of=self.job_table.codec
        )
        self.judgment = SenderJudgment(peers)
        self.uplink = Uplink(client=client, round_peers=self.round_peers, telemetry=telemetry)
        self.delivery = RoundDelivery(
            uplink=self.uplink,
            round_peers=self.round_peers,
            jobs=self.job_table,
            records=self.records,
            telemetry=telemetry,
            record_merge=lambda job_id, merge: self.record_merge(job_id, merge),
        )
        self.admission = FrameAdmission(
            peers=peers,
            trains=lambda job_id: self.jobs is not None and self.jobs.trains(job_id),
            jobs=self.job_table,
            round_peers=self.round_peers,
            records=self.records,
            judgment=self.judgment,
            telemetry=telemetry,
        )
        self._tg: asyncio.TaskGroup | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def run(self) -> None:
        """Own the uploads and records until cancelled."""
        self._loop = asyncio.get_running_loop()
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                await asyncio.Event().wait()
        finally:
            self._tg = None

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        if self._tg is None:  # not running (yet, or any more): nothing to own it
            coro.close()
            return
        self._tg.create_task(coro, name=name)

    def _from_trainer(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        """Hand a coroutine made on the trainer thread to the loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            coro.close()
            return
        loop.call_soon_threadsafe(self._spawn, coro, name)

    # -- the job manager's side --------------------------------------------------------------

    def expect(self, job_id: str, spec: JobSpec) -> None:
        """``job_id`` is about to train here: its frames are kept from now on, until its
        plugin is attached (``plugin``) or the job is released. Called before the trainer's
        modules load (seconds on a busy machine), so that a restarted daemon does not refuse
        the frames the others send it meanwhile."""
        self.job_table.expect(job_id, spec)

    def plugin(self, job_id: str, spec: JobSpec, *, may_retake: bool = False) -> SyncPlugin:
        """The trainer-thread side of the exchange for one job, wired to this exchange;
        ``may_retake``: it may end the trainer to take the swarm's state again, far behind
        (``SyncPlugin.may_retake``)."""
        from atomd.sync.runner import SyncPlugin

        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        rounds = self.round_peers
        plugin = SyncPlugin(
            job_id=job_id,
            spec=spec.sync,
            identity=self.identity,
            counted=lambda base_version: [
                p.id for p in rounds.counted(job_id, base_version, self._max_staleness(job_id))
            ],
            send=lambda out: self._from_trainer(self.delivery.deliver(out), f"round-{out.step}"),
            absorbed=lambda job, merge: self._from_trainer(
                self.record_merge(job, merge), "absorbed"
            ),
            send_average=lambda frame, timeout_s: self._from_trainer(
                self.delivery.deliver_average(job_id, frame, timeout_s), "average"
            ),
            finishers=lambda: rounds.finishers(job_id),
            training=lambda base_version: [p.id for p in rounds.training(job_id, base_version)],
            total_steps=spec.total_steps,
            lr=functools.partial(lr_at, spec),
        )
        plugin.excluded = lambda sender: self.peers.exclusion(sender) is not None
        plugin.may_retake = may_retake
        plugin.on_attached = lambda: self._from_trainer(self.admission.drain_early(job_id), "early")
        # ``attach`` asks who is counted on version 0, before a restart's or a joiner's
        # checkpoint sets the state's version (hundreds of rounds on): every peer would then
        # read as silent since round 0, and the first round count this peer alone, committing
        # its whole delta where the others commit what it sent. Silence counts from the
        # restored version on.
        plugin.on_restored = functools.partial(rounds.forget_counted, job_id)
        self.job_table.plugins[job_id] = plugin
        self.expect(job_id, spec)  # the same bound, if the manager has not expected it
        return plugin

    def _max_staleness(self, job_id: str) -> int:
        """The job's max_staleness (0 once it no longer trains here)."""
        max_staleness = self.job_table.max_staleness(job_id)
        return max_staleness if max_staleness is not None else 0

    def drop_sender(self, peer_id: str) -> None:
        """``peer_id`` was quarantined or banned: forget its deltas waiting in every inbox
        (those held until a round closes leave at the trainer's next merge: ``_inbox``)."""
        for plugin in self.job_table.plugins.values():
            plugin.inbox.drop_sender(peer_id)
        self.records.drop_sender(peer_id)

    def release(self, job_id: str) -> None:
        """The job no longer trains here: frames for it are refused from now on."""
        self.job_table.release(job_id)
        self.round_peers.release(job_id)
        self.admission.early.take(job_id)
        self.delivery.release(job_id)
        self.uplink.release(job_id)
        self.records.release(job_id)

    # -- the peer plane's side ---------------------------------------------------------------

    def max_frame_bytes(self, job_id: str) -> int:
        """The largest frame accepted for ``job_id`` (0: not training it here)."""
        return self.job_table.max_frame_bytes(job_id)

    async def receive(self, job_id: str, body: bytes, signer: str) -> int:
        """Check and queue one frame for the job's plugin; returns its size
        (``FrameAdmission.receive``)."""
        return await self.admission.receive(job_id, body, signer)

    # -- what a merge did --------------------------------------------------------------------

    async def record_merge(self, job_id: str, merge: MergeReport) -> None:
        """Record what a merge did with the deltas it was given (applied, clipped, or why
        not), and count the strikes against their senders."""
        records = self.records
        rows = [
            records.merged_row(job_id, a.sender, a.round, a.staleness, True, a.note)
            for a in merge.applied
        ] + [records.merged_row(job_id, r.sender, r.round, None, False, r.reason)
             for r in merge.refused]  # fmt: skip
        if job_id in self.job_table.plugins:  # who still contributes (``RoundPeers.counted``)
            applied = [a.sender for a in merge.applied if not a.strike]
            self.round_peers.applied(job_id, merge.version, applied)
        await records.record(job_id, rows, ratio_of=self.job_table.model_bytes(job_id))
        await self.judgment.merge(merge, self.identity.peer_id)
