"""Hugging Face interop: atomd checkpoints to and from GPT-2 folders (``save_pretrained``'s).

atomd's GPT is GPT-2's architecture; the tensors differ only in names and in one layout:
GPT-2's ``Conv1D`` stores a projection's weight as (in, out), ``nn.Linear`` as (out, in), so
``c_attn``, ``c_proj`` and ``c_fc`` weights are transposed. The fused qkv projection has the
same layout in both (queries, keys, values, each heads-major). The output head is tied to the
token embedding in both (``tie_word_embeddings``); an untied atomd model exports its head as
``lm_head.weight``. A model without biases (``bias: false``) exports zeros, which computes the
same. atomd's MLP uses the exact GELU (``activation_function: "gelu"``); GPT-2's checkpoints use
its tanh approximation (``"gelu_new"``), which atomd models as ``activation: "gelu_tanh"``.

Neither direction needs ``transformers``: the folder is ``config.json`` + ``model.safetensors``
(+ ``tokenizer.json`` and ``tokenizer_config.json``), written and read directly. The tests load
the exports with ``transformers.GPT2LMHeadModel``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from atomd.errors import CheckpointError, ConfigError
from atomd.model.config import GPTConfig

if TYPE_CHECKING:
    from torch import Tensor

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, GPT-2's layer_norm_epsilon
# atomd activation -> transformers' activation_function, and back (the aliases it reads).
_TO_HF_ACT = {"gelu": "gelu", "gelu_tanh": "gelu_new"}
_FROM_HF_ACT = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
}
# atomd name -> GPT-2 name within a block; True where the weight is transposed (Conv1D).
_BLOCK = {
    "ln_1.weight": ("ln_1.weight", False),
    "ln_1.bias": ("ln_1.bias", False),
    "attn.qkv.weight": ("attn.c_attn.weight", True),
    "attn.qkv.bias": ("attn.c_attn.bias", False),
    "attn.proj.weight": ("attn.c_proj.weight", True),
    "attn.proj.bias": ("attn.c_proj.bias", False),
    "ln_2.weight": ("ln_2.weight", False),
    "ln_2.bias": ("ln_2.bias", False),
    "mlp.fc.weight": ("mlp.c_fc.weight", True),
    "mlp.fc.bias": ("mlp.c_fc.bias", False),
    "mlp.proj.weight": ("mlp.c_proj.weight", True),
    "mlp.proj.bias": ("mlp.c_proj.bias", False),
}
_TOP = {
    "embed.wte.weight": "transformer.wte.weight",
    "embed.wpe.weight": "transformer.wpe.weight",
    "head.ln_f.weight": "transformer.ln_f.weight",
    "head.ln_f.bias": "transformer.ln_f.bias",
}


def hf_config(cfg: GPTConfig, *, eos_token_id: int | None = None) -> dict[str, Any]:
    """``config.json`` of a ``GPT2LMHeadModel`` computing what ``GPT(cfg)`` computes."""
    out: dict[str, Any] = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_ctx": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,
        "activation_function": _TO_HF_ACT[cfg.activation],
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "layer_norm_epsilon": LAYER_NORM_EPS,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    # GPT-2's default (50256) would point outside a smaller vocabulary: none unless the
    # tokenizer has <|endoftext|>.
    out["bos_token_id"] = out["eos_token_id"] = eos_token_id
    return out


def to_hf_tensors(tensors: dict[str, Tensor], cfg: GPTConfig) -> dict[str, Tensor]:
    """atomd model tensors (``engine.model_tensors()``: resident or swapped, the same names)
    to GPT-2's, fp32 and contiguous."""
    import torch

    out: dict[str, Tensor] = {}

    def put(name: str, t: Tensor, transpose: bool) -> None:
        t = t.detach().to("cpu", torch.float32)
        out[name] = (t.t() if transpose else t).contiguous()

    for name, hf in _TOP.items():
        if name in tensors:
            put(hf, tensors[name], False)
    for i in range(cfg.n_layer):
        for ours, (theirs, transpose) in _BLOCK.items():
            t = tensors.get(f"blocks.{i}.{ours}")
            if t is not None:
                put(f"transformer.h.{i}.{theirs}", t, transpose)
    if not cfg.tie_embeddings:
        put("lm_head.weight", tensors["head.lm_head.weight"], False)
    if not cfg.bias:  # zeros compute the same; GPT-2 always has biases
        c = cfg.n_embd
        zeros = {"ln_1.bias": c, "ln_2.bias": c, "attn.c_attn.bias": 3 * c}
        zeros |= {"attn.c_proj.bias": c, "mlp.c_fc.bias": 4 * c, "mlp.c_proj.bias": c}
        for i in range(cfg.n_layer):
            for name, n in zeros.items():
                out[f"transformer.h.{i}.{name}"] = torch.zeros(n)
        out["transformer.ln_f.bias"] = torch.zeros(cfg.n_embd)
    expected = 4 + cfg.n_layer * len(_BLOCK) + (0 if cfg.tie_embeddings else 1)
    if len(out) != expected:
        raise CheckpointError(
            f"the checkpoint's tensors do not make a GPT-2 model ({len(out)} of {expected})"
        )
    return out


def config_from_hf(hf: dict[str, Any], *, source: str) -> GPTConfig:
    """The atomd shape of a GPT-2 ``config.json``; anything atomd does not model is refused."""
    if hf.get("model_type") != "gpt2":
        raise ConfigError(
            f"{source}: model_type {hf.get('model_type')!r}; atomd imports GPT-2 models only"
        )
    act = hf.get("activation_function", "gelu_new")
    if act not in _FROM_HF_ACT:
        raise ConfigError(
            f"{source}: activation_function {act!r}; atomd has {', '.join(_FROM_HF_ACT)}"
        )
    n_embd = int(hf.get("n_embd", 768))
    inner = hf.get("n_inner")
    if inner is not None and int(inner) != 4 * n_embd:
        raise ConfigError(f"{source}: n_inner {inner}; atomd's MLP is 4 x n_embd = {4 * n_embd}")
    eps = float(hf.get("layer_norm_epsilon", LAYER_NORM_EPS))
    if abs(eps - LAYER_NORM_EPS) > 1e-12:
        raise ConfigError(f"{source}: layer_norm_epsilon {eps}; atomd uses {LAYER_NORM_EPS}")
    for flag, want in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
    ):
        if bool(hf.get(flag, want)) != want:
            raise ConfigError(f"{source}: {flag} {hf.get(flag)!r} is not supported by atomd")
    try:
        return GPTConfig(
            n_layer=int(hf.get("n_layer", 12)),
            n_head=int(hf.get("n_head", 12)),
            n_embd=n_embd,
            vocab_size=int(hf.get("vocab_size", 50257)),
            block_size=int(hf.get("n_positions", 1024)),
            dropout=0.0,
            bias=True,
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
            activation=_FROM_HF_ACT[act],
        )
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None


def from_hf_tensors(tensors: dict[str, Tensor], cfg: GPTConfig) -> dict[str, Tensor]:
    """GPT-2 tensors (with or without the ``transformer.`` prefix) to atomd's names."""
    import torch

    plain = {re.sub(r"^transformer\.", "", k): v for k, v in tensors.items()}
    out: dict[str, Tensor] = {}

    def take(theirs: str, ours: str, transpose: bool) -> None:
        if theirs not in plain:
            raise CheckpointError(f"GPT-2 weights lack {theirs}")
        t = plain[theirs].to(torch.float32)
        out[ours] = (t.t() if transpose else t).contiguous()

    for ours, theirs in _TOP.items():
        take(theirs.removeprefix("transformer."), ours, False)
    for i in range(cfg.n_layer):
        for ours, (theirs, transpose) in _BLOCK.items():
            take(f"h.{i}.{theirs}", f"blocks.{i}.{ours}", transpose)
    if not cfg.tie_embeddings:
        take("lm_head.weight", "head.lm_head.weight", False)
    return out


def export_checkpoint(checkpoint: Path, out: Path) -> dict[str, Any]:
    """Write the newest good checkpoint under ``checkpoint`` as a GPT-2 folder in ``out``:
    ``config.json``, ``model.safetensors``, and the run's tokenizer. Returns a summary."""
    from safetensors.torch import save_file

    from atomd.data.tokenizer import END_OF_TEXT, TOKENIZER_FILE
    from atomd.train.checkpoint import load_latest

    found = load_latest(checkpoint)
    if found is None:
        raise CheckpointError(f"no checkpoint found in {checkpoint}")
    cfg = GPTConfig.from_dict(found.meta["model_config"])
    tensors = to_hf_tensors(found.model, cfg)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty; choose another folder")
    out.mkdir(parents=True, exist_ok=True)
    tok_file = found.path / TOKENIZER_FILE
    eos: int | None = None
    if tok_file.is_file():
        tok_text = tok_file.read_text(encoding="utf-8")
        eos = _token_id(tok_text, END_OF_TEXT)
        (out / TOKENIZER_FILE).write_text(tok_text, encoding="utf-8")
        tok_config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": cfg.block_size,
            "clean_up_tokenization_spaces": False,
        }
        if eos is not None:
            tok_config |= {"eos_token": END_OF_TEXT, "bos_token": END_OF_TEXT}
        (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    config = hf_config(cfg, eos_token_id=eos)
    config["atomd"] = {"checkpoint": str(found.path), "step": found.step}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return {
        "checkpoint": str(found.path),
        "step": found.step,
        "out": str(out),
        "tensors": len(tensors),
        "tokenizer": tok_file.is_file(),
    }


def _token_id(tokenizer_json: str, token: str) -> int | None:
    try:
        doc = json.loads(tokenizer_json)
    except json.JSONDecodeError:
        return None
    for added in doc.get("added_tokens") or []:
        if added.get("content") == token:
            return int(added["id"])
    return None


def import_pretrained(source: Path, out: Path) -> dict[str, Any]:
    """A GPT-2 ``save_pretrained`` folder (config.json + model.safetensors, and tokenizer.json
    when present) as an atomd checkpoint at step 0 under ``out`` (a run folder), which a job
    starts from with ``init_from``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from atomd.data.tokenizer import TOKENIZER_FILE
    from atomd.train import checkpoint as ckpt

    cfg_path, weights = source / CONFIG_FILE, source / WEIGHTS_FILE
    for p in (cfg_path, weights):
        if not p.is_file():
            raise ConfigError(
                f"{source} is not a GPT-2 folder as save_pretrained writes it: {p.name} is "
                "missing (a pytorch_model.bin checkpoint: load it with transformers and "
                "save_pretrained it again, which writes safetensors)"
            )
    try:
        hf = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{cfg_path} cannot be read: {e}") from None
    cfg = config_from_hf(hf, source=str(cfg_path))
    try:
        tensors = from_hf_tensors(load_file(str(weights)), cfg)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{weights} cannot be read: {e}") from None
    if ckpt.list_checkpoints(ckpt.checkpoint_root(out)):
        raise ConfigError(f"{out} already holds checkpoints; choose another folder")
    extra: dict[str, bytes] = {}
    tok = source / TOKENIZER_FILE
    if tok.is_file():
        extra[TOKENIZER_FILE] = tok.read_bytes()
    meta = {
        "model_config": cfg.to_dict(),
        "imported_from": str(source),
        "data_position": {"step": 0, "shard_index": 0},
        "tokens": 0,
        "tokenizer": TOKENIZER_FILE if extra else None,
    }
    path = ckpt.save_checkpoint(
        ckpt.checkpoint_root(out), step=0, model=tensors, state={}, meta=meta, extra=extra
    )
    return {"checkpoint": str(path), "model_config": cfg.to_dict(), "tokenizer": bool(extra)}
