"""Nothing on the request path of ``POST /v1/jobs`` loads torch (seconds on a busy machine)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
import atomd_api.control, atomd.daemon, atomd.jobs
from atomd.errors import SpecError
from atomd.model import PRESETS
from atomd.spec import JobSpec
for name in PRESETS:
    try:
        atomd.jobs.admit(JobSpec(preset=name))
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
from atomd.db.engine import make_engine, make_sessionmaker
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
