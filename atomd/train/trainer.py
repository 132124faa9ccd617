"""The training loop shared by ``atomd train`` and the daemon's jobs.

``Trainer.run()`` is blocking and meant to run on a thread of its own. It stops at a step
boundary when ``stop_event`` is set, writing a checkpoint first, so nothing is lost.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from torch import Tensor
from tqdm import tqdm

from atomd import __version__
from atomd.data.dataset import VAL_BATCH, TokenDataset, load_dataset
from atomd.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer, tokenizer_from_json
from atomd.errors import (
    CheckpointError,
    ConfigError,
    DonorStateError,
    SwarmMovedOnError,
    TrainingError,
)
from atomd.logs import get_logger
from atomd.model.gpt import GPT, GPTConfig
from atomd.spec import JobSpec, lr_at
from atomd.train import checkpoint as ckpt
from atomd.train.metrics import MetricsLog, StepReport
from atomd.train.step_engine import StepEngine
from atomd.train.tracking import Trackers

log = get_logger(__name__)


class RoundPlugin(Protocol):
    """Something that acts on the replica between steps (the swarm's delta exchange)."""

    def attach(self, engine: StepEngine) -> None: ...
    def after_step(self, step: int) -> None: ...
    def finish(self, step: int, stop: threading.Event) -> None: ...
    def state_tensors(self) -> dict[str, Tensor]: ...
    def load_state_tensors(self, tensors: dict[str, Tensor]) -> bool: ...
    def adopt(self, donor: str | None = None) -> None: ...
    def before_snapshot(self) -> bool:
        """Just before a checkpoint that another peer will take: True if the state changed."""
        ...

    @property
    def version(self) -> int:
        """Rounds closed (0: the swarm's model is still the initial weights)."""
        ...

    def stats(self) -> dict[str, Any]:
        """What to report with each logged step (the cadence in force, time in sync)."""
        ...


PROBE_BATCH = 8  # sequences in the loss guard's probe batch (atomd.sync.guard)
PROBE_SEED = 99  # not the validation batches' seed
# The job's final model (the swarm's, its own, the peers' average) is chosen on this many times
# the probe's windows (the same seed: the probe's 16 first). Once per job, between models that
# differ by ~0.01 (0.004-0.031 at 256 kbit/s upload), where 16 windows leave a standard error
# of 0.003-0.0045 on the difference and 64 half that (``JobEnding._end_on_the_better_model``).
FINAL_PROBE_COUNT = 4


@dataclass(frozen=True)
class TrainSummary:
    state: Literal["finished", "stopped"]
    step: int
    tokens: int
    loss: float | None
    val_loss: float | None
    checkpoint: Path | None


class SnapshotRequests:
    """Requests for a checkpoint of the live state, written at the trainer's next step boundary
    (a peer joining a swarm job wants the swarm's current model, not the last checkpoint on
    disk). The event loop asks; the trainer thread serves every request pending at a boundary
    with one checkpoint. A future resolves to the checkpoint's step, or fails once the trainer
    has stopped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: list[concurrent.futures.Future[int]] = []
        self._closed = False

    def ask(self) -> concurrent.futures.Future[int]:
        fut: concurrent.futures.Future[int] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                fut.set_exception(RuntimeError("the trainer has stopped"))
            else:
                self._waiting.append(fut)
        return fut

    def serve(self, save: Callable[[], int]) -> None:
        """On the trainer thread, between two steps: one checkpoint for every request."""
        with self._lock:
            waiting, self._waiting = self._waiting, []
        waiting = [f for f in waiting if not f.done()]  # the asker may have given up
        if not waiting:
            return
        try:
            step = save()
        except BaseException as e:
            for f in waiting:
                _settle(f, exc=e)
            raise
        for f in waiting:
            _settle(f, step=step)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            waiting, self._waiting = self._waiting, []
        for f in waiting:
            _settle(f, exc=RuntimeError("the trainer has stopped"))


def _settle(
    f: concurrent.futures.Future[int], *, step: int = 0, exc: BaseException | None = None
) -> None:
    try:
        if exc is None:
            f.set_result(step)
        else:
            f.set_exception(exc)
    except concurrent.futures.InvalidStateError:  # cancelled meanwhile
        pass


# A donor's state may evaluate at most this much worse than the job's untrained model (an early
# swarm is barely better than it), and than what the job's other members last measured (their
# evaluation lags the state by up to an eval interval, and the swarm's estimate a joiner
# adopts by up to a round; the joiner evaluates fewer windows): ``donor_state_problem``.
UNTRAINED_SLACK = (1.05, 0.05)
CLAIMED_SLACK = (1.25, 0.1)
# The validation batches a donor's state is evaluated on: the swarm goes on meanwhile, and a
# restarted peer whose first deltas lag more than max_staleness rounds has them refused by
# some peers and not others (4 real daemons, a round every ~0.9 s, two evaluations of 20
# batches: 4.5 s from the fetch to the first step, deltas 5-6 rounds stale, the settled
# anchors 0.077 apart; measured with `atomd bench swarm --scenarios sigkill`).
ADOPT_EVAL_BATCHES = 4


def untrained_loss(vocab_size: int) -> float:
    """The validation loss of an untrained model: a uniform guess over the vocabulary (GPT-2's
    initialisation gives near-uniform logits: the tiny preset's 256 tokens, 5.531 measured
    against ln 256 = 5.545). A swarm job starts from random weights (an advert may not name
    ``init_from``), so the joiner need not evaluate one."""
    return math.log(vocab_size)


def donor_state_problem(untrained: float, taken: float, claimed: float | None) -> str | None:
    """Why a state taken from a peer, whose validation loss is ``taken``, is not trained on, or
    None: it is not finite, or worse than the job's ``untrained`` model or than the loss the
    job's other members ``claimed`` (None: unknown) by more than the slack (a factor and a
    term)."""
    if not math.isfinite(taken):
        return f"its validation loss is {taken}"
    (f, t), (cf, ct) = UNTRAINED_SLACK, CLAIMED_SLACK
    if taken > untrained * f + t:
        return (
            f"its validation loss {taken:.4f} is worse than the untrained model's {untrained:.4f}"
        )
    if claimed is not None and taken > claimed * cf + ct:
        return (
            f"its validation loss {taken:.4f} is far worse than the {claimed:.4f} the job's "
            "other members last measured"
        )
    return None


class Trainer:
    """Trains one model on one process with the step engine it is handed (resident or
    swapped: ``atomd.engine_choice.build_engine``) and that engine's ``plan`` (what plan.json and
    every checkpoint record)."""

    def __init__(
        self,
        spec: JobSpec,
        out_dir: Path,
        engine: StepEngine,
        *,
        plan: Mapping[str, Any],
        resume: bool = False,
        progress: bool = False,
        on_report: Callable[[StepReport], None] | None = None,
        stop_event: threading.Event | None = None,
        dataset: TokenDataset | None = None,
        on_checkpoint: Callable[[Path, int], None] | None = None,
        data_seed: int | None = None,
        plugin: RoundPlugin | None = None,
        adopt_step: int | None = None,
        adopt_claim: float | None = None,
        adopt_from: str | None = None,
        snapshots: SnapshotRequests | None = None,
    ) -> None:
        self.spec = spec
        self.out_dir = out_dir
        self.progress = progress
        self.on_report = on_report
        self.on_checkpoint = on_checkpoint
        # Peers of one swarm job share spec.seed (the same initial weights) but must not draw
        # the same batches: the daemon passes a seed derived from its peer id.
        self.data_seed = spec.seed if data_seed is None else data_seed
        self.plugin = plugin
        # A checkpoint at this step came from another peer (state transfer): the plugin decides
        # what of the donor's state this peer trains on (see SyncPlugin.adopt).
        self.adopt_step = adopt_step
        # ... and the validation loss the job's other members last measured (None: unknown):
        # the state is refused if it evaluates far worse (``donor_state_problem``).
        self.adopt_claim = adopt_claim
        self.adopt_from = adopt_from  # ... and the donor's peer id, where known
        self.snapshots = snapshots
        self.stop_event = stop_event or threading.Event()
        self.ckpt_root = ckpt.checkpoint_root(out_dir)
        self.metrics = MetricsLog(out_dir / "metrics.jsonl")
        # The engine's model: the preset's shape (with the spec's vocab_size), and for a model
        # started from an import (init_from) that checkpoint's activation.
        self.model_config = engine.model.config
        self.tokenizer = load_tokenizer(spec.tokenizer)
        vocab = self.model_config.vocab_size
        if self.tokenizer.vocab_size > vocab:
            raise ConfigError(
                f"tokenizer {spec.tokenizer!r} has {self.tokenizer.vocab_size:,} tokens, but the "
                f"model's vocabulary has {vocab:,} (preset {spec.preset!r}"
                + (f", vocab_size {spec.vocab_size}" if spec.vocab_size else "")
                + f"): set the job's vocab_size to {self.tokenizer.vocab_size}"
            )
        self._tokenizer_json = self.tokenizer.to_json().encode("utf-8")

        existing = ckpt.list_checkpoints(self.ckpt_root)
        if existing and not resume:
            raise ConfigError(
                f"{out_dir} already holds checkpoints (newest {existing[0].name}); "
                "pass --resume to continue that run, or choose another --out"
            )
        self.dataset = dataset or load_dataset(
            spec.data,
            seq_len=spec.effective_seq_len,
            val_fraction=spec.val_fraction,
            shard_index=spec.shard_index,
            num_shards=spec.num_shards,
            shard_mode=spec.shard_mode,
            tokenizer=self.tokenizer,
            vocab_size=vocab,
            text_field=spec.text_field,
        )
        if spec.data_sha256 is not None and self.dataset.sha256 != spec.data_sha256:
            raise ConfigError(
                f"data {spec.data!r} tokenized here (tokenizer {spec.tokenizer!r}) has sha256 "
                f"{self.dataset.sha256}, the job's data_sha256 is {spec.data_sha256}: this "
                "peer's copy of the data or its tokenizer differs, so it does not train the job"
            )
        self.engine = engine
        # Resident or swapped, and the swap plan: recorded with the run and every checkpoint.
        self.plan = dict(plan)
        if plugin is not None:
            plugin.attach(self.engine)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "plan.json").write_text(json.dumps(self.plan, indent=2) + "\n")
        self.start_step = 0
        self.last_checkpoint: Path | None = None
        # The same windows whatever the batch size; at most a micro-batch of them at a time.
        self.val_batches = self.dataset.val_batches(
            count=spec.eval_batches, batch_size=min(spec.micro_batch_size, VAL_BATCH)
        )
        if resume:
            self._resume()
        guard_with = getattr(plugin, "guard_with", None)
        if guard_with is not None:  # the swarm's merges are checked on a fixed batch's loss
            guard_with(
                self.dataset.val_batches(count=1, batch_size=PROBE_BATCH, seed=PROBE_SEED),
                self.dataset.val_batches(
                    count=FINAL_PROBE_COUNT, batch_size=PROBE_BATCH, seed=PROBE_SEED
                ),
            )

    def _resume(self) -> None:
        found = ckpt.load_latest(self.ckpt_root)
        if found is None:
            log.info("no checkpoint in %s; starting from step 0", self.ckpt_root)
            return
        # Taken from a peer just now, or before this daemon stopped and had not checked it.
        marker = found.path / ckpt.DONATED_FILE
        donated = found.step == self.adopt_step or marker.exists()
        # A donor's state is checked against an untrained model's loss and the other members'
        # word: a state far worse than either is a broken or hostile donor's, and the job takes
        # another's (``JobManager``); so is one that does not load (another model, misshapen
        # tensors or sync state).
        try:
            saved = GPTConfig.from_dict(found.meta["model_config"])
            if saved != self.model_config:
                raise CheckpointError(
                    f"{found.path} holds a {saved} model, the spec asks for {self.model_config}"
                )
            self.engine.load_tensors(found.model, found.state)
            if self.plugin is not None:
                has_sync_state = self.plugin.load_state_tensors(found.state)
                if has_sync_state and donated:
                    self.plugin.adopt(self.adopt_from if found.step == self.adopt_step else None)
        except (CheckpointError, KeyError, TypeError, ValueError) as e:
            if not donated:
                raise
            raise DonorStateError(
                f"the state of step {found.step} from a peer does not load: {e}", found.step
            ) from e
        if donated:
            untrained = untrained_loss(self.model_config.vocab_size)
            taken = self.engine.evaluate(self.val_batches[:ADOPT_EVAL_BATCHES])
            problem = donor_state_problem(untrained, taken, self.adopt_claim)
            if problem is not None:
                raise DonorStateError(
                    f"the state of step {found.step} from a peer: {problem}", found.step
                )
            marker.unlink(missing_ok=True)
            claim = "unknown" if self.adopt_claim is None else f"{self.adopt_claim:.4f}"
            log.info("the state of step %d from a peer: validation loss %.4f (untrained %.4f, "
                     "the other members %s)", found.step, taken, untrained, claim)  # fmt: skip
        ckpt.set_rng_state(found.state)
        self.start_step = found.step
        self.last_checkpoint = found.path
        self.metrics.truncate_after(found.step)
        log.info("resumed from %s (step %d)", found.path, found.step)

    def save(self, step: int) -> Path:
        meta = {
            "atomd_version": __version__,
            "model_config": self.model_config.to_dict(),
            "spec": self.spec.model_dump(),
            # Sampling is a pure function of (seed, shard, step): the step is the data position.
            "data_position": {"step": step, "shard_index": self.spec.shard_index},
            "tokens": step * self.spec.tokens_per_step,
            "plan": self.plan,
            "tokenizer": self.spec.tokenizer,
        }
        state = {**self.engine.optimizer_tensors(), **ckpt.rng_state()}
        if self.plugin is not None:
            state.update(self.plugin.state_tensors())
        path = ckpt.save_checkpoint(
            self.ckpt_root,
            step=step,
            model=self.engine.model_tensors(),
            state=state,
            meta=meta,
            keep=self.spec.keep_checkpoints,
            extra={ckpt.TOKENIZER_FILE: self._tokenizer_json},
        )
        self.last_checkpoint = path
        if self.on_checkpoint is not None:
            self.on_checkpoint(path, step)
        return path

    def _precision_stats(self) -> dict[str, Any] | None:
        stats = getattr(self.engine, "precision_stats", None)
        out: dict[str, Any] | None = stats() if callable(stats) else None
        return out

    def _checkpoint_now(self, step: int) -> int:
        """A checkpoint of this very step for a peer that takes it (written unless it exists
        already and the plugin changed nothing for it: ``RoundPlugin.before_snapshot``)."""
        flushed = self.plugin is not None and self.plugin.before_snapshot()
        if (
            flushed
            or self.last_checkpoint is None
            or self.last_checkpoint.name != ckpt.checkpoint_dir(self.ckpt_root, step).name
        ):
            self.save(step)
        return step

    def run(self) -> TrainSummary:
        spec, total = self.spec, self.spec.total_steps
        step = self.start_step
        loss: float | None = None
        val_loss: float | None = None
        bar = tqdm(
            total=total, initial=step, disable=not self.progress, unit="step", dynamic_ncols=True
        )
        t_start = time.perf_counter()
        window_tokens, window_time = 0, 0.0
        trackers = Trackers(self.out_dir, start_step=self.start_step, config=self.spec.model_dump())
        try:
            while step < total and not self.stop_event.is_set():
                lr = lr_at(spec, step)
                t0 = time.perf_counter()
                batches = [
                    self.dataset.train_batch(
                        seed=self.data_seed, step=step, micro=m, batch_size=spec.micro_batch_size
                    )
                    for m in range(spec.grad_accum)
                ]
                loss = self.engine.train_step(batches, lr)
                if not math.isfinite(loss):
                    raise TrainingError(
                        f"loss became {loss} at step {step + 1}; the last good checkpoint is "
                        f"{self.last_checkpoint or 'none'} (lower the learning rate and resume)"
                    )
                step += 1
                if self.plugin is not None:  # round boundaries, deltas absorbed in between
                    if step < total:
                        try:
                            self.plugin.after_step(step)
                        except SwarmMovedOnError:
                            self.save(step)  # where it goes on if no peer's state is had
                            if self.stop_event.is_set():
                                break  # asked to stop: stopped here, not a retake
                            raise
                    else:  # the last round, and the others' last deltas, make the final model
                        waited = time.perf_counter()
                        self.plugin.finish(step, self.stop_event)
                        t0 += time.perf_counter() - waited  # waiting is not training time
                window_time += time.perf_counter() - t0
                window_tokens += spec.tokens_per_step
                val_loss = None
                if step % spec.eval_interval == 0 or step == total:
                    val_loss = self.engine.evaluate(self.val_batches)
                if step % spec.log_interval == 0 or val_loss is not None or step == total:
                    report = StepReport(
                        step=step,
                        tokens=step * spec.tokens_per_step,
                        loss=loss,
                        lr=lr,
                        tokens_per_s=window_tokens / max(window_time, 1e-9),
                        val_loss=val_loss,
                        elapsed_s=time.perf_counter() - t_start,
                        sync=self.plugin.stats() if self.plugin is not None else None,
                        precision=self._precision_stats(),
                    )
                    window_tokens, window_time = 0, 0.0
                    row = report.to_row()
                    self.metrics.write(row)
                    trackers.write(row)
                    if self.on_report is not None:
                        self.on_report(report)
                    post = {"loss": f"{loss:.3f}", "tok/s": f"{report.tokens_per_s:,.0f}"}
                    if val_loss is not None:
                        post["val"] = f"{val_loss:.3f}"
                    bar.set_postfix(post, refresh=False)
                bar.update(1)
                if step % spec.checkpoint_interval == 0 and step < total:
                    self.save(step)
                if self.snapshots is not None and step < total:
                    self.snapshots.serve(functools.partial(self._checkpoint_now, step))
        finally:
            bar.close()
            trackers.close()
            if self.snapshots is not None:
                self.snapshots.close()
        if self.last_checkpoint is None or ckpt.list_checkpoints(self.ckpt_root)[:1] != [
            ckpt.checkpoint_dir(self.ckpt_root, step)
        ]:
            self.save(step)
        state: Literal["finished", "stopped"] = "finished" if step >= total else "stopped"
        final_val = val_loss if val_loss is not None else None
        return TrainSummary(
            state=state,
            step=step,
            tokens=step * spec.tokens_per_step,
            loss=loss,
            val_loss=final_val,
            checkpoint=self.last_checkpoint,
        )


def tokenizer_of(found: ckpt.Checkpoint) -> Tokenizer:
    """The tokenizer a checkpoint carries (bytes for those written before tokenizers)."""
    path = found.path / ckpt.TOKENIZER_FILE
    if not path.is_file():
        return ByteTokenizer()
    return tokenizer_from_json(path.read_text(encoding="utf-8"), name=str(path))


def model_from_checkpoint(path: Path, device: torch.device) -> tuple[GPT, ckpt.Checkpoint]:
    """Build the model a checkpoint describes and load its weights (newest good one)."""
    found = ckpt.load_latest(path)
    if found is None:
        raise CheckpointError(f"no checkpoint found in {path}")
    from atomd.train.step_engine import load_model_tensors

    model = GPT(GPTConfig.from_dict(found.meta["model_config"]))
    load_model_tensors(model, found.model)
    return model.to(device), found
