"""The demo's Ctrl-C is not lost when Python drops the exception its handler raised."""

from __future__ import annotations

import contextlib
import signal

import pytest

from atomd import demo


def test_a_signal_whose_exception_was_dropped_still_stops_the_demo() -> None:
    demo._received.clear()
    demo._check_signals()  # nothing received: goes on
    # What an at-fork callback does with the handler's exception: "Exception ignored in ...".
    with contextlib.suppress(demo._InterruptedError):
        demo._raise(signal.SIGINT, None)
    with pytest.raises(demo._InterruptedError) as caught:
        demo._check_signals()
    assert caught.value.signum == signal.SIGINT
    demo._received.clear()
