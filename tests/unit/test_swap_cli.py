"""``atomd plan`` and ``atomd bench swap`` (in-process: the CLI is the user-facing layer)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from atomd.cli import app

runner = CliRunner()


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_plan_help() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "atomd", "plan", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Usage" in proc.stdout and "--gpu-mem" in proc.stdout and "--json" in proc.stdout


def test_plan_prints_a_table() -> None:
    result = runner.invoke(app, ["plan", "--preset", "gpt3-6.7b", "--gpu-mem", "24GiB"])
    assert result.exit_code == 0, result.output
    for row in ("slots (K)", "micro-batches per layer visit (M)", "peak", "assumed", "tokens/s"):
        assert row in result.output


def test_plan_json_respects_the_budget() -> None:
    result = runner.invoke(
        app, ["plan", "--preset", "gpt3-2.7b", "--gpu-mem", "8GiB", "--grad-accum", "8", "--json"]
    )
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["preset"] == "gpt3-2.7b" and plan["slots"] >= 2
    assert plan["peak_device_bytes"] <= 8 * 2**30 == plan["budget_bytes"]
    assert 8 % plan["micro_batches"] == 0


def test_plan_with_an_impossible_budget_says_why() -> None:
    result = runner.invoke(app, ["plan", "--preset", "gpt3-13b", "--gpu-mem", "1GiB"])
    assert result.exit_code == 2
    assert "no swap plan fits 1.00 GiB" in result.output


def test_plan_can_put_the_optimizer_on_the_device() -> None:
    result = runner.invoke(
        app, ["plan", "--preset", "gpt3-2.7b", "--gpu-mem", "24GiB", "--swap-optimizer", "device"]
    )
    assert result.exit_code == 0, result.output
    assert "device (AdamW as the layer is next loaded)" in result.output
    bad = runner.invoke(app, ["plan", "--preset", "gpt3-2.7b", "--swap-optimizer", "gpu"])
    assert bad.exit_code == 2
    assert "--swap-optimizer must be auto, host, device or split" in bad.output


@pytest.mark.parametrize("optimizer", ["host", "device"])
def test_bench_swap_on_the_cpu(optimizer: str) -> None:
    args = ["bench", "swap", "--preset", "tiny", "--device", "cpu", "--json"]
    small = ["--micro-batch-size", "2", "--seq-len", "32", "--grad-accum", "2", "--steps", "2"]
    result = runner.invoke(app, [*args, *small, "--swap-optimizer", optimizer])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output.strip().splitlines()[-1])
    for key in ("resident_tokens_per_s", "swapped_tokens_per_s", "ratio", "peak_device_bytes"):
        assert out[key] > 0
    assert out["max_rel_param_diff"] < 1e-5
    assert out["bytes_loaded_per_step"] == out["plan"]["predicted_bytes_loaded_per_step"]
    assert out["plan"]["predicted_bound"] in {"compute", "load", "store", "host_optimizer"}
    assert out["plan"]["optimizer"] == optimizer
    assert out["resident_final_loss"] == pytest.approx(out["final_loss"], rel=1e-4)


def test_bench_swap_profile_and_no_resident(tmp_path: Path) -> None:
    args = ["bench", "swap", "--preset", "tiny", "--device", "cpu", "--json", "--no-resident"]
    small = ["--micro-batch-size", "2", "--seq-len", "32", "--grad-accum", "2", "--steps", "2"]
    result = runner.invoke(app, [*args, *small, "--profile", str(tmp_path / "prof")])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output.strip().splitlines()[-1])
    assert out["resident_skipped"] == "--no-resident" and out["ratio"] is None
    assert out["swapped_tokens_per_s"] > 0
    assert out["profile"]["steps"] == 2 and out["profile"]["wall_s"] > 0
    trace = tmp_path / "prof" / "swap-trace.json.gz"
    assert out["profile"]["trace"] == str(trace)
    with gzip.open(trace, "rt") as f:  # a real trace of the CPU ops
        assert json.load(f)["traceEvents"]
    (tmp_path / "file").write_text("x")
    bad = runner.invoke(app, [*args, *small, "--profile", str(tmp_path / "file")])
    assert bad.exit_code == 2 and "not a folder" in bad.output
