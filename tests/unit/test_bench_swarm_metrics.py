"""The swarm benchmark: it reads each daemon's sync timings from its real /metrics text, and
refuses a folder an earlier run has used."""

from __future__ import annotations

from pathlib import Path

import pytest

from atomd.telemetry import Telemetry
from atomd_bench.swarm import run
from atomd_bench.swarm_daemon import tcp_congestion_of
from atomd_bench.swarm_report import mean_seconds


def test_the_means_of_the_upload_round_traffic_and_answer_held_histograms() -> None:
    t = Telemetry()
    assert mean_seconds(t.render().decode()) == {
        "upload_s_mean": None,
        "round_traffic_s_mean": None,
        "answer_held_s_mean": None,
    }
    for s in (0.2, 0.4, 0.9):
        t.upload_seconds.observe(s)
    t.round_traffic_seconds.observe(1.5)
    t.answer_held_seconds.observe(0.1)
    t.answer_held_seconds.observe(0.3)
    got = mean_seconds(t.render().decode())
    assert got["upload_s_mean"] == pytest.approx(0.5)
    assert got["round_traffic_s_mean"] == pytest.approx(1.5)
    assert got["answer_held_s_mean"] == pytest.approx(0.2)


def test_a_folder_kept_by_an_earlier_run_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """A daemon resumes the job its folder holds, so a second run into the same ``--keep``
    folder would fail minutes later with a 409 from POST /v1/jobs; it is refused at once."""
    (tmp_path / "unlimited").mkdir()
    with pytest.raises(ValueError, match="used by an earlier run"):
        run(scenarios=["unlimited"], root=tmp_path)


def test_the_anchors_divergence_is_read_from_each_peers_newest_checkpoint(tmp_path: Path) -> None:
    """The swarm benchmark reports how far apart the peers' anchors ended (they commit the same
    sums, so ~0 is expected): from each peer's newest checkpoint of the job."""
    import torch
    from safetensors.torch import save_file

    from atomd_bench.swarm_report import anchor_divergence

    job = "a" * 32

    def checkpoint(peer: int, step: int, w: list[float]) -> Path:
        d = tmp_path / f"peer{peer}" / "jobs" / job / "checkpoints" / f"step-{step:08d}"
        d.mkdir(parents=True)
        save_file({"sync.anchor.w": torch.tensor(w), "sync.ef.w": torch.ones(2)},
                  str(d / "state.safetensors"))  # fmt: skip
        return tmp_path / f"peer{peer}"

    a = checkpoint(0, 600, [3.0, 4.0])
    checkpoint(1, 200, [100.0, 100.0])  # an older checkpoint: not the one read
    b = checkpoint(1, 600, [3.0, 4.0])
    assert anchor_divergence([a, b], job) == 0.0
    c = checkpoint(2, 600, [3.0, 4.5])
    assert anchor_divergence([a, b, c], job) == pytest.approx(0.1)  # |(0, 0.5)| / |(3, 4)|
    assert anchor_divergence([a, tmp_path / "nobody"], job) is None


def test_the_settled_anchors_of_real_states_agree_where_the_anchors_do_not(tmp_path: Path) -> None:
    """``settled_divergence`` reads each peer's newest checkpoint into a real ``SyncState`` and
    compares where the anchors settle (``SyncState.settled``): A merged B's delta of round 0
    in time, B merged A's only after committing the round, so it is still pending there and
    the anchors differ; the settled anchors do not."""
    import torch
    from safetensors.torch import save_file

    from atomd.spec import SyncSpec
    from atomd.sync.codecs import decode
    from atomd.sync.intake import Contribution
    from atomd.sync.state import Outgoing, SyncState
    from atomd_bench.swarm_report import anchor_divergence, settled_divergence

    job = "b" * 32
    sync = {"codec": "fp32", "every": 2, "outer_momentum": 0.7}
    a, b = (SyncState({"w": torch.tensor([3.0, 4.0, 1.0])}, SyncSpec(**sync), peer_id=p)
            for p in "ab")  # fmt: skip
    a.params["w"].add_(torch.tensor([0.5, 0.0, 0.1]))
    b.params["w"].add_(torch.tensor([0.0, 0.3, -0.1]))

    def got(sender: str, out: Outgoing) -> Contribution:
        return Contribution(sender, out.round, out.base_version,
                            {n: decode(e) for n, e in out.tensors})  # fmt: skip

    oa, ob = a.prepare(), b.prepare()
    a.merge([got("b", ob)], n_peers=2, commit_complete=False)
    b.merge([], n_peers=2, commit_complete=False)
    for st in (a, b):  # round 1, nothing trained: round 0 commits
        st.prepare()
        st.merge([], n_peers=2, commit_complete=False)
    b.absorb([got("a", oa)])  # after B committed round 0 with its own delta only
    dirs = []
    for i, st in enumerate((a, b)):
        d = tmp_path / f"peer{i}" / "jobs" / job / "checkpoints" / "step-00000002"
        d.mkdir(parents=True)
        save_file({f"sync.{k}": v.contiguous() for k, v in st.state_tensors().items()},
                  str(d / "state.safetensors"))  # fmt: skip
        dirs.append(tmp_path / f"peer{i}")
    apart = anchor_divergence(dirs, job)
    assert apart is not None and apart > 1e-3
    settled = settled_divergence(dirs, job, sync)
    assert settled is not None and settled < 1e-6


def test_each_peers_congestion_control_is_read_from_its_last_start_up_line(tmp_path: Path) -> None:
    log = tmp_path / "peer0.log"
    assert tcp_congestion_of(log) is None  # no log yet
    line = (
        "2026-12-05 17:25:10,778 INFO    atomd.daemon: ready: control http://127.0.0.1:7070, "
        "peer plane 10.245.86.1:7071 (TLS, {}, advertised https://10.245.86.1:7071), data /x\n"
    )
    log.write_text(line.format("TCP bbr (the system's)") + "more\n" + line.format("TCP cubic"))
    assert tcp_congestion_of(log) == "TCP cubic"  # restarted: the last start counts
