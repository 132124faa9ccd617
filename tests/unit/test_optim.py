"""AdamW with the swarm's second moment (atomd.train.optim): alone it is torch's AdamW; with
peers it divides by an estimate of the second moment of the mean of their gradients."""

from __future__ import annotations

import logging

import pytest
import torch

from atomd.train import optim
from atomd.train.optim import AdamW, swarm_adamw_step, swarm_share
from tests.conftest import CompiledKernel

BETAS = (0.9, 0.95)


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 7, generator=gen)) for _ in range(3)]


def _run(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int = 6) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


def test_the_share_is_adamw_alone_and_estimates_the_mean_of_n_gradients() -> None:
    assert swarm_share(1, 0.9) == 1.0
    assert swarm_share(0, 0.9) == 1.0
    k = 0.1 / 1.9  # the noise left in m**2 with beta1 0.9
    assert swarm_share(4, 0.9) == pytest.approx((0.25 - k) / (1 - k))
    shares = [swarm_share(n, 0.9) for n in range(1, 40)]
    assert shares == sorted(shares, reverse=True)  # more peers, less of the own variance
    assert shares[-1] == 0.0  # past 1/k peers: m**2 alone (the step's size stays bounded)


@pytest.mark.parametrize("fused", [None, True])
def test_alone_it_is_torchs_adamw(fused: bool | None) -> None:
    mine, ref = _params(), _params()
    kwargs = {"lr": 1e-2, "betas": BETAS, "weight_decay": 0.1, "fused": fused}
    _run(AdamW(mine, **kwargs), mine)
    _run(torch.optim.AdamW(ref, **kwargs), ref)
    for a, b in zip(mine, ref, strict=True):
        assert torch.equal(a, b)


def test_the_swarm_step_with_share_1_is_adamw() -> None:
    mine, ref = _params(), _params()
    opt = torch.optim.AdamW(ref, lr=1e-2, betas=BETAS, weight_decay=0.1)
    m = [torch.zeros_like(p) for p in mine]
    v = [torch.zeros_like(p) for p in mine]
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 7):
        grads = [torch.randn(p.shape, generator=gen) for p in mine]
        for p, g in zip(ref, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        with torch.no_grad():
            swarm_adamw_step(
                list(mine), grads, m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.95,
                weight_decay=0.1, eps=1e-8, share=1.0,
            )  # fmt: skip
    for a, b in zip(mine, ref, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
    state = opt.state[ref[0]]
    torch.testing.assert_close(m[0], state["exp_avg"])
    torch.testing.assert_close(v[0], state["exp_avg_sq"])


def test_with_peers_it_steps_as_adamw_on_the_mean_of_their_gradients() -> None:
    """Gradients mu + sigma * noise: AdamW on one of them divides by ~sqrt(mu**2 + sigma**2),
    AdamW on the mean of 4 by ~sqrt(mu**2 + sigma**2 / 4); one peer's AdamW with peers=4
    divides by the second, from its own gradients only."""
    torch.manual_seed(0)
    n, size, steps, lr = 4, 20_000, 400, 1e-3
    mu = torch.full((size,), 0.5)
    sigma = 2.0
    params = {k: torch.nn.Parameter(torch.zeros(size)) for k in ("alone", "swarm", "mean")}
    opts = {k: AdamW([p], lr=lr, betas=BETAS, weight_decay=0.0) for k, p in params.items()}
    opts["swarm"].peers = n
    for _ in range(steps):
        noise = torch.randn(n, size) * sigma
        own = mu + noise[0]
        params["alone"].grad = own.clone()
        params["swarm"].grad = own.clone()
        params["mean"].grad = mu + noise.mean(0)  # the swarm's batch
        for opt in opts.values():
            opt.step()
    moved = {k: float(-p.detach().mean()) / (lr * steps) for k, p in params.items()}
    # Per step along mu: ~mu / sqrt(mu**2 + sigma**2 / n) for the batch of n, ~mu / sqrt(mu**2 +
    # sigma**2) alone (0.45 against 0.24 here).
    assert moved["mean"] == pytest.approx(0.5 / (0.25 + 1.0) ** 0.5, rel=0.1)
    assert moved["alone"] == pytest.approx(0.5 / (0.25 + 4.0) ** 0.5, rel=0.1)
    assert moved["swarm"] == pytest.approx(moved["mean"], rel=0.15)  # measured: 0.41, 0.44
    state = opts["swarm"].state[params["swarm"]]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"}  # AdamW's state: checkpoints as ever


def test_a_step_that_overflowed_under_fp16_is_skipped() -> None:
    params = _params()
    opt = AdamW(params, lr=1e-2, betas=BETAS)
    opt.peers = 4
    before = [p.detach().clone() for p in params]
    opt.found_inf = torch.ones(())  # type: ignore[attr-defined]  # as GradScaler hands it
    _run(opt, params, steps=1)
    assert all(torch.equal(a, b) for a, b in zip(params, before, strict=True))
    assert not opt.state


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("peers", [4, 30])  # 30: share 0, the step is m / |m|
def test_with_peers_each_step_is_the_formula(
    compiled: bool, peers: int, compiled_kernel: CompiledKernel
) -> None:
    """AdamW(peers) against the formula written out per step (bias corrections, decay, eps),
    for the first steps, where a wrong count or correction shows; with eager ops and through
    the compiled loop (1,031 entries: its vector body and its tail)."""
    compiled_kernel.every_tensor(compiled)
    n = 1031
    gen = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter(torch.randn(n, generator=gen))
    opt = AdamW([p], lr=1e-2, betas=BETAS, weight_decay=0.1, eps=1e-8)
    opt.peers = peers
    a = swarm_share(peers, BETAS[0])
    x, m, v = p.detach().double().clone(), torch.zeros(n).double(), torch.zeros(n).double()
    for t in range(1, 5):
        g = torch.randn(n, generator=gen)
        p.grad = g.clone()
        opt.step()
        m = BETAS[0] * m + (1 - BETAS[0]) * g.double()
        v = BETAS[1] * v + (1 - BETAS[1]) * g.double() ** 2
        m_hat, v_hat = m / (1 - BETAS[0] ** t), v / (1 - BETAS[1] ** t)
        x = x * (1 - 1e-2 * 0.1) - 1e-2 * m_hat / ((a * v_hat + (1 - a) * m_hat**2).sqrt() + 1e-8)
        torch.testing.assert_close(p.detach().double(), x, rtol=1e-5, atol=1e-7)
    assert float(opt.state[p]["step"]) == 4.0
    if compiled:
        compiled_kernel.check()
    else:
        assert compiled_kernel.calls == 0


def test_a_kernel_that_does_not_compile_leaves_the_eager_step(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where inductor cannot compile (no C++ compiler, say), the step is the eager one, the
    failure is logged once and the kernel is not tried again."""
    calls: list[int] = []

    def broken(*args: object) -> None:
        calls.append(1)
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(optim, "FUSED_MIN_NUMEL", 1)
    monkeypatch.setattr(optim, "_kernel", broken)
    monkeypatch.setattr(optim, "_kernel_ran", False)
    monkeypatch.setattr(optim, "_kernel_failed", False)
    mine, ref = _params(), _params()
    opt, eager = AdamW(mine, lr=1e-2, betas=BETAS), AdamW(ref, lr=1e-2, betas=BETAS)
    opt.peers = eager.peers = 4
    with caplog.at_level(logging.WARNING, logger="atomd.train.optim"):
        _run(opt, mine)
    monkeypatch.setattr(optim, "FUSED_MIN_NUMEL", 1 << 62)
    _run(eager, ref)
    for a, b in zip(mine, ref, strict=True):
        assert torch.equal(a, b)
    assert calls == [1] and optim._kernel_failed
    assert sum("no compiled kernel (no C++ compiler)" in r.message for r in caplog.records) == 1
