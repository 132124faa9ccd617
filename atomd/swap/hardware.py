"""The rates the planner works from: link bandwidths, compute rate, host optimizer rate.

They are measured on the device at hand (``measure``), or assumed and said so (``assumed``):
``atomd plan`` on a machine without a GPU plans for a typical consumer GPU box.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from atomd.logs import get_logger
from atomd.swap.streams import Streams

log = get_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """Sustained rates of one host + device pair."""

    h2d_bytes_per_s: float
    """Host (pinned) -> device copy bandwidth."""
    d2h_bytes_per_s: float
    """Device -> host (pinned) copy bandwidth; PCIe is full duplex, so both run at once."""
    flops_per_s: float
    """Achieved rate of a large square matmul in the compute dtype (bf16 on CUDA, fp32 on the
    CPU); a whole model runs at ``plan.MODEL_FLOPS_FRACTION`` of it."""
    host_adam_params_per_s: float
    """Parameters per second the host's fused AdamW updates (memory-bound: ~28 B/param)."""
    source: str
    """How these were obtained: 'measured on ...' or 'assumed: ...'."""
    copy_compute_overlap: float = 1.0
    """How much of a host -> device copy hides behind compute running at the same time: 1 when
    they run fully in parallel (separate copy engines), 0 when they take turns."""
    duplex: float = 1.0
    """How much of a device -> host copy hides behind a host -> device one: 1 for a full-duplex
    link (PCIe), 0 when the two directions take turns."""
    host_narrow_per_s: float | None = None
    """fp32 -> bf16 elements per second on the host (refreshing a bf16 link's copies)."""
    host_widen_per_s: float | None = None
    """bf16 -> fp32 elements per second on the host (a bf16 gradient made fp32 for AdamW)."""
    host_add_per_s: float | None = None
    """fp32 += fp32 elements per second on the host (summing waves' gradients)."""

    def __post_init__(self) -> None:
        for name in ("h2d_bytes_per_s", "d2h_bytes_per_s", "flops_per_s", "host_adam_params_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("copy_compute_overlap", "duplex"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # Rates recorded before they were measured: their ratio to AdamW's on a 2-core host and
    # an H200's 16-thread host alike (conversions cost half to 0.4 of an AdamW step per
    # element, not the 6/28 their bytes suggest).
    @property
    def narrow_per_s(self) -> float:
        return self.host_narrow_per_s or 2.0 * self.host_adam_params_per_s

    @property
    def widen_per_s(self) -> float:
        return self.host_widen_per_s or 2.5 * self.host_adam_params_per_s

    @property
    def add_per_s(self) -> float:
        return self.host_add_per_s or 1.8 * self.host_adam_params_per_s


def assumed() -> Hardware:
    """A consumer GPU box: PCIe 4.0 x16 (~25 GB/s each way in practice), an RTX 4090-class GPU
    (~165 TFLOP/s dense bf16 peak, ~100 achieved), fused AdamW on a desktop CPU (~50 GB/s of
    memory bandwidth / 28 B per parameter ~ 1.5 G parameters/s)."""
    return Hardware(
        h2d_bytes_per_s=25e9,
        d2h_bytes_per_s=25e9,
        flops_per_s=100e12,
        host_adam_params_per_s=1.5e9,
        source="assumed (not measured): PCIe 4.0 x16 at 25 GB/s each way, 100 TFLOP/s bf16, "
        "host AdamW 1.5 G params/s",
    )


def hidden_fraction(t_a: float, t_b: float, t_both: float) -> float:
    """Share of the shorter of two operations that hid behind the other when both ran at once
    (``t_both``): 1 for ``max(t_a, t_b)``, 0 for ``t_a + t_b``; clamped to [0, 1]."""
    shorter = min(t_a, t_b)
    if shorter <= 0:
        return 1.0
    return min(1.0, max(0.0, (t_a + t_b - t_both) / shorter))


def _time(fn: Any, repeat: int) -> float:
    """Best-of-``repeat`` seconds for ``fn()`` (which synchronizes on its own)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(device: torch.device, *, repeat: int = 3) -> Hardware:
    """Measure the rates on ``device`` in about a second (on the CPU the "links" are memcpy)."""
    cuda = device.type == "cuda"
    # Sizes: large enough to reach steady state, small enough to take well under a second.
    copy_bytes = (256 if cuda else 32) * 2**20
    n_mat = 4096 if cuda else 384
    dtype = torch.bfloat16 if cuda else torch.float32
    host = torch.empty(copy_bytes // 4, dtype=torch.float32, pin_memory=cuda)
    dev = torch.empty_like(host, device=device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def h2d() -> None:
        dev.copy_(host, non_blocking=True)
        sync()

    def d2h() -> None:
        host.copy_(dev, non_blocking=True)
        sync()

    a = torch.randn(n_mat, n_mat, device=device, dtype=dtype)
    b = torch.randn(n_mat, n_mat, device=device, dtype=dtype)

    def mms(n: int) -> None:
        for _ in range(n):
            torch.mm(a, b)

    def mm() -> None:
        mms(4)
        sync()

    # Concurrency, on side streams as the swap engine issues its copies: a copy next to
    # matmuls sized to last about as long, and copies both ways at once.
    side = Streams(device)  # its load and store streams (None on the CPU)
    host2 = torch.empty_like(host, pin_memory=cuda)
    dev2 = torch.empty_like(dev)
    n_both = 4

    def copy_and_mm() -> None:
        with side.on(side.load):
            dev.copy_(host, non_blocking=True)
        mms(n_both)
        sync()

    def both_ways() -> None:
        with side.on(side.load):
            dev.copy_(host, non_blocking=True)
        with side.on(side.store):
            host2.copy_(dev2, non_blocking=True)
        sync()

    # Larger than any CPU cache (4 x 128 MiB on CUDA hosts): a cache-sized tensor measured
    # 9.1 G params/s on an H200's host, ~4x what AdamW over a 1.3B model's layers reached.
    n_adam = (32 if cuda else 8) * 2**20
    p = torch.nn.Parameter(torch.zeros(n_adam))
    grad = p.grad = torch.full((n_adam,), 1e-3)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    low = torch.empty(n_adam, dtype=torch.bfloat16)
    wide = torch.empty(n_adam)

    def narrow() -> None:
        low.copy_(p.detach())

    def widen() -> None:
        wide.copy_(low)

    def add() -> None:
        wide.add_(grad)

    for warm_up in (h2d, d2h, mm, opt.step):  # allocators, kernels, optimizer state
        warm_up()
    t_h2d, t_d2h = _time(h2d, repeat), _time(d2h, repeat)
    t_mm, t_adam = _time(mm, repeat), _time(opt.step, repeat)
    for warm_up in (narrow, widen, add):
        warm_up()
    t_narrow, t_widen, t_add = (_time(f, repeat) for f in (narrow, widen, add))
    n_both = max(1, min(256, round(4 * t_h2d / t_mm)))
    t_mms = t_mm * n_both / 4
    for warm_up in (copy_and_mm, both_ways):
        warm_up()
    t_copy_mm, t_both_ways = _time(copy_and_mm, repeat), _time(both_ways, repeat)
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    hw = Hardware(
        h2d_bytes_per_s=copy_bytes / t_h2d,
        d2h_bytes_per_s=copy_bytes / t_d2h,
        flops_per_s=4 * 2 * n_mat**3 / t_mm,
        host_adam_params_per_s=n_adam / t_adam,
        source=f"measured on {name} ({torch.get_num_threads()} host threads)",
        copy_compute_overlap=hidden_fraction(t_h2d, t_mms, t_copy_mm),
        duplex=hidden_fraction(t_h2d, t_d2h, t_both_ways),
        host_narrow_per_s=n_adam / t_narrow,
        host_widen_per_s=n_adam / t_widen,
        host_add_per_s=n_adam / t_add,
    )
    log.info("measured hardware: %s", hw)
    return hw
