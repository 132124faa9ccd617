"""Swapped training (device = cpu) against plain resident training from the same seed."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from atomd.data.dataset import Batch
from atomd.engine_choice import optim_config
from atomd.model.gpt import GPT, GPTConfig
from atomd.spec import JobSpec
from atomd.swap.compare import max_rel_param_diff
from atomd.swap.engine import SwapEngine
from atomd.swap.hardware import assumed
from atomd.swap.plan import Optimizer, Shape, SwapPlan, make_plan
from atomd.train.optim import OptimConfig
from atomd.train.step_engine import ResidentEngine, model_tensors
from tests.conftest import CompiledKernel

CPU = torch.device("cpu")
# Smaller than the tiny preset (4 blocks of width 32) so that the whole matrix runs in seconds.
CFG = GPTConfig(n_layer=4, n_head=2, n_embd=32, vocab_size=64, block_size=16)
B, T, G, STEPS, LR = 2, 16, 4, 3, 1e-2
# Tolerance: per-parameter relative L2 difference 1e-5 in fp32 (measured: ~5e-7). Forward,
# recompute and per-layer gradients are bitwise equal to resident training on the CPU; what
# differs is the order of fp32 additions of the tied embedding's gradient (the head's and the
# embedding's contributions are summed per use here, per micro-batch there) and the fused CPU
# AdamW kernel (the reference uses the single-tensor one): ~1e-7 relative per step, which a
# few steps do not grow past 1e-6. The key third of attn.qkv.bias, whose exact gradient is
# zero, is left out of the comparison (atomd.swap.compare explains why).
TOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _spec(grad_clip: float) -> OptimConfig:
    return optim_config(
        JobSpec(preset="tiny", micro_batch_size=B, seq_len=T, grad_accum=G, grad_clip=grad_clip)
    )


def _batches(step: int, count: int = G) -> list[Batch]:
    gen = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(count):
        t = torch.randint(0, CFG.vocab_size, (B, T + 1), generator=gen)
        out.append(Batch(x=t[:, :-1].contiguous(), y=t[:, 1:].contiguous()))
    return out


def _plan(
    k: int,
    m: int,
    resident_blocks: int = 0,
    spill: bool | None = None,
    optimizer: Optimizer = "host",
    graphs: int = 0,
) -> SwapPlan:
    plan = make_plan(
        Shape(cfg=CFG, micro_batch_size=B, seq_len=T, grad_accum=G, dtype_bytes=4),
        budget_bytes=2**40,
        hardware=assumed(),
        slots=k,
        micro_batches=m,
        resident_blocks=resident_blocks,
        optimizer=optimizer,
        graph_blocks=graphs,
    )
    return plan if spill is None else replace(plan, spill=spill)


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def _train(engine: ResidentEngine | SwapEngine, lr: float = LR) -> list[float]:
    return [engine.train_step(_batches(s), lr) for s in range(STEPS)]


@pytest.fixture(scope="module", params=[0.0, 1.0], ids=["noclip", "clip1"])
def resident(request: pytest.FixtureRequest) -> tuple[float, list[float], ResidentEngine]:
    clip = float(request.param)
    engine = ResidentEngine(_model(), _spec(clip), CPU)
    return clip, _train(engine), engine


@pytest.mark.parametrize(
    ("k", "m", "optimizer"),
    [
        (2, 1, "host"),
        (2, 4, "host"),
        (3, 1, "host"),
        (3, 4, "host"),
        (2, 1, "device"),
        (3, 4, "device"),
    ],
)
def test_swapped_matches_resident(
    resident: tuple[float, list[float], ResidentEngine], k: int, m: int, optimizer: Optimizer
) -> None:
    """Same losses, parameters and AdamW state as resident training; with the optimizer on the
    device too (its steps applied at the next load, clipping coefficient included)."""
    clip, losses, ref = resident
    engine = SwapEngine(_model(), _spec(clip), CPU, _plan(k, m, optimizer=optimizer))
    try:
        got = _train(engine)
        assert got == pytest.approx(losses, rel=1e-6)
        assert max_rel_param_diff(engine.model_tensors(), ref.model_tensors()) < TOL
        opt, ref_opt = engine.optimizer_tensors(), ref.optimizer_tensors()
        assert set(opt) == set(ref_opt)  # same checkpoint names: optim.<param>.<key>
        assert torch.equal(opt["optim.blocks.0.attn.qkv.weight.step"], torch.tensor(3.0))
        exp_avg = {k: v for k, v in opt.items() if k.endswith("exp_avg")}
        ref_avg = {k: v for k, v in ref_opt.items() if k.endswith("exp_avg")}
        assert max_rel_param_diff(exp_avg, ref_avg) < TOL
        # M micro-batches per load: 2q - K loads in the first wave, 2q - 2K in later ones.
        q, waves = CFG.n_layer, G // m
        assert engine.stats.layer_loads == (2 * q - k) + (waves - 1) * (2 * q - 2 * k)
        val = _batches(99, count=3)
        assert engine.evaluate(val) == pytest.approx(ref.evaluate(val), rel=1e-6)
    finally:
        engine.close()


@pytest.mark.parametrize(("resident_blocks", "spill"), [(0, True), (1, True), (2, False)])
def test_spill_and_resident_blocks_match_resident(
    resident: tuple[float, list[float], ResidentEngine], resident_blocks: int, spill: bool
) -> None:
    clip, losses, ref = resident
    engine = SwapEngine(_model(), _spec(clip), CPU, _plan(2, 2, resident_blocks, spill))
    try:
        assert _train(engine) == pytest.approx(losses, rel=1e-6)
        assert max_rel_param_diff(engine.model_tensors(), ref.model_tensors()) < TOL
        assert len(engine.swapped) == CFG.n_layer - resident_blocks
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("graphs", "m", "spill", "resident_blocks", "optimizer"),
    [
        (2, 4, False, 0, "host"),
        (4, 1, False, 0, "device"),
        (1, 2, True, 0, "host"),
        (3, 2, True, 2, "host"),
    ],
)
def test_blocks_that_keep_their_graph_match_resident(
    resident: tuple[float, list[float], ResidentEngine],
    graphs: int,
    m: int,
    spill: bool,
    resident_blocks: int,
    optimizer: Optimizer,
) -> None:
    """The last blocks keep their forward graph instead of recomputing it (their slots are
    reused before backward: saved slot tensors are copied), with spilling, resident blocks and
    either optimizer around them."""
    clip, losses, ref = resident
    plan = _plan(2, m, resident_blocks, spill, optimizer, graphs)
    engine = SwapEngine(_model(), _spec(clip), CPU, plan)
    try:
        assert _train(engine) == pytest.approx(losses, rel=1e-6)
        assert max_rel_param_diff(engine.model_tensors(), ref.model_tensors()) < TOL
        n = len(engine.layers)
        assert engine._graphs == set(range(n - 1 - graphs, n - 1))
        assert not engine._spilled_layers & engine._graphs
        assert engine.stats.peak_held_bytes > 0 and not engine._graph_bytes  # all consumed
    finally:
        engine.close()


def test_the_comparison_can_fail(resident: tuple[float, list[float], ResidentEngine]) -> None:
    """A 0.1% different learning rate is a difference the tolerance sees."""
    clip, _, ref = resident
    engine = SwapEngine(_model(), _spec(clip), CPU, _plan(2, 4))
    try:
        _train(engine, lr=LR * 1.001)
        assert max_rel_param_diff(engine.model_tensors(), ref.model_tensors()) > 100 * TOL
    finally:
        engine.close()


def test_host_memory_holds_one_copy_and_the_device_k_slots() -> None:
    model = _model()
    params = dict(model.named_parameters())
    engine = SwapEngine(model, _spec(1.0), CPU, _plan(3, 4))
    try:
        _train(engine)
        tensors = engine.model_tensors()
        # The master weights are the model's own tensors: no second full copy of the model.
        assert all(tensors[n].data_ptr() == p.data_ptr() for n, p in params.items())
        assert len(engine.slots) == 3
        block = sum(p.numel() for p in model.blocks[0].parameters())
        assert all(sum(w.numel() for w in s.weights) == block for s in engine.slots)
        # The tied embedding stays one parameter, resident, trained by both of its uses.
        assert model.head.lm_head.weight is model.embed.wte.weight
        assert 0 in engine.resident and len(model.layers()) - 1 in engine.resident
    finally:
        engine.close()


def test_device_steps_wait_for_the_next_load_or_settle(
    resident: tuple[float, list[float], ResidentEngine],
) -> None:
    """With the optimizer on the device a step's update is not in the host masters until the
    layer's next load or ``settle``: whoever reads or writes the masters in between (sync) must
    settle first, and then sees the same model as resident training."""
    clip, _, ref = resident
    model = _model()
    block = model.layers()[1]
    engine = SwapEngine(model, _spec(clip), CPU, _plan(2, 1, optimizer="device"))
    try:
        before = [p.detach().clone() for p in block.parameters()]
        _train(engine)
        # The last step's update waits: the masters hold the model after step 2 of 3.
        assert all(
            not torch.equal(a, b.detach()) for a, b in zip(before, block.parameters(), strict=True)
        )
        stale = {n: t.clone() for n, t in model_tensors(model).items()}
        assert max_rel_param_diff(stale, ref.model_tensors()) > 100 * TOL
        engine.settle()
        assert max_rel_param_diff(model_tensors(model), ref.model_tensors()) < TOL
        assert not engine._due and all(s.layer is None for s in engine.slots)
        assert all(
            sum(m.numel() for m in s.moments) == 2 * sum(w.numel() for w in s.weights)
            for s in engine.slots
        )
    finally:
        engine.close()


def test_dropout_is_refused() -> None:
    from atomd.errors import SwapError

    cfg = replace(CFG, dropout=0.1)
    with pytest.raises(SwapError, match="dropout"):
        SwapEngine(GPT(cfg), _spec(0.0), CPU, _plan(2, 4))


@pytest.mark.parametrize("graphs", [0, 2], ids=["recompute", "kept-graphs"])
def test_under_bf16_autocast_as_on_cuda(monkeypatch: pytest.MonkeyPatch, graphs: int) -> None:
    """On CUDA both engines run under bf16 autocast, whose weight cache the swap engine shares
    across a visit's M micro-batches (forward, kept graphs, recompute). The CPU's bf16 autocast
    exercises the same caching here: same losses and parameters as resident training under it,
    within fp32 rounding, as the same bf16 casts and kernels run in both."""

    def bf16(device: torch.device) -> torch.autocast:
        return torch.autocast("cpu", dtype=torch.bfloat16)

    monkeypatch.setattr("atomd.train.step_engine.autocast", bf16)
    monkeypatch.setattr("atomd.swap.engine.autocast", bf16)
    ref = ResidentEngine(_model(), _spec(1.0), CPU)
    losses = _train(ref)
    engine = SwapEngine(_model(), _spec(1.0), CPU, _plan(2, 4, graphs=graphs))
    try:
        got = _train(engine)
        assert got == pytest.approx(losses, rel=1e-3)
        # Same bf16 casts and matmuls, fp32 sums over micro-batches: measured 6e-8. Summing the
        # M micro-batches' gradients of the shared bf16 weight copy in bf16 instead (one
        # backward through M kept graphs) measured 8e-2.
        assert max_rel_param_diff(engine.model_tensors(), ref.model_tensors()) < 1e-5
    finally:
        engine.close()


def _bf16_autocast(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both engines under the CPU's bf16 autocast, as they run on CUDA."""

    def bf16(device: torch.device) -> torch.autocast:
        return torch.autocast("cpu", dtype=torch.bfloat16)

    monkeypatch.setattr("atomd.train.step_engine.autocast", bf16)
    monkeypatch.setattr("atomd.swap.engine.autocast", bf16)


@pytest.mark.parametrize("clip", [0.0, 1.0], ids=["noclip", "clip1"])
@pytest.mark.parametrize(
    ("m", "tol"),
    [
        # M=1: each micro-batch's weight gradient comes out of a bf16 matmul, so rounding it to
        # bf16 loses nothing: the bf16 link must then match resident training as fp32 does.
        (1, 1e-6),
        # One wave of 4: the fp32 sum is rounded once (2^-9 relative, sign kept). Measured
        # 2.0e-3 (no clipping) and 3.4e-3 after 3 steps of lr 1e-2 from the initialization,
        # where AdamW's step is nearly sign(g) for every entry.
        (4, 1e-2),
        # Two waves of 2: each wave's sum is rounded, then summed in fp32 on the host; entries
        # whose two waves nearly cancel can change sign, and a sign-like first step shows it:
        # measured 2.8e-2 and 3.4e-2. Gradient noise between micro-batches dwarfs this.
        (2, 6e-2),
    ],
)
def test_a_bf16_link_trains_as_resident_under_bf16_autocast(
    monkeypatch: pytest.MonkeyPatch, clip: float, m: int, tol: float
) -> None:
    _bf16_autocast(monkeypatch)
    ref = ResidentEngine(_model(), _spec(clip), CPU)
    losses = _train(ref)
    plan = replace(_plan(2, m), link="bf16")
    engine = SwapEngine(_model(), _spec(clip), CPU, plan)
    try:
        got = _train(engine)
        assert got == pytest.approx(losses, rel=1e-4)
        assert max_rel_param_diff(engine.model_tensors(), ref.model_tensors()) < tol
        # half the bytes of an fp32 link: bf16 matrices, fp32 vectors, both ways
        fp32_bytes = (
            engine.stats.layer_loads * 4 * sum(p.numel() for p in engine.layers[1].parameters())
        )
        assert 0.5 < engine.stats.bytes_loaded / fp32_bytes < 0.55
    finally:
        engine.close()


def test_a_bf16_link_that_kept_stale_copies_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bf16 copies must follow every optimizer step: without the refresh the slots keep
    computing with the initial weights, which the tolerance above sees at once."""
    _bf16_autocast(monkeypatch)
    ref = ResidentEngine(_model(), _spec(0.0), CPU)
    _train(ref)
    engine = SwapEngine(_model(), _spec(0.0), CPU, replace(_plan(2, 4), link="bf16"))
    monkeypatch.setattr("atomd.swap.host.HostLayer.refresh", lambda self: None)
    try:
        _train(engine)
        assert max_rel_param_diff(engine.model_tensors(), ref.model_tensors()) > 0.1
    finally:
        engine.close()


@pytest.mark.parametrize("link", ["bf16", "fp32"])
def test_masters_written_after_settle_are_what_the_next_visit_loads(
    monkeypatch: pytest.MonkeyPatch, link: str
) -> None:
    """Sync and checkpoint loads write the masters after ``settle``: the next step and
    evaluation compute with the written values (the bf16 copies are made again first)."""
    _bf16_autocast(monkeypatch)
    ref = ResidentEngine(_model(), _spec(0.0), CPU)
    engine = SwapEngine(_model(), _spec(0.0), CPU, replace(_plan(2, 4), link=link))
    try:
        _train(engine)
        _train(ref)
        for e in (engine, ref):
            e.settle()
            with torch.no_grad():
                for p in e.model.blocks.parameters():
                    p.mul_(0.5)
        val = _batches(99, count=3)
        # rel 1e-4: the bf16 link's 3 steps left the parameters ~2e-3 apart (above); a layer
        # computing with its unwritten weights moves the loss by ~1e-1
        assert engine.evaluate(val) == pytest.approx(ref.evaluate(val), rel=1e-4)
        assert engine.train_step(_batches(7), LR) == pytest.approx(
            ref.train_step(_batches(7), LR), rel=1e-4
        )
    finally:
        engine.close()


def test_adamw_state_exists_before_the_first_step() -> None:
    """Created with the engine (zeros, step 0), not lazily inside the first timed step."""
    engine = SwapEngine(_model(), _spec(1.0), CPU, _plan(2, 4))
    try:
        opt = engine.optimizer_tensors()
        swapped = {k: v for k, v in opt.items() if k.startswith("optim.blocks.")}
        assert swapped and all(float(v.abs().max()) == 0.0 for v in swapped.values())
        assert torch.equal(opt["optim.blocks.1.mlp.fc.weight.step"], torch.tensor(0.0))
    finally:
        engine.close()


def test_a_step_with_other_waves_than_planned_is_refused() -> None:
    from atomd.errors import SwapError

    engine = SwapEngine(_model(), _spec(0.0), CPU, _plan(2, 4))  # one wave of 4
    try:
        with pytest.raises(SwapError, match="wave"):
            engine.train_step(_batches(0, count=8), LR)
    finally:
        engine.close()


def test_resident_training_with_recompute_is_resident_training() -> None:
    """The reference for swapped runs that recompute: same losses and parameters (the
    recomputed forward repeats the kept one exactly on the CPU)."""
    plain = ResidentEngine(_model(), _spec(1.0), CPU)
    again = ResidentEngine(_model(), _spec(1.0), CPU, recompute=True)
    assert _train(again) == pytest.approx(_train(plain), rel=1e-6)
    assert max_rel_param_diff(again.model_tensors(), plain.model_tensors()) < TOL


@pytest.mark.parametrize(("k", "m"), [(2, 4), (3, 1), (2, 2)])
def test_a_split_optimizer_matches_resident(
    resident: tuple[float, list[float], ResidentEngine], k: int, m: int
) -> None:
    """The first swapped layers step on the device (their step with their next load), the
    others on the host: the same model as resident training, one wave or several."""
    clip, losses, ref = resident
    plan = replace(_plan(k, m, optimizer="device"), optimizer="split", device_steps=2)
    engine = SwapEngine(_model(), _spec(clip), CPU, plan)
    try:
        assert engine.on_device == set(engine.swapped[:2])
        assert _train(engine) == pytest.approx(losses, rel=1e-6)
        assert max_rel_param_diff(engine.model_tensors(), ref.model_tensors()) < TOL
        opt, ref_opt = engine.optimizer_tensors(), ref.optimizer_tensors()
        exp_avg = {k: v for k, v in opt.items() if k.endswith("exp_avg")}
        assert max_rel_param_diff(exp_avg, {k: ref_opt[k] for k in exp_avg}) < TOL
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("optimizer", "compiled"), [("host", False), ("device", False), ("host", True)]
)
def test_with_peers_swapped_steps_as_resident(
    optimizer: Optimizer, compiled: bool, compiled_kernel: CompiledKernel
) -> None:
    """With the swarm's second moment (``set_peers``) the host's and the device's AdamW steps
    are the resident engine's (eager ops), and they differ from AdamW alone; also where the
    host's worker takes every tensor through the compiled loop (a real model's large host
    tensors do)."""
    ref = ResidentEngine(_model(), _spec(1.0), CPU)
    alone = ResidentEngine(_model(), _spec(1.0), CPU)
    engine = SwapEngine(_model(), _spec(1.0), CPU, _plan(2, 1, optimizer=optimizer))
    try:
        ref.set_peers(4)
        engine.set_peers(4)
        compiled_kernel.every_tensor(False)
        expected = _train(ref)
        _train(alone)
        compiled_kernel.every_tensor(compiled)
        assert _train(engine) == pytest.approx(expected, rel=1e-6)
        assert max_rel_param_diff(engine.model_tensors(), ref.model_tensors()) < TOL
        assert max_rel_param_diff(alone.model_tensors(), ref.model_tensors()) > 100 * TOL
        if compiled:
            compiled_kernel.check()
        else:
            assert compiled_kernel.calls == 0
    finally:
        engine.close()


@pytest.mark.parametrize("optimizer", ["host", "device"])
def test_second_moments_are_the_resident_engines(optimizer: Optimizer) -> None:
    """What top-k ranks by (``SyncSpec.topk_rank``): every parameter's AdamW second moment by
    name, the same swapped (host or device steps) as resident; none before a step."""
    ref = ResidentEngine(_model(), _spec(1.0), CPU)
    engine = SwapEngine(_model(), _spec(1.0), CPU, _plan(2, 1, optimizer=optimizer))
    try:
        assert ref.second_moments() == {}
        _train(ref)
        _train(engine)
        engine.settle()
        got, want = engine.second_moments(), ref.second_moments()
        assert set(want) == {n for n, _ in ref.model.named_parameters()}
        assert set(got) == set(want)
        assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in got.values())
        assert max_rel_param_diff(got, want) < TOL
        assert all(float(t.max()) > 0 for t in want.values())
    finally:
        engine.close()
