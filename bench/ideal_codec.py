"""``IdealCodec``: an oracle for the codec study (not a codec a daemon can send), and the size
of the frames it stands for."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from atomd.sync.codecs import Encoded, Fp32Codec


class IdealCodec(Fp32Codec):
    """An oracle for the codec study: what the best code of ``rate`` bits a parameter delivers
    if a delta's entries are Gaussian with each chunk's own variance (each tensor gets the same
    rate; within it, the chunks share it). Not a bound for every code: a delta's tails are
    heavier than Gaussian, and top-k, which uses them, beats it at half its bytes.

    Rate-distortion theory gives the least mean squared error at a rate: per chunk of variance
    s2, D = min(theta, s2), with theta chosen so the chunks' rates, n/2 log2(s2 / D), add up
    to ``rate`` x numel (reverse water-filling). The encoder-decoder pair that reaches it is
    the test channel x_hat = a x + sqrt(a D) z, a = 1 - D / s2, z ~ N(0, 1) independent at each
    sender: the receiver gets a shrunk estimate with independent noise; the residual x - x_hat
    stays with the sender as any codec's would. No real code reaches the bound; a code that
    beats it must use more than each chunk's variance (heavier tails than Gaussian, the peers'
    deltas being alike). Frames carry x_hat as fp32 (the harness counts
    ``ideal_frame_bytes``).
    """

    def __init__(self, *, rate: float, seed: int, chunk: int = 4096) -> None:
        super().__init__(zstd=False)
        if rate <= 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        self.rate = rate
        self.chunk = chunk
        self.gen = torch.Generator().manual_seed(seed)

    def encode(self, x: torch.Tensor) -> Encoded:
        flat = x.detach().reshape(-1).to(torch.float64)
        n = flat.numel()
        n_chunks = max(1, math.ceil(n / self.chunk))
        size = math.ceil(n / n_chunks)
        pad = torch.zeros(n_chunks * size - n, dtype=torch.float64)
        rows = torch.cat([flat, pad]).reshape(n_chunks, size)
        counts = torch.full((n_chunks,), float(size), dtype=torch.float64)
        counts[-1] -= pad.numel()
        var = rows.square().sum(1) / counts
        live = var > 0
        if not live.any():
            return super().encode(x)
        budget = self.rate * n

        def bits(log_theta: float) -> float:
            ratio = (var[live].log() - log_theta).clamp(min=0.0)
            return float((counts[live] * ratio).sum() / (2 * math.log(2)))

        lo, hi = float(var[live].log().max()) - 80.0, float(var[live].log().max())
        for _ in range(100):  # bits() falls as theta rises
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if bits(mid) > budget else (lo, mid)
        theta = math.exp(hi)
        dist = torch.where(live, var.clamp(max=theta), torch.zeros_like(var))
        alpha = torch.where(live, 1 - dist / var.clamp(min=1e-300), torch.zeros_like(var))
        beta = (alpha * dist).sqrt()
        z = torch.randn(rows.shape, generator=self.gen, dtype=torch.float64)
        out = (alpha[:, None] * rows + beta[:, None] * z).reshape(-1)[:n]
        return super().encode(out.to(torch.float32).reshape(x.shape))


def ideal_frame_bytes(rate: float, numels: Sequence[int], chunk: int = 4096) -> int:
    """An ideal frame's size for tensors of ``numels`` entries: the rate's payload, a bf16
    variance per chunk, and the 702 B of a top-k frame's signed header for the tiny model's 52
    tensors (measured; scaled by the tensors' count)."""
    payload = math.ceil(rate * sum(numels) / 8)
    chunks = sum(max(1, math.ceil(n / chunk)) for n in numels)
    return payload + 2 * chunks + 702 * len(numels) // 52
