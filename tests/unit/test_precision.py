"""--precision: what auto picks, fp16's dynamic loss scaling (skipped steps, the scale backing
off and growing), its state across a resume, and the swapping engine's refusal."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from atomd.engine_choice import build_engine, optim_config
from atomd.errors import ConfigError
from atomd.model.gpt import GPT
from atomd.spec import JobSpec
from atomd.train.metrics import read_metrics
from atomd.train.step_engine import ResidentEngine, resolve_precision
from tests.conftest import fast_spec, trainer_for

CPU = torch.device("cpu")


def test_auto_is_fp32_on_the_cpu_and_explicit_choices_stand() -> None:
    assert resolve_precision("auto", CPU) == "fp32"
    for p in ("bf16", "fp16", "fp32"):
        assert resolve_precision(p, CPU) == p
    with pytest.raises(ConfigError, match="precision must be"):
        resolve_precision("fp8", CPU)


def _engine(precision: str | None) -> tuple[ResidentEngine, object]:
    spec = fast_spec()
    torch.manual_seed(0)
    model = GPT(spec.model_shape)
    engine = ResidentEngine(model, optim_config(spec), CPU, precision=precision)  # type: ignore[arg-type]
    from atomd.data.dataset import load_dataset

    data = load_dataset(seq_len=spec.effective_seq_len)
    return engine, data


def _batches(data: object, step: int) -> list:  # type: ignore[type-arg]
    return [data.train_batch(seed=0, step=step, micro=0, batch_size=4)]  # type: ignore[attr-defined]


def test_an_overflowing_gradient_skips_the_step_and_halves_the_scale() -> None:
    engine, data = _engine("fp16")
    scale0 = engine.scaler.get_scale()
    assert scale0 == 2.0**16
    victim = engine.model.blocks[0].mlp.fc.weight
    poison = {"on": True}

    def hook(g: torch.Tensor) -> torch.Tensor:
        if poison["on"]:
            g = g.clone()
            g[0, 0] = math.inf
        return g

    handle = victim.register_hook(hook)
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    loss = engine.train_step(_batches(data, 0), lr=1e-3)
    assert math.isfinite(loss)
    # Skipped: no parameter moved, no AdamW state was made, the scale halved.
    for n, p in engine.model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert not engine.optimizer.state
    assert engine.scaler.get_scale() == scale0 / 2
    assert engine.precision_stats() == {"loss_scale": scale0 / 2, "skipped_steps": 1}

    poison["on"] = False
    engine.train_step(_batches(data, 1), lr=1e-3)
    moved = any(not torch.equal(p, before[n]) for n, p in engine.model.named_parameters())
    assert moved
    assert engine.scaler.get_scale() == scale0 / 2  # grows only after 2000 clean steps
    assert engine.precision_stats() == {"loss_scale": scale0 / 2, "skipped_steps": 1}
    handle.remove()


def test_the_scale_grows_after_its_interval_of_clean_steps() -> None:
    engine, data = _engine("fp16")
    engine.scaler.set_growth_factor(2.0)
    engine.scaler._growth_interval = 2  # torch's default is 2000 clean steps
    scale0 = engine.scaler.get_scale()
    engine.train_step(_batches(data, 0), lr=1e-3)
    engine.train_step(_batches(data, 1), lr=1e-3)
    assert engine.scaler.get_scale() == scale0 * 2
    assert engine.skipped_steps == 0


def test_fp16_with_scaling_follows_fp32_training() -> None:
    """Unscaled before clipping and AdamW: fp16 autocast trains as fp32 does, to fp16's
    rounding (the CPU runs fp16 autocast kernels too)."""
    runs = {}
    for precision in ("fp32", "fp16"):
        engine, data = _engine(precision)
        runs[precision] = [engine.train_step(_batches(data, s), lr=1e-3) for s in range(4)]
    assert runs["fp16"] == pytest.approx(runs["fp32"], rel=2e-2)


def test_fp16_runs_record_skips_and_resume_keeps_the_scale(tmp_path: Path, text_file: Path) -> None:
    spec = fast_spec(data=str(text_file), precision="fp16", max_steps=4, checkpoint_interval=2)
    trainer = trainer_for(spec, tmp_path)
    assert trainer.plan["precision"] == "fp16"
    engine = trainer.engine
    assert isinstance(engine, ResidentEngine)
    state = engine.scaler.state_dict()
    engine.scaler.load_state_dict(state | {"scale": 1024.0})
    trainer.run()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert all(r["loss_scale"] == 1024.0 and r["skipped_steps"] == 0 for r in rows)
    resumed = trainer_for(spec.model_copy(update={"max_steps": 5}), tmp_path, resume=True)
    assert isinstance(resumed.engine, ResidentEngine)
    assert resumed.engine.scaler.get_scale() == 1024.0


def test_fp32_runs_have_no_scaling_figures(tmp_path: Path, text_file: Path) -> None:
    trainer_for(fast_spec(data=str(text_file), max_steps=2), tmp_path).run()
    assert all("loss_scale" not in r for r in read_metrics(tmp_path / "metrics.jsonl"))


def test_the_swapping_engine_refuses_a_bf16_link_with_fp16() -> None:
    spec = JobSpec(preset="tiny", swap="on", precision="fp16", swap_link="bf16")
    with pytest.raises(ConfigError, match="precision fp16 needs swap_link fp32"):
        build_engine(spec, "cpu")
    with pytest.raises(ConfigError, match="on cpu it computes in fp32 or fp16"):
        build_engine(JobSpec(preset="tiny", swap="on", precision="bf16"), "cpu")


@pytest.mark.parametrize(
    ("clip", "optimizer", "m"),
    [(1.0, "host", 4), (0.0, "host", 2), (1.0, "device", 4), (1.0, "split", 2)],
    ids=["clip-host", "noclip-host-2waves", "clip-device", "clip-split-2waves"],
)
def test_swapped_fp16_trains_as_resident_fp16(clip: float, optimizer: str, m: int) -> None:
    """The swapping engine's loss scaling (unscaled through the clipping coefficient) gives
    resident fp16 training's losses and parameters; an overflow skips every layer's step."""
    from atomd.swap.compare import max_rel_param_diff
    from atomd.swap.engine import SwapEngine
    from tests.unit.test_swap_engine import _batches, _model, _plan, _spec

    ref = ResidentEngine(_model(), _spec(clip), CPU, precision="fp16")
    want = [ref.train_step(_batches(s), 1e-2) for s in range(3)]
    engine = SwapEngine(_model(), _spec(clip), CPU, _plan(2, m, optimizer=optimizer),  # type: ignore[arg-type]
                        precision="fp16")  # fmt: skip
    try:
        got = [engine.train_step(_batches(s), 1e-2) for s in range(3)]
        assert got == pytest.approx(want, rel=1e-4)
        # fp16 gradients summed over 2 micro-batch waves in another order than the resident
        # run's differ by an fp16 rounding (2^-11 = 4.9e-4 relative; measured 4.97e-4 on one
        # CPU, < 1e-4 on another): a bar of a few fp16 ulps, not fp32's.
        assert max_rel_param_diff(engine.model_tensors(), ref.model_tensors()) < 2e-3
        assert engine.precision_stats() == {"loss_scale": 2.0**16, "skipped_steps": 0}

        before = {n: t.clone() for n, t in engine.model_tensors().items()}
        ln_f = engine.model.head.ln_f.weight  # resident: a hook makes its gradient inf

        def poison(g: torch.Tensor) -> torch.Tensor:
            return torch.full_like(g, math.inf)

        handle = ln_f.register_hook(poison)
        loss = engine.train_step(_batches(3), 1e-2)
        handle.remove()
        assert math.isfinite(loss)
        after = engine.model_tensors()
        for name, t in before.items():
            assert torch.equal(after[name], t), name  # no layer stepped, swapped or resident
        assert engine.precision_stats() == {"loss_scale": 2.0**15, "skipped_steps": 1}
        state = engine.optimizer_tensors()
        assert float(state["amp.scale"]) == 2.0**15 and int(state["amp.skipped_steps"]) == 1
        engine.train_step(_batches(4), 1e-2)  # and trains on
        assert any(not torch.equal(engine.model_tensors()[n], t) for n, t in before.items())
    finally:
        engine.close()
