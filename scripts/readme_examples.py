"""Keep the documentation's example outputs true: every ```text block of the README or of a
page under docs/ that starts with ``$ atomd ...`` is the output of that command.
``python scripts/readme_examples.py`` checks them (exit 1 and a diff on a mismatch);
``--write`` runs each command and writes its output into the file that shows it.
tests/unit/test_readme.py runs the check."""

from __future__ import annotations

import difflib
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BLOCK = re.compile(r"```text\n\$ (atomd [^\n]*)\n(.*?)```", re.S)


def output_of(command: str) -> str:
    argv = [sys.executable, "-m", "atomd", *shlex.split(command)[1:]]
    done = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=300)
    return done.stdout


def examples(text: str) -> list[tuple[str, str]]:
    """(command, the output the README shows) for each example."""
    return [(m[1], m[2]) for m in BLOCK.finditer(text)]


def documents() -> list[Path]:
    """The README and every page of the documentation site."""
    return [README, *sorted((REPO / "docs").rglob("*.md"))]


def all_examples() -> list[tuple[str, str]]:
    """(command, the output shown) for each example of every document."""
    return [e for doc in documents() for e in examples(doc.read_text())]


def main(write: bool) -> int:
    stale = total = 0
    for doc in documents():
        text = doc.read_text()
        found = examples(text)
        total += len(found)
        for command, shown in found:
            actual = output_of(command)
            if actual == shown:
                continue
            stale += 1
            if write:
                text = text.replace(f"$ {command}\n{shown}```", f"$ {command}\n{actual}```")
            else:
                name = str(doc.relative_to(REPO))
                diff = difflib.unified_diff(shown.splitlines(), actual.splitlines(), name,
                                            f"$ {command}", lineterm="")  # fmt: skip
                print("\n".join(diff))
        if write:
            doc.write_text(text)
    print(f"{total} example(s), {stale} {'rewritten' if write else 'stale'}")
    return 1 if stale and not write else 0


if __name__ == "__main__":
    sys.exit(main("--write" in sys.argv))
