"""The recorded schedule of swapped steps, and its simulation (atomd.swap.trace, rehearse).

The plans are the planner's own for the issue's configurations at the H200's measured rates
(research/results/results-swap-h200-2026-11-30b.json); each is recorded on a stand-in model with the
preset's layer count (the schedule does not depend on layer widths) and simulated with the
real shape. Every property is also shown to fail on a deliberately serialized engine.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from atomd.model.presets import get_preset
from atomd.swap.engine import SwapEngine
from atomd.swap.hardware import Hardware
from atomd.swap.plan import Shape, SwapPlan, make_plan
from atomd.swap.record import Recorder, Work, check_schedule
from atomd.swap.rehearse import rehearse
from atomd.swap.slots import Slot, Wave
from atomd.swap.streams import Marker
from atomd.swap.trace import Simulation, Timed
from tests.conftest import H200_RATES

GiB = 2**30
H200 = H200_RATES
FAST_HOST = replace(H200, host_adam_params_per_s=1e13, host_narrow_per_s=1e13)
FAST_HOST = replace(FAST_HOST, host_widen_per_s=1e13, host_add_per_s=1e13)
# (preset, micro-batch size, grad_accum, device budget): 32k tokens per step each
CONFIGS = {
    "xl": ("gpt3-xl", 4, 4, 130 * GiB),
    "2.7b-8GiB": ("gpt3-2.7b", 1, 16, 8 * GiB),
    "6.7b-12GiB": ("gpt3-6.7b", 1, 16, 12 * GiB),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _planned(
    name: str, clip: bool, hw: Hardware = H200, **choices: object
) -> tuple[Shape, SwapPlan]:
    preset, batch, g, budget = CONFIGS[name]
    shape = Shape(
        cfg=get_preset(preset), micro_batch_size=batch, seq_len=2048, grad_accum=g, grad_clip=clip
    )
    plan = make_plan(shape, budget_bytes=budget, hardware=hw, resident_blocks=0, **choices)  # type: ignore[arg-type]
    return shape, plan


class LateWave(Wave):
    """Serialized: a layer's load is issued when its visit comes (no prefetch)."""

    def _issue(self, p: int) -> None:
        pass

    def next(self, layer: int) -> Slot:
        slot = super().next(layer)
        for after in sorted(self.loads_after):
            loads = self.loads_after[after]
            if (layer, slot.index) in loads:
                loads.remove((layer, slot.index))
                self.load_weights(layer, slot)
                break
        return slot


class LoadsWhenNeeded(SwapEngine):
    """Serialized: each load waits for the compute issued before its visit."""

    def _wave(self, visits: list[int]) -> Wave:
        def late(layer: int, slot: Slot) -> None:
            st = self.streams
            st.wait(st.load, st.mark(st.compute))
            self._load_weights(layer, slot)

        return LateWave(self.slots, visits, late)


class LoadsAfterStores(SwapEngine):
    """Serialized: every load waits for the gradient stores issued before it."""

    def _load_weights(self, layer: int, slot: Slot) -> None:
        st = self.streams
        st.wait(st.load, st.mark(st.store))
        super()._load_weights(layer, slot)


class StoresAfterLoads(SwapEngine):
    """Serialized: every gradient store waits for the loads issued before it."""

    def _store_grads(self, layer: int, slot: Slot) -> Marker:
        st = self.streams
        st.wait(st.store, st.mark(st.load))
        return super()._store_grads(layer, slot)


def _last_step(sim: Simulation, step: int) -> list[Timed]:
    return [t for t in sim.timed if t.work.step == step]


@pytest.mark.parametrize("clip", [True, False], ids=["clip", "noclip"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_planners_schedules_keep_their_promises(name: str, clip: bool) -> None:
    """For each plan the planner picks: loads wait only for the compute reading their slot,
    gradient stores never wait for loads; in the forward each swapped layer's compute follows
    the previous one without waiting for a load; and with a host that keeps up, the step is
    within 10% of the planner's max(compute, link) per phase."""
    shape, plan = _planned(name, clip, FAST_HOST)
    recorder, sim = rehearse(plan, shape, FAST_HOST, steps=2)
    assert check_schedule(recorder) == []
    steady = _last_step(sim, 1)
    forward = [t for t in steady if t.work.kind == "fwd"]
    assert forward and all(t.cause != "wait" for t in forward[1:]), [
        (t.work.describe(), t.cause, t.by.describe() if t.by else None) for t in forward
    ]
    assert plan.host_optimizer_s < 0.01 * plan.step_s  # the host is out of the picture
    assert sim.step_s[-1] == pytest.approx(plan.step_s, rel=0.10)
    assert sim.step_s[-1] >= plan.compute_s * 0.999


@pytest.mark.parametrize(
    ("name", "choices"),
    [
        ("xl", {"optimizer": "device"}),
        ("xl", {"optimizer": "split"}),
        ("2.7b-8GiB", {"slots": 3, "micro_batches": 8, "spill": True}),
        ("2.7b-8GiB", {"slots": 2, "micro_batches": 4, "link": "fp32"}),
        ("xl", {"slots": 2, "micro_batches": 4, "graph_blocks": 6}),
    ],
    ids=["device-optimizer", "split-optimizer", "two-waves-spill", "four-waves-fp32", "kept-6"],
)
def test_other_choices_keep_them_too(name: str, choices: dict[str, object]) -> None:
    shape, plan = _planned(name, True, H200, **choices)
    recorder, _ = rehearse(plan, shape, H200, steps=2)
    assert check_schedule(recorder) == []


def _host_on_path(sim: Simulation, step: int) -> list[Work]:
    return [t.work for t in sim.critical_path() if t.work.lane == "host" and t.work.step == step]


def test_the_host_optimizer_stays_off_the_next_forward_unless_clipping_puts_it_there() -> None:
    """gpt3-xl at the H200's rates: without clipping each layer's AdamW runs while earlier
    layers' backward computes, and no host task is on the critical path; with clipping the
    steps wait for the whole backward, and the next forward waits for them (the bound the
    H200 measured: 0.25 s per step)."""
    shape, plan = _planned("xl", False, H200, optimizer="host")
    _, sim = rehearse(plan, shape, H200, steps=2)
    assert _host_on_path(sim, 1) == []
    assert sim.step_s[-1] == pytest.approx(plan.compute_s, rel=0.05)
    shape, plan = _planned("xl", True, H200, optimizer="host")
    _, clipped = rehearse(plan, shape, H200, steps=2)
    on_path = _host_on_path(clipped, 0)
    assert on_path and all(w.what.get("step") for w in on_path)
    assert clipped.step_s[-1] > sim.step_s[-1] * 1.05


def test_a_serialized_engine_is_caught() -> None:
    """Deliberately serialized engines at a link a little faster than the compute per layer:
    loads issued when their layer is needed, after the compute before it (no prefetch), leave
    the forward waiting on every load and the step takes about compute + link; loads that wait
    for gradient stores, and stores that wait for loads, are named by the schedule check."""
    slow = replace(FAST_HOST, h2d_bytes_per_s=28e9, d2h_bytes_per_s=28e9)
    shape, plan = _planned("xl", False, slow, slots=3, micro_batches=4, link="fp32")
    _, good = rehearse(plan, shape, slow, steps=2)
    forward = [t for t in _last_step(good, 1) if t.work.kind == "fwd"]
    assert all(t.cause != "wait" for t in forward[1:])  # the first waits for the fill
    _, late = rehearse(plan, shape, slow, steps=2, engine_cls=LoadsWhenNeeded)
    assert late.step_s[-1] > 1.2 * good.step_s[-1]
    forward = [t for t in _last_step(late, 1) if t.work.kind == "fwd"]
    assert sum(t.cause == "wait" and t.by is not None and t.by.lane == "load" for t in forward) > 20
    recorder, _ = rehearse(plan, shape, slow, steps=2, engine_cls=LoadsAfterStores)
    problems = check_schedule(recorder)
    assert problems and all("waits for store:grads" in p for p in problems)
    recorder, _ = rehearse(plan, shape, slow, steps=2, engine_cls=StoresAfterLoads)
    assert any("store:grads" in p and "waits for load" in p for p in check_schedule(recorder))


def test_the_recorded_work_is_complete() -> None:
    """Every swapped layer is loaded, computed forward and backward and stored once per wave;
    every host step follows its layer's store; the loss is read once per step."""
    shape, plan = _planned("xl", False, H200, optimizer="host", slots=3)
    recorder = rehearse(plan, shape, H200, steps=2)[0]
    works = recorder.works()
    q = shape.cfg.n_layer
    for step in (0, 1):
        ws = [w for w in works if w.step == step]
        assert len([w for w in ws if w.kind == "fwd"]) == q
        assert len([w for w in ws if w.kind == "bwd"]) == q
        assert len([w for w in ws if w.kind == "grads"]) == q
        assert len([w for w in ws if w.kind == "weights"]) == plan.layer_loads
        steps = [w for w in ws if w.lane == "host"]
        assert len(steps) == q and all(w.waits[0].kind == "grads" for w in steps)
    assert [e.why for e in recorder.events if not isinstance(e, Work)].count("loss") == 2
    assert isinstance(recorder, Recorder)


def test_the_split_optimizer_keeps_the_host_off_the_path_when_clipping() -> None:
    """gpt3-xl with clipping at the H200's rates, the planner's split: the simulated step is
    within 5% of the planner's and of resident compute, where the host optimizer alone leaves
    the next forward waiting on its steps."""
    shape, plan = _planned("xl", True, H200)
    assert plan.optimizer == "split"
    _, sim = rehearse(plan, shape, H200, steps=2)
    assert sim.step_s[-1] == pytest.approx(plan.step_s, rel=0.05)
    assert sim.step_s[-1] < 1.08 * plan.compute_s  # ratio 0.93-0.94 to resident; host: 0.89
    shape, host = _planned("xl", True, H200, optimizer="host")
    _, alone = rehearse(host, shape, H200, steps=2)
    assert alone.step_s[-1] > 1.05 * sim.step_s[-1]
