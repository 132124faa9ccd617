"""The codecs by name: :func:`make_codec` for a sender, :func:`decode` and :func:`kept` for a
receiver, which read every parameter from the frame's meta."""

from __future__ import annotations

import torch
from torch import Tensor

from atomd.errors import WireError
from atomd.sync.codecs.base import Codec, Encoded, Kept
from atomd.sync.codecs.dense import Bf16Codec, Fp32Codec, Int8Codec
from atomd.sync.codecs.topk import TopKCodec

_CODECS: dict[str, type[Codec]] = {c.name: c for c in (Fp32Codec, Bf16Codec, Int8Codec, TopKCodec)}
# Decoding reads every parameter from meta, so one instance of each codec decodes anything.
_DECODERS: dict[str, Codec] = {name: cls() for name, cls in _CODECS.items()}
CODEC_NAMES: tuple[str, ...] = tuple(_CODECS)


def make_codec(name: str, *, topk_fraction: float = 0.01, zstd: bool = True) -> Codec:
    """The codec called ``name`` (one of ``CODEC_NAMES``); ``ValueError`` for any other name.
    ``topk_fraction`` is the share of entries topk keeps."""
    if name not in _CODECS:
        raise ValueError(f"unknown codec {name!r}; expected one of {', '.join(CODEC_NAMES)}")
    if name == "topk":
        return TopKCodec(fraction=topk_fraction, zstd=zstd)
    return _CODECS[name](zstd=zstd)


def decode(enc: Encoded) -> Tensor:
    """Decode with the codec ``enc`` names: a finite float32 tensor of ``enc.shape``.

    Raises ``WireError("malformed")`` for an unknown codec or a payload that does not fit its
    shape and meta, ``WireError("non_finite")`` if it would decode to NaN/Inf."""
    codec = _DECODERS.get(enc.codec)
    if codec is None:
        raise WireError(
            "malformed", f"unknown codec {enc.codec!r}; expected one of {', '.join(CODEC_NAMES)}"
        )
    return codec.decode(enc)


def kept(enc: Encoded) -> Kept:
    """``enc`` decoded (as :func:`decode`), with which entries it kept and how large each entry
    it left out can have been: ``TopKCodec.kept`` for a top-k share; every entry kept for the
    dense codecs, which send them all."""
    codec = _DECODERS.get(enc.codec)
    if isinstance(codec, TopKCodec):
        return codec.kept(enc)
    values = decode(enc)
    return Kept(values, torch.ones(values.shape, dtype=torch.bool), torch.zeros_like(values))
