"""The README and the documentation tell the truth: their example outputs are what the
commands print, and they link nothing outside the repository."""

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

DOCS = readme_examples.documents()
EXAMPLES = readme_examples.all_examples()
# Pages the site's build writes from the code (docs/hooks/reference.py): not files in the tree.
GENERATED = {REPO / "docs/reference/configuration.md", REPO / "docs/reference/rest-api.md"}


def test_there_are_examples_to_check() -> None:
    assert any(cmd.startswith("atomd plan") for cmd, _ in EXAMPLES)


@pytest.mark.parametrize(("command", "shown"), EXAMPLES, ids=[c for c, _ in EXAMPLES])
def test_example_output_is_what_the_command_prints(command: str, shown: str) -> None:
    assert readme_examples.output_of(command) == shown, (
        "stale README example: run `python scripts/readme_examples.py --write`"
    )


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_links_stay_inside_the_repository(doc: Path) -> None:
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if target.startswith(("http://", "https://", "#", "mailto:")):
            continue
        path = (doc.parent / target.split("#")[0]).resolve()
        assert path.is_relative_to(REPO), f"{doc} links outside the repository: {target}"
        if path in GENERATED:
            continue
        assert path.exists(), f"{doc} links to a missing file: {target}"
