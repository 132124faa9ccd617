from __future__ import annotations

import logging

import pytest

from atomd.logs import Repeated


def test_a_repeated_condition_is_logged_once_then_at_a_backoff(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    rep = Repeated(logging.getLogger("atomd.test"), first=2, longest=16, clock=lambda: now[0])
    logged = []
    with caplog.at_level(logging.INFO, logger="atomd.test"):
        for t in range(0, 120, 2):  # every 2 s for 2 minutes, as the rejoin loop does
            now[0] = float(t)
            if rep.log("alone", logging.INFO, "alone"):
                logged.append(t)
    assert logged == [0, 2, 6, 14, 30, 46, 62, 78, 94, 110]
    assert "seen 7 more time(s) in the last 16 s" in caplog.records[5].getMessage()


def test_clearing_logs_the_next_occurrence_at_once() -> None:
    now = [0.0]
    rep = Repeated(logging.getLogger("atomd.test"), clock=lambda: now[0])
    assert rep.log("k", logging.INFO, "x")
    now[0] = 1
    assert not rep.log("k", logging.INFO, "x")
    rep.clear("k")
    assert rep.log("k", logging.INFO, "x")
