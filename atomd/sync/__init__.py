"""Asynchronous delta exchange (ATOM, arXiv 2403.10504; DESIGN.md "Asynchronous delta exchange").

- ``codecs``: fp32, bf16, int8 block-wise and chunked top-k (the default) codecs behind one small
  interface, and the error feedback that keeps what a codec drops for the next round.
- ``wire``: the delta frame's layout and its encoding (versioned, length-prefixed, signed);
  ``frame_header`` its header's fields and checks, ``frame_decoder`` the incremental reading of
  a received frame and ``replay`` the replay guard: anything malformed, stale, replayed,
  unauthenticated or non-finite is refused with a ``WireError``.
- ``state``: ``SyncState``, one peer's round boundary, composed of ``anchor`` (anchor, outer
  step), ``rounds`` (pending and committed sums), ``encoder`` (codec, error feedback),
  ``replica`` and ``offset`` (the live model, a joiner's inherited progress), ``intake``
  (which deltas merge), ``pace`` (the rounds other peers claim) and ``snapshot`` (state I/O).
- ``runner``: ``SyncPlugin``, the trainer thread's side, with ``schedule`` (when rounds close),
  ``inbox`` (deltas waiting) and ``ending`` (last rounds, final average: ``average``).
"""
