"""The product's text is written for its users: no work-log text (issue numbers, dates, run
codes, who worked on it) in the README, the documentation or the site's configuration. Work
logs and dated measurements live in research/. The README stays short."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# What is scanned: files, or folders (every text file under them).
SCANNED = ("README.md", "mkdocs.yml", "docs")
TEXT_SUFFIXES = {".md", ".yml", ".yaml", ".py", ".txt", ".html", ".css", ".js", ".toml"}
README_MAX_LINES = 300

# English words that follow "run" and are not run codes ("run ak", "runs dw-ft").
_ENGLISH = "as|at|by|in|is|it|of|on|or|to|up|so|no|do|if|an|be|we|me|my|us|go|he"
WORK_LOG = {
    "issue number": re.compile(r"issue\s*#|\bissue-\d+", re.I),
    "date": re.compile(r"\b\d{4}-\d{2}-\d{2}"),
    "run code": re.compile(
        rf"\bruns?\s+(?!(?:{_ENGLISH})\b)[a-z]{{2}}\b(?:\s*[-–]\s*[a-z]{{2}}\b)?"
    ),
    "helper": re.compile(r"\bhelpers?\b", re.I),
    "session": re.compile(r"\bsessions?\b", re.I),
    "lead": re.compile(r"\blead\b", re.I),
    "review of": re.compile(r"\breview of\b", re.I),
}
# Result files keep the names they were recorded under; a path to one is not prose.
_RESULT_PATH = re.compile(r"research/results/[\w.-]+\.json")


def scanned_files() -> list[Path]:
    files: list[Path] = []
    for name in SCANNED:
        root = REPO / name
        if root.is_dir():
            files += sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        elif root.exists():
            files.append(root)
    return files


def work_log_text(text: str) -> list[str]:
    """Each work-log phrase in ``text``: '<line>: <kind>: <the phrase>'."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        prose = _RESULT_PATH.sub("", line)
        for kind, pattern in WORK_LOG.items():
            found += [f"{number}: {kind}: {m[0]!r}" for m in pattern.finditer(prose)]
    return found


def test_the_scan_covers_the_documentation() -> None:
    files = {p.relative_to(REPO).as_posix() for p in scanned_files()}
    assert {"README.md", "mkdocs.yml", "docs/DESIGN.md"} <= files


@pytest.mark.parametrize("path", scanned_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_work_log_text(path: Path) -> None:
    assert work_log_text(path.read_text()) == []


@pytest.mark.parametrize(
    "text",
    [
        "see issue #14",
        "docs/notes/issue-14.md",
        "measured on 2026-12-06",
        "since run ak",
        "runs dw–ft recover",
        "the helper found",
        "one session",
        "the lead asked",
        "a review of the peer plane",
    ],
)
def test_the_scan_finds_work_log_text(text: str) -> None:
    assert work_log_text(text)


@pytest.mark.parametrize(
    "text",
    [
        "run it on the CPU",
        "the runs of one setting",
        "runs as an unprivileged user",
        "leading zeros",
        "[JSON](../research/results/results-swarm-2026-12-06eq.json)",
    ],
)
def test_the_scan_lets_plain_text_through(text: str) -> None:
    assert work_log_text(text) == []


def test_the_readme_is_short() -> None:
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines"
