"""Small asyncio helpers the daemon's parts share."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def unless_set(event: asyncio.Event, aw: Awaitable[T]) -> tuple[bool, T | None]:
    """``(True, result)`` of ``aw``, or ``(False, None)`` if ``event`` is set first (also at
    the same moment): ``aw`` is then cancelled and waited for, its outcome dropped. An
    exception of ``aw`` that ends it first is raised; cancelled, ``aw`` goes with the caller.
    For a wait a stop or a shutdown must cut short (a state transfer, a start-up step)."""
    task = asyncio.ensure_future(aw)
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        waiter.cancel()
    if event.is_set():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        return False, None
    return True, task.result()
