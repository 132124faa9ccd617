"""Delta codecs and error feedback.

A codec turns a float32 tensor into an :class:`Encoded` (a small JSON-able ``meta`` and a byte
payload) and back; :func:`decode` takes anything a peer sends and returns a finite float32
tensor or raises ``WireError``.

- ``base``: the :class:`Codec` interface, :class:`Encoded`, :class:`Kept`, and the payload
  checks and number formats every codec shares.
- ``dense``: ``fp32``, ``bf16`` and ``int8``, which send every entry.
- ``topk``: the default, the largest entries of each chunk with 4-bit values.
- ``registry``: the codecs by name (:func:`make_codec`, :func:`decode`, :func:`kept`).
- ``feedback``: :class:`ErrorFeedback`, which carries what compression dropped to later rounds.
"""

from atomd.sync.codecs.base import MAX_CHUNK, ZSTD_LEVEL, Codec, Encoded, Kept
from atomd.sync.codecs.dense import INT8_BLOCK, Bf16Codec, Fp32Codec, Int8Codec
from atomd.sync.codecs.feedback import ErrorFeedback
from atomd.sync.codecs.registry import CODEC_NAMES, decode, kept, make_codec
from atomd.sync.codecs.topk import RANK_MIN_K, TOPK_BITS, TOPK_CHUNK, TopKCodec

__all__ = [
    "CODEC_NAMES",
    "INT8_BLOCK",
    "MAX_CHUNK",
    "RANK_MIN_K",
    "TOPK_BITS",
    "TOPK_CHUNK",
    "ZSTD_LEVEL",
    "Bf16Codec",
    "Codec",
    "Encoded",
    "ErrorFeedback",
    "Fp32Codec",
    "Int8Codec",
    "Kept",
    "TopKCodec",
    "decode",
    "kept",
    "make_codec",
]
