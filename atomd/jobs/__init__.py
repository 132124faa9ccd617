"""The job manager: one training job at a time, run on a dedicated trainer thread.

The event loop never waits for training: the trainer thread hands step reports and checkpoint
notices to the loop through ``call_soon_threadsafe`` onto an asyncio queue, and the loop records
them in SQLite. States: pending -> running -> stopping -> stopped | finished | failed.

Swarm jobs (scope "swarm", the default) are announced to the peers through a ``SwarmLink``;
a peer that hears of one it has no record of joins it (auto-join), fetching the newest state
from a live peer first, and trains it with a plugin from the ``DeltaLink`` (the delta exchange).
A stop is local, or swarm-wide when asked.

Durability: ``metrics.jsonl`` and the checkpoints are written by the trainer thread itself, so
nothing depends on the loop keeping up. After a crash, a restarted daemon resumes every job that
was pending or running from its newest good checkpoint, and re-syncs the progress table with the
run's ``metrics.jsonl`` (truncated to that checkpoint).

The package's parts: ``manager`` (``JobManager``: the commands and queries, and the one job
it trains), ``admission`` (what may start here), ``joining`` (the swarm's jobs taken up),
``donor_state`` (a swarm job's state from its donors), ``driving`` (the loop's side of a
training), ``trainer_thread`` (the thread's side), ``recording`` (the database's side),
``active`` (the job trained now) and ``links`` (the swarm and the delta exchange).
"""

from atomd.jobs.active import Scope
from atomd.jobs.manager import JobManager
from atomd.jobs.trainer_thread import load_training_modules

__all__ = ["JobManager", "Scope", "load_training_modules"]
