"""Asynchronous delta exchange (ATOM, arXiv 2403.10504; DESIGN.md "Asynchronous delta exchange").

- ``codecs``: fp32, bf16, int8 block-wise and chunked top-k (the default) codecs behind one small
  interface, and the error feedback that keeps what a codec drops for the next round.
- ``wire``: the delta frame: versioned, length-prefixed, signed, decoded incrementally; anything
  malformed, stale, replayed, unauthenticated or non-finite is refused with a ``WireError``.
"""
