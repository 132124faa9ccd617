from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from atomd.errors import ConfigError, SwarmMovedOnError, TrainingError
from atomd.train.metrics import StepReport, read_metrics
from atomd.train.trainer import model_from_checkpoint
from tests.conftest import fast_spec, trainer_for


def test_training_lowers_the_loss_and_writes_metrics(tmp_path: Path, text_file: Path) -> None:
    spec = fast_spec(data=str(text_file), max_steps=30, lr=3e-3, eval_interval=10)
    summary = trainer_for(spec, tmp_path, device="cpu").run()
    assert summary.state == "finished" and summary.step == 30
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 31))
    for r in rows:
        assert {"step", "tokens", "loss", "tokens_per_s"} <= set(r)
        assert r["tokens"] == r["step"] * spec.tokens_per_step
    evals = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in evals] == [10, 20, 30]
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert summary.checkpoint is not None and summary.checkpoint.name == "step-00000030"


def _losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(path / "metrics.jsonl")}


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_resume_continues_exactly(tmp_path: Path, text_file: Path, grad_accum: int) -> None:
    """N steps, stop, resume for M: the same losses as N + M straight (CPU, fixed seed)."""
    spec = fast_spec(
        data=str(text_file), max_steps=14, grad_accum=grad_accum, checkpoint_interval=100
    )
    straight = tmp_path / "straight"
    trainer_for(spec, straight, device="cpu").run()

    stop = threading.Event()

    def stop_at_8(r: StepReport) -> None:
        if r.step == 8:
            stop.set()

    split = tmp_path / "split"
    first = trainer_for(spec, split, device="cpu", on_report=stop_at_8, stop_event=stop).run()
    assert first.state == "stopped" and first.step == 8  # stopped at a step boundary, saved
    resumed = trainer_for(spec, split, device="cpu", resume=True)
    assert resumed.start_step == 8
    second = resumed.run()
    assert second.state == "finished" and second.step == 14
    assert _losses(split) == _losses(straight)  # exact equality, every step
    a, _ = model_from_checkpoint(straight, torch.device("cpu"))
    b, _ = model_from_checkpoint(split, torch.device("cpu"))
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), n


def test_resume_after_a_crash_drops_rows_past_the_checkpoint(
    tmp_path: Path, text_file: Path
) -> None:
    spec = fast_spec(data=str(text_file), max_steps=10, checkpoint_interval=4)
    trainer_for(spec, tmp_path, device="cpu").run()
    # Simulate a crash after step 10's rows but with only step 8 safely on disk.
    for p in (tmp_path / "checkpoints").iterdir():
        if p.name == "step-00000010":
            (p / "meta.json").unlink()
    t = trainer_for(spec, tmp_path, device="cpu", resume=True)
    assert t.start_step == 8
    assert max(r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")) == 8
    t.run()
    steps = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert steps == list(range(1, 11))


def test_existing_run_is_not_overwritten(tmp_path: Path, text_file: Path) -> None:
    spec = fast_spec(data=str(text_file), max_steps=2)
    trainer_for(spec, tmp_path, device="cpu").run()
    with pytest.raises(ConfigError, match="--resume"):
        trainer_for(spec, tmp_path, device="cpu")


def test_resume_with_another_model_is_refused(tmp_path: Path, text_file: Path) -> None:
    from atomd.errors import CheckpointError

    trainer_for(fast_spec(data=str(text_file), max_steps=2), tmp_path, device="cpu").run()
    with pytest.raises(CheckpointError, match="holds a"):
        trainer_for(
            fast_spec(data=str(text_file), preset="small", seq_len=32),
            tmp_path,
            device="cpu",
            resume=True,
        )


def test_nan_loss_stops_without_poisoning_the_checkpoint(tmp_path: Path, text_file: Path) -> None:
    spec = fast_spec(data=str(text_file), max_steps=10, checkpoint_interval=3)
    t = trainer_for(spec, tmp_path, device="cpu")
    real_step = t.engine.train_step
    calls = {"n": 0}

    def poisoned(batches, lr):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        return float("nan") if calls["n"] == 5 else real_step(batches, lr)

    t.engine.train_step = poisoned  # type: ignore[method-assign]
    with pytest.raises(TrainingError, match=r"loss became nan at step 5.*step-00000003"):
        t.run()
    names = [p.name for p in (tmp_path / "checkpoints").iterdir()]
    assert names == ["step-00000003"]


def test_validation_loss_does_not_depend_on_the_batch_size(tmp_path: Path, text_file: Path) -> None:
    """The same model, two runs whose batch sizes differ: the same windows, the same loss."""
    losses = []
    for micro in (3, 16):
        spec = fast_spec(data=str(text_file), micro_batch_size=micro, eval_batches=2)
        t = trainer_for(spec, tmp_path / f"b{micro}", device="cpu")
        assert sum(b.x.shape[0] for b in t.val_batches) == 2 * 16
        losses.append(t.engine.evaluate(t.val_batches))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


@pytest.mark.parametrize("stopping", [False, True])
def test_a_swarm_moved_on_ends_the_trainer_at_a_checkpoint_of_that_step(
    tmp_path: Path, text_file: Path, stopping: bool
) -> None:
    """The plugin finds the swarm moved on past this peer (``SwarmMovedOnError``): the trainer
    checkpoints that step and ends with the error, for the job manager to take the swarm's
    state; asked to stop meanwhile, it stops there instead."""
    stop = threading.Event()

    class Plugin:
        def attach(self, engine: Any) -> None:
            pass

        def after_step(self, step: int) -> None:
            if step == 3:
                if stopping:
                    stop.set()
                raise SwarmMovedOnError("the swarm has closed 9 round(s) past", step)

        def state_tensors(self) -> dict[str, Any]:
            return {}

        def stats(self) -> dict[str, Any]:
            return {}

    spec = fast_spec(data=str(text_file), micro_batch_size=3, eval_batches=2, max_steps=10)
    t = trainer_for(spec, tmp_path, device="cpu", plugin=Plugin(), stop_event=stop)
    if stopping:
        summary = t.run()
        assert summary.state == "stopped" and summary.step == 3
    else:
        with pytest.raises(SwarmMovedOnError):
            t.run()
    assert t.last_checkpoint is not None and t.last_checkpoint.name.endswith("3")


def test_the_swarms_final_model_is_chosen_on_four_times_the_probes_windows(
    tmp_path: Path, text_file: Path
) -> None:
    """The loss guard probes every merge on 16 fixed validation windows; the job's final model
    is chosen once on 64, the probe's 16 first (atomd.sync.runner.SyncPlugin.guard_with)."""
    given: list[tuple[Any, Any]] = []

    class Plugin:
        def attach(self, engine: Any) -> None:
            pass

        def guard_with(self, probe: Any, final: Any) -> None:
            given.append((probe, final))

    spec = fast_spec(data=str(text_file), micro_batch_size=3, eval_batches=2)
    trainer_for(spec, tmp_path, device="cpu", plugin=Plugin())
    [(probe, final)] = given
    assert [b.x.shape[0] for b in probe] == [8, 8]
    assert [b.x.shape[0] for b in final] == [8] * 8
    for a, b in zip(probe, final, strict=False):
        assert torch.equal(a.x, b.x)


def test_a_snapshot_of_the_live_state_is_written_at_the_next_step(
    tmp_path: Path, text_file: Path
) -> None:
    """A joining peer asks for the live state: the trainer checkpoints the step it is at (not a
    multiple of checkpoint_interval) and says which; once it has stopped, asking fails."""
    from atomd.train import checkpoint as ckpt
    from atomd.train.trainer import SnapshotRequests

    snapshots = SnapshotRequests()
    spec = fast_spec(data=str(text_file), max_steps=40, checkpoint_interval=1000)
    asked: list[Any] = []

    def ask_at_5(r: StepReport) -> None:
        if r.step == 5:
            asked.append(snapshots.ask())

    trainer = trainer_for(spec, tmp_path, on_report=ask_at_5, snapshots=snapshots)
    trainer.run()
    step = asked[0].result(timeout=0)
    assert 5 <= step < 40  # the step it was at, not the end
    steps = [int(p.name.split("-")[1]) for p in ckpt.list_checkpoints(trainer.ckpt_root)]
    assert step in steps and 40 in steps
    with pytest.raises(RuntimeError, match="stopped"):
        snapshots.ask().result(timeout=0)


def test_the_rule_for_a_donors_state() -> None:
    """A state from a peer is refused if it is not finite, worse than the untrained model, or
    far worse than the loss the job's other members last measured; within the slack it is
    taken (an early swarm is barely better than the untrained model)."""
    from atomd.train.trainer import donor_state_problem

    assert donor_state_problem(8.3, 8.3, None) is None
    assert donor_state_problem(8.3, 8.6, None) is None  # within 5 % + 0.05
    assert "untrained" in (donor_state_problem(8.3, 8.8, None) or "")
    assert "is nan" in (donor_state_problem(8.3, float("nan"), None) or "")
    assert "is inf" in (donor_state_problem(8.3, float("inf"), 2.0) or "")
    assert donor_state_problem(8.3, 2.0, 1.9) is None
    assert donor_state_problem(8.3, 2.4, 1.9) is None  # the claim lags: 1.9 * 1.25 + 0.1
    assert "other members last measured" in (donor_state_problem(8.3, 8.3, 1.9) or "")


def test_a_donors_state_worse_than_untrained_is_refused_and_a_good_one_taken(
    tmp_path: Path, text_file: Path
) -> None:
    """The trainer evaluates a state taken from a peer (``adopt_step``) on the job's validation
    windows before it trains on it: the donor's weights scaled x10 (a hostile donor) evaluate
    far worse than the untrained model and are refused with ``DonorStateError``; the honest
    state is taken, and refused only where the other members' word says it is far behind."""
    import shutil

    from atomd.errors import DonorStateError
    from atomd.train import checkpoint as ckpt

    spec = fast_spec(data=str(text_file), max_steps=20, lr=3e-3, checkpoint_interval=100)
    donor = tmp_path / "donor"
    trainer_for(spec, donor, device="cpu").run()
    found = ckpt.load_latest(ckpt.checkpoint_root(donor))
    assert found is not None and found.step == 20

    def joiner(name: str, scale: float, claim: float | None = None, marked: bool = False) -> Any:
        """A trainer taking the donor's state (x ``scale``): told so (``adopt_step``), or, with
        ``marked``, resuming a checkpoint fetched before it stopped (its ``donated`` file)."""
        out = tmp_path / name
        root = ckpt.checkpoint_root(out)
        root.mkdir(parents=True)
        shutil.copytree(ckpt.checkpoint_dir(ckpt.checkpoint_root(donor), 20),
                        ckpt.checkpoint_dir(root, 20))  # fmt: skip
        if scale != 1.0:
            model = {n: t * scale for n, t in found.model.items()}
            ckpt.save_checkpoint(root, step=20, model=model, state=found.state, meta=found.meta,
                                 keep=2)  # fmt: skip
        if marked:
            (ckpt.checkpoint_dir(root, 20) / ckpt.DONATED_FILE).write_text("https://donor")
        step = None if marked else 20
        return trainer_for(spec, out, device="cpu", resume=True, adopt_step=step, adopt_claim=claim)

    with pytest.raises(DonorStateError, match="worse than the untrained model"):
        joiner("hostile", 10.0)
    with pytest.raises(DonorStateError, match="worse than the untrained model") as refused:
        joiner("hostile-then-stopped", 10.0, marked=True)
    assert refused.value.step == 20
    checked = joiner("honest-then-stopped", 1.0, marked=True)
    marker = ckpt.checkpoint_dir(ckpt.checkpoint_root(tmp_path / "honest-then-stopped"), 20)
    assert checked.start_step == 20 and not (marker / ckpt.DONATED_FILE).exists(), "checked once"
    taken = joiner("honest", 1.0, claim=3.2)
    trained = taken.engine.evaluate(taken.val_batches)
    assert taken.start_step == 20 and trained < 3.5
    with pytest.raises(DonorStateError, match="other members last measured"):
        joiner("behind", 1.0, claim=(trained - 0.1) / 1.25 - 0.05)


def test_a_donors_state_that_does_not_load_is_refused_like_a_bad_one(
    tmp_path: Path, text_file: Path
) -> None:
    """A donor's state that does not fit the job's model (another model config in its meta, a
    tensor of another shape, a sync state that does not fit) is refused (``DonorStateError``):
    the job takes another donor's, as for a state that evaluates badly. A hostile donor failed
    the joiner's job outright with it (a CheckpointError, or a ValueError from the sync state).
    The joiner's own checkpoint that does not fit is still the job's own error."""
    import dataclasses

    from atomd.errors import CheckpointError, DonorStateError
    from atomd.model.config import GPTConfig
    from atomd.p2p.identity import Identity
    from atomd.sync.runner import SyncPlugin
    from atomd.train import checkpoint as ckpt

    spec = fast_spec(data=str(text_file), max_steps=4, checkpoint_interval=100)
    trainer_for(spec, tmp_path / "donor", device="cpu").run()
    found = ckpt.load_latest(ckpt.checkpoint_root(tmp_path / "donor"))
    assert found is not None and found.step == 4
    config = GPTConfig.from_dict(found.meta["model_config"])
    other = dataclasses.replace(config, n_layer=config.n_layer + 1).to_dict()
    head = next(iter(found.model))
    cases = {
        "config": ({**found.meta, "model_config": other}, found.model, found.state),
        "shape": (found.meta, {**found.model, head: found.model[head][:1]}, found.state),
        "sync": (found.meta, found.model, {**found.state, "sync.anchor.x": torch.zeros(1)}),
    }
    for name, (meta, model, state) in cases.items():
        for adopt in (4, None):
            out = tmp_path / f"{name}-{adopt}"
            ckpt.save_checkpoint(ckpt.checkpoint_root(out), step=4, model=model, state=state,
                                 meta=meta, keep=2)  # fmt: skip
            plugin = SyncPlugin(job_id="j" * 32, spec=spec.sync, identity=Identity.generate(),
                                counted=lambda base: [], send=lambda out: None)  # fmt: skip
            with pytest.raises((CheckpointError, ValueError)) as raised:
                trainer_for(spec, out, device="cpu", resume=True, adopt_step=adopt,
                            plugin=plugin)  # fmt: skip
            assert isinstance(raised.value, DonorStateError) == (adopt is not None), name


@pytest.mark.parametrize(("tokenizer", "vocab"), [("bytes", None), ("default", 4096)])
def test_an_untrained_model_scores_a_uniform_guess(
    tmp_path: Path, text_file: Path, tokenizer: str, vocab: int | None
) -> None:
    """The donor check takes ln(vocabulary) for the untrained model's loss instead of
    evaluating one (``untrained_loss``): it holds for the initialisation swarm jobs start from."""
    from atomd.train.trainer import untrained_loss

    spec = fast_spec(data=str(text_file), tokenizer=tokenizer, vocab_size=vocab)
    t = trainer_for(spec, tmp_path, device="cpu")
    measured = t.engine.evaluate(t.val_batches)
    assert abs(measured - untrained_loss(t.model_config.vocab_size)) < 0.02 * measured


def test_a_taken_state_is_adopted_as_from_the_donor_the_transfer_named(
    tmp_path: Path, text_file: Path
) -> None:
    """The trainer hands the donor's peer id the state transfer verified (``adopt_from``) to
    the plugin's adopt: the joiner's inherited offset gives way by that peer's deltas. A
    checkpoint taken before a restart (no ``adopt_step``) falls back to the id its state
    names."""
    import shutil

    from atomd.p2p.identity import Identity
    from atomd.sync.runner import SyncPlugin
    from atomd.train import checkpoint as ckpt

    spec = fast_spec(data=str(text_file), max_steps=20, lr=3e-3, checkpoint_interval=100)

    def plugin(identity: Identity | None = None) -> SyncPlugin:
        return SyncPlugin(job_id="j" * 32, spec=spec.sync, identity=identity or Identity.generate(),
                          counted=lambda base: [], send=lambda out: None)  # fmt: skip

    donor_id = Identity.generate()
    trainer_for(spec, tmp_path / "donor", device="cpu", plugin=plugin(donor_id)).run()
    for name, told in (("told", "t" * 32), ("marked", None)):
        out = tmp_path / name
        root = ckpt.checkpoint_root(out)
        root.mkdir(parents=True)
        shutil.copytree(ckpt.checkpoint_dir(ckpt.checkpoint_root(tmp_path / "donor"), 20),
                        ckpt.checkpoint_dir(root, 20))  # fmt: skip
        if told is None:
            (ckpt.checkpoint_dir(root, 20) / ckpt.DONATED_FILE).write_text("https://donor")
        joiner = plugin()
        trainer_for(spec, out, device="cpu", resume=True, plugin=joiner,
                    adopt_step=20 if told else None, adopt_from=told)  # fmt: skip
        assert joiner.state is not None
        assert joiner.state.offset.sources == {told or donor_id.peer_id}, name
