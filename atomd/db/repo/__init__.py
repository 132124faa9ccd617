"""Repository functions: the only way atomd reads and writes its records.

Transactions: every function runs inside the caller's transaction and flushes, but never
commits. Callers own the unit of work::

    async with sessionmaker() as s, s.begin():
        await repo.set_job_state(s, job_id=job_id, state="running")
        await repo.add_event(s, kind="job.started", message="...", job_id=job_id)

Functions take the session first and everything else by keyword, and return frozen records
from ``atomd.db.schemas``, never ORM rows. Every function that takes a ``job_id`` of an
existing job (all but ``create_job`` and ``add_event``) raises ``NotFoundError`` if there is
no such job. Lists of logs (jobs, rounds, events) come newest first; progress comes in step
order, a series to plot or page through with ``after_step``.

Retention: the events keep their newest rows (``prune_events``), a job its newest rounds
(``prune_rounds``) and its newest progress points with the older ones thinned over the run
(``thin_progress``); ``atomd.db.retention`` runs the last two in short batches.

The functions live by the records they serve: ``jobs`` (the node, jobs, runs, checkpoints),
``progress``, ``rounds``, ``events`` and ``peers`` (peers, bans, quarantines); this package
names them all, so callers write ``repo.add_event(...)``.
"""

from atomd.db.repo.events import add_event, list_events, prune_events, swarm_stopped_jobs
from atomd.db.repo.jobs import (
    active_jobs,
    add_checkpoint,
    advance_job,
    create_job,
    delete_job,
    get_job,
    get_or_create_node,
    jobs_touched_since,
    latest_checkpoint,
    list_jobs,
    next_run,
    set_job_plan,
    set_job_spec,
    set_job_state,
    set_run,
)
from atomd.db.repo.peers import (
    add_ban,
    add_quarantine,
    list_bans,
    list_peers,
    list_quarantines,
    remove_ban,
    remove_quarantines,
    upsert_peer,
)
from atomd.db.repo.progress import (
    add_progress,
    delete_progress_after,
    list_progress,
    progress_curve,
    thin_progress,
    thinned_until,
)
from atomd.db.repo.rounds import add_round, list_rounds, prune_rounds
from atomd.db.repo.rows import PRUNE_BATCH

__all__ = [
    "PRUNE_BATCH",
    "active_jobs",
    "add_ban",
    "add_checkpoint",
    "add_event",
    "add_progress",
    "add_quarantine",
    "add_round",
    "advance_job",
    "create_job",
    "delete_job",
    "delete_progress_after",
    "get_job",
    "get_or_create_node",
    "jobs_touched_since",
    "latest_checkpoint",
    "list_bans",
    "list_events",
    "list_jobs",
    "list_peers",
    "list_progress",
    "list_quarantines",
    "list_rounds",
    "next_run",
    "progress_curve",
    "prune_events",
    "prune_rounds",
    "remove_ban",
    "remove_quarantines",
    "set_job_plan",
    "set_job_spec",
    "set_job_state",
    "set_run",
    "swarm_stopped_jobs",
    "thin_progress",
    "thinned_until",
    "upsert_peer",
]
