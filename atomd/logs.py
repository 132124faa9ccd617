"""One logging setup for the whole package: ``get_logger(__name__)`` everywhere."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def printable(text: str) -> str:
    """``text`` with every character that is not printable (line breaks, escape sequences'
    ESC, other control characters, bidirectional overrides) written as its Python escape
    (``\\n``, ``\\x1b``, ``\\u202e``): one log line or table cell stays one, and shows
    what was sent instead of acting on the terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class LineFormatter(logging.Formatter):
    """One record, one line: the message (which may quote a peer's words: an error answer's
    detail) through ``printable``, so that no peer forges a log line or writes escape
    sequences to the operator's terminal. A traceback keeps its line breaks, not its other
    control characters."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        record.message = printable(record.message)
        return super().formatMessage(record)

    def formatException(self, ei: Any) -> str:  # noqa: N802
        return "\n".join(map(printable, super().formatException(ei).split("\n")))

    def formatStack(self, stack_info: str) -> str:  # noqa: N802
        return "\n".join(map(printable, super().formatStack(stack_info).split("\n")))


class JsonFormatter(logging.Formatter):
    """One record, one JSON object on one line: ``time`` (ISO 8601, UTC), ``level``,
    ``logger``, ``message`` and, when the record carries them, ``exception`` and ``stack``
    (the formatted traceback), for log collectors."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=True)


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


# Loggers that get the one format: ours, and uvicorn's (its servers run inside the daemon).
_LOGGERS = ("atomd", "uvicorn")


def setup_logging(level: str | int | None = None, log_format: str = "text") -> None:
    """Log to stderr at ``level`` (default: ``$ATOMD_LOG_LEVEL`` or INFO), every line in one
    format, uvicorn's included: timestamped text, or JSON objects (``JsonFormatter``) with
    ``log_format="json"``. Idempotent; a later call changes the level and format."""
    level = level or os.environ.get("ATOMD_LOG_LEVEL", "INFO")
    formatter = JsonFormatter() if log_format == "json" else LineFormatter(_FORMAT)
    handler = logging.StreamHandler(sys.stderr)
    handler._atomd = True  # type: ignore[attr-defined]
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(level if isinstance(level, int) else level.upper())
        ours = [h for h in logger.handlers if getattr(h, "_atomd", False)]
        if not ours:
            logger.addHandler(handler)
            logger.propagate = False
            ours = [handler]
        for h in ours:
            h.setFormatter(formatter)


class Repeated:
    """Log a condition that persists once, then again only at a growing interval (``first``
    seconds, doubling up to ``longest``), saying how often it recurred in between; ``clear``
    when it ends, so that its next occurrence is logged at once.

    ``log("no-peers", logging.INFO, "no seeds ...")`` called every 2 s logs at 0 s, 2 s, 6 s,
    14 s, ... and every ``longest`` seconds after that."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        first: float = 2.0,
        longest: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.first = first
        self.longest = longest
        self.clock = clock
        self._state: dict[str, tuple[float, float, int]] = {}  # key -> (next at, gap, skipped)

    def log(self, key: str, level: int, msg: str, *args: object) -> bool:
        """Log unless ``key`` was logged too recently; True if it was logged."""
        now = self.clock()
        state = self._state.get(key)
        if state is not None and now < state[0]:
            self._state[key] = (state[0], state[1], state[2] + 1)
            return False
        gap = self.first if state is None else min(state[1] * 2, self.longest)
        suffix = ""
        if state is not None and state[2]:
            suffix = f" (seen {state[2]} more time(s) in the last {state[1]:.0f} s)"
        self.logger.log(level, msg + suffix, *args)
        self._state[key] = (now + gap, gap, 0)
        return True

    def clear(self, key: str) -> None:
        self._state.pop(key, None)
