"""The product stays readable: no module of atomd/ or api/ over 700 lines, no class over 400."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("atomd", "api")
MAX_FILE_LINES = 700
MAX_CLASS_LINES = 400


def oversized(path: Path) -> list[str]:
    """What in ``path`` breaks a bar: the file's line count, then each class's."""
    text = path.read_text(encoding="utf-8")
    found = []
    lines = text.count("\n")
    if lines > MAX_FILE_LINES:
        found.append(f"{path}: {lines} lines")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
            size = node.end_lineno - node.lineno + 1
            if size > MAX_CLASS_LINES:
                found.append(f"{path}:{node.name}: {size} lines")
    return found


def test_no_module_or_class_is_too_long_to_read_in_one_sitting() -> None:
    modules = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
    assert len(modules) > 50  # the walk found the packages
    assert [f for p in modules for f in oversized(p)] == []


def test_the_bars_catch_a_long_module_and_a_long_class(tmp_path: Path) -> None:
    short = tmp_path / "short.py"
    short.write_text("class Short:\n    x = 1\n")
    assert oversized(short) == []
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES))
    long_class = tmp_path / "long_class.py"
    long_class.write_text(f"class Long:\n{body}\n")
    assert oversized(long_class) == [f"{long_class}:Long: {MAX_CLASS_LINES + 1} lines"]
    long_module = tmp_path / "long_module.py"
    long_module.write_text("x = 1\n" * (MAX_FILE_LINES + 1))
    assert oversized(long_module) == [f"{long_module}: {MAX_FILE_LINES + 1} lines"]
