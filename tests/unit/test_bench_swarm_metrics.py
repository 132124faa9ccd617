"""The swarm benchmark reads each daemon's sync timings from its real /metrics text."""

from __future__ import annotations

import pytest

from atomd.telemetry import Telemetry
from atomd_bench.swarm import _mean_seconds


def test_the_means_of_the_upload_and_round_traffic_histograms() -> None:
    t = Telemetry()
    assert _mean_seconds(t.render().decode()) == {
        "upload_s_mean": None,
        "round_traffic_s_mean": None,
    }
    for s in (0.2, 0.4, 0.9):
        t.upload_seconds.observe(s)
    t.round_traffic_seconds.observe(1.5)
    got = _mean_seconds(t.render().decode())
    assert got["upload_s_mean"] == pytest.approx(0.5)
    assert got["round_traffic_s_mean"] == pytest.approx(1.5)
