"""The product's text is written for its users: no work-log text (issue numbers, dates, run
codes, who worked on it) in the README, the documentation, the site's configuration or the
code's comments and help. Work logs and dated measurements live in research/. The README stays
short."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# What is scanned: files, or folders (every text file under them).
SCANNED = ("README.md", "mkdocs.yml", "docs", "atomd", "api")
# In code, "session" is a database session and "helpers" are functions (or SWIM's probe helpers):
# only the work-log forms of those words count there.
CODE = ("atomd", "api")
TEXT_SUFFIXES = {".md", ".yml", ".yaml", ".py", ".txt", ".html", ".css", ".js", ".toml"}
README_MAX_LINES = 300

# English words that follow "run" and are not run codes ("run ak", "runs dw-ft").
_ENGLISH = "as|at|by|in|is|it|of|on|or|to|up|so|no|do|if|an|be|we|me|my|us|go|he"
WORK_LOG = {
    "issue number": re.compile(r"issue\s*#|\bissue-\d+", re.I),
    # A date followed by a time of day is a timestamp in a command's example output.
    "date": re.compile(r"\b\d{4}-\d{2}-\d{2}(?![ T]\d{2}:\d{2})"),
    "run code": re.compile(
        rf"\bruns?\s+(?!(?:{_ENGLISH})\b)[a-z]{{2}}\b(?:\s*[-–]\s*[a-z]{{2}}\b)?"
    ),
    "helper": re.compile(r"\bhelpers?\b", re.I),
    "session": re.compile(r"\bsessions?\b", re.I),
    "lead": re.compile(r"\blead\b", re.I),
    "review of": re.compile(r"\breview of\b", re.I),
}
CODE_WORK_LOG = {k: v for k, v in WORK_LOG.items() if k not in {"helper", "session"}} | {
    "helper": re.compile(r"\bhelper's\b", re.I),
    "session": re.compile(r"\b(?:this|a|one|each|the last|an earlier) session\b(?! of)", re.I),
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


def work_log_text(text: str, patterns: dict[str, re.Pattern[str]] = WORK_LOG) -> list[str]:
    """Each work-log phrase in ``text``: '<line>: <kind>: <the phrase>'."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        prose = _RESULT_PATH.sub("", line)
        for kind, pattern in patterns.items():
            found += [f"{number}: {kind}: {m[0]!r}" for m in pattern.finditer(prose)]
    return found


def test_the_scan_covers_the_documentation() -> None:
    files = {p.relative_to(REPO).as_posix() for p in scanned_files()}
    assert {"README.md", "mkdocs.yml", "docs/DESIGN.md"} <= files


@pytest.mark.parametrize("path", scanned_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_work_log_text(path: Path) -> None:
    code = path.relative_to(REPO).parts[0] in CODE
    assert work_log_text(path.read_text(), CODE_WORK_LOG if code else WORK_LOG) == []


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
    ["a helper's flake hunt found it", "as measured in this session", "(issue #14)", "run ak"],
)
def test_the_code_scan_finds_work_log_text(text: str) -> None:
    assert work_log_text(text, CODE_WORK_LOG)


@pytest.mark.parametrize(
    "text",
    ["async with self.sessions() as s:", "small asyncio helpers", "2026-12-08 02:16:12  step 10"],
)
def test_the_code_scan_lets_code_words_through(text: str) -> None:
    assert work_log_text(text, CODE_WORK_LOG) == []


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
