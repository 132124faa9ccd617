"""``python -m atomd_bench optim``: what the swarm's AdamW step costs on the host.

A swapped model's host optimizer steps each layer's fp32 masters on the CPU (``atomd.swap.
hostopt``). Alone it is torch's fused AdamW; while peers average their updates it is the
swarm's AdamW (``atomd.train.optim.swarm_adamw_step``, docs/swarm-adam.md), whose large host
tensors take one compiled loop (``FUSED_MIN_NUMEL``) and whose small ones take eager ops.

Side by side on the same tensors (the shapes of one transformer layer of width ``d``: four
d x d attention matrices, two d x 4d MLP matrices and the small vectors), the best of
``repeats`` timed steps of each, interleaved so that a load that comes and goes hits them
alike:

- ``fused``: torch's fused AdamW (what the planner, ``atomd plan``, times);
- ``foreach``: torch's AdamW with foreach ops (torch's default where fused is not asked);
- ``swarm_eager``: the swarm's step with eager ops only;
- ``swarm``: the swarm's step as a swapped model's host takes it (compiled where large);
- ``compile_s``: the compiled loop's first call, where it compiles (seconds, once a process;
  a warm inductor cache makes it shorter).

Reported per form: milliseconds a step, parameters per second, and the time over ``fused``'s.
Takes ~30 s (``quick``: ~10 s, a smaller layer). ``python -m atomd_bench.optim [--threads N]``
runs it alone.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch

from atomd.train import optim
from atomd.train.optim import swarm_adamw_step, swarm_share

LR, BETAS, WD, EPS, PEERS = 1e-3, (0.9, 0.95), 0.1, 1e-8, 4


def _shapes(d: int) -> list[tuple[int, ...]]:
    square: tuple[int, ...] = (d, d)
    vector: tuple[int, ...] = (d,)
    return [square] * 4 + [(4 * d, d), (d, 4 * d)] + [vector] * 6 + [(4 * d,)]


def _tensors(shapes: list[tuple[int, ...]], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) * 0.02 for s in shapes]


def _adamw(shapes: list[tuple[int, ...]], **kwargs: Any) -> Callable[[], None]:
    params = [torch.nn.Parameter(t) for t in _tensors(shapes, 0)]
    for p, g in zip(params, _tensors(shapes, 1), strict=True):
        p.grad = g
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WD, eps=EPS, **kwargs)
    return lambda: opt.step()


def _swarm(shapes: list[tuple[int, ...]], *, eager: bool) -> Callable[[], None]:
    params, grads = _tensors(shapes, 0), _tensors(shapes, 1)
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    step = [0]

    def run() -> None:
        step[0] += 1
        saved = optim.FUSED_MIN_NUMEL
        if eager:
            optim.FUSED_MIN_NUMEL = 1 << 62
        try:
            swarm_adamw_step(
                params, grads, m, v, step=step[0], lr=LR, beta1=BETAS[0], beta2=BETAS[1],
                weight_decay=WD, eps=EPS, share=swarm_share(PEERS, BETAS[0]),
            )  # fmt: skip
        finally:
            optim.FUSED_MIN_NUMEL = saved

    return run


def run(
    *, d: int = 1024, repeats: int = 15, threads: int | None = None, quick: bool = False
) -> dict[str, Any]:
    """``threads``: torch's intra-op threads (default: torch's, the cores); on a busy machine
    1 keeps a multi-threaded kernel from waiting on its slowest thread."""
    if quick:
        d, repeats = 512, 5
    if threads is not None:
        torch.set_num_threads(threads)
    shapes = _shapes(d)
    n = sum(torch.Size(s).numel() for s in shapes)
    load0 = os.getloadavg()
    forms: dict[str, Callable[[], None]] = {
        "fused": _adamw(shapes, fused=True),
        "foreach": _adamw(shapes, foreach=True),
        "swarm_eager": _swarm(shapes, eager=True),
        "swarm": _swarm(shapes, eager=False),
    }
    t0 = time.perf_counter()
    forms["swarm"]()  # compiles (where it can), once a process
    compile_s = time.perf_counter() - t0
    for f in forms.values():
        f()  # allocators, optimizer state
    best = dict.fromkeys(forms, float("inf"))
    for _ in range(repeats):
        for name, f in forms.items():
            t = time.perf_counter()
            f()
            best[name] = min(best[name], time.perf_counter() - t)
    return {
        "bench": "optim",
        "layer_width": d,
        "params": n,
        "peers": PEERS,
        "threads": torch.get_num_threads(),
        "compiled": optim.kernel_compiled(),
        "fused_min_numel": optim.FUSED_MIN_NUMEL,
        "compile_s": round(compile_s, 3),
        "forms": {
            name: {
                "ms": round(t * 1e3, 3),
                "params_per_s": round(n / t),
                "vs_fused": round(t / best["fused"], 3),
            }
            for name, t in best.items()
        },
        "repeats": repeats,
        "load_avg_start": load0[0],
        "load_avg_end": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m atomd_bench.optim", description=__doc__)
    ap.add_argument("--width", type=int, default=1024, help="the layer's width d (1024)")
    ap.add_argument("--repeats", type=int, default=15, help="timed steps of each form (15)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (the cores)")
    ap.add_argument("--quick", action="store_true", help="a smaller layer, 5 repeats")
    a = ap.parse_args(argv)
    out = run(d=a.width, repeats=a.repeats, threads=a.threads, quick=a.quick)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
