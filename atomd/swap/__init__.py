"""The swapping engine: the whole model in host memory, its layers streamed through the device.

- ``plan``: the planner (K slots, M micro-batches per layer visit, the resident set; predicted
  step time and peak device memory) and ``hardware``: the rates it works from.
- ``engine``: ``SwapEngine``, a ``StepEngine`` (atomd.train.step_engine) that wraps a GPT without
  changing it, composed of ``traffic`` (``SlotTraffic``: the copies between host and slots,
  spills, device-optimizer steps), ``walk`` (``LayerWalk``: a layer visit's forward, kept
  graph and backward on a slot's tensors) and ``stepping`` (``LayerSteps``: clipping, fp16
  loss scaling and each layer's AdamW step where it lives); ``slots``: device slots and the
  walk through one wave; ``schedule``: which slot each layer visit uses and when its load is
  issued; ``streams``: CUDA streams and events, no-ops on the CPU; ``host``: a swapped
  layer's host buffers (fp32 masters, the bf16 copy a slot loads, gradient staging);
  ``hostopt``: per-layer AdamW and gradient sums on the host, on a worker thread.
- ``record``: the work a step issues, written down; ``trace``: replayed in time with given
  rates (critical path); ``rehearse``: a plan's schedule run on a stand-in model on the CPU.
- ``planning``: a job's shape, device and host budgets, and its plan (``atomd.engine_choice``,
  above both ``train`` and ``swap``, builds the resident or swapped engine from it).
- ``report``: the plan as a table; ``compare``: how far two runs' parameters are apart.

This ``__init__`` imports nothing heavy, so ``atomd.spec`` and the CLI can import submodules
cheaply.
"""
