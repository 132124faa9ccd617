"""atomd plot (loss curves to a PNG) and the TensorBoard event files of every run."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from atomd.errors import DataError
from atomd.plot import curves_from_run, render
from atomd.train.metrics import read_metrics
from atomd.train.tracking import TB_DIR, scalars
from tests.conftest import fast_spec, trainer_for

PNG = b"\x89PNG\r\n\x1a\n"


def _events(run: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / TB_DIR))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_a_run_writes_tensorboard_events_with_its_metrics(tmp_path: Path, text_file: Path) -> None:
    spec = fast_spec(data=str(text_file), max_steps=6, eval_interval=3)
    trainer_for(spec, tmp_path).run()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    events = _events(tmp_path)
    assert {"train/loss", "val/loss", "train/lr", "train/tokens_per_s"} <= set(events)
    assert [s for s, _ in events["train/loss"]] == [r["step"] for r in rows]
    for (_, v), r in zip(events["train/loss"], rows, strict=True):
        assert v == pytest.approx(r["loss"], rel=1e-6)
    assert [s for s, _ in events["val/loss"]] == [3, 6]


def _wandb_history(run: Path) -> list[dict[str, float]]:
    """The history rows of the offline W&B run under ``run`` (read back with wandb's own
    record reader: what ``wandb sync`` would upload)."""
    from wandb.proto import wandb_internal_pb2 as pb
    from wandb.sdk.internal import datastore

    (path,) = run.glob("wandb/offline-run-*/run-*.wandb")
    store = datastore.DataStore()
    store.open_for_scan(str(path))
    rows = []
    while (data := store.scan_data()) is not None:
        record = pb.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
    return rows


def test_a_run_with_a_wandb_project_logs_the_same_scalars_offline(
    tmp_path: Path, text_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    monkeypatch.setenv("ATOMD_WANDB_PROJECT", "atomd-test")
    monkeypatch.setenv("WANDB_MODE", "offline")  # no account, no network
    monkeypatch.setenv("WANDB_SILENT", "true")
    spec = fast_spec(data=str(text_file), max_steps=6, eval_interval=3)
    trainer_for(spec, tmp_path).run()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    history = _wandb_history(tmp_path)
    assert [h["_step"] for h in history] == [r["step"] for r in rows]
    for h, r in zip(history, rows, strict=True):
        assert h["train/loss"] == pytest.approx(r["loss"], rel=1e-6)
        assert h["train/lr"] == pytest.approx(r["lr"], rel=1e-6)
    assert [h["_step"] for h in history if "val/loss" in h] == [3, 6]


def test_a_resumed_run_purges_the_events_past_its_checkpoint(
    tmp_path: Path, text_file: Path
) -> None:
    spec = fast_spec(data=str(text_file), max_steps=6, checkpoint_interval=4)
    trainer_for(spec, tmp_path).run()
    import shutil

    shutil.rmtree(tmp_path / "checkpoints" / "step-00000006")  # as if it died after step 6
    trainer_for(spec, tmp_path, resume=True).run()
    steps = [s for s, _ in _events(tmp_path)["train/loss"]]
    assert steps == [1, 2, 3, 4, 5, 6]  # 5 and 6 once, from the resumed run


def test_sync_figures_become_scalars() -> None:
    row = {"step": 3, "loss": 2.0, "lr": 1e-3, "sync": {"round": 4, "every": 50, "mode": "x"}}
    assert scalars(row) == {
        "train/loss": 2.0,
        "train/lr": 1e-3,
        "sync/round": 4.0,
        "sync/every": 50.0,
    }


def test_plot_writes_a_png_of_both_curves(tmp_path: Path) -> None:
    rows = [{"step": s, "loss": 5.0 / s} for s in range(1, 21)]
    rows += [{"step": 10, "loss": 0.5, "val_loss": 0.6}]
    rows += [{"step": 20, "loss": 0.25, "val_loss": 0.3}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    curves = curves_from_run(tmp_path)
    assert curves.val_steps == [10, 20]
    render(curves, tmp_path / "out" / "loss.png")
    data = (tmp_path / "out" / "loss.png").read_bytes()
    assert data.startswith(PNG) and len(data) > 5000
    import matplotlib.image

    img = matplotlib.image.imread(tmp_path / "out" / "loss.png")
    assert img.shape[:2] == (450, 800)


def test_plot_fails_clearly_without_metrics(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"holds no metrics\.jsonl"):
        curves_from_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(DataError, match="no loss values to plot"):
        render(curves_from_run(tmp_path), tmp_path / "loss.png")
    assert not (tmp_path / "loss.png").exists()


def test_a_new_event_file_is_made_in_a_later_second_than_the_older_ones(tmp_path: Path) -> None:
    """TensorBoard reads event files in name order and a name starts with its second, then a
    counter that sorts ".10" before ".9": a resumed run's file must come from a later second,
    or the events its purge drops would be read after it (seen in the full suite)."""
    from atomd.train.tracking import _after_older_event_files

    now = int(time.time())
    (tmp_path / f"events.out.tfevents.{now}.host.123.9").write_bytes(b"")
    (tmp_path / "events.out.tfevents.garbage").write_bytes(b"")  # not a name it can read
    _after_older_event_files(tmp_path)
    assert int(time.time()) > now
