"""What runs on the trainer thread: the import of torch and the training code, the thread's
priority, and the build and run of one job's trainer, whose reports reach the event loop
through ``call_soon_threadsafe`` onto the job's queue."""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import os
import sys
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

from atomd.jobs.active import (
    ActiveJob,
    CheckpointSaved,
    TrainerMessage,
    TrainerResumed,
    TrainerStarted,
)
from atomd.jobs.admission import local_data
from atomd.logs import get_logger
from atomd.train.metrics import read_metrics

if TYPE_CHECKING:  # torch loads when the first job trains, not when the daemon starts
    from atomd.train.trainer import TrainSummary

log = get_logger("atomd.jobs")

TRAINING_MODULES = ("atomd.train.trainer", "atomd.sync.runner")


def load_training_modules() -> None:
    """Import torch and the training code (blocking: call it off the event loop), and what
    torch loads lazily on first use: building the first AdamW imports torch._dynamo (3 s of
    a tiny job's 3.5 s start on 2 cores)."""
    for name in TRAINING_MODULES:
        importlib.import_module(name)
    import torch

    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])


def lower_thread_priority(nice: int) -> None:
    """Make the calling thread ``nice`` steps nicer (Linux, where niceness is per thread;
    elsewhere nothing). Threads it starts later, torch's workers included, inherit it. A
    thread may always lower its own priority; a failure to is logged and training goes on."""
    if nice <= 0 or sys.platform != "linux":
        return
    tid = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, now + nice))
    except OSError as e:
        log.warning("could not lower the training thread's priority: %s", e)


def data_seed(peer_id: str, seed: int) -> int:
    """This peer's sampling seed for a job: distinct per peer, stable across restarts."""
    digest = hashlib.sha256(f"{peer_id}:{seed}".encode()).digest()
    return int.from_bytes(digest[:6], "big")


def train_blocking(
    active: ActiveJob,
    loop: asyncio.AbstractEventLoop,
    *,
    device: str,
    peer_id: str,
    data_names: Mapping[str, str],
) -> TrainSummary:
    """Build ``active``'s trainer and run it (on the trainer thread: it blocks until the job
    ends), telling the loop of its start, resume, steps and checkpoints."""
    from atomd.engine_choice import build_engine
    from atomd.train.trainer import Trainer

    def send(item: TrainerMessage) -> None:
        loop.call_soon_threadsafe(active.queue.put_nowait, item)

    spec = local_data(active.spec, data_names)
    built = build_engine(spec, device)
    trainer = Trainer(
        spec,
        active.out_dir,
        built.engine,
        plan=built.plan,
        resume=active.resume,
        on_report=send,
        on_checkpoint=lambda path, step: send(CheckpointSaved(path, step)),
        stop_event=active.stop_event,
        data_seed=data_seed(peer_id, active.spec.seed),
        plugin=active.plugin,
        adopt_step=active.adopt_step,
        adopt_claim=active.claimed_val,
        adopt_from=active.adopt_from,
        snapshots=active.snapshots,
    )
    if active.resume:
        rows = read_metrics(trainer.metrics.path) if trainer.metrics.path.exists() else []
        send(TrainerResumed(trainer.start_step, rows))
    send(TrainerStarted(trainer.start_step))
    return trainer.run()
