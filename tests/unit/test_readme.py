"""The README tells the truth: its example outputs are what the commands print, and it links
nothing outside the repository."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "readme_examples", REPO / "scripts/readme_examples.py"
)
assert _spec is not None and _spec.loader is not None
readme_examples = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(readme_examples)

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
EXAMPLES = readme_examples.examples((REPO / "README.md").read_text())


def test_there_are_examples_to_check() -> None:
    assert any(cmd.startswith("atomd plan") for cmd, _ in EXAMPLES)


@pytest.mark.parametrize(("command", "shown"), EXAMPLES, ids=[c for c, _ in EXAMPLES])
def test_example_output_is_what_the_command_prints(command: str, shown: str) -> None:
    assert readme_examples.output_of(command) == shown, (
        "stale README example: run `python scripts/readme_examples.py --write`"
    )


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_links_stay_inside_the_repository(doc: Path) -> None:
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if target.startswith(("http://", "https://", "#", "mailto:")):
            continue
        path = (doc.parent / target.split("#")[0]).resolve()
        assert path.is_relative_to(REPO), f"{doc.name} links outside the repository: {target}"
        assert path.exists(), f"{doc.name} links to a missing file: {target}"
