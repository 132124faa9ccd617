"""One way for tests to wait: poll a condition until it holds.

The bound only matters when the condition never holds, so it is generous: a busy machine (many
test workers and daemons on two cores) is many times slower than a quiet one. A test states what
it waits for; the timeout's message names it."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

BOUND_S = 300.0  # seconds before a wait gives up and fails its test


def wait_for(
    predicate: Callable[[], T], *, timeout: float = BOUND_S, interval: float = 0.05, what: str = ""
) -> T:
    """Call ``predicate`` until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what or predicate}")
        time.sleep(interval)


async def until(
    predicate: Callable[[], T | Awaitable[T]],
    what: str = "",
    *,
    timeout: float = BOUND_S,
    interval: float = 0.01,
) -> T:
    """``wait_for`` on the event loop: ``predicate`` may be a plain or an async function."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what or predicate}")
        await asyncio.sleep(interval)
