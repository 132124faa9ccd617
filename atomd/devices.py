"""Choosing the compute device, and the memory arithmetic that admits a job (no torch)."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Literal

from atomd.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from atomd.spec import JobSpec

DeviceName = Literal["auto", "cpu", "cuda"]


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present, else the CPU; ``cuda`` without CUDA is an error."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda asked for, but torch sees no CUDA device")
        return torch.device("cuda")
    if name == "cpu":
        return torch.device("cpu")
    raise ConfigError(f"unknown device {name!r}: use auto, cpu or cuda")


# fp32 weights (4) + gradients (4) + AdamW moments (8): what training keeps per parameter.
TRAIN_BYTES_PER_PARAMETER = 16

# The device nodes a GPU torch could train on needs: NVIDIA's driver, ROCm's, WSL's.
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def host_memory_available() -> int | None:
    """Bytes of host memory available for new allocations (Linux ``MemAvailable``), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def trains_on_host(device: str) -> bool:
    """Whether a job on ``device`` (the daemon's setting) trains on the CPU, whose activations
    then live in host memory, without importing torch: ``cpu`` does; ``cuda`` does not; ``auto``
    does where no GPU device node exists (Linux; and macOS, where ``auto`` never picks a GPU),
    since torch sees no GPU without one. A host with a node is taken to train on its GPU (even
    where torch is a CPU build): its activations then are not counted against host memory, so
    that no job that fits is refused; an out-of-memory on the GPU fails the job cleanly."""
    if device != "auto":
        return device == "cpu"
    if sys.platform == "darwin":
        return True
    if sys.platform != "linux":
        return False
    return not any(os.path.exists(node) for node in GPU_DEVICE_NODES)


ALLOCATOR_SLACK = 1.5
"""What the process's peak RSS may reach per byte of activations alive: glibc's allocator keeps
freed chunks below its adaptive mmap threshold (up to 32 MiB) for reuse, and they fragment.
Tiny, micro_batch_size 256 (1280 MiB of activations estimated), grad_accum 2: 1742-1856 MiB
at the peak in two runs, grad_accum 4: 1920, where with every tensor mmap'd they peaked at
1229-1233 MiB (``atomd bench activation_memory``)."""

TRAINING_RESERVE_BYTES = 128 * 2**20
"""What training on the CPU keeps in the process besides its tensors from the first step on
(oneDNN's and OpenMP's buffers, autograd's threads, the allocator's arenas): 35-55 MiB
measured with every tensor mmap'd, with room for more threads."""


def host_step_bytes(spec: JobSpec) -> int:
    """What ``admit`` counts beyond the training state for a job that trains on the CPU: one
    micro-batch's activations (``activation_bytes``) with the allocator's slack, and the
    reserve the runtime keeps."""
    return int(ALLOCATOR_SLACK * activation_bytes(spec)) + TRAINING_RESERVE_BYTES


ACT_BYTES = 4
"""The residual stream is fp32, also under autocast (as atomd.swap.plan's ``ACT_BYTES``)."""


def activation_bytes(spec: JobSpec) -> int:
    """Peak bytes, in closed form, of what one micro-batch's forward and backward hold on the
    CPU beyond the 16 B/parameter of weights, gradients and AdamW state (micro-batches run one
    after another, each freeing its graph, so ``grad_accum`` does not count). The memory
    model of ``atomd.swap.plan`` (a = 4: the residual stream is fp32; d: the compute dtype's
    bytes, 4 on the CPU unless the spec asks for bf16/fp16 autocast; BTC = micro_batch_size *
    seq_len * n_embd; V the vocabulary), which ``atomd bench activation_memory`` checks against
    the peak RSS of real steps:

    - resident training (``ResidentEngine``) keeps each block's autograd graph until backward:
      its input and the attention's residual sum in fp32 and 15 BTC in the compute dtype
      (LayerNorm outputs 2, qkv 3, attention output and its contiguous copy 2, MLP 4 + 4):
      ``n_layer * BTC * (2a + 15d)``. Attention is ``scaled_dot_product_attention``, whose
      CPU and CUDA kernels keep no seq_len x seq_len scores (measured: the same peak for one
      sequence of 1024 tokens as for four of 256);
    - the head: the final LayerNorm's input and output (2 BTC a), the logits, their log-softmax
      and the gradients of both (``B * T * V * (2d + 12)``), and the tied weight's gradient
      returned before it is summed into ``.grad`` (``V * C * 4``);
    - under autocast, the compute-dtype copies of the weights (``d`` B/parameter);
    - the swapping engine (``swap: on``; ``auto`` never swaps on the CPU) keeps only each layer's
      input for the ``swap_micro_batches`` (M) of a wave, the graphs of ``swap_graph_blocks``,
      two layers' outputs flowing, and one micro-batch's working set in one layer: a block's
      recomputed graph or the head. Where the spec leaves M and the kept graphs to the planner
      this counts the fewest it may choose (M = 1, no kept graph): a bound that never refuses
      a job some plan fits."""
    from atomd.model.config import num_parameters

    cfg = spec.model_shape
    a = ACT_BYTES
    d = 2 if spec.precision in ("bf16", "fp16") else 4
    c, v, n = cfg.n_embd, cfg.vocab_size, cfg.n_layer
    tokens = spec.micro_batch_size * spec.effective_seq_len
    btc = tokens * c
    head = tokens * v * (2 * d + 12) + 2 * btc * a + v * c * 4
    casts = d * num_parameters(cfg) if d < 4 else 0
    if spec.swap != "on":
        return n * btc * (2 * a + 15 * d) + head + casts
    m = spec.swap_micro_batches or 1
    graphs = spec.swap_graph_blocks or 0
    saved = (n + 1 - graphs) * m * btc * a
    kept = graphs * m * btc * (2 * a + 15 * d)
    flowing = 2 * m * btc * a
    working = max(btc * (2 * a + 24 * d), head)
    return saved + kept + flowing + working + casts
