"""``python -m atomd_bench optim``: the host's AdamW forms timed side by side on one layer."""

from __future__ import annotations

import pytest

from atomd.train import optim
from atomd_bench import optim as bench
from tests.conftest import CompiledKernel


@pytest.mark.parametrize("compiled", [False, True])
def test_every_form_is_timed_on_the_same_layer(
    compiled: bool, compiled_kernel: CompiledKernel
) -> None:
    compiled_kernel.every_tensor(compiled)
    out = bench.run(d=32, repeats=2, threads=None)
    assert out["params"] == 4 * 32 * 32 + 2 * 4 * 32 * 32 + 6 * 32 + 4 * 32
    assert set(out["forms"]) == {"fused", "foreach", "swarm_eager", "swarm"}
    for form in out["forms"].values():
        assert form["ms"] > 0 and form["params_per_s"] > 0
    assert out["forms"]["fused"]["vs_fused"] == 1.0
    threshold = 1 if compiled else 1 << 62
    assert threshold == optim.FUSED_MIN_NUMEL  # the eager form put it back
    if compiled:
        compiled_kernel.check()  # the swarm form went through the compiled loop
        assert out["compiled"]
    else:
        assert compiled_kernel.calls == 0
