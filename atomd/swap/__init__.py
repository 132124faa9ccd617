"""The swapping engine: the whole model in host memory, its layers streamed through the device.

- ``plan``: the planner (K slots, M micro-batches per layer visit, the resident set; predicted
  step time and peak device memory) and ``hardware``: the rates it works from.
- ``engine``: ``SwapEngine``, a ``StepEngine`` (atomd.train.engine) that wraps a GPT without
  changing it; ``slots``: device slots and the walk through one wave; ``schedule``: which slot
  each layer visit uses and when its load is issued; ``streams``: CUDA streams and events,
  no-ops on the CPU; ``hostopt``: per-layer AdamW on the host, on a worker thread.
- ``factory``: ``make_engine(model, spec, device)``, resident or swapped per the job spec.
- ``report``: the plan as a table; ``compare``: how far two runs' parameters are apart.

This ``__init__`` imports nothing heavy, so ``atomd.spec`` and the CLI can import submodules
cheaply.
"""
