"""Nothing on the request path of ``POST /v1/jobs`` loads torch (seconds on a busy machine)."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import pytest

from atomd import devices
from atomd.devices import (
    TRAIN_BYTES_PER_PARAMETER,
    TRAINING_RESERVE_BYTES,
    activation_bytes,
    host_step_bytes,
)
from atomd.errors import SpecError
from atomd.jobs import admission
from atomd.model.config import num_parameters
from atomd.spec import JobSpec

SCRIPT = """
import sys
import atomd_api.control, atomd.daemon, atomd.jobs.admission
from atomd.errors import SpecError
from atomd.model import PRESETS
from atomd.spec import JobSpec
for name in PRESETS:
    try:
        atomd.jobs.admission.admit(JobSpec(preset=name))
    except SpecError as e:
        assert "host memory" in str(e), e
heavy = sorted(m for m in ("torch", "numpy", "atomd.model.gpt") if m in sys.modules)
print(",".join(heavy) or "none")
"""


def test_admitting_a_job_loads_neither_torch_nor_numpy() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "none", out.stdout + out.stderr


def test_the_check_can_fail() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT.replace("import sys\n", "import sys, torch\n", 1)],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    assert "torch" in out.stdout


DASHBOARD_SCRIPT = """
import asyncio, sys, tempfile, time
from datetime import UTC, datetime
from pathlib import Path
import httpx
from atomd.config import Settings
from atomd.db import migrate, repo
from atomd.db.connection import make_engine, make_sessionmaker
from atomd.db.schemas import ProgressPoint
from atomd.jobs import JobManager
from atomd.telemetry import Telemetry
from atomd_api.control import ControlContext, create_control_app

async def main():
    d = Path(tempfile.mkdtemp())
    settings = Settings(data_dir=d, device="cpu")
    migrate.upgrade(settings.db_path)
    engine = make_engine(settings.db_path)
    sessions = make_sessionmaker(engine)
    async with sessions() as s, s.begin():
        await repo.create_job(s, job_id="a" * 32, spec={"preset": "tiny"}, out_dir=str(d))
        await repo.add_progress(s, job_id="a" * 32, points=[ProgressPoint(
            step=i, tokens=i, loss=3.0, tokens_per_s=1.0, at=datetime.now(UTC))
            for i in range(1, 50)])
    jobs = JobManager(jobs_dir=settings.jobs_dir, sessions=sessions, telemetry=Telemetry(),
                      device="cpu")
    ctx = ControlContext(settings=settings, jobs=jobs, telemetry=Telemetry(), sessions=sessions,
                         readiness=lambda: {}, started_at=time.monotonic())
    app = create_control_app(ctx)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://127.0.0.1") as c:
        for path in ("/dashboard", "/dashboard/assets/dashboard.js",
                     "/dashboard/assets/dashboard.css", "/v1/status", "/v1/peers", "/v1/jobs",
                     "/v1/events", "/v1/jobs/" + "a" * 32 + "/curves",
                     "/v1/jobs/" + "a" * 32 + "/rounds"):
            r = await c.get(path)
            assert r.status_code == 200, (path, r.status_code, r.text)
    await engine.dispose()

asyncio.run(main())
heavy = sorted(m for m in ("torch", "numpy", "atomd.model.gpt") if m in sys.modules)
print(",".join(heavy) or "none")
"""


def test_the_dashboard_and_its_data_routes_load_no_torch() -> None:
    """Every request the dashboard makes, served without importing torch or numpy."""
    out = subprocess.run(
        [sys.executable, "-c", DASHBOARD_SCRIPT],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "none", out.stdout + out.stderr[-3000:]


# -- what admit counts: the training state and, on the CPU, one micro-batch's activations ----


def _state(spec: JobSpec) -> int:
    return num_parameters(spec.model_shape) * TRAIN_BYTES_PER_PARAMETER


def _available(monkeypatch: pytest.MonkeyPatch, have: int) -> None:
    monkeypatch.setattr(admission, "host_memory_available", lambda: have)


HUGE = JobSpec(preset="tiny", micro_batch_size=4096)  # ~20 GiB of activations on the CPU


def test_what_admit_counts_on_the_cpu_is_the_activations_with_slack_and_a_reserve() -> None:
    acts = activation_bytes(HUGE)
    assert acts > 19 * 2**30
    assert host_step_bytes(HUGE) == int(devices.ALLOCATOR_SLACK * acts) + TRAINING_RESERVE_BYTES


def test_a_job_whose_activations_do_not_fit_the_host_is_refused_naming_the_field(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    need = _state(HUGE) + host_step_bytes(HUGE)
    _available(monkeypatch, need - 1)
    with pytest.raises(SpecError, match="host memory") as e:
        admission.admit(HUGE, "cpu")
    assert e.value.field == "micro_batch_size"
    message = str(e.value)
    assert f"needs about {need / 2**30:.1f} GiB" in message
    assert "micro_batch_size 4096 and seq_len 128" in message
    assert "lower micro_batch_size" in message
    # it says how many sequences do fit: that many pass, one more does not
    fit = int(re.findall(r"\((\d+) sequences fit\)", message)[0])
    assert 1024 <= fit < 4096
    admission.admit(HUGE.model_copy(update={"micro_batch_size": fit}), "cpu")
    with pytest.raises(SpecError):
        admission.admit(HUGE.model_copy(update={"micro_batch_size": fit + 1}), "cpu")


def test_a_job_whose_activations_fit_is_admitted(monkeypatch: pytest.MonkeyPatch) -> None:
    _available(monkeypatch, _state(HUGE) + host_step_bytes(HUGE))
    admission.admit(HUGE, "cpu")


def test_not_one_sequence_fitting_names_seq_len(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = JobSpec(preset="tiny", micro_batch_size=1)
    _available(monkeypatch, _state(spec) + TRAINING_RESERVE_BYTES)
    with pytest.raises(SpecError, match="not one sequence fits") as e:
        admission.admit(spec, "cpu")
    assert e.value.field == "seq_len" and "lower seq_len" in str(e.value)


def test_the_training_state_alone_still_names_the_preset(monkeypatch: pytest.MonkeyPatch) -> None:
    _available(monkeypatch, _state(HUGE) - 1)
    for device in ("cpu", "cuda"):
        with pytest.raises(SpecError, match="weights, gradients and AdamW state") as e:
            admission.admit(HUGE, device)
        assert e.value.field == "preset"


def test_activations_on_a_gpu_are_not_counted_against_host_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _available(monkeypatch, _state(HUGE))
    admission.admit(HUGE, "cuda")
    with pytest.raises(SpecError):
        admission.admit(HUGE, "cpu")


@pytest.mark.skipif(sys.platform != "linux", reason="the device nodes are Linux's")
def test_auto_counts_them_only_where_no_gpu_device_node_exists(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _available(monkeypatch, _state(HUGE))
    nodes: set[str] = set()
    monkeypatch.setattr(devices.os.path, "exists", lambda p: p in nodes)
    assert devices.trains_on_host("auto")
    with pytest.raises(SpecError, match="training on the CPU"):
        admission.admit(HUGE)  # the default: auto
    nodes.add("/dev/nvidiactl")  # a GPU torch may train on: never refuse what may fit there
    assert not devices.trains_on_host("auto")
    admission.admit(HUGE)
    assert devices.trains_on_host("cpu") and not devices.trains_on_host("cuda")


def test_the_estimate_grows_linearly_with_the_tokens_of_a_micro_batch() -> None:
    def acts(**fields: Any) -> int:
        return activation_bytes(JobSpec(preset="small", **fields))

    one, two, four = (acts(micro_batch_size=b, seq_len=256) for b in (1, 2, 4))
    per_sequence = two - one
    assert per_sequence > 0 and four - two == 2 * per_sequence
    assert one > per_sequence  # plus what does not grow: the tied weight's gradient
    # linear in seq_len too (attention keeps no seq_len x seq_len scores): tokens are tokens
    assert acts(micro_batch_size=1, seq_len=1024) == four
    assert acts(micro_batch_size=1, seq_len=512) - acts(micro_batch_size=1, seq_len=256) == (
        per_sequence
    )
    # grad_accum runs micro-batches one after another: no more at once
    assert acts(micro_batch_size=4, seq_len=256, grad_accum=8) == four
    # bf16 autocast halves most of them (the residual stream stays fp32), plus bf16 weights
    assert acts(micro_batch_size=4, seq_len=256, precision="bf16") < four
    # the swapping engine keeps each layer's input, not its graph
    assert acts(micro_batch_size=4, seq_len=256, swap="on") < four


def test_the_estimate_bounds_what_autograd_saves_from_above() -> None:
    """Within 2x of what the real forward keeps for backward (and the logits the engine
    holds); ``atomd bench activation_memory`` measures the whole step's RSS."""
    import torch

    from atomd.model.gpt import GPT

    spec = JobSpec(preset="tiny", micro_batch_size=4, seq_len=64)
    torch.manual_seed(0)
    model = GPT(spec.model_shape)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    x, y = torch.randint(0, 256, (2, 4, 64))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits, _ = model(x, y)
    kept = sum(saved.values()) + logits.untyped_storage().nbytes()
    assert kept <= activation_bytes(spec) <= 2 * kept
