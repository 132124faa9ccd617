"""The attack benchmark's summary: means over repeated runs, and the flood's own memory."""

from __future__ import annotations

from typing import Any

import pytest

from atomd_bench.attack import flood_growth, summarize


def run(attack: str, *vals: float, **extra: Any) -> dict[str, Any]:
    return {"attack": attack, "honest": [{"val_loss": v} for v in vals], **extra}


def test_ratios_compare_means_over_every_run_of_an_attack() -> None:
    """Two clean runs 3 % apart and an attack between them: the attack is within the spread,
    so it is compared with the clean runs' mean, not with whichever ran first."""
    results = [
        run("none", 3.0, 3.0, 3.0),
        run("noise", 3.06, 3.06, 3.06),
        run("none", 3.09, 3.09, 3.09),
        run("noise", 3.0, 3.0, 3.0),
    ]
    s = summarize(results)
    none, noise = s["by_attack"]["none"], s["by_attack"]["noise"]
    assert none["runs"] == 2 and noise["runs"] == 2
    assert none["val_mean"] == pytest.approx(3.045)
    assert noise["val_ratio_to_reference"] == pytest.approx(3.03 / 3.045, abs=1e-4)
    low, high = s["reference_spread"]
    assert (low, high) == (
        pytest.approx(3.0 / 3.045, abs=1e-4),
        pytest.approx(3.09 / 3.045, abs=1e-4),
    )
    assert s["worst_val_deviation_from_reference"] == pytest.approx(abs(3.03 / 3.045 - 1), abs=1e-4)


def test_the_reference_is_the_swarm_without_a_hostile_member_where_it_was_run() -> None:
    """A silent member (``none``) is counted among the job's peers, so each round waits for
    and divides by one more delta: the reference is ``absent`` (no hostile member) when run."""
    results = [run("absent", 2.0, 2.0), run("none", 2.1, 2.1), run("const", 2.02, 2.02)]
    s = summarize(results)
    assert s["reference"] == "absent"
    assert s["by_attack"]["none"]["val_ratio_to_reference"] == pytest.approx(1.05)
    assert s["by_attack"]["const"]["val_ratio_to_reference"] == pytest.approx(1.01)
    assert s["worst_val_deviation_from_reference"] == pytest.approx(0.05)
    assert summarize(results[1:])["reference"] == "none"


def test_a_harmful_attack_shows_and_failed_or_diverged_runs_are_left_out() -> None:
    results = [
        run("none", 2.0, 2.0),
        run("x10", 2.2, 2.2),
        run("x1e30", float("nan"), 2.0),  # a diverged peer: no ratio from that run
        {"attack": "flood", "error": "ReadTimeout: ...", "honest": []},
        run("const", 2.0, 2.0, crashed=[False, True]),
    ]
    s = summarize(results)
    assert s["by_attack"]["x10"]["val_ratio_to_reference"] == pytest.approx(1.1)
    assert s["worst_val_deviation_from_reference"] == pytest.approx(0.1)
    assert "x1e30" not in s["by_attack"]
    assert s["failed_runs"] == ["flood"] and s["crashes"] == 1


def test_the_flood_counts_only_the_memory_beyond_the_jobs_own() -> None:
    assert flood_growth({"rss_growth_mb": 55.5, "reference_rss_growth_mb": 20.0}) == 35.5
    # A reference that shrank (the allocator gave memory back) does not flatter the flood.
    assert flood_growth({"rss_growth_mb": 55.5, "reference_rss_growth_mb": -5.0}) == 55.5
    assert flood_growth({"rss_growth_mb": 55.5, "reference_rss_growth_mb": None}) == 55.5
    assert flood_growth({"rss_growth_mb": None}) is None
    flood = {"rss_growth_mb": 80.0, "reference_rss_growth_mb": 45.0}
    s = summarize([run("none", 2.0), run("flood", 2.0, flood=flood)])
    assert s["flood_rss_growth_beyond_job_mb"] == 35.0
