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
