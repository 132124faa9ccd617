"""The planner and the slot schedule (pure arithmetic: no tensors are allocated)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from atomd.errors import PlanError
from atomd.model.gpt import GPT
from atomd.model.presets import get_preset
from atomd.swap.hardware import Hardware, assumed, hidden_fraction
from atomd.swap.plan import (
    GRAPH_HEADROOM,
    LayerSizes,
    Optimizer,
    Shape,
    SwapPlan,
    host_worker_s,
    make_plan,
    resident_peak_bytes,
)
from atomd.swap.report import format_plan
from atomd.swap.schedule import schedule_slots, training_visits
from atomd.units import format_bytes, parse_bytes
from tests.conftest import H200_RATES

GiB = 2**30


def _shape(preset: str, grad_accum: int | None = None, batch: int = 1) -> Shape:
    cfg = get_preset(preset)
    return Shape(cfg=cfg, micro_batch_size=batch, seq_len=cfg.block_size, grad_accum=grad_accum)


@pytest.mark.parametrize(("preset", "budget"), [("gpt3-6.7b", 12 * GiB), ("gpt3-2.7b", 8 * GiB)])
@pytest.mark.parametrize("grad_accum", [None, 8])
def test_big_models_fit_small_gpus(preset: str, budget: int, grad_accum: int | None) -> None:
    plan = make_plan(_shape(preset, grad_accum), budget_bytes=budget, hardware=assumed())
    assert plan.slots >= 2
    assert plan.peak_device_bytes <= budget
    assert plan.peak_device_bytes == sum(plan.memory.values())
    assert resident_peak_bytes(_shape(preset, grad_accum)) > budget  # it needs swapping
    assert plan.swapped_blocks + plan.resident_blocks == get_preset(preset).n_layer
    assert plan.tokens_per_s > 0 and plan.step_s >= max(plan.compute_s, plan.load_s)
    if grad_accum is not None:
        assert grad_accum % plan.micro_batches == 0
        assert plan.waves == grad_accum // plan.micro_batches


@pytest.mark.parametrize("budget", [10 * GiB, 12 * GiB, 16 * GiB, 24 * GiB, 40 * GiB])
def test_budget_is_respected_and_more_memory_keeps_more_resident(budget: int) -> None:
    plan = make_plan(_shape("gpt3-6.7b", 8), budget_bytes=budget, hardware=assumed())
    assert plan.peak_device_bytes <= budget and plan.slots >= 2
    tight = make_plan(_shape("gpt3-6.7b", 8), budget_bytes=10 * GiB, hardware=assumed())
    assert plan.resident_blocks >= tight.resident_blocks


def test_resident_set_choice() -> None:
    """With room to spare, blocks stay resident (each saves two loads and a host AdamW step);
    with none, only the tied embedding + head do; saved inputs spill when memory is tight."""
    roomy = make_plan(_shape("gpt3-2.7b", 8), budget_bytes=40 * GiB, hardware=assumed())
    tight = make_plan(_shape("gpt3-2.7b", 8), budget_bytes=6 * GiB, hardware=assumed())
    assert roomy.resident_blocks > 0
    assert tight.resident_blocks == 0 and tight.spill
    assert roomy.params_resident > tight.params_resident
    sizes = LayerSizes.of(get_preset("gpt3-2.7b"))
    assert tight.params_resident == sizes.embed + sizes.head  # the tied weight counted once


def test_impossible_budget_is_a_clear_error() -> None:
    with pytest.raises(PlanError, match=r"no swap plan fits 2\.00 GiB.*needs .*Raise the budget"):
        make_plan(_shape("gpt3-6.7b"), budget_bytes=2 * GiB, hardware=assumed())


def test_overrides_are_kept_or_refused() -> None:
    plan = make_plan(
        _shape("gpt3-2.7b", 8),
        budget_bytes=24 * GiB,
        hardware=assumed(),
        slots=3,
        micro_batches=2,
        resident_blocks=1,
    )
    assert (plan.slots, plan.micro_batches, plan.resident_blocks, plan.waves) == (3, 2, 1, 4)
    with pytest.raises(PlanError, match="must divide"):
        make_plan(
            _shape("gpt3-2.7b", 8), budget_bytes=24 * GiB, hardware=assumed(), micro_batches=3
        )
    with pytest.raises(PlanError, match="slots"):
        make_plan(_shape("gpt3-2.7b"), budget_bytes=24 * GiB, hardware=assumed(), slots=1)


def test_faster_link_does_not_slow_the_plan() -> None:
    # Isolate the link: a host optimizer and a GPU fast enough not to bound the step.
    base = assumed().to_dict() | {"host_adam_params_per_s": 1e12, "flops_per_s": 400e12}
    slow = make_plan(_shape("gpt3-6.7b", 1), budget_bytes=12 * GiB, hardware=Hardware(**base))
    rates = base | {"h2d_bytes_per_s": 100e9, "d2h_bytes_per_s": 100e9}
    fast = make_plan(_shape("gpt3-6.7b", 1), budget_bytes=12 * GiB, hardware=Hardware(**rates))
    assert slow.bottleneck == "load"  # one micro-batch per visit cannot hide 4 B/param loads
    assert fast.step_s < slow.step_s
    assert fast.load_s == pytest.approx(slow.load_s / 4, rel=0.3)


def test_layer_sizes_match_the_model() -> None:
    cfg = get_preset("tiny")
    assert LayerSizes.of(cfg).total(cfg.n_layer) == GPT(cfg).num_parameters()
    with torch.device("meta"):
        big = GPT(get_preset("gpt3-2.7b")).num_parameters()
    assert LayerSizes.of(get_preset("gpt3-2.7b")).total(32) == big


def test_schedule_prefetches_and_keeps_the_turn() -> None:
    layers = [1, 2, 3, 4, 5]
    visits = training_visits(layers)
    for k in (2, 3):
        sched = schedule_slots(visits, [None] * k)
        # One load per forward visit; backward reloads all but the K layers left at the turn.
        assert len(sched.loads) == 2 * len(layers) - k
        assert {ld.layer for ld in sched.loads[len(layers) :]} == set(layers[: len(layers) - k])
        for i, ld in enumerate(sched.loads):
            first_use = min(p for p, v in enumerate(visits) if v == ld.layer and p > ld.after)
            assert ld.after < first_use  # issued before it is needed
            if i >= k:  # steady state: issued K - 1 visits ahead of its use
                assert first_use - ld.after >= k - 1
        # A slot is only reloaded after its previous layer's last visit before the load.
        for ld in sched.loads:
            holder = [
                v for p, v in enumerate(visits) if p <= ld.after and sched.slot_of[p] == ld.slot
            ]
            assert ld.after == -1 or visits[ld.after] in holder
    later = schedule_slots(visits, schedule_slots(visits, [None, None]).final)
    assert len(later.loads) == 2 * len(layers) - 4  # the next wave starts on what is left


def test_sizes_parse_and_print() -> None:
    assert parse_bytes("24GiB") == 24 * GiB
    assert parse_bytes("8GB") == 8 * 10**9
    assert parse_bytes("1.5 MiB") == 3 * 2**19
    assert parse_bytes(123) == 123
    assert format_bytes(3 * GiB) == "3.00 GiB"
    with pytest.raises(ValueError, match="cannot read"):
        parse_bytes("12 parsecs")


def test_the_optimizer_goes_to_the_device_only_when_the_host_cannot_keep_up() -> None:
    """The device optimizer costs twice the slot memory and 24 B/parameter more over the link
    each step, and moves fp32 weights: the planner takes it only when the host AdamW would
    bound the step."""
    shape = _shape("gpt3-2.7b", 8, batch=4)
    fast = Hardware(**(assumed().to_dict() | {"host_adam_params_per_s": 1e10}))
    fast_host = make_plan(shape, budget_bytes=24 * GiB, hardware=fast)
    assert fast_host.optimizer == "host" and fast_host.bottleneck != "host_optimizer"
    slow = Hardware(**(assumed().to_dict() | {"host_adam_params_per_s": 5e7}))
    forced_host = make_plan(shape, budget_bytes=24 * GiB, hardware=slow, optimizer="host")
    assert forced_host.bottleneck == "host_optimizer"
    chosen = make_plan(shape, budget_bytes=24 * GiB, hardware=slow)
    assert chosen.optimizer == "device" and chosen.host_optimizer_s == 0.0
    assert chosen.step_s < forced_host.step_s / 2
    host, dev = (
        make_plan(
            shape,
            budget_bytes=24 * GiB,
            hardware=slow,
            slots=3,
            micro_batches=2,
            resident_blocks=0,
            spill=False,
            optimizer=opt,
            link=link,
        )
        for opt, link in (("host", "bf16"), ("device", None))
    )
    block, q = host.params_per_block, host.swapped_blocks
    sizes = LayerSizes.of(shape.cfg)
    # The device optimizer steps fp32 masters in the slot: fp32 weights, gradient, moments.
    assert (host.link, dev.link) == ("bf16", "fp32")
    assert dev.memory["slots"] == 3 * 16 * block
    assert host.memory["slots"] == (3 * 1 + 1) * sizes.link_bytes("bf16") + 3 * 4 * block
    assert dev.bytes_loaded == dev.layer_loads * 4 * block + q * 12 * block
    assert dev.bytes_stored == host.waves * q * 4 * block + q * 12 * block
    assert host.bytes_loaded == host.layer_loads * sizes.link_bytes("bf16")
    assert host.bytes_stored == host.waves * q * sizes.link_bytes("bf16")


def test_blocks_keep_their_graphs_as_far_as_memory_allows() -> None:
    """Each kept graph saves a recompute (a quarter of a block's compute) for its memory: the
    planner keeps as many as fit, leaving GRAPH_HEADROOM of the budget free."""
    shape = _shape("gpt3-2.7b", 8, batch=1)
    fixed = {"slots": 2, "micro_batches": 2, "resident_blocks": 0, "spill": False}
    none = make_plan(shape, budget_bytes=24 * GiB, hardware=assumed(), graph_blocks=0, **fixed)
    small = make_plan(shape, budget_bytes=12 * GiB, hardware=assumed(), **fixed)
    big = make_plan(shape, budget_bytes=48 * GiB, hardware=assumed(), **fixed)
    n = shape.cfg.n_layer
    assert none.graph_blocks == 0 and none.memory["kept_graphs"] == 0
    assert 0 < small.graph_blocks < big.graph_blocks == n
    assert small.peak_device_bytes <= 12 * GiB * (1 - GRAPH_HEADROOM)
    assert big.compute_s < small.compute_s < none.compute_s
    assert none.compute_s / big.compute_s == pytest.approx(4 / 3, rel=0.05)
    with pytest.raises(PlanError, match="graph_blocks"):
        make_plan(shape, budget_bytes=24 * GiB, hardware=assumed(), graph_blocks=n + 1)


def test_clipping_keeps_the_host_optimizer_out_of_the_backward() -> None:
    """With clipping, host AdamW steps wait for the whole backward and hide only behind the
    next forward: 6.7b with 16 micro-batches of 2k tokens in 12 GiB is then bound by them.
    Without clipping they run during the backward too, and the step is compute-bound again."""
    cfg = get_preset("gpt3-6.7b")
    rates = assumed().to_dict() | {  # the H200 measured on 2026-11-30
        "host_adam_params_per_s": 3.9e9,
        "flops_per_s": 760e12,
        "h2d_bytes_per_s": 55e9,
        "d2h_bytes_per_s": 55e9,
    }
    hw = Hardware(**rates)
    plans = {
        clip: make_plan(
            Shape(cfg=cfg, micro_batch_size=1, seq_len=2048, grad_accum=16, grad_clip=clip),
            budget_bytes=12 * GiB,
            hardware=hw,
            optimizer="host",
            resident_blocks=0,
        )
        for clip in (True, False)
    }
    p = plans[True]
    host_s = p.swapped_blocks * host_worker_s(LayerSizes.of(cfg), hw, p.link, p.waves, True)
    assert p.host_optimizer_s == pytest.approx(host_s)
    assert host_s > p.swapped_blocks * p.params_per_block / 3.9e9  # AdamW and the bf16 copy
    # most of the host steps' time is exposed with clipping, none of it without
    assert plans[True].step_s - plans[False].step_s > 0.5 * host_s


def _xl_plan(hw: Hardware, *, batch: int, grad_accum: int, clip: bool, **choices: Any) -> SwapPlan:
    """gpt3-xl at 2048 tokens per sequence on a 139 GiB device, the planner's choices fixed."""
    shape = Shape(
        cfg=get_preset("gpt3-xl"),
        micro_batch_size=batch,
        seq_len=2048,
        grad_accum=grad_accum,
        grad_clip=clip,
    )
    return make_plan(shape, budget_bytes=139 * GiB, hardware=hw, **choices)


@pytest.mark.parametrize("optimizer", ["host", "device"])
@pytest.mark.parametrize("spill", [False, True])
@pytest.mark.parametrize(("k", "m", "g"), [(2, 1, 4), (3, 2, 8), (5, 4, 4)])
def test_phases_carry_every_byte(optimizer: Optimizer, spill: bool, k: int, m: int, g: int) -> None:
    """On hardware where nothing overlaps, a step is exactly compute + loads + stores + fill:
    the phases together move the plan's bytes_loaded and bytes_stored, whatever the waves,
    spill and optimizer."""
    serial = replace(assumed(), host_adam_params_per_s=1e15, duplex=0.0, copy_compute_overlap=0.0)
    for clip in (True, False):
        plan = _xl_plan(
            serial,
            batch=1,
            grad_accum=g,
            clip=clip,
            slots=k,
            micro_batches=m,
            resident_blocks=3,
            spill=spill,
            optimizer=optimizer,
        )
        assert plan.step_s == pytest.approx(
            plan.compute_s + plan.load_s + plan.store_s + plan.fill_s, rel=1e-9
        )


@pytest.mark.parametrize("adam", [1e9, 6e9, 1e12])
@pytest.mark.parametrize(("k", "m"), [(2, 1), (3, 2), (6, 4)])
def test_clipping_never_makes_a_step_faster(adam: float, k: int, m: int) -> None:
    hw = replace(assumed(), host_adam_params_per_s=adam)
    clipped, unclipped = (
        _xl_plan(
            hw,
            batch=4,
            grad_accum=8,
            clip=clip,
            slots=k,
            micro_batches=m,
            resident_blocks=0,
            optimizer="host",
        ).step_s
        for clip in (True, False)
    )
    assert clipped >= unclipped


def test_hidden_fraction() -> None:
    assert hidden_fraction(2.0, 1.0, 2.0) == 1.0  # the shorter one hid entirely
    assert hidden_fraction(2.0, 1.0, 3.0) == 0.0  # they took turns
    assert hidden_fraction(2.0, 1.0, 2.5) == pytest.approx(0.5)
    assert hidden_fraction(2.0, 1.0, 3.5) == 0.0 and hidden_fraction(2.0, 1.0, 1.0) == 1.0
    assert hidden_fraction(0.0, 1.0, 1.0) == 1.0


def test_copies_that_do_not_overlap_add_up() -> None:
    """Measured overlap below 1 (a link without duplex, copies that take turns with compute)
    costs what does not hide."""
    shape = _shape("gpt3-2.7b", 8)
    # A slow link (10 GB/s each way): the backward's loads and stores together outlast its
    # compute only when the two directions take turns.
    slow_link = {"host_adam_params_per_s": 1e12, "h2d_bytes_per_s": 1e10, "d2h_bytes_per_s": 1e10}
    full = Hardware(**(assumed().to_dict() | slow_link))

    def plan(hw: Hardware) -> SwapPlan:
        return make_plan(
            shape,
            budget_bytes=24 * GiB,
            hardware=hw,
            slots=3,
            micro_batches=2,
            resident_blocks=0,
            optimizer="host",
            link="fp32",
        )

    base = plan(full)
    no_duplex = plan(replace(full, duplex=0.0))
    serial = plan(replace(full, duplex=0.0, copy_compute_overlap=0.0))
    everything = base.compute_s + base.load_s + base.store_s + base.fill_s
    assert serial.step_s == pytest.approx(everything)  # nothing hides: every phase adds up
    assert max(base.compute_s, base.load_s, base.store_s) + base.fill_s <= base.step_s
    assert base.step_s < no_duplex.step_s < serial.step_s
    with pytest.raises(ValueError, match="duplex"):
        replace(full, duplex=1.5)


def test_transfers_hide_only_behind_their_own_phase() -> None:
    """gpt3-xl with the optimizer on the device: the first forward loads weights, gradients
    and moments (16 B/param) against a third of the compute, so it is load-bound even though
    the whole step's compute exceeds the whole step's transfers."""
    hw = replace(assumed(), h2d_bytes_per_s=55e9, d2h_bytes_per_s=55e9, flops_per_s=760e12)
    plan = _xl_plan(
        hw,
        batch=4,
        grad_accum=4,
        clip=True,
        slots=2,
        micro_batches=4,
        resident_blocks=0,
        optimizer="device",
    )
    assert plan.compute_s > plan.load_s and plan.bottleneck == "compute"
    forward_loads_s = plan.swapped_blocks * 16 * plan.params_per_block / 55e9
    assert forward_loads_s > plan.compute_s / 3  # the forward is a third of the compute
    # At least: the forward's loads, then the backward's compute (two thirds, or a bit more
    # with the head's); the whole-step view would have said compute_s.
    assert plan.step_s >= forward_loads_s + 2 * plan.compute_s / 3 + plan.fill_s
    assert plan.step_s > plan.compute_s + plan.fill_s + 0.1


def test_the_report_names_overlap_below_one() -> None:
    shape = _shape("gpt3-2.7b", 8)
    full = make_plan(shape, budget_bytes=24 * GiB, hardware=assumed())
    assert "hide behind compute" not in format_plan(full, preset="gpt3-2.7b")
    half = replace(assumed(), copy_compute_overlap=0.5, duplex=0.25)
    text = format_plan(make_plan(shape, budget_bytes=24 * GiB, hardware=half), preset="gpt3-2.7b")
    assert "copies hide behind compute 50%, the two directions overlap 25%" in text


@pytest.mark.parametrize(("grad_accum", "m"), [(8, 8), (8, 2)])
def test_a_bf16_link_halves_the_matrix_bytes(grad_accum: int, m: int) -> None:
    """Over a bf16 link the matrices travel as bf16, both ways: half the bytes of an fp32 link
    for the same loads; host memory stays 16 B/parameter with one
    wave (the bf16 copy and staging replace the fp32 gradient) and is 20 with several."""
    shape = _shape("gpt3-2.7b", grad_accum, batch=1)
    fixed: dict[str, Any] = {
        "slots": 3,
        "micro_batches": m,
        "resident_blocks": 0,
        "spill": False,
        "optimizer": "host",
    }
    bf16 = make_plan(shape, budget_bytes=48 * GiB, hardware=assumed(), link="bf16", **fixed)
    fp32 = make_plan(shape, budget_bytes=48 * GiB, hardware=assumed(), link="fp32", **fixed)
    sizes = LayerSizes.of(shape.cfg)
    assert bf16.layer_loads == fp32.layer_loads
    assert 0.5 < bf16.bytes_loaded / fp32.bytes_loaded < 0.51  # vectors stay fp32
    assert 0.5 < bf16.bytes_stored / fp32.bytes_stored < 0.51
    per_param = 16 if bf16.waves == 1 else 20
    assert bf16.host_bytes == pytest.approx(bf16.swapped_blocks * per_param * sizes.block, 0.01)
    assert fp32.host_bytes == bf16.swapped_blocks * (16 if m == grad_accum else 20) * sizes.block
    # fp32 compute (the CPU) moves fp32; the device optimizer cannot take a bf16 link
    cpu = make_plan(replace(shape, dtype_bytes=4), budget_bytes=48 * GiB, hardware=assumed())
    assert cpu.link == "fp32"
    with pytest.raises(PlanError, match="fp32 link"):
        make_plan(shape, budget_bytes=48 * GiB, hardware=assumed(), optimizer="device", link="bf16")


def test_host_memory_bounds_the_plan() -> None:
    """gpt3-6.7b in 12 GiB swaps 103 GB with one wave per step and 129 GB with several (plus
    17 GB or 8 GB of spilled layer inputs): on a host that can give it 123 GB (0.9 of an
    H200 box's 128 GiB) the planner keeps one wave, and with 50 GB none fits."""
    shape = Shape(cfg=get_preset("gpt3-6.7b"), micro_batch_size=1, seq_len=2048, grad_accum=16)
    hw = replace(assumed(), host_adam_params_per_s=4e9, flops_per_s=7.6e14, h2d_bytes_per_s=5.5e10)
    fixed: dict[str, Any] = {"budget_bytes": 12 * GiB, "hardware": hw, "resident_blocks": 0}
    free = make_plan(shape, micro_batches=8, **fixed)
    assert free.waves == 2 and free.host_bytes > 130e9
    bounded = make_plan(shape, host_budget_bytes=123 * 10**9, **fixed)
    assert bounded.waves == 1 and bounded.host_bytes <= 123e9
    with pytest.raises(PlanError, match="host memory"):
        make_plan(shape, host_budget_bytes=50 * 10**9, **fixed)


def test_the_link_follows_the_bottleneck() -> None:
    """The bf16 link halves the bytes and costs the host worker conversions (a refresh and a
    widening per step, each ~0.4-0.5 of an AdamW step per element): a slow link with a fast
    host takes bf16; a fast link with a host that is already the bound takes fp32 (measured
    on the H200: gpt3-xl's first step after a drained host ran at resident speed, later ones
    waited for the host)."""
    shape = Shape(cfg=get_preset("gpt3-xl"), micro_batch_size=4, seq_len=2048, grad_accum=4)
    fixed: dict[str, Any] = {"budget_bytes": 24 * GiB, "optimizer": "host", "resident_blocks": 0}
    slow_link = replace(assumed(), h2d_bytes_per_s=4e9, d2h_bytes_per_s=4e9, flops_per_s=8e14)
    slow_link = replace(slow_link, host_adam_params_per_s=2e10)
    assert make_plan(shape, hardware=slow_link, **fixed).link == "bf16"
    assert make_plan(shape, hardware=H200_RATES, **fixed).link == "fp32"


def test_a_split_optimizer_hides_the_host_steps_that_clipping_delays() -> None:
    """gpt3-xl at 32k tokens per step with clipping, at the H200's rates: the host's AdamW
    (0.29 s) waits for the whole backward and the forward it can hide behind takes 0.22 s;
    stepping the first layers on the device (their steps ride on the next forward's loads,
    16 B/param against that layer's compute) gives the host that much more forward to catch
    up: the planner takes the split, and it is faster than either optimizer alone."""
    shape = Shape(cfg=get_preset("gpt3-xl"), micro_batch_size=4, seq_len=2048, grad_accum=4)
    fixed: dict[str, Any] = {
        "budget_bytes": 130 * GiB,
        "hardware": H200_RATES,
        "resident_blocks": 0,
    }
    chosen = make_plan(shape, **fixed)
    host = make_plan(shape, optimizer="host", **fixed)
    device = make_plan(shape, optimizer="device", **fixed)
    assert chosen.optimizer == "split" and 0 < chosen.steps_on_device < chosen.swapped_blocks
    # predicted 0.757 s against 0.792 (host) and 0.858 (device): 0.94 of resident speed
    assert chosen.step_s < 0.97 * min(host.step_s, device.step_s)
    assert chosen.resident_step_s / chosen.step_s > 0.93
    assert chosen.memory["slots"] == chosen.slots * 16 * chosen.params_per_block
    assert chosen.link == "fp32"
    fixed_split = make_plan(shape, optimizer="split", device_steps=6, **fixed)
    assert fixed_split.steps_on_device == 6
    with pytest.raises(PlanError, match="device_steps"):
        make_plan(shape, optimizer="host", device_steps=6, **fixed)
    with pytest.raises(PlanError, match="device_steps"):
        make_plan(shape, optimizer="split", device_steps=24, **fixed)
