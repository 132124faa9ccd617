"""A swapped layer's host buffers (atomd.swap.host): groups by link dtype, views, sums."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from atomd.model.gpt import Block, GPTConfig
from atomd.swap.hardware import assumed
from atomd.swap.host import HostLayer, slot_buffers
from atomd.swap.plan import LayerSizes, Shape, make_plan

CFG = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16)
BF16 = torch.bfloat16


def _block() -> nn.Module:
    torch.manual_seed(0)
    return Block(CFG)


def _host(link: torch.dtype, *, accumulate: bool = False, keep_grad: bool = False) -> HostLayer:
    return HostLayer(
        list(_block().parameters()),
        link=link,
        pin=False,
        accumulate=accumulate,
        keep_grad=keep_grad,
    )


def test_a_bf16_link_moves_matrices_as_bf16_copies_of_the_fp32_masters() -> None:
    before = [p.detach().clone() for p in _block().parameters()]
    host = _host(BF16)
    low, full = host.groups
    assert (low.dtype, full.dtype) == (BF16, torch.float32)
    assert all(host.params[i].dim() >= 2 for i in low.index)
    assert all(host.params[i].dim() < 2 for i in full.index)
    # the parameters are the fp32 masters, views of the group's flat buffer, values kept
    for p, b in zip(host.params, before, strict=True):
        assert p.dtype == torch.float32 and torch.equal(p.detach(), b)
    base = low.master.untyped_storage().data_ptr()
    assert all(host.params[i].untyped_storage().data_ptr() == base for i in low.index)
    assert torch.equal(low.src, low.master.to(BF16)) and full.src is full.master
    # a write to the masters reaches the bf16 copy at the next refresh, not before
    with torch.no_grad():
        host.params[low.index[0]].mul_(2)
    assert not torch.equal(low.src, low.master.to(BF16))
    host.refresh()
    assert torch.equal(low.src, low.master.to(BF16))


def test_gradients_one_wave_and_several() -> None:
    """One wave over an fp32 link: the staging is .grad. Several: each wave's gradient lands
    in the staging and is summed into .grad in fp32 (the first wave copies)."""
    fp32 = _host(torch.float32)
    (g,) = fp32.groups
    assert g.staging is g.grad
    assert all(p.grad is not None for p in fp32.params)

    host = _host(BF16, accumulate=True)
    waves = [torch.randn(sum(g.numel for g in host.groups)) for _ in range(3)]
    for w, grad in enumerate(waves):
        at = 0
        for g in host.groups:
            g.staging.copy_(grad[at : at + g.numel])
            at += g.numel
        host.accumulate(w == 0, torch.empty(host.numel))
    got = torch.cat(host.grads())
    n = host.groups[0].numel
    rounded = waves[0][:n].to(BF16).float() + waves[1][:n].to(BF16).float()
    rounded += waves[2][:n].to(BF16).float()
    assert torch.equal(got[:n], rounded)  # each wave rounded once, summed in fp32
    assert torch.equal(got[n:], waves[0][n:] + waves[1][n:] + waves[2][n:])  # fp32 group


def test_one_wave_over_a_bf16_link_keeps_no_fp32_gradient() -> None:
    host = _host(BF16)
    low, full = host.groups
    assert low.grad is None and full.grad is full.staging
    assert all(host.params[i].grad is None for i in low.index)
    low.staging.copy_(torch.randn(low.numel))
    scratch = torch.empty(host.numel)
    host.grads_for_step(scratch)
    grads = [host.params[i].grad for i in low.index]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)
    assert torch.equal(
        torch.cat([g.flatten() for g in grads if g is not None]), low.staging.float()
    )
    host.release_grads()
    assert all(host.params[i].grad is None for i in low.index)


@pytest.mark.parametrize(("link", "waves"), [("bf16", 1), ("bf16", 2), ("fp32", 1), ("fp32", 2)])
def test_host_memory_is_what_the_planner_counts(link: str, waves: int) -> None:
    """The buffers HostLayer allocates plus AdamW's moments are the planner's host_bytes."""
    dtype = BF16 if link == "bf16" else torch.float32
    host = _host(dtype, accumulate=waves > 1)
    held = sum(t.numel() * t.element_size() for t in host.host_tensors())
    moments = 8 * host.numel
    g = 2 * waves
    plan = make_plan(
        Shape(cfg=CFG, micro_batch_size=1, seq_len=16, grad_accum=g, dtype_bytes=2),
        budget_bytes=2**40,
        hardware=assumed(),
        slots=2,
        micro_batches=2,
        resident_blocks=0,
        spill=False,
        optimizer="host",
        link="bf16" if link == "bf16" else "fp32",
    )
    assert plan.waves == waves
    assert plan.host_bytes == plan.swapped_blocks * (held + moments)
    assert LayerSizes.of(CFG).block == host.numel


def test_slot_buffers_mirror_the_layout() -> None:
    host = _host(BF16)
    layout = host.slot_layout()
    weights, grads, flat_w, flat_g = slot_buffers(layout, len(host.params), torch.device("cpu"))
    assert [w.shape for w in weights] == [p.shape for p in host.params]
    assert [w.dtype for w in flat_w] == [BF16, torch.float32]
    assert all(g.dtype == torch.float32 for g in grads)
    assert [w.numel() for w in flat_w] == [g.numel for g in host.groups]
    # the per-parameter views write into the flat buffers that copies move in one piece
    for w in weights:
        w.fill_(1)
    assert all(bool((f == 1).all()) for f in flat_w)
    assert sum(f.numel() for f in flat_g) == host.numel
