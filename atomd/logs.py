"""One logging setup for the whole package: ``get_logger(__name__)`` everywhere."""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


def setup_logging(level: str | int | None = None) -> None:
    """Log to stderr at ``level`` (default: ``$ATOMD_LOG_LEVEL`` or INFO). Idempotent."""
    level = level or os.environ.get("ATOMD_LOG_LEVEL", "INFO")
    root = logging.getLogger("atomd")
    root.setLevel(level if isinstance(level, int) else level.upper())
    if not any(getattr(h, "_atomd", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT))
        handler._atomd = True  # type: ignore[attr-defined]
        root.addHandler(handler)
        root.propagate = False
