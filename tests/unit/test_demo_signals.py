"""A launcher's Ctrl-C or SIGTERM is not lost when Python drops the exception its handler
raised (it does so inside at-fork callbacks, while subprocess starts a daemon)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable

import pytest

from atomd import launch


def test_a_signal_whose_exception_was_dropped_is_delivered_at_the_next_step() -> None:
    before = signal.getsignal(signal.SIGTERM)  # not always SIG_DFL: another test's server's
    with launch.interrupts():
        launch.check_interrupts()  # nothing received: goes on
        # What an at-fork callback does with the handler's exception: "Exception ignored in".
        with contextlib.suppress(launch.Interrupted):
            os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(launch.Interrupted) as caught:
            launch.wait_until(lambda: False, timeout=1, what="never")
        assert caught.value.signum == signal.SIGTERM
    launch.check_interrupts()  # leaving the block forgets it
    assert signal.getsignal(signal.SIGTERM) is before


def _launcher(cleanup: Callable[[], None]) -> None:
    """A launcher that gets SIGTERM and runs ``cleanup`` in its ``finally``."""
    with launch.interrupts():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        finally:
            cleanup()


def test_sigterm_unwinds_like_ctrl_c_so_every_finally_runs() -> None:
    ran: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        _launcher(lambda: ran.append("cleanup"))
    assert ran == ["cleanup"]


def test_a_second_signal_does_not_cut_a_shielded_cleanup_short() -> None:
    """``timeout`` forwards the SIGTERM a ``pkill`` sends it too: the launcher gets two. The
    first unwinds; the second, arriving while daemons are stopped, must not stop that."""
    ran: list[str] = []

    def cleanup() -> None:
        with launch.shielded():
            os.kill(os.getpid(), signal.SIGTERM)  # mid-cleanup
            launch.check_interrupts()  # nor does a poll inside it raise
            ran.append("first daemon stopped")
            ran.append("namespaces removed")

    with pytest.raises(launch.Interrupted):
        _launcher(cleanup)
    assert ran == ["first daemon stopped", "namespaces removed"]


def test_a_signal_during_a_shielded_block_is_raised_once_it_is_left() -> None:
    ran: list[str] = []

    def cleanup() -> None:
        with launch.shielded():
            with launch.shielded():  # nested: only the outermost raises
                os.kill(os.getpid(), signal.SIGINT)
                ran.append("inner done")
            ran.append("outer done")

    with launch.interrupts(), pytest.raises(launch.Interrupted) as caught:
        cleanup()
    assert caught.value.signum == signal.SIGINT
    assert ran == ["inner done", "outer done"]


def test_a_signal_during_cleanup_does_not_hide_the_error_being_cleaned_up_after() -> None:
    """A shielded cleanup in a ``finally``: the error it runs for goes on, not the signal;
    the signal is raised at the launcher's next step."""

    def launcher() -> None:
        try:
            raise RuntimeError("the real failure")
        finally:
            with launch.shielded():
                os.kill(os.getpid(), signal.SIGTERM)

    with launch.interrupts():
        with pytest.raises(RuntimeError, match="the real failure"):
            launcher()
        with pytest.raises(launch.Interrupted):
            launch.check_interrupts()
