"""AdamW construction and its state as named tensors (for safetensors checkpoints)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from atomd.errors import CheckpointError
from atomd.logs import get_logger

log = get_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """What the step engines read of a job's optimization settings (``engine_choice.optim_config``
    makes one from a ``JobSpec``)."""

    lr: float
    """The base learning rate (each step passes its scheduled one)."""
    betas: tuple[float, float]
    weight_decay: float
    """AdamW's decoupled weight decay, on matrices only."""
    grad_clip: float
    """Clip the gradients' global norm to this (0: no clipping)."""


def named_unique_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters by name, a tied one once under its first name (``named_parameters`` order)."""
    return list(model.named_parameters())


def swarm_share(peers: int, beta1: float) -> float:
    """The weight ``a`` of a peer's own second moment in the one it normalises its step by when
    ``peers`` peers average their updates: ``a * v + (1 - a) * m**2`` estimates the second moment
    of the mean of ``peers`` gradients (docs/swarm-adam.md). 1 for a peer alone (AdamW)."""
    if peers <= 1:
        return 1.0
    k = (1 - beta1) / (1 + beta1)  # the share of the gradient's variance left in m**2
    return max(0.0, (1 / peers - k) / (1 - k))


FUSED_MIN_NUMEL = 1 << 18
"""A host (CPU) tensor of at least this many entries takes the swarm's step as one compiled
loop (``_fused_kernel``); smaller ones, and device tensors, take eager ops. A compiled call's
guards cost ~20 us, and compiling costs seconds once a process: the tiny preset (at most 65,536
entries a tensor with its 256-token vocabulary) never compiles; a real model's host optimizer
does, once."""


def _swarm_step_one(p: Tensor, g: Tensor, m: Tensor, v: Tensor, h: Tensor) -> None:
    """The swarm's AdamW step of one flat tensor; ``h`` holds (1 - beta1, beta2, 1 - beta2,
    1 - lr * weight_decay, eps, share / bc2, (1 - share) / bc1**2, -lr / bc1), a tensor so
    that one compiled kernel serves every step."""
    m.lerp_(g, h[0])
    v.mul_(h[1]).add_(g * g * h[2])
    p.mul_(h[3]).add_(m / ((v * h[5] + m * m * h[6]).sqrt() + h[4]) * h[7])


_kernel: Callable[..., None] | None = None
_kernel_ran = False  # once it has run, it is compiled: no lock needed
_kernel_failed = False
_kernel_lock = threading.Lock()


def _fused_kernel() -> Callable[..., None] | None:
    """``_swarm_step_one`` compiled by inductor into one loop over the four tensors (~1.15x
    the time of torch's fused AdamW on the host, against ~5x for eager ops: ``python -m
    atomd_bench optim``), or None where it cannot be: no C++ compiler, or an earlier failure
    (logged once)."""
    global _kernel
    if _kernel is None and not _kernel_failed:
        with _kernel_lock:
            if _kernel is None:
                import torch._inductor.config as inductor

                # Compile in this process: a pool of compile workers would outlive the step.
                inductor.compile_threads = 1
                _kernel = torch.compile(_swarm_step_one, dynamic=True, fullgraph=True)
    return None if _kernel_failed else _kernel


def kernel_compiled() -> bool:
    """Whether the compiled host kernel has run in this process and still serves the steps."""
    return _kernel_ran and not _kernel_failed


def _fusable(ts: tuple[Tensor, ...]) -> bool:
    p = ts[0]
    return (
        p.device.type == "cpu"
        and p.numel() >= FUSED_MIN_NUMEL
        and all(t.dtype == torch.float32 and t.is_contiguous() for t in ts)
    )


def _step_fused(kernel: Callable[..., None], ts: tuple[Tensor, ...], h: Tensor) -> bool:
    """One tensor's step through the compiled kernel; False (nothing changed) where compiling
    failed (the first call compiles; a later one may recompile), which turns the kernel off for
    the process: the caller steps the tensor with eager ops."""
    global _kernel_failed, _kernel_ran
    flat = [t.detach().view(-1) for t in ts]
    with _kernel_lock if not _kernel_ran else contextlib.nullcontext():
        if _kernel_failed:
            return False
        try:
            if not _kernel_ran:
                log.info("compiling the swarm's AdamW step for the host (once a process)")
            # Under no_grad whatever the caller's mode: a change of mode would recompile.
            with torch.no_grad():
                kernel(*flat, h)
        except Exception as e:  # inductor raises many kinds; a compile fails before any write
            _kernel_failed = True
            log.warning("the swarm's AdamW steps with eager ops: no compiled kernel (%s)", e)
            return False
        _kernel_ran = True
    return True


def swarm_adamw_step(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    share: float,
) -> None:
    """One AdamW step (``step``: its number, from 1, the same for every tensor) whose
    denominator is ``sqrt(share * v_hat + (1 - share) * m_hat**2) + eps``; ``share`` 1 is
    torch's AdamW. The moments are updated in place as AdamW updates them, so the state stays
    AdamW's and a peer that leaves the swarm goes on with it. Large host tensors take one
    compiled loop (``FUSED_MIN_NUMEL``), the others eager ops."""
    if not params:
        return
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    eager: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []
    h: Tensor | None = None
    for ts in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        kernel = _fused_kernel() if _fusable(ts) else None
        if kernel is not None:
            if h is None:
                h = torch.tensor(
                    [
                        1 - beta1,
                        beta2,
                        1 - beta2,
                        1 - lr * weight_decay,
                        eps,
                        share / bc2,
                        (1 - share) / bc1**2,
                        -lr / bc1,
                    ],
                    dtype=torch.float32,
                )
            if _step_fused(kernel, ts, h):
                continue
        eager.append(ts)
    if not eager:
        return
    params, grads, exp_avgs, exp_avg_sqs = (list(x) for x in zip(*eager, strict=True))
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    if weight_decay:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    for p, m, v in zip(params, exp_avgs, exp_avg_sqs, strict=True):
        # One tensor's denominator at a time: the peak is the largest tensor, not the model.
        denom = torch.mul(m, m).mul_((1 - share) / bc1**2).add_(v, alpha=share / bc2)
        p.addcdiv_(m, denom.sqrt_().add_(eps), value=-lr / bc1)


class AdamW(torch.optim.AdamW):
    """torch's AdamW, normalised by the swarm's second moment while ``peers`` > 1.

    A swarm of ``peers`` peers that average their updates trains with ``peers`` times the
    batch; AdamW's denominator, the root of each peer's own second moment, holds the variance
    of one peer's gradient, ``peers`` times that of the swarm's, and shrinks every step where
    noise dominates (docs/swarm-adam.md). ``peers`` is set by the sync plugin each round; alone
    (1, the default) this is torch's AdamW, fused where asked. The state is AdamW's."""

    peers: int = 1

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if self.peers <= 1:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # fp16's GradScaler hands a fused AdamW the overflow flag and, where the gradients were
        # not unscaled yet, the scale: a step that overflowed is skipped, as the kernel skips it.
        found_inf, scale = getattr(self, "found_inf", None), getattr(self, "grad_scale", None)
        if found_inf is not None and bool(found_inf):
            return loss
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"]:
                raise ValueError("the swarm's AdamW has no amsgrad or maximize")
            on_device = bool(group.get("fused") or group.get("capturable"))
            todo: list[tuple[Tensor, dict[str, Any]]] = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:  # what AdamW's first step creates
                    state["step"] = torch.zeros(
                        (), dtype=torch.float32, device=p.device if on_device else "cpu"
                    )
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                todo.append((p, state))
            if not todo:
                continue
            grads = [p.grad for p, _ in todo]
            if scale is not None:
                torch._foreach_div_(grads, scale)  # type: ignore[arg-type]
            self.swarm_step(
                group,
                [p for p, _ in todo],
                grads,  # type: ignore[arg-type]
                [st["exp_avg"] for _, st in todo],
                [st["exp_avg_sq"] for _, st in todo],
                # Every parameter of a group steps together here (each has a gradient every
                # step), so the first one's count is theirs: one read, not one sync each.
                step=int(todo[0][1]["step"]),
                lr=float(group["lr"]),
            )
        return loss

    def swarm_step(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        exp_avgs: list[Tensor],
        exp_avg_sqs: list[Tensor],
        *,
        step: int,
        lr: float,
    ) -> None:
        """The swarm's step (``swarm_adamw_step``) with ``group``'s hyperparameters and this
        optimizer's ``peers`` over these tensors: its own state, or a copy of it elsewhere (a
        swapped layer's slot on the device, stepped there)."""
        beta1, beta2 = (float(b) for b in group["betas"])
        swarm_adamw_step(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            step=step,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=float(group["weight_decay"]),
            eps=float(group["eps"]),
            share=swarm_share(self.peers, beta1),
        )


def build_adamw(model: nn.Module, cfg: OptimConfig, *, fused: bool | None = None) -> AdamW:
    """AdamW with weight decay on matrices only (not on biases, LayerNorms)."""
    decay = [p for _, p in named_unique_parameters(model) if p.dim() >= 2]
    no_decay = [p for _, p in named_unique_parameters(model) if p.dim() < 2]
    groups: list[dict[str, Any]] = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    kwargs: dict[str, Any] = {"lr": cfg.lr, "betas": cfg.betas}
    if fused is not None:
        kwargs["fused"] = fused
    return AdamW(groups, **kwargs)


def optimizer_tensors(opt: torch.optim.Optimizer, model: nn.Module) -> dict[str, Tensor]:
    """Optimizer state as ``optim.<param name>.<key>`` tensors."""
    names = {id(p): n for n, p in named_unique_parameters(model)}
    out: dict[str, Tensor] = {}
    for p, st in opt.state.items():
        for key, value in st.items():
            t = value if isinstance(value, Tensor) else torch.tensor(value)
            out[f"optim.{names[id(p)]}.{key}"] = t.detach().cpu()
    return out


def second_moments(
    optimizers: Iterable[torch.optim.Optimizer], model: nn.Module
) -> dict[str, Tensor]:
    """Each parameter's AdamW second moment (``exp_avg_sq``, as stored: no bias correction)
    by parameter name, fp32 on the CPU; parameters without one yet (no step) are left out."""
    names = {id(p): n for n, p in named_unique_parameters(model)}
    out: dict[str, Tensor] = {}
    for opt in optimizers:
        for p, st in opt.state.items():
            v = st.get("exp_avg_sq")
            if isinstance(v, Tensor) and id(p) in names:
                out[names[id(p)]] = v.detach().to("cpu", torch.float32)
    return out


def optimizer_state_by_param(
    tensors: Mapping[str, Tensor], params: Mapping[str, object]
) -> dict[str, dict[str, Tensor]]:
    """``optim.<param name>.<key>`` tensors grouped by parameter; an unknown name is an error."""
    per_param: dict[str, dict[str, Tensor]] = {}
    for full, t in tensors.items():
        if not full.startswith("optim."):
            continue
        name, _, key = full[len("optim.") :].rpartition(".")
        if name not in params:
            raise CheckpointError(f"optimizer state names unknown parameter {name!r}")
        per_param.setdefault(name, {})[key] = t
    return per_param


def load_optimizer_tensors(
    opt: torch.optim.Optimizer, model: nn.Module, tensors: dict[str, Tensor]
) -> None:
    """Restore what ``optimizer_tensors`` produced, checking names and shapes."""
    params = dict(named_unique_parameters(model))
    per_param = optimizer_state_by_param(tensors, params)
    for name, st in per_param.items():
        p = params[name]
        for key, t in st.items():
            if t.dim() > 0 and t.shape != p.shape:
                raise CheckpointError(
                    f"optimizer state {name}.{key} has shape {tuple(t.shape)}, "
                    f"parameter has {tuple(p.shape)}"
                )
            # AdamW keeps 'step' on the CPU unless fused/capturable; moments live with the param.
            on_device = bool(opt.defaults.get("fused") or opt.defaults.get("capturable"))
            st[key] = t.to(p.device) if t.dim() > 0 or on_device else t
        opt.state[p] = st
