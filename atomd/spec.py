"""The job spec: what to train and how. Every field has a default; ``{"preset": "tiny"}`` is valid.

``atomd train`` builds one from its flags, the daemon from the body of ``POST /v1/jobs``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from atomd.logs import get_logger
from atomd.model.config import GPTConfig
from atomd.model.presets import PRESETS
from atomd.units import parse_bytes

log = get_logger(__name__)

# Upper bounds: far beyond any real job, small enough that arithmetic on them stays exact.
MAX_STEPS = 10**9
MAX_TOKENS = 10**15
MAX_SHARDS = 1_000_000

# Peak learning rates: GPT-3 Table 2.1 for its family, GPT-2 small's, and a tuned one for tiny.
DEFAULT_LR: dict[str, float] = {
    "tiny": 3e-3,
    "small": 6e-4,
    "gpt3-xl": 2e-4,
    "gpt3-2.7b": 1.6e-4,
    "gpt3-6.7b": 1.2e-4,
    "gpt3-13b": 1.0e-4,
}


class _Spec(BaseModel):
    """Unknown fields are an error, and so is a boolean where a number is due or a number where
    a boolean is (pydantic would read ``false`` as 0 and ``1`` as true:
    ``{"swap_graph_blocks": false}`` is a mistake)."""

    # NaN and infinities are refused (a weight decay of Infinity trained to NaN at step 2, and
    # the stored spec was no longer JSON); every integer has an upper bound (max_steps 10**400).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _booleans_are_booleans(cls, v: object, info: ValidationInfo) -> object:
        name = info.field_name
        if not name or not isinstance(v, int | float):
            return v
        annotation = cls.model_fields[name].annotation
        takes_bool = bool in (annotation, *get_args(annotation))  # bool, bool | None
        if isinstance(v, bool) and not takes_bool:
            raise ValueError(f"a boolean ({str(v).lower()}) is not a valid value here")
        if not isinstance(v, bool) and annotation is bool:
            raise ValueError(f"expected true or false, got {v!r}")
        return v


# The outer momentum a codec gets unless the spec names one (see SyncSpec.outer_momentum).
OUTER_MOMENTUM: dict[str, float] = {"topk": 0.5}
# ... and top-k's where rounds are frequent: with the automatic cadence (a LAN closes a round
# every 1-5 steps) or a fixed H of 2-5 (measured in research/ with `atomd bench sync`). The
# momentum is the job's, not the round's: every peer must commit the same outer step.
FREQUENT_MOMENTUM: dict[str, float] = {"topk": 0.7}
FREQUENT_EVERY = range(2, 6)
# Options removed from the sync spec: the only value still accepted (the behaviour kept), and
# what replaces the others. Specs stored by older daemons and adverts of older peers carry them.
REMOVED_SYNC_OPTIONS: dict[str, tuple[object, str]] = {
    "residual": ("replica", "the replica always keeps the unsent part (residual 'replica')"),
    "ef_decay": (1.0, "the replica always keeps all of the unsent part (ef_decay 1.0)"),
    "final_tail": (0.0, "the final average always shares the last model (final_tail 0)"),
    "value_bits": (4, "topk always sends 4-bit values (value_bits 4)"),
}
REMOVED_CODECS = {"rice2": "topk", "lowrank": "topk"}


class SyncSpec(_Spec):
    """How peers of a swarm job exchange progress: compressed weight deltas every H steps."""

    # "auto": the pace the swarm agrees on, as often as traffic and work hide behind the
    # compute (docs/cadence.md).
    every: Annotated[int, Field(ge=1, le=MAX_STEPS)] | Literal["auto"] = Field(
        "auto",
        description="Inner steps between rounds (delta exchanges), or 'auto' to pace rounds by "
        "the link and the compute.",
    )
    codec: Literal["fp32", "bf16", "int8", "topk"] = Field(
        "topk", description="Delta codec; every codec keeps what it drops for the next round."
    )
    # The numbers are atomd.sync.cadence's MIN_FRACTION and LINK_EVERY (tests/unit/test_spec.py
    # holds them equal; the spec imports nothing of the sync package).
    topk_fraction: float = Field(
        0.01,
        gt=0,
        le=1,
        description="Share of entries topk sends; with every 'auto' less, down to 0.25%, where "
        "rounds would be more than 5 steps apart.",
    )
    # 'moment' ranks by |delta| / v^2 where rounds are rare and by |delta| where they are
    # frequent (atomd.sync.encoder.RANK_POWER; measured in research/ with `atomd bench sync`).
    topk_rank: Literal["moment", "magnitude"] = Field(
        "moment",
        description="Which entries topk sends: 'moment' weighs |delta| by the AdamW second "
        "moment, 'magnitude' takes the largest |delta|.",
    )
    # lr 1 for every codec, momentum 0 (the plain average) for the dense codecs and 0.5 for
    # top-k, whose sparse deltas gain from the amplification (measured with `atomd bench sync`).
    outer_lr: float = Field(1.0, gt=0, le=10, description="Outer (merge) learning rate.")
    outer_momentum: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Nesterov momentum of the outer step (0: plain average); default 0.5 for "
        "topk (0.7 at frequent rounds), else 0.",
    )
    swarm_adam: bool = Field(
        True,
        description="Scale each peer's AdamW step by the swarm's second-moment estimate instead "
        "of its own (docs/swarm-adam.md).",
    )
    max_staleness: int = Field(
        4, ge=0, le=1_000_000, description="Rounds a delta may lag behind before it is refused."
    )
    zstd: bool = Field(True, description="zstd on top of the codec where it shrinks the bytes.")
    final_wait_s: float = Field(
        30.0,
        ge=0,
        le=3600,
        description="Seconds a finished peer waits for the others' last deltas, and for each "
        "consolidation round.",
    )
    consolidate_rounds: int = Field(
        0,
        ge=0,
        le=10_000,
        description="Rounds after the last step in which peers send their unsent progress "
        "without training, to converge their models.",
    )
    # The share is as large as the measured link carries in 20 s or a tenth of the job's time,
    # at most 10 minutes (atomd.sync.average.upload_budget_s).
    final_average: bool = Field(
        True,
        description="After the last round, exchange each peer's model beyond its anchor and end "
        "on the average if it probes better.",
    )

    @property
    def frequent(self) -> bool:
        """Rounds a few steps apart: the automatic cadence (a swarm on a LAN closes a round
        every 1-5 steps) or a fixed H of 2-5. Defaults measured apart for them: the outer
        momentum, and how top-k ranks entries (``atomd.sync.encoder.RANK_POWER``)."""
        return self.every == "auto" or self.every in FREQUENT_EVERY

    @model_validator(mode="before")
    @classmethod
    def _removed_options(cls, data: object) -> object:
        """Drop a removed option given at the value whose behaviour stays; refuse any other."""
        if not isinstance(data, dict):
            return data
        kept = dict(data)
        for name, (value, instead) in REMOVED_SYNC_OPTIONS.items():
            if name not in kept:
                continue
            given = kept.pop(name)
            if isinstance(given, bool) or given != value:
                raise ValueError(
                    f"sync.{name} was removed: only {value!r} is accepted, not {given!r}; "
                    f"omit it ({instead})"
                )
            log.info("sync.%s=%r: a removed option at its only value, ignored", name, given)
        codec = kept.get("codec")
        if isinstance(codec, str) and codec in REMOVED_CODECS:
            raise ValueError(
                f"sync.codec {codec!r} was removed: use {REMOVED_CODECS[codec]!r} instead"
            )
        return kept

    @model_validator(mode="after")
    def _codec_defaults(self) -> SyncSpec:
        if "outer_momentum" not in self.model_fields_set:  # set here, so it shows in the spec
            momentum = FREQUENT_MOMENTUM.get(self.codec) if self.frequent else None
            self.outer_momentum = (
                OUTER_MOMENTUM.get(self.codec, 0.0) if momentum is None else momentum
            )
        return self


# The job spec's fields by concern, the configuration reference's tables (tests/unit/
# test_spec.py holds it to every field, once).
JOB_SPEC_GROUPS: dict[str, tuple[str, ...]] = {
    "Model": ("preset", "seq_len", "vocab_size", "init_from"),
    "Data": (
        "data", "tokenizer", "text_field", "data_sha256", "val_fraction", "shard_index",
        "num_shards", "shard_mode",
    ),
    "Training length and batch": (
        "max_steps", "max_tokens", "micro_batch_size", "grad_accum", "seed",
    ),
    "Optimizer": (
        "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "beta1", "beta2", "grad_clip",
    ),
    "Evaluation and checkpoints": (
        "eval_interval", "eval_batches", "log_interval", "checkpoint_interval",
        "keep_checkpoints",
    ),
    "Precision and swapping": (
        "precision", "swap", "gpu_mem", "swap_slots", "swap_micro_batches",
        "swap_resident_blocks", "swap_graph_blocks", "swap_optimizer", "swap_device_steps",
        "swap_link",
    ),
    "Swarm": ("sync",),
}  # fmt: skip


def job_spec_group(field: str) -> str:
    """The concern ``field`` of the job spec belongs to (a key of ``JOB_SPEC_GROUPS``)."""
    return next(group for group, fields in JOB_SPEC_GROUPS.items() if field in fields)


class JobSpec(_Spec):
    """A training job. Unknown fields are an error, so a typo never passes silently."""

    preset: str = Field("tiny", description=f"Model preset: one of {', '.join(PRESETS)}.")
    data: str = Field(
        "shakespeare",
        description="'shakespeare' (bundled), a text file or folder, .bin tokens, JSON lines, "
        "Parquet or a `datasets` folder.",
    )
    seq_len: int | None = Field(
        None,
        ge=8,
        le=1 << 20,
        description="Tokens per sequence; default: the preset's context length.",
    )
    micro_batch_size: int = Field(32, ge=1, le=4096, description="Sequences per micro-batch.")
    grad_accum: int = Field(1, ge=1, le=1024, description="Micro-batches per optimizer step.")
    lr: float | None = Field(
        None, gt=0, le=1.0, description="Peak learning rate; default: the preset's."
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Cosine floor as a fraction of lr.")
    warmup_steps: int = Field(50, ge=0, le=MAX_STEPS, description="Linear warm-up steps.")
    weight_decay: float = Field(0.1, ge=0, le=1, description="AdamW weight decay (matrices only).")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW's first-moment decay (beta1).")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW's second-moment decay (beta2).")
    grad_clip: float = Field(
        1.0, ge=0, le=1e6, description="Clip the gradient norm to this; 0 disables."
    )
    max_steps: int | None = Field(
        600, ge=1, le=MAX_STEPS, description="Stop after this many optimizer steps."
    )
    max_tokens: int | None = Field(
        None, ge=1, le=MAX_TOKENS, description="Stop after this many tokens."
    )
    eval_interval: int = Field(
        100, ge=1, le=MAX_STEPS, description="Validate every this many steps."
    )
    # The same windows whatever the batch size: every run's validation loss compares with
    # every other's.
    eval_batches: int = Field(
        20, ge=1, le=1000, description="Validation batches of 16 fixed windows each."
    )
    log_interval: int = Field(
        10, ge=1, le=MAX_STEPS, description="Write a metrics row every this many steps."
    )
    checkpoint_interval: int = Field(
        200, ge=1, le=MAX_STEPS, description="Checkpoint every this many steps."
    )
    keep_checkpoints: int = Field(3, ge=1, le=1000, description="Checkpoints kept on disk.")
    seed: int = Field(
        0, ge=0, le=2**63 - 1, description="Seed for initialization and data sampling."
    )
    val_fraction: float = Field(0.05, gt=0, lt=1, description="Tail of the data held out.")
    shard_index: int = Field(0, ge=0, le=MAX_SHARDS, description="This peer's data shard.")
    num_shards: int = Field(1, ge=1, le=MAX_SHARDS, description="Number of data shards.")
    sync: SyncSpec = Field(
        default_factory=SyncSpec, description="Delta exchange with the swarm's other peers."
    )
    shard_mode: Literal["interleaved", "contiguous"] = Field(
        "interleaved",
        description="Deal chunks round-robin, or give each shard one contiguous part.",
    )
    # The swapping engine (atomd.swap): the whole model in host memory, layers streamed through
    # the device. `atomd plan` shows what these choose.
    # 'auto' never swaps on the CPU.
    swap: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Swap layers through the device: auto (when resident training does not fit), "
        "on or off.",
    )
    gpu_mem: int | None = Field(
        None,
        ge=1,
        le=1 << 50,
        description="Device-memory budget in bytes or as '24GiB' or '8GB'; default: all of the "
        "device's memory.",
    )
    swap_slots: int | None = Field(
        None,
        ge=2,
        le=1024,
        description="Layer slots on the device (K >= 2); default: the planner's.",
    )
    swap_micro_batches: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="Micro-batches through a layer per load (M), a divisor of grad_accum; "
        "default: the planner's.",
    )
    swap_resident_blocks: int | None = Field(
        None,
        ge=0,
        le=10_000,
        description="Blocks kept on the device besides embedding and head; default: the planner's.",
    )
    swap_graph_blocks: int | None = Field(
        None,
        ge=0,
        le=10_000,
        description="Last blocks whose forward graph is kept, not recomputed; default: as many as "
        "fit.",
    )
    # 'host': fused, on a worker thread, overlapping the backward. 'device': applied when the
    # layer is next loaded, its moments travelling with it (for a slow host CPU; 16 B/parameter
    # of slot memory instead of 8). 'split': the first swapped layers on the device, the rest
    # on the host; with gradient clipping the host's steps then have the next forward through
    # the device-stepped layers to catch up.
    swap_optimizer: Literal["auto", "host", "device", "split"] = Field(
        "auto",
        description="Where swapped layers' AdamW runs: auto (the planner's choice), host, device "
        "or split (first layers on the device).",
    )
    swap_device_steps: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="With swap_optimizer split: swapped layers that step on the device; default: "
        "the planner's.",
    )
    # 'default' is the byte-level BPE of 4,096 tokens fitted on the bundled corpus; its
    # vocabulary must fit the model's (vocab_size).
    tokenizer: str = Field(
        "bytes",
        description="bytes (256 symbols), default (the bundled 4,096-token BPE) or a "
        "tokenizer.json or its folder.",
    )
    # The presets' are 256 for tiny and 50,257 for the GPT-2/GPT-3 presets.
    vocab_size: int | None = Field(
        None,
        ge=1,
        le=1 << 20,
        description="The model's vocabulary, at least the tokenizer's size; default: the preset's.",
    )
    text_field: str = Field(
        "text",
        min_length=1,
        max_length=200,
        description="The JSON lines field or Parquet/datasets column that holds each document's "
        "text.",
    )
    # Another copy of the data, or another tokenizer, gives another hash.
    data_sha256: str | None = Field(
        None,
        pattern="^[0-9a-f]{64}$",
        description="sha256 of the tokenized data (`atomd data prepare`); a peer whose tokens "
        "differ refuses the job.",
    )
    # A run's folder, its checkpoints/ folder or one checkpoint (e.g. one `atomd import`
    # made); its shape must be the preset's (with vocab_size). Ignored when resuming.
    init_from: str | None = Field(
        None,
        description="Start from this checkpoint's weights (fresh optimizer state) instead of a "
        "random initialization.",
    )
    # Weights and AdamW stay fp32. fp16 uses dynamic loss scaling; skipped steps are recorded
    # in metrics.jsonl.
    precision: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto",
        description="Forward and backward precision: bf16, fp16, fp32, or auto (bf16 where "
        "supported, else fp16 on CUDA, else fp32).",
    )
    # bf16: the matrices as bf16 copies of their fp32 masters, exactly what bf16 autocast
    # computes with; each wave's gradient rounded to bf16 once (half the bytes). auto: bf16
    # with the host optimizer on a bf16 device, else fp32 (the device optimizer needs fp32).
    swap_link: Literal["auto", "bf16", "fp32"] = Field(
        "auto",
        description="What swapped weights and gradients cross the host link in: auto, bf16 or "
        "fp32.",
    )

    @field_validator("gpu_mem", mode="before")
    @classmethod
    def _parse_gpu_mem(cls, v: object) -> object:
        return parse_bytes(v) if isinstance(v, str) else v

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, v: str) -> str:
        if v not in PRESETS:
            raise ValueError(f"unknown preset {v!r}; known presets: {', '.join(PRESETS)}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        if self.max_steps is None and self.max_tokens is None:
            raise ValueError("give a stop condition: max_steps or max_tokens")
        if self.vocab_size is not None and self.vocab_size < 256 and self.tokenizer == "bytes":
            raise ValueError(f"vocab_size {self.vocab_size} cannot hold the 256 byte values")
        block = PRESETS[self.preset].block_size
        if self.seq_len is not None and self.seq_len > block:
            raise ValueError(f"seq_len {self.seq_len} exceeds preset {self.preset!r}'s {block}")
        if self.shard_index >= self.num_shards:
            raise ValueError(
                f"shard_index {self.shard_index} must be < num_shards {self.num_shards}"
            )
        if self.swap_micro_batches is not None and self.grad_accum % self.swap_micro_batches:
            raise ValueError(
                f"swap_micro_batches {self.swap_micro_batches} must divide "
                f"grad_accum {self.grad_accum}"
            )
        if self.swap_device_steps is not None and self.swap_optimizer in ("host", "device"):
            raise ValueError(
                f"swap_device_steps goes with swap_optimizer 'split' (or 'auto'), "
                f"not {self.swap_optimizer!r}"
            )
        n_layer = PRESETS[self.preset].n_layer
        for name in ("swap_resident_blocks", "swap_graph_blocks", "swap_device_steps"):
            blocks = getattr(self, name)
            if blocks is not None and blocks > n_layer:
                raise ValueError(
                    f"{name} {blocks} exceeds the {n_layer} blocks of preset {self.preset!r}"
                )
        return self

    @property
    def model_shape(self) -> GPTConfig:
        """The preset's shape, with ``vocab_size`` when the spec sets it."""
        cfg = PRESETS[self.preset]
        if self.vocab_size is not None and self.vocab_size != cfg.vocab_size:
            cfg = dataclasses.replace(cfg, vocab_size=self.vocab_size)
        return cfg

    @property
    def effective_seq_len(self) -> int:
        return self.seq_len or PRESETS[self.preset].block_size

    @property
    def effective_lr(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[self.preset]

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.effective_seq_len

    @property
    def total_steps(self) -> int:
        """Optimizer steps until the stop condition (the length of the LR schedule)."""
        steps = [self.max_steps] if self.max_steps is not None else []
        if self.max_tokens is not None:
            steps.append(math.ceil(self.max_tokens / self.tokens_per_step))
        return min(steps)


def lr_at(spec: JobSpec, step: int) -> float:
    """Linear warm-up then cosine decay to ``min_lr_ratio * lr``; ``step`` counts from 0."""
    peak, total = spec.effective_lr, spec.total_steps
    if step < spec.warmup_steps:
        return peak * (step + 1) / spec.warmup_steps
    progress = min(1.0, (step - spec.warmup_steps) / max(1, total - spec.warmup_steps))
    floor = peak * spec.min_lr_ratio
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))
