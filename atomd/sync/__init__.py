"""Asynchronous delta exchange (ATOM, arXiv 2403.10504; DESIGN.md "Asynchronous delta exchange").

- ``codecs``: fp32, bf16, int8 block-wise and chunked top-k (the default) codecs behind one small
  interface, and the error feedback that keeps what a codec drops for the next round.
- ``wire``: the delta frame: versioned, length-prefixed, signed, decoded incrementally; anything
  malformed, stale, replayed, unauthenticated or non-finite is refused with a ``WireError``.
- ``state``: ``SyncState``, one peer's round boundary, composed of ``anchor`` (anchor, outer
  step), ``rounds`` (pending and committed sums), ``encoder`` (codec, error feedback),
  ``replica`` and ``offset`` (the live model, a joiner's inherited progress), ``intake``
  (which deltas merge), ``pace`` (the rounds other peers claim) and ``snapshot`` (state I/O).
- ``runner``: ``SyncPlugin``, the trainer thread's side, with ``schedule`` (when rounds close),
  ``inbox`` (deltas waiting) and ``ending`` (last rounds, final average: ``average``).
"""
