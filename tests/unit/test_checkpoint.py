from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from atomd.errors import CheckpointError
from atomd.train import checkpoint as ckpt


def _save(root: Path, step: int, value: float = 1.0, keep: int = 5) -> Path:
    return ckpt.save_checkpoint(
        root,
        step=step,
        model={"w": torch.full((4, 4), value)},
        state={"optim.w.exp_avg": torch.zeros(4, 4), "rng.torch": torch.get_rng_state()},
        meta={"model_config": {"n": 1}},
        keep=keep,
    )


def test_round_trip(tmp_path: Path) -> None:
    path = _save(tmp_path, 7, 2.5)
    loaded = ckpt.load_checkpoint(path)
    assert loaded.step == 7
    assert torch.equal(loaded.model["w"], torch.full((4, 4), 2.5))
    assert loaded.meta["model_config"] == {"n": 1}
    assert set(loaded.meta["files"]) == {"model.safetensors", "state.safetensors"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_newest_first_and_pruned(tmp_path: Path) -> None:
    for step in (5, 10, 15, 20):
        _save(tmp_path, step, keep=3)
    names = [p.name for p in ckpt.list_checkpoints(tmp_path)]
    assert names == ["step-00000020", "step-00000015", "step-00000010"]
    found = ckpt.load_latest(tmp_path)
    assert found is not None and found.step == 20


@pytest.mark.parametrize("damage", ["flip", "truncate", "no_meta", "bad_json", "no_file"])
def test_corrupt_checkpoint_falls_back_to_previous_good(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    _save(tmp_path, 10, 1.0)
    bad = _save(tmp_path, 20, 2.0)
    target = bad / "model.safetensors"
    if damage == "flip":
        data = bytearray(target.read_bytes())
        data[-1] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-7])
    elif damage == "no_meta":
        (bad / "meta.json").unlink()
    elif damage == "bad_json":
        (bad / "meta.json").write_text("{not json")
    elif damage == "no_file":
        target.unlink()
    with pytest.raises(CheckpointError):
        ckpt.load_checkpoint(bad)
    with caplog.at_level(logging.WARNING, logger="atomd"):
        found = ckpt.load_latest(tmp_path)
    assert found is not None and found.step == 10
    assert torch.equal(found.model["w"], torch.full((4, 4), 1.0))
    assert "skipping bad checkpoint" in caplog.text


def test_all_corrupt_is_an_error_none_is_none(tmp_path: Path) -> None:
    assert ckpt.load_latest(tmp_path / "nothing") is None
    path = _save(tmp_path, 3)
    (path / "state.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        ckpt.load_latest(tmp_path)


def test_leftover_temp_folder_is_ignored(tmp_path: Path) -> None:
    _save(tmp_path, 4)
    (tmp_path / ".tmp-step-00000008-999").mkdir()  # a crash mid-write
    found = ckpt.load_latest(tmp_path)
    assert found is not None and found.step == 4


def test_wrong_format_version_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path, 1)
    meta = json.loads((path / "meta.json").read_text())
    meta["format_version"] = 99
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="format_version 99"):
        ckpt.load_checkpoint(path)


def test_resolve_accepts_run_or_checkpoint_folder(tmp_path: Path) -> None:
    path = _save(tmp_path / "checkpoints", 2)
    assert ckpt.resolve_checkpoint_dir(tmp_path) == tmp_path / "checkpoints"
    assert ckpt.resolve_checkpoint_dir(path) == path


@pytest.mark.parametrize("where", ["python", "safetensors"])
def test_full_disk_names_the_path_and_the_last_good_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    import errno
    import os

    import safetensors.torch
    from safetensors import SafetensorError

    _save(tmp_path, 5, 1.0)
    _save(tmp_path, 10, 2.0)

    def full(*args: object, **kwargs: object) -> None:
        if where == "python":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              "(os error 28)")  # fmt: skip

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(CheckpointError) as e:
        _save(tmp_path, 15, 3.0)
    assert str(e.value) == (
        f"no space left on device writing {tmp_path / 'step-00000015'}; the last good "
        f"checkpoint is step 10 ({tmp_path / 'step-00000010'})"
    )
    assert [p.name for p in tmp_path.iterdir()] != [] and not list(tmp_path.glob(".tmp*"))
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-00000010", "step-00000005"]
    assert ckpt.load_latest(tmp_path).step == 10  # type: ignore[union-attr]


def test_the_half_written_folders_a_crash_left_are_removed(tmp_path: Path) -> None:
    """A checkpoint's and a state transfer's folders are named by the writer's pid until they
    are renamed into place; after a crash nothing removed them (a review of 2026-12-07)."""
    root = tmp_path / "checkpoints"
    ckpt.save_checkpoint(root, step=5, model={"w": torch.ones(4)}, state={}, meta={})
    for name in (".tmp-step-00000010-4242", ".incoming-step-00000012-4343"):
        (root / name).mkdir()
        (root / name / "model.safetensors").write_bytes(b"half")
    assert ckpt.remove_partial(root) == [".incoming-step-00000012-4343", ".tmp-step-00000010-4242"]
    assert sorted(p.name for p in root.iterdir()) == ["step-00000005"]
    assert ckpt.load_checkpoint(root / "step-00000005").step == 5  # the good one untouched
    assert ckpt.remove_partial(root) == [] and ckpt.remove_partial(tmp_path / "none") == []
