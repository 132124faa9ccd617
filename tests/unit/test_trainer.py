from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from atomd.errors import ConfigError, TrainingError
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
