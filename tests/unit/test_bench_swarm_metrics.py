"""The swarm benchmark: it reads each daemon's sync timings from its real /metrics text, and
refuses a folder an earlier run has used."""

from __future__ import annotations

from pathlib import Path

import pytest

from atomd.telemetry import Telemetry
from atomd_bench.swarm import _mean_seconds, run


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


def test_a_folder_kept_by_an_earlier_run_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """A daemon resumes the job its folder holds, so a second run into the same ``--keep``
    folder would fail minutes later with a 409 from POST /v1/jobs; it is refused at once."""
    (tmp_path / "unlimited").mkdir()
    with pytest.raises(ValueError, match="used by an earlier run"):
        run(scenarios=["unlimited"], root=tmp_path)
