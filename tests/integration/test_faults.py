"""Faults a real daemon meets: a full disk while checkpointing, a database file deleted under
it, and a stopped job whose record must say where its checkpoint is."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from atomd.launch import DaemonProcess
from atomd.train import checkpoint as ckpt
from tests.integration.conftest import FAST_JOB, wait_for


def _job(c: httpx.Client, job_id: str) -> dict[str, Any]:
    return dict(c.get(f"/v1/jobs/{job_id}").json())


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 25 MiB tmpfs (room for two checkpoints of the tiny model, not three); root only."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (the unit test injects ENOSPC instead)")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=25m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)  # fmt: skip
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_stops_the_job_clearly_and_it_resumes_when_space_returns(
    daemons: Any, small_disk: Path
) -> None:
    d: DaemonProcess = daemons("d0")
    d.data_dir = small_disk / "atomd"
    d.start()
    with d.client() as c:
        spec = {**FAST_JOB, "max_steps": 60, "checkpoint_interval": 5}
        jid = c.post("/v1/jobs?scope=local", json=spec).json()["id"]
        failed = wait_for(lambda: _job(c, jid)["state"] == "failed" and _job(c, jid),
                          what="the job to fail on the full disk")  # fmt: skip
        m = re.fullmatch(
            r"no space left on device writing (\S+/step-(\d+)); "
            r"the last good checkpoint is step (\d+) \((\S+)\)",
            failed["reason"],
        )
        assert m, failed["reason"]
        root = Path(m[1]).parent
        assert int(m[3]) == int(m[2]) - 5 and Path(m[4]).is_dir()
        assert not list(root.glob(".tmp*"))  # the half-written checkpoint is gone
        assert ckpt.load_latest(root).step == int(m[3])  # type: ignore[union-attr]
        assert "Traceback" not in d.log() and "crashed" not in d.log()

        # Space returns: the job resumes from its last good checkpoint and finishes.
        subprocess.run(["mount", "-o", "remount,size=200m", str(small_disk)], check=True)
        r = c.post(f"/v1/jobs/{jid}/resume")
        assert r.status_code == 200, r.text
        done = wait_for(lambda: _job(c, jid)["state"] == "finished" and _job(c, jid),
                        what="the resumed job to finish")  # fmt: skip
        assert done["step"] == 60
        assert c.post(f"/v1/jobs/{jid}/resume").status_code == 409  # finished: nothing to do


def test_a_stopped_jobs_step_is_its_last_checkpoints(daemons: Any) -> None:
    d: DaemonProcess = daemons().start()
    with d.client() as c:
        spec = {**FAST_JOB, "max_steps": 100000, "log_interval": 7, "checkpoint_interval": 1000}
        jid = c.post("/v1/jobs?scope=local", json=spec).json()["id"]
        wait_for(lambda: _job(c, jid)["step"] >= 7, what="a first progress point")
        c.post(f"/v1/jobs/{jid}/stop")
        job = wait_for(lambda: _job(c, jid)["state"] == "stopped" and _job(c, jid), what="stop")
        newest = ckpt.list_checkpoints(Path(job["out_dir"]) / "checkpoints")[0]
        assert job["step"] == int(newest.name.split("-")[1])
        assert job["tokens"] == job["step"] * 4 * 32


def test_a_deleted_database_fails_readiness_and_is_never_recreated(daemons: Any) -> None:
    d: DaemonProcess = daemons().start()
    with d.client() as c:
        assert c.get("/readyz").status_code == 200
        for suffix in ("", "-wal", "-shm"):
            Path(f"{d.data_dir / 'atomd.db'}{suffix}").unlink(missing_ok=True)
        r = c.get("/readyz")
        assert r.status_code == 503
        body = r.json()
        assert body["checks"]["database"] is False
        assert "has disappeared" in body["reasons"]["database"]
        wait_for(lambda: "ERROR" in d.log() and "has disappeared" in d.log(),
                 what="the error in the log")  # fmt: skip
    d.stop()
    d.start(wait=False)
    code = d.wait(timeout=120)
    assert code != 0
    assert "is missing, but" in d.log() and "atomd migrate" in d.log()
    assert not (d.data_dir / "atomd.db").exists()
