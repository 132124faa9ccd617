"""The shared wait helpers return what the condition found, and fail naming what never held."""

from __future__ import annotations

import itertools

import pytest

from tests.polling import until, wait_for


def test_wait_for_returns_the_first_truthy_value() -> None:
    counter = itertools.count()
    assert wait_for(lambda: next(counter) >= 3 and "done", interval=0) == "done"


def test_wait_for_fails_naming_what_never_held() -> None:
    with pytest.raises(AssertionError, match="the impossible"):
        wait_for(lambda: False, timeout=0, what="the impossible")


async def test_until_takes_plain_and_async_conditions() -> None:
    counter = itertools.count()

    async def third() -> int:
        return next(counter) >= 2

    assert await until(third, "the third call", interval=0) is True
    assert await until(lambda: 7, "a plain value") == 7
    with pytest.raises(AssertionError, match="never"):
        await until(lambda: 0, "never", timeout=0)
