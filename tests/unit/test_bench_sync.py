"""The sync benchmark on a tiny budget: every run kind completes and reports its fields."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from atomd.cli import app
from atomd.model.gpt import GPT
from atomd.model.presets import get_preset
from atomd.sync.cadence import MARGIN, MIN_EVERY, MIN_FRACTION
from atomd_bench.ideal_codec import IdealCodec, ideal_frame_bytes
from atomd_bench.sync import main, run
from atomd_bench.sync_runs import Budget, RunSpec, default_runs, resolve_runs

TINY = Budget(steps=12, peers=2, seq_len=32, batch_scale=0.25, every_scale=0.1, val_batches=2)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_quick_runs_report_their_fields() -> None:
    runs: list[str | RunSpec] = ["topk-h50", "topk-h50-sync", "fp32-h10", "alone-b16"]
    result = run(runs=runs, budget=TINY, workers=0, progress=None)
    json.dumps(result)  # JSON all the way down
    assert result["task"]["steps"] == 12
    by_name = {r["name"]: r for r in result["runs"]}
    assert list(by_name) == runs
    for name in ("topk-h50", "topk-h50-sync", "fp32-h10"):
        r = by_name[name]
        assert r["peers"] == 2 and r["steps"] == 12 and r["rounds"] >= 2
        assert len(r["val_loss_per_peer"]) == 2
        assert 0 < r["val_loss"] < 6 and r["bytes_per_round"] > 0 and r["wall_s"] > 0
        assert r["ratio_vs_fp32_model"] == pytest.approx(
            r["model_fp32_bytes"] / r["bytes_per_round"]
        )
        assert r["divergence_max"] >= r["divergence_final"] >= 0
        assert r["start_divergence_max"] >= r["start_divergence_final"] >= 0
        assert 0 < r["val_loss_anchor"] < 6
        assert r["model_divergence_final"] >= 0
        # Every delta arrives within a round, so the committed anchors agree (up to rounding).
        assert r["divergence_max"] < 1e-6
    # Synchronous peers also restart from the same point; asynchronous ones do not.
    assert by_name["topk-h50-sync"]["start_divergence_max"] < 1e-6
    assert by_name["topk-h50"]["start_divergence_max"] > 1e-6
    assert (
        by_name["topk-h50"]["ratio_vs_fp32_model"] > 20 * by_name["fp32-h10"]["ratio_vs_fp32_model"]
    )
    assert by_name["alone-b16"]["codec"] is None
    targets = result["targets"]
    assert targets["codec"] == "topk" and targets["best"] == "h50"  # the only topk-h<H> run
    h50 = targets["by_every"]["h50"]
    assert set(h50) == {
        "val_loss", "loss_below_hivemind", "bytes_ratio", "divergence", "async_vs_sync"
    }  # fmt: skip
    sync = by_name["topk-h50-sync"]["val_loss"]
    assert h50["async_vs_sync"]["value"] == pytest.approx(
        by_name["topk-h50"]["val_loss"] / sync - 1
    )
    assert h50["bytes_ratio"]["ok"] == (by_name["topk-h50"]["ratio_vs_fp32_model"] >= 100)


def test_run_names() -> None:
    names = [r.name for r in default_runs()]
    assert len(names) == len(set(names)) == 13
    assert {"fp32-h50", "bf16-h50", "int8-h50", "alone-b16", "single-b64"} <= set(names)
    assert [r.name for r in resolve_runs(None)] == names
    assert resolve_runs(["fp32-h50-nesterov"])[0].sync["outer_momentum"] == 0.9
    # The default codec's runs take its default outer step; the plain one is an extra run.
    by_name = {r.name: r for r in resolve_runs(["topk-h2", "topk-h2-plain", "fp32-h2"])}
    assert by_name["topk-h2"].sync_spec().outer_momentum > 0
    assert by_name["topk-h2-plain"].sync_spec().outer_momentum == 0
    assert by_name["fp32-h2"].sync_spec().outer_momentum == 0
    with pytest.raises(ValueError, match="unknown run"):
        resolve_runs(["nope"])


def test_cli_rejects_unknown_runs() -> None:
    result = CliRunner().invoke(app, ["bench", "sync", "--runs", "nope", "--workers", "0"])
    assert result.exit_code == 2
    assert "unknown run" in result.output


def test_consolidation_rounds_converge_the_models_to_their_mean() -> None:
    """Rounds without training after the last step: the peers' models (different, with top-k's
    residual in each replica) end at the mean of their final models, whose loss the plain run
    reports as a diagnostic. (The plain outer step throughout, so the two runs are the same up
    to the last boundary: with momentum consolidation switches to the plain average there,
    which test_sync_runner covers.)"""
    avg = {"outer_momentum": 0.0}
    plain = RunSpec("topk-h50", codec="topk", sync=avg)
    consolidated = RunSpec("topk-h50-c", codec="topk", sync={**avg, "consolidate_rounds": 120})
    result = run(runs=[plain, consolidated], budget=TINY, workers=0, progress=None)
    a, b = result["runs"]
    assert a["consolidation_rounds"] == 0 and a["consolidation_bytes_per_peer"] == 0
    assert a["val_loss_before_consolidation"] == a["val_loss"]
    assert a["model_divergence_final"] > 1e-3  # top-k leaves the models apart
    assert b["consolidation_rounds"] == 120 and b["consolidation_bytes_per_peer"] > 0
    assert b["val_loss_before_consolidation"] == pytest.approx(a["val_loss"])
    assert b["model_divergence_final"] < 0.02 * a["model_divergence_final"]
    assert b["val_loss"] == pytest.approx(a["val_loss_mean_model"], abs=2e-3)
    assert b["val_loss_mean_model"] == pytest.approx(a["val_loss_mean_model"], abs=1e-4)


def test_sync_settings_for_every_run_and_the_swarm_adam_they_turn_off(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``sync`` overrides every swarm run's settings (the single runs have none); with the
    swarm's AdamW off the same run trains differently; an unknown setting fails at once."""
    runs: list[str | RunSpec] = ["fp32-h10", "alone-b16"]
    on = {r["name"]: r for r in run(runs=runs, budget=TINY, workers=0, progress=None)["runs"]}
    off = run(runs=runs, budget=TINY, workers=0, progress=None, sync={"swarm_adam": False})
    by_name = {r["name"]: r for r in off["runs"]}
    assert on["fp32-h10"]["sync"]["swarm_adam"] is True
    assert by_name["fp32-h10"]["sync"]["swarm_adam"] is False
    assert by_name["fp32-h10"]["val_loss"] != pytest.approx(on["fp32-h10"]["val_loss"], abs=1e-6)
    assert by_name["alone-b16"]["val_loss"] == pytest.approx(on["alone-b16"]["val_loss"])
    with pytest.raises(ValueError, match="nope"):
        run(runs=runs, budget=TINY, workers=0, progress=None, sync={"nope": 1})
    result = CliRunner().invoke(app, ["bench", "sync", "--sync", "[1]", "--workers", "0"])
    assert result.exit_code == 2 and "JSON object" in result.output
    with pytest.raises(SystemExit) as exit_info:  # the bench's own entry point says it too
        main(["--sync", "[1]"])
    assert exit_info.value.code == 2
    assert "JSON object" in capsys.readouterr().err


def test_the_ideal_codec_reaches_the_rate_distortion_bound() -> None:
    """At R bits a weight a Gaussian of variance s2 is received with a mean squared error of
    s2 * 2^(-2R) at best; the oracle delivers that, and shares the bits by water-filling:
    a chunk of 16x the variance gets 2 bits more a weight (0.5 * log2(16))."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64 * 4096, generator=g, dtype=torch.float64).float()
    codec = IdealCodec(rate=0.3, seed=1)
    err = float((codec.decode(codec.encode(x)) - x).double().square().mean())
    assert err == pytest.approx(float(x.double().square().mean()) * 2 ** (-0.6), rel=0.02)
    y = torch.cat([x[: 32 * 4096], 4.0 * x[32 * 4096 :]])  # half the chunks at 16x
    rate = 1.5  # water level below both variances: 0.5 and 2.5 bits a weight
    got = IdealCodec(rate=rate, seed=1).decode(IdealCodec(rate=rate, seed=1).encode(y)) - y
    lo, hi = got[: 32 * 4096].double().square().mean(), got[32 * 4096 :].double().square().mean()
    assert float(lo) == pytest.approx(float(hi), rel=0.05)  # one water level for both
    assert float(lo) == pytest.approx(2 ** (-1.0), rel=0.05)  # 1 * 2^(-2 * 0.5)


def test_an_ideal_run_counts_the_rate_not_its_fp32_frames() -> None:
    result = run(
        runs=[RunSpec("ideal", codec="topk", ideal_rate=0.3, every=2)],
        budget=TINY,
        workers=0,
        progress=None,
    )["runs"][0]
    assert result["ideal_rate"] == 0.3
    numels = [p.numel() for p in GPT(get_preset("tiny")).parameters()]
    assert sum(numels) == result["model_fp32_bytes"] // 4
    assert result["bytes_per_round"] == ideal_frame_bytes(0.3, numels)
    assert 95 < result["ratio_vs_fp32_model"] < 110
    assert result["divergence_max"] < 1e-5  # the peers merge what they decode


def test_another_seed_is_another_draw_of_the_same_task() -> None:
    """``seed`` draws other initial weights, batches and delays; the validation windows stay,
    so the losses of two seeds compare (and seed 0 is the default)."""
    runs: list[str | RunSpec] = ["alone-b16", "topk-h2"]
    base = run(runs=runs, budget=TINY, workers=0, progress=None)
    same = run(runs=runs, budget=TINY, workers=0, progress=None, seed=0)
    other = run(runs=runs, budget=TINY, workers=0, progress=None, seed=1)
    assert (base["task"]["seed"], other["task"]["seed"]) == (0, 1)
    for i in range(2):  # a lone peer and a swarm
        assert same["runs"][i]["val_loss"] == base["runs"][i]["val_loss"]
        assert other["runs"][i]["val_loss"] != pytest.approx(base["runs"][i]["val_loss"], abs=1e-6)


def test_the_automatic_cadence_over_a_slow_link_sends_fewer_entries_less_often() -> None:
    """``RunSpec.link``: the daemon's cadence code sizes each round's share of entries and H
    from the simulated link, and the frames it settles on fit the link."""
    budget = Budget(steps=40, peers=2, seq_len=32, batch_scale=0.25, val_batches=2)
    fast, slow = (
        run(runs=[spec], budget=budget, workers=0, progress=None)["runs"][0]
        for spec in (
            RunSpec("fast", codec="topk", every="auto", link=1e9),
            RunSpec("slow", codec="topk", every="auto", link=1200.0),
        )
    )
    for r in (fast, slow):
        assert r["sync"]["every"] == "auto" and r["sync"]["outer_momentum"] == 0.7
        assert len(r["every_per_round"]) == len(r["fraction_per_round"]) == r["rounds"]
        assert r["bytes_per_step"] == pytest.approx(r["bytes_per_round"] * r["rounds"] / r["steps"])
        # Frames take their upload's time, the last close waits for those still on their way:
        # every delta is in by the round after its own, so the anchors agree.
        assert r["divergence_max"] < 1e-6
    # A free link: the spec's share, a round every MIN_EVERY steps once a step is measured.
    assert set(fast["fraction_per_round"]) == {0.01}
    assert fast["every_per_round"][-3:] == [MIN_EVERY] * 3
    # A slow one: the smallest share, and rounds spaced so that its frames fit.
    assert slow["fraction_per_round"][0] == 0.01
    assert slow["fraction_per_round"][-1] == MIN_FRACTION
    every, frames = slow["every_per_round"], slow["frame_bytes_per_round"]
    assert every[-2] > 2 * MIN_EVERY
    assert slow["bytes_per_step"] < fast["bytes_per_step"] / 5
    # One round in flight: a round lasts at least its last frame's traffic time.
    assert all(h >= f / 1200.0 for h, f in zip(every[1:], frames, strict=False))
    # Settled: the frames take at most 1 / MARGIN of the link (H rounds to the nearest step).
    assert frames[-2] / every[-2] <= 1200.0 / MARGIN * (1 + 0.5 / every[-2])
