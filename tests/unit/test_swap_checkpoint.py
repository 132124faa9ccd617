"""Swapped runs through the trainer: checkpoints interchangeable with resident runs, the plan
recorded with the run, and the planner's byte counts equal to what the engine moves."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from atomd.data.dataset import load_dataset
from atomd.engine_choice import optim_config
from atomd.model.gpt import GPT
from atomd.model.presets import get_preset
from atomd.swap.compare import max_rel_param_diff
from atomd.swap.engine import SwapEngine
from atomd.swap.hardware import assumed
from atomd.swap.plan import Optimizer, Shape, make_plan
from atomd.train.metrics import StepReport
from atomd.train.step_engine import ResidentEngine
from atomd.train.trainer import model_from_checkpoint
from tests.conftest import fast_spec, trainer_for

TOL = 1e-5  # as in test_swap_engine: fp32 summation order only (see there)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _params(run: Path) -> dict[str, torch.Tensor]:
    model, _ = model_from_checkpoint(run, torch.device("cpu"))
    return {n: p.detach() for n, p in model.named_parameters()}


def _split_run(out: Path, spec_first: object, spec_second: object, stop_at: int) -> None:
    stop = threading.Event()

    def stopper(r: StepReport) -> None:
        if r.step == stop_at:
            stop.set()

    first = trainer_for(spec_first, out, device="cpu", on_report=stopper, stop_event=stop)  # type: ignore[arg-type]
    assert first.run().step == stop_at
    second = trainer_for(spec_second, out, device="cpu", resume=True)  # type: ignore[arg-type]
    assert second.start_step == stop_at
    assert second.run().state == "finished"


@pytest.mark.parametrize(
    ("first", "second", "optimizer"),
    [
        ("on", "off", "host"),
        ("off", "on", "host"),
        ("on", "off", "device"),
        ("off", "on", "device"),
    ],
)
def test_checkpoints_move_between_swapped_and_resident(
    tmp_path: Path, text_file: Path, first: str, second: str, optimizer: str
) -> None:
    common = {"data": str(text_file), "max_steps": 6, "grad_accum": 2, "checkpoint_interval": 100}
    straight = tmp_path / "straight"
    trainer_for(fast_spec(swap="off", **common), straight, device="cpu").run()
    split = tmp_path / "split"
    common["swap_optimizer"] = optimizer
    _split_run(split, fast_spec(swap=first, **common), fast_spec(swap=second, **common), 3)
    assert max_rel_param_diff(_params(split), _params(straight)) < TOL
    for step, mode in ((3, first), (6, second)):  # each checkpoint names the engine it came from
        meta = json.loads((split / "checkpoints" / f"step-{step:08d}" / "meta.json").read_text())
        assert meta["plan"]["engine"] == ("swap" if mode == "on" else "ResidentEngine")


def test_the_plan_is_stored_with_the_run(tmp_path: Path, text_file: Path) -> None:
    spec = fast_spec(data=str(text_file), max_steps=2, grad_accum=2, swap="on", swap_slots=3)
    trainer = trainer_for(spec, tmp_path, device="cpu")
    assert isinstance(trainer.engine, SwapEngine)
    trainer.run()
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["engine"] == "swap" and plan["slots"] == 3 and plan["reason"] == "swap on"
    meta = json.loads((tmp_path / "checkpoints" / "step-00000002" / "meta.json").read_text())
    assert meta["plan"] == plan


def test_auto_and_off_stay_resident_on_the_cpu(tmp_path: Path, text_file: Path) -> None:
    for mode in ("auto", "off"):
        out = tmp_path / mode
        trainer = trainer_for(
            fast_spec(data=str(text_file), max_steps=1, swap=mode), out, device="cpu"
        )
        assert isinstance(trainer.engine, ResidentEngine)
        plan = json.loads((out / "plan.json").read_text())
        assert plan["engine"] == "ResidentEngine" and mode in plan["reason"]


@pytest.mark.parametrize(
    ("spill", "optimizer"), [(False, "host"), (True, "host"), (False, "device")]
)
def test_planner_predicts_the_bytes_the_engine_moves(
    text_file: Path, spill: bool, optimizer: Optimizer
) -> None:
    """Loads, stores and spills counted by the planner are what the engine does (2 waves; with
    the optimizer on the device, in a step that applies the previous one's updates)."""
    cfg = get_preset("tiny")
    shape = Shape(cfg=cfg, micro_batch_size=4, seq_len=32, grad_accum=4, dtype_bytes=4)
    plan = make_plan(
        shape,
        budget_bytes=2**40,
        hardware=assumed(),
        micro_batches=2,
        resident_blocks=0,
        spill=spill,
        optimizer=optimizer,
    )
    spec = fast_spec(data=str(text_file), grad_accum=4)
    engine = SwapEngine(GPT(cfg), optim_config(spec), torch.device("cpu"), plan)
    try:
        data = load_dataset(str(text_file), seq_len=32)
        batches = [data.train_batch(seed=0, step=0, micro=m, batch_size=4) for m in range(4)]
        engine.train_step(batches, 1e-3)
        engine.train_step(batches, 1e-3)
        assert engine.stats.layer_loads == plan.layer_loads
        assert engine.stats.bytes_loaded == plan.bytes_loaded
        assert engine.stats.bytes_stored == plan.bytes_stored
        held = engine.device_state_bytes() + engine.stats.peak_held_bytes
        assert held <= plan.peak_device_bytes - plan.memory["reserve"]
    finally:
        engine.close()
