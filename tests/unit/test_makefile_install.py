"""The Makefile's install step: torch from PyPI by default (the CUDA build on Linux, which the
comment says), the CPU-only build from the PyTorch CPU index with CPU=1. Checked with
`make -n` (print the commands, run nothing) against a virtual environment that does not exist,
so nothing is downloaded."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def dry_run(tmp_path: Path, *args: str) -> list[str]:
    """The commands `make -n` prints for a fresh .venv under tmp_path."""
    done = subprocess.run(
        ["make", "--no-print-directory", "-n", "-C", str(REPO), f"VENV={tmp_path / 'venv'}", *args],
        capture_output=True, text=True, timeout=60, check=True, env=own_make_env(),
    )  # fmt: skip
    return done.stdout.splitlines()


def own_make_env() -> dict[str, str]:
    """This process's environment without what a make that runs the tests (`make test`) hands
    its children: its flags and variables would reach the make under test."""
    return {k: v for k, v in os.environ.items() if k not in {"MAKEFLAGS", "MFLAGS", "MAKELEVEL"}}


def torch_install(lines: list[str]) -> str:
    (line,) = [line for line in lines if re.search(r"pip install .*\"torch", line)]
    return line


@pytest.mark.parametrize("target", ["demo", "test"])
def test_cpu_1_installs_torch_from_the_cpu_index(tmp_path: Path, target: str) -> None:
    lines = dry_run(tmp_path, "CPU=1", target)
    assert torch_install(lines).endswith(f'"torch==2.13.0" --index-url {CPU_INDEX}')
    # torch first, then the project, which keeps it (pyproject asks only for torch>=2.4).
    project = next(i for i, line in enumerate(lines) if 'install --quiet -e ".[dev]"' in line)
    assert lines.index(torch_install(lines)) < project
    # Only torch comes from the PyTorch index; the project's dependencies come from PyPI.
    assert sum("--index-url" in line for line in lines) == 1


def test_without_cpu_torch_comes_from_pypi(tmp_path: Path) -> None:
    line = torch_install(dry_run(tmp_path, "demo"))
    assert line.endswith('"torch==2.13.0"') and "--index-url" not in line


def test_another_index_can_be_named(tmp_path: Path) -> None:
    index = "https://download.pytorch.org/whl/cu126"
    assert torch_install(dry_run(tmp_path, f"TORCH_INDEX={index}", "demo")).endswith(index)


def test_the_venv_gets_a_setuptools_that_reads_the_license_fields(tmp_path: Path) -> None:
    (line,) = [line for line in dry_run(tmp_path, "demo") if "--upgrade pip" in line]
    assert '"setuptools>=77"' in line


def test_the_comment_tells_which_torch_build_pypi_gives() -> None:
    text = (REPO / "Makefile").read_text()
    comment = text[: text.index("TORCH_SPEC ?=")].rpartition("VENV")[2]
    assert "CUDA build" in comment and "CPU=1" in comment
    assert "The CPU build works everywhere" not in text
