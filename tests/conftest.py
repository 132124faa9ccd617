from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from atomd.engine_choice import build_engine
from atomd.launch import PORTS_ENV
from atomd.spec import JobSpec
from atomd.swap.hardware import Hardware
from atomd.train import optim
from atomd.train.trainer import Trainer

# pytest-xdist's worker ("gw0", "gw1", ...), None when the suite runs in one process.
WORKER = os.environ.get("PYTEST_XDIST_WORKER")

# Tests are small; two threads match CI and keep runs reproducible. With two workers, one each:
# two OpenMP teams of two on two cores spin. The same for the daemons and commands the tests
# start (``start_swarm`` already gives a swarm's daemons their share).
torch.set_num_threads(1 if WORKER else min(2, os.cpu_count() or 1))
if WORKER:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# Each worker takes the daemons' ports from a range of its own, below Linux's ephemeral ports
# (32768-60999): two workers cannot both pick a port one of them has freed and not yet bound.
if WORKER and PORTS_ENV not in os.environ:
    _w = int(WORKER.removeprefix("gw") or 0)
    os.environ[PORTS_ENV] = f"{20000 + 1000 * (_w % 12)}-{20999 + 1000 * (_w % 12)}"


# Tests whose xdist_group did not take (``pytest_collection_modifyitems``): each fails at setup.
UNGROUPED = pytest.StashKey[set[str]]()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Find the tests ``--dist loadgroup`` did not group. pytest-xdist sends the tests of one
    ``xdist_group`` to one worker by appending ``@<group>`` to their node ids as a worker
    collects them; pytest 9.2 keeps node ids elsewhere and the suffix silently stopped taking
    (pytest-xdist#1386). The "swarm" group's daemon-heavy tests then ran two at a time on two
    cores, and one test's wait ran out in CI (2026-12-07)."""
    lost = set()
    if getattr(config.option, "loadgroup", False):
        for item in items:
            groups = {str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                      for m in item.iter_markers("xdist_group")}  # fmt: skip
            if groups and not item.nodeid.endswith("@" + "_".join(sorted(groups))):
                lost.add(item.nodeid)
    config.stash[UNGROUPED] = lost


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.nodeid in item.config.stash.get(UNGROUPED, set()):
        pytest.fail(
            "--dist loadgroup did not group this test with its xdist_group: pytest-xdist's "
            "loadgroup needs pytest < 9.2 (pytest-xdist#1386); constraints.txt pins a pair "
            "that works (make test installs it)",
            pytrace=False,
        )


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for a module's tests (``pytestmark = pytest.mark.usefixtures(
    "one_thread")``): their tensors are too small for more to help, and where a swap engine's
    optimizer worker thread already uses the second core, two OpenMP teams on two busy cores
    spin."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def fast_spec(**overrides: Any) -> JobSpec:
    """A spec that trains the tiny model in well under a second per step on a CPU."""
    base: dict[str, Any] = {
        "preset": "tiny",
        "seq_len": 32,
        "micro_batch_size": 4,
        "max_steps": 12,
        "warmup_steps": 2,
        "eval_interval": 6,
        "eval_batches": 2,
        "log_interval": 1,
        "checkpoint_interval": 5,
    }
    base.update(overrides)
    return JobSpec(**base)


@pytest.fixture
def text_file(tmp_path: Any) -> Any:
    """A small text corpus with learnable structure."""
    p = tmp_path / "corpus.txt"
    lines = [f"line {i % 17}: the quick brown fox jumps over the lazy dog.\n" for i in range(3000)]
    p.write_text("".join(lines))
    return p


def trainer_for(spec: JobSpec, out: Path, device: str = "cpu", **kwargs: Any) -> Trainer:
    """A Trainer with the engine the job spec asks for, as the CLI and the daemon build it."""
    built = build_engine(spec, device)
    return Trainer(spec, out, built.engine, plan=built.plan, **kwargs)


# The rates measured on the lent H200 (bench/results-swap-h200-2026-11-30b.json, rounded):
# what the planner and the schedule tests plan for.
H200_RATES = Hardware(
    h2d_bytes_per_s=55e9,
    d2h_bytes_per_s=55e9,
    flops_per_s=7.8e14,
    host_adam_params_per_s=4.2e9,
    host_narrow_per_s=8.4e9,
    host_widen_per_s=1.05e10,
    host_add_per_s=7.5e9,
    source="measured on the lent H200, 2026-11-30 (rounded)",
)


def another_congestion() -> tuple[str, str]:
    """The kernel's default TCP congestion control and another this process may choose (tried
    lazily: as root, each name tried may load its kernel module); skips where there is none."""
    from atomd.p2p import congestion

    default = congestion.system_default()
    others = (n for n in ("reno", "cubic", "bbr") if n != default)
    name = next((n for n in others if congestion.choose(n).options), None)
    if default is None or name is None:
        pytest.skip("no congestion control other than the system's can be chosen here")
    return default, name


def fake_engine(model: torch.nn.Module) -> Any:
    """What a SyncPlugin uses of a StepEngine: its model, settle (nothing in flight here),
    set_peers, whose calls ``peers`` records, and second_moments (none: no AdamW steps here,
    so top-k ranks by |delta|)."""
    peers: list[int] = []
    return cast(Any, SimpleNamespace(model=model, settle=lambda: None, set_peers=peers.append,
                                     peers=peers, second_moments=dict))  # fmt: skip


class CompiledKernel:
    """The swarm's AdamW's compiled loop, counted (fixture ``compiled_kernel``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        self.calls = 0
        monkeypatch.setattr(optim, "_kernel_failed", False)
        real = optim._fused_kernel()
        assert real is not None

        def counting(*args: Any) -> None:
            real(*args)
            self.calls += 1

        monkeypatch.setattr(optim, "_kernel", counting)

    def every_tensor(self, on: bool = True) -> None:
        """Every tensor through the compiled loop (FUSED_MIN_NUMEL 1), or none (eager ops)."""
        self.monkeypatch.setattr(optim, "FUSED_MIN_NUMEL", 1 if on else 1 << 62)

    def check(self) -> None:
        """The steps went through the compiled loop; where inductor could not compile, a
        failure if a C++ compiler is on PATH (a regression), else a skip."""
        if optim._kernel_failed:
            if shutil.which("c++") or shutil.which("g++"):
                pytest.fail("the swarm's AdamW kernel did not compile, with a C++ compiler here")
            pytest.skip("no C++ compiler: inductor cannot compile, the steps are eager")
        assert self.calls > 0


@pytest.fixture
def compiled_kernel(monkeypatch: pytest.MonkeyPatch) -> CompiledKernel:
    return CompiledKernel(monkeypatch)
