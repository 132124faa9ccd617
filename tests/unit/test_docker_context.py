"""The image's build context: every path deploy/Dockerfile copies exists and gets through
deploy/Dockerfile.dockerignore, and the image gets every file `pip install .` needs.

No container engine is needed: the .dockerignore rules are applied here as Docker applies them
(moby/patternmatcher): patterns are relative to the context, `*` and `?` stay within one folder,
`**` spans any number of folders, a pattern that matches a folder matches everything under it,
`!` re-includes, and the last matching line wins.
"""

from __future__ import annotations

import json
import posixpath
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "Dockerfile"
DOCKERIGNORE = REPO / "deploy" / "Dockerfile.dockerignore"
# Never part of the image: the tests, the documentation, the research notes.
NOT_IN_IMAGE = ("tests", "docs", "research")


@dataclass(frozen=True)
class Rule:
    regex: re.Pattern[str]
    exclusion: bool  # a `!` line: re-includes what it matches


def _regex(pattern: str) -> re.Pattern[str]:
    out, i = "^", 0
    while i < len(pattern):
        ch = pattern[i]
        i += 1
        if ch == "*" and pattern[i : i + 1] == "*":
            i += 1
            if pattern[i : i + 1] == "/":
                i += 1
            out += ".*" if i == len(pattern) else "(.*/)?"
        elif ch == "*":
            out += "[^/]*"
        elif ch == "?":
            out += "[^/]"
        elif ch == "\\" and i < len(pattern):
            out += re.escape(pattern[i])
            i += 1
        elif ch in "[]^-":  # character classes pass through, as in Go's regexp
            out += ch
        else:
            out += re.escape(ch)
    return re.compile(out + "$")


def parse_dockerignore(text: str) -> list[Rule]:
    rules = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        exclusion = line.startswith("!")
        if exclusion:
            line = line[1:].strip()
        line = posixpath.normpath(line).lstrip("/") if line not in ("/", "") else line
        rules.append(Rule(_regex(line), exclusion))
    return rules


def excluded(rules: list[Rule], path: str) -> bool:
    """Whether the context leaves ``path`` (relative to the context) out of the build."""
    parents = path.split("/")[:-1]
    matched = False
    for rule in rules:
        if rule.exclusion != matched:
            continue
        match = bool(rule.regex.match(path))
        if not match:
            match = any(rule.regex.match("/".join(parents[: i + 1])) for i in range(len(parents)))
        if match:
            matched = not rule.exclusion
    return matched


@dataclass(frozen=True)
class Copy:
    sources: tuple[str, ...]
    dest: str  # absolute, the WORKDIR applied


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comment lines dropped, continuation lines joined."""
    lines = [line for line in text.splitlines() if not line.strip().startswith("#")]
    out = []
    for line in re.sub(r"\\\n", " ", "\n".join(lines)).splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def parse_copies(text: str) -> tuple[list[Copy], str]:
    """The COPY/ADD instructions from the context, and the WORKDIR `pip install .` runs in."""
    workdir, copies, install_dir = "/", [], ""
    for word, rest in _instructions(text):
        if word == "WORKDIR":
            workdir = posixpath.join(workdir, rest)
        elif word in ("COPY", "ADD"):
            args = json.loads(rest) if rest.startswith("[") else rest.split()
            flags = [a for a in args if a.startswith("--")]
            if any(f.startswith("--from") for f in flags):
                continue  # from another stage, not from the context
            *sources, dest = [a for a in args if not a.startswith("--")]
            dest_abs = posixpath.join(workdir, dest)
            if dest.endswith("/"):
                dest_abs += "/"
            copies.append(Copy(tuple(sources), dest_abs))
        elif word == "RUN" and re.search(r"\bpip install \.(\s|$)", rest) and not install_dir:
            install_dir = workdir
    return copies, install_dir


def context_files(source: str) -> list[str]:
    """The files (relative to the context) a COPY source names: a file, or a folder's files."""
    path = REPO / source
    if path.is_dir():
        return sorted(
            str(p.relative_to(REPO))
            for p in path.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        )
    return [source] if path.is_file() else []


def image_files(copies: list[Copy], rules: list[Rule]) -> dict[str, str]:
    """Image path -> context path of every file the copies put into the image."""
    out: dict[str, str] = {}
    for copy in copies:
        for source in copy.sources:
            for file in context_files(source):
                if excluded(rules, file):
                    continue
                if (REPO / source).is_dir():
                    target = posixpath.join(copy.dest, posixpath.relpath(file, source))
                elif copy.dest.endswith("/") or len(copy.sources) > 1:
                    target = posixpath.join(copy.dest, posixpath.basename(file))
                else:
                    target = copy.dest
                out[posixpath.normpath(target)] = file
    return out


def copy_problems(copies: list[Copy], rules: list[Rule]) -> list[str]:
    """Copy sources that are missing, or that the .dockerignore empties or cuts into."""
    problems = []
    for copy in copies:
        for source in copy.sources:
            files = context_files(source)
            if not files:
                problems.append(f"{source}: not in the repository")
            elif all(excluded(rules, f) for f in files):
                problems.append(f"{source}: excluded by the .dockerignore")
    return problems


def install_needs() -> list[str]:
    """The files (relative to the repository) that `pip install .` reads: pyproject.toml, the
    readme, the license files, every listed package's modules and its package data."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    project, setuptools = pyproject["project"], pyproject["tool"]["setuptools"]
    needs = ["pyproject.toml", project["readme"], *project.get("license-files", [])]
    package_dir: dict[str, str] = setuptools.get("package-dir", {})

    def folder(package: str) -> Path:
        top, *rest = package.split(".")
        return REPO / package_dir.get(top, top) / Path(*rest)

    for package in setuptools["packages"]:
        needs += [str(p.relative_to(REPO)) for p in sorted(folder(package).glob("*.py"))]
    for package, patterns in setuptools.get("package-data", {}).items():
        for pattern in patterns:
            found = sorted(folder(package).glob(pattern))
            assert found, f"package data {package}: {pattern} matches no file"
            needs += [str(p.relative_to(REPO)) for p in found]
    return needs


@pytest.fixture(scope="module")
def rules() -> list[Rule]:
    return parse_dockerignore(DOCKERIGNORE.read_text())


@pytest.fixture(scope="module")
def copies() -> tuple[list[Copy], str]:
    return parse_copies(DOCKERFILE.read_text())


@pytest.mark.parametrize(
    ("patterns", "path", "is_excluded"),
    [
        ("*\n!atomd", "atomd/cli.py", False),  # a folder's `!` re-includes its files
        ("*\n!atomd", "bench/sync.py", True),  # `*` matches the top folder, so its files too
        ("*\n!atomd\n**/__pycache__", "atomd/data/__pycache__/x.pyc", True),
        ("*\n!bench\nbench/**/*.json", "bench/results-a.json", True),  # ** spans zero folders
        ("*\n!bench\nbench/**/*.json", "bench/deep/er/b.json", True),
        ("*\n!bench\nbench/**/*.json", "bench/sync.py", False),
        ("**/*.py[co]", "api/x.pyc", True),
        ("**/*.py[co]", "api/x.py", False),
        ("docs\n!docs/keep.md", "docs/keep.md", False),  # the last match wins
        ("!docs/keep.md\ndocs", "docs/keep.md", True),
        ("/README.md", "README.md", True),  # a leading slash is the context's root
        ("./tests/", "tests/unit/a.py", True),  # cleaned like a path
        ("a?c", "abc", True),
        ("a?c", "a/c", False),  # `?` never matches a slash
        ("*.md", "docs/a.md", False),  # `*` stays in the top folder
    ],
)
def test_dockerignore_rules_follow_docker(patterns: str, path: str, is_excluded: bool) -> None:
    assert excluded(parse_dockerignore(patterns), path) is is_excluded


def test_every_copied_path_exists_and_is_in_the_context(
    rules: list[Rule], copies: tuple[list[Copy], str]
) -> None:
    assert copies[0], "the Dockerfile copies nothing from the context"
    assert copy_problems(copies[0], rules) == []


def test_the_check_catches_an_excluded_copy(copies: tuple[list[Copy], str]) -> None:
    """A Dockerfile that copies bench/ with an ignore file that leaves bench/ out fails."""
    rules = parse_dockerignore("*\n!pyproject.toml\n!README.md\n!atomd\n!api\n!migrations\n")
    problems = copy_problems(copies[0], rules)
    assert "bench: excluded by the .dockerignore" in problems
    missing = parse_copies("WORKDIR /src\nCOPY nowhere ./nowhere\n")[0]
    assert copy_problems(missing, rules) == ["nowhere: not in the repository"]


def test_the_image_gets_everything_pip_install_needs(
    rules: list[Rule], copies: tuple[list[Copy], str]
) -> None:
    copied, install_dir = copies
    assert install_dir == "/src", "no `RUN pip install .` after the copies"
    in_image = image_files(copied, rules)
    missing = [
        need for need in install_needs() if in_image.get(posixpath.join(install_dir, need)) != need
    ]
    assert missing == []


def test_the_image_needs_no_tests_docs_or_research(
    rules: list[Rule], copies: tuple[list[Copy], str]
) -> None:
    sources = {source.split("/")[0] for copy in copies[0] for source in copy.sources}
    assert not sources & set(NOT_IN_IMAGE)
    for top in NOT_IN_IMAGE:
        assert excluded(rules, f"{top}/anything.md"), top
    # The benchmarks' result files stay out of the image; the .venv and .git never go in.
    for path in ("bench/results-x.json", ".venv/bin/python", ".git/HEAD", "runs/a/ckpt.pt"):
        assert excluded(rules, path), path
