"""The join benchmark on a tiny budget: the variants run, report their fields, and differ
only in where the joiner starts."""

from __future__ import annotations

import json
import math

import pytest

from atomd_bench.join import main, run

TINY = {"steps": 12, "join_at": 4, "every": 2, "seq_len": 16, "batch": 2}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_both_variants_train_and_report_their_curves() -> None:
    reset, keep = run("reset", **TINY), run("keep", **TINY)
    for r in (reset, keep):
        json.dumps(r)
        finals = r["val_loss_per_peer"]
        assert len(finals) == 2 and all(0 < v < 6 for v in finals)
        assert r["val_loss_mean"] == pytest.approx(sum(finals) / 2)
        c = r["curves"]
        assert len(c["peer0"]) == len(c["peer1"]) == 2  # steps 10 and 12
        assert all(math.isfinite(v) for v in c["peer0"] + c["peer1"])  # joined at 4
    # Peer 0 is the same until the join; the variants then differ in the joiner's start.
    assert reset["val_loss_per_peer"] != keep["val_loss_per_peer"]


def test_a_restarted_peer_starts_from_the_donors_model_in_clone_and_keep() -> None:
    """``--restart``: both peers train from step 0; the restarted one evaluates as the donor's
    model in ``clone`` and ``keep`` (which then differ in what it sends), as the anchor plus
    the deltas in with ``reset``."""
    runs = {v: run(v, **TINY, restart=True) for v in ("clone", "reset", "keep")}
    at = {v: r["joiner_val_at_join"] for v, r in runs.items()}
    assert at["clone"] == at["keep"] != at["reset"]
    assert all(math.isfinite(v) for r in runs.values() for v in r["curves"]["peer1"])
    assert runs["clone"]["val_loss_per_peer"] != runs["keep"]["val_loss_per_peer"]


def test_a_join_outside_the_run_is_refused() -> None:
    with pytest.raises(ValueError, match="join_at"):
        run("reset", **{**TINY, "join_at": 12})
    with pytest.raises(ValueError, match="unknown variant"):
        run("donor", **TINY)


def test_the_command_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--steps", "8", "--join-at", "3", "--every", "2", "--seq-len", "16", "--batch", "2",
            "--seeds", "1", "--variants", "reset"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["mean_by_variant"]) == {"reset"} and len(out["runs"]) == 1
    assert out["task"]["join_at"] == 3
