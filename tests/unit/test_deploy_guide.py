"""docs/guide/deploy.md stays true: its `make -n` output is what make prints, the metrics and
settings it names exist, and the files it points to are in the repository."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from atomd.config import ENV_PREFIX, Settings
from atomd.telemetry import Telemetry
from tests.unit.test_makefile_install import own_make_env

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "guide" / "deploy.md"


def _console_blocks(text: str) -> dict[str, list[str]]:
    """Command -> its output lines, from the guide's ```console blocks."""
    out: dict[str, list[str]] = {}
    for block in re.findall(r"```console\n(.*?)```", text, re.S):
        command = None
        for line in block.splitlines():
            if line.startswith("$ "):
                command = line[2:]
                out[command] = []
            elif command is not None:
                out[command].append(line)
    return out


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_the_make_dry_run_shown_is_what_make_prints(tmp_path: Path) -> None:
    """In a fresh checkout: the Makefile and the files its rules depend on, no .venv."""
    shown = _console_blocks(GUIDE.read_text())["make -n CPU=1 demo"]
    for name in ("Makefile", "pyproject.toml", "constraints.txt"):
        shutil.copy(REPO / name, tmp_path / name)
    done = subprocess.run(
        ["make", "--no-print-directory", "-n", "CPU=1", "demo"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True, env=own_make_env(),
    )  # fmt: skip
    assert done.stdout.splitlines() == shown


def test_the_metrics_named_exist() -> None:
    names: set[str] = set()
    for family in text_string_to_metric_families(Telemetry().render().decode()):
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
        if family.type == "counter":
            names.add(f"{family.name}_total")
    named = set(re.findall(r"\b(?:atomd|process)_[a-z_]+\b", GUIDE.read_text()))
    assert named - names == set()
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes"} <= named


def test_the_settings_named_exist() -> None:
    known = {f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields}
    named = set(re.findall(r"\bATOMD_[A-Z0-9_]+\b", GUIDE.read_text()))
    assert named - known - {"ATOMD_CONFIG"} == set()


def test_the_files_named_exist() -> None:
    text = GUIDE.read_text()
    named = set(re.findall(r"`((?:deploy/|docker-compose)[\w.@-]+)`", text))
    assert {"deploy/atomd.service", "deploy/atomd@.service", "deploy/Dockerfile"} <= named
    assert [name for name in sorted(named) if not (REPO / name).exists()] == []
    # Links inside the repository, but the generated configuration reference.
    for link in re.findall(r"\]\(([^)#]+)\)", text):
        if not link.startswith("http") and link != "../reference/configuration.md":
            assert (GUIDE.parent / link).exists(), link
