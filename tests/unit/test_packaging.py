"""Every third-party module the installed code imports belongs to a declared dependency (a
fresh ``pip install .`` would otherwise fail at the first import of an undeclared one), and the
pins and floors the code needs are there."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The folders the wheel holds (installed as atomd, atomd_api, atomd_migrations, atomd_bench).
INSTALLED = ("atomd", "api", "migrations", "bench")
OWN = {"atomd", "atomd_api", "atomd_migrations", "atomd_bench", "tests"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared(extra: str | None = None) -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    return {_norm(re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0]) for r in reqs}


def _imports(folder: Path) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                found.setdefault(name.split(".")[0], path)
    return found


def undeclared(folders: tuple[str, ...], declared: set[str]) -> list[str]:
    dists = packages_distributions()
    problems = []
    for folder in folders:
        for name, path in sorted(_imports(REPO / folder).items()):
            if name in sys.stdlib_module_names or name in OWN or name == "__future__":
                continue
            owners = {_norm(d) for d in dists.get(name, [])}
            if not owners & declared:
                problems.append(f"{name} ({path.relative_to(REPO)}; from {owners or '?'})")
    return problems


def test_the_installed_code_imports_only_declared_dependencies() -> None:
    assert undeclared(INSTALLED, _declared()) == []


def test_the_check_can_fail() -> None:
    assert any(p.startswith("rich ") for p in undeclared(("atomd",), _declared() - {"rich"}))


def test_tests_import_only_declared_dependencies() -> None:
    assert undeclared(("tests",), _declared() | _declared("dev")) == []


def test_floors_the_code_needs() -> None:
    text = (REPO / "pyproject.toml").read_text()
    assert '"pydantic-settings>=2.7"' in text  # NoDecode
    assert '"pytest-asyncio>=0.24"' in text  # asyncio_default_fixture_loop_scope


def test_test_tools_are_pinned_and_installed_with_the_pins() -> None:
    pins = {
        _norm(line.split("==")[0])
        for line in (REPO / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    }
    assert {"ruff", "mypy", "pytest", "pytest-asyncio", "pytest-timeout"} <= pins
    assert "-c constraints.txt" in (REPO / "Makefile").read_text()


def test_every_package_folder_is_installed_under_the_projects_own_name() -> None:
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folder_of = {v: k for k, v in setuptools["package-dir"].items()}  # api -> atomd_api
    found = set()
    for init in REPO.glob("*/**/__init__.py"):
        parts = init.parent.relative_to(REPO).parts
        if parts[0] in INSTALLED:
            found.add(".".join((folder_of.get(parts[0], parts[0]), *parts[1:])))
    assert found == set(setuptools["packages"])
    assert not {"api", "migrations", "bench"} & {p.split(".")[0] for p in setuptools["packages"]}


def test_the_wheel_ships_the_dashboard(tmp_path: Path) -> None:
    """`pip install .` installs the dashboard's page and assets (package data), where
    ``atomd_api.dashboard`` reads them with importlib.resources."""
    import shutil
    import subprocess
    import zipfile

    from atomd_api.dashboard import ASSETS, asset

    # A copy of what the wheel is built from, so that the build leaves nothing in the clone.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "NOTICE", *INSTALLED):
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif (REPO / name).exists():
            shutil.copy(REPO / name, src / name)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("atomd-*.whl")
    with zipfile.ZipFile(wheel) as z:
        shipped = {n: z.read(n) for n in z.namelist() if n.startswith("atomd_api/dashboard.")}
    assert set(shipped) == {f"atomd_api/{n}" for n in ASSETS} | {"atomd_api/dashboard.py"}
    for name in ASSETS:
        assert shipped[f"atomd_api/{name}"] == asset(name) and len(asset(name)) > 1000, name
