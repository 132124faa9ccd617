"""A real ``atomd run`` driven over HTTP: jobs, progress, stop, SIGTERM, SIGKILL + restart."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from atomd.datadir import lock_data_dir
from atomd.db.connection import BUSY_TIMEOUT_MS
from atomd.launch import READY_TIMEOUT, DaemonProcess
from tests.conftest import another_congestion
from tests.integration.conftest import FAST_JOB, restarted_while_database_held, wait_for


def _job(c: httpx.Client, job_id: str) -> dict[str, Any]:
    r = c.get(f"/v1/jobs/{job_id}")
    assert r.status_code == 200, r.text
    return dict(r.json())


def _steps(c: httpx.Client, job_id: str) -> list[int]:
    return [p["step"] for p in c.get(f"/v1/jobs/{job_id}/progress", params={"limit": 10000}).json()]


def test_job_lifecycle_over_rest(daemons: Any) -> None:
    d: DaemonProcess = daemons().start()
    with d.client() as c:
        assert c.get("/healthz").json() == {"status": "ok"}
        assert c.get("/readyz").json()["ready"] is True

        bad = c.post("/v1/jobs", json={"preset": "tiny", "micro_batch_size": 0, "typo": 1})
        assert bad.status_code == 422
        fields = {e["loc"][-1] for e in bad.json()["detail"]}
        assert {"micro_batch_size", "typo"} <= fields
        assert c.get("/v1/jobs/nope").status_code == 404

        r = c.post("/v1/jobs", json={**FAST_JOB, "max_steps": 100000})
        assert r.status_code == 201, r.text
        job = r.json()
        assert job["state"] in ("pending", "running") and job["id"]
        jid = job["id"]

        busy = c.post("/v1/jobs", json={"preset": "tiny"})
        assert busy.status_code == 409 and jid in busy.json()["detail"]

        wait_for(lambda: _job(c, jid)["state"] == "running", what="running")
        first = wait_for(lambda: _job(c, jid)["step"] >= 3 and _job(c, jid)["step"], what="steps")
        later = wait_for(
            lambda: _job(c, jid)["step"] > first + 3 and _job(c, jid)["step"], what="more"
        )
        assert later > first  # progress advances
        points = c.get(f"/v1/jobs/{jid}/progress").json()
        assert {"step", "tokens", "loss", "tokens_per_s", "at"} <= set(points[0])

        status = c.get("/v1/status").json()
        assert status["job"]["id"] == jid

        metrics = c.get("/metrics").text
        assert (
            "atomd_job_step" in metrics
            and 'atomd_job_state{atomd_job_state="running"} 1.0' in metrics
        )

        stop = c.post(f"/v1/jobs/{jid}/stop")
        assert stop.status_code == 200 and stop.json()["state"] == "stopping"
        final = wait_for(
            lambda: _job(c, jid)["state"] == "stopped" and _job(c, jid), what="stopped"
        )
        assert final["reason"] == "stopped by request"
        assert c.post(f"/v1/jobs/{jid}/stop").status_code == 409  # not active any more

        steps = _steps(c, jid)
        assert steps == list(range(1, final["step"] + 1))  # every step recorded once
        ckpt = Path(final["out_dir"]) / "checkpoints" / f"step-{final['step']:08d}"
        assert (ckpt / "meta.json").exists()  # stopped at a step boundary, checkpointed
        assert (Path(final["out_dir"]) / "metrics.jsonl").exists()
        assert (ckpt / "tokenizer.json").exists()  # every checkpoint carries its tokenizer
        # Daemon jobs write TensorBoard events as atomd train does.
        assert list((Path(final["out_dir"]) / "tensorboard").glob("events.out.tfevents.*"))
        assert c.get(f"/v1/jobs/{jid}/rounds").json() == []

        # A short job runs to the end.
        r = c.post("/v1/jobs", json={**FAST_JOB, "max_steps": 8})
        assert r.status_code == 201, r.text
        done = wait_for(
            lambda: _job(c, r.json()["id"])["state"] == "finished" and _job(c, r.json()["id"])
        )
        assert done["step"] == 8 and done["finished_at"] and done["val_loss"] is not None
        assert [j["id"] for j in c.get("/v1/jobs").json()] == [done["id"], jid]

        # A peer whose tokens hash differently from the spec's data_sha256 refuses the job.
        r = c.post("/v1/jobs", json={**FAST_JOB, "data_sha256": "0" * 64})
        assert r.status_code == 201, r.text
        refused = wait_for(
            lambda: _job(c, r.json()["id"])["state"] == "failed" and _job(c, r.json()["id"])
        )
        assert f"the job's data_sha256 is {'0' * 64}" in refused["reason"]
        assert "this peer's copy of the data or its tokenizer differs" in refused["reason"]


def test_sigterm_checkpoints_exits_zero_and_resumes(daemons: Any) -> None:
    d: DaemonProcess = daemons().start()
    with d.client() as c:
        jid = c.post("/v1/jobs", json={**FAST_JOB, "max_steps": 100000}).json()["id"]
        wait_for(lambda: _job(c, jid)["step"] >= 6, what="steps")
    d.signal(signal.SIGTERM)
    assert d.wait(timeout=60) == 0
    assert "shutting down (SIGTERM)" in d.log()

    db = sqlite3.connect(d.data_dir / "atomd.db")
    state, reason, step = db.execute(
        "SELECT state, reason, step FROM jobs WHERE id=?", (jid,)
    ).fetchone()
    db.close()
    assert state == "pending" and "resumes" in reason
    ckpt = d.data_dir / "jobs" / jid / "checkpoints" / f"step-{step:08d}"
    assert (ckpt / "meta.json").exists()  # the last step is on disk: nothing lost

    d.start()  # same data dir: the job resumes from its checkpoint
    with d.client() as c:
        wait_for(lambda: _job(c, jid)["state"] == "running" and _job(c, jid)["step"] > step + 2)
        steps = _steps(c, jid)
        assert steps == list(range(1, len(steps) + 1))


def _killed_during_a_job(daemons: Any, steps: int) -> tuple[DaemonProcess, str]:
    """A daemon SIGKILLed once its job has trained ``steps`` steps, and the job's id."""
    d: DaemonProcess = daemons().start()
    with d.client() as c:
        jid = c.post("/v1/jobs", json={**FAST_JOB, "max_steps": 100000}).json()["id"]
        wait_for(lambda: _job(c, jid)["step"] >= steps, what="steps")
    d.signal(signal.SIGKILL)
    d.wait(timeout=10)
    return d, jid


def test_sigkill_then_restart_resumes_from_last_good_checkpoint(daemons: Any) -> None:
    d, jid = _killed_during_a_job(daemons, 13)

    db = sqlite3.connect(d.data_dir / "atomd.db")
    assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    db.close()
    ckpts = sorted((d.data_dir / "jobs" / jid / "checkpoints").glob("step-*"))
    last_good = int(ckpts[-1].name.split("-")[1])
    assert last_good >= 10

    # Not ready before the interrupted job is taken up: until then its record still reads the
    # "running" the SIGKILL left (a client that trusted /readyz read it in CI while nothing
    # trained). A writer holding the database keeps the daemon from taking it up meanwhile.
    # Held past the busy timeout: a start-up that failed then ended the daemon; it waits.
    with restarted_while_database_held(d) as first:
        time.sleep(BUSY_TIMEOUT_MS / 1000 + 2)
        assert d.running(), d.log()[-3000:]
    assert first.status_code == 503 and first.json()["checks"]["jobs"] is False, first.text
    assert "another process holds a write lock on the database" in d.log()
    d.wait_ready()
    with d.client() as c:
        assert _job(c, jid)["state"] in ("pending", "running")
        wait_for(
            lambda: _job(c, jid)["state"] == "running" and _job(c, jid)["step"] > last_good + 2
        )
        steps = _steps(c, jid)
        assert steps[:last_good] == list(range(1, last_good + 1))  # nothing before it lost
        assert steps == sorted(set(steps))  # and nothing doubled
        events = (
            sqlite3.connect(d.data_dir / "atomd.db")
            .execute("SELECT message FROM events WHERE kind='job.resumed'")
            .fetchall()
        )
        assert events and f"step {last_good}" in events[-1][0]


def test_sigterm_while_the_jobs_wait_on_a_held_database_exits(daemons: Any) -> None:
    """Restarted while another process holds the database, the daemon waits to take up the
    job a SIGKILL interrupted. A SIGTERM then ends the wait and the daemon (exit 0; before,
    the wait held the shutdown for as long as the lock), and the next start takes it up."""
    d, jid = _killed_during_a_job(daemons, 3)
    with restarted_while_database_held(d) as first:
        assert first.json()["checks"]["jobs"] is False, first.text
        d.signal(signal.SIGTERM)
        assert d.wait(timeout=READY_TIMEOUT) == 0, d.log()[-3000:]
    assert "shutting down before the jobs the last run left were taken up" in d.log()
    d.start()
    with d.client() as c:
        wait_for(lambda: _job(c, jid)["state"] == "running", what="resumed")


def test_control_token_required_when_set(daemons: Any) -> None:
    d: DaemonProcess = daemons(env={"ATOMD_CONTROL_TOKEN": "s3cret"}).start()
    with httpx.Client(base_url=d.url, timeout=5) as c:
        assert c.get("/healthz").status_code == 200  # health stays open for probes
        for path in ("/v1/status", "/v1/jobs", "/metrics", "/readyz"):
            r = c.get(path)
            assert r.status_code == 401, path
            assert r.json()["error"] == "unauthorized"
        assert c.get("/v1/status", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/v1/status", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def _atomd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("ATOMD_")}
    return subprocess.run(
        [sys.executable, "-m", "atomd", *args],
        capture_output=True,
        text=True,
        timeout=READY_TIMEOUT,  # a failure's bound: a command loads torch on a busy machine
        env={**base, **(env or {})},
    )


def test_bad_settings_stop_the_start_with_a_clear_message(tmp_path: Path) -> None:
    r = _atomd("run", "--data-dir", str(tmp_path), env={"ATOMD_DEVCE": "cpu"})
    assert r.returncode == 2 and "ATOMD_DEVCE (did you mean ATOMD_DEVICE?)" in r.stderr
    r = _atomd("run", "--data-dir", str(tmp_path), "--control", "0.0.0.0:7070")
    assert r.returncode == 2 and "ATOMD_CONTROL_TOKEN" in r.stderr
    r = _atomd("run", "--data-dir", str(tmp_path), "--device", "tpu")
    assert r.returncode == 2 and "--device" in r.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = _atomd("run", "--data-dir", str(tmp_path), "--control", f"127.0.0.1:{port}")
    assert r.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in r.stderr
    held = lock_data_dir(tmp_path)  # as a daemon that uses it holds it
    try:
        r = _atomd("run", "--data-dir", str(tmp_path), "--control", "127.0.0.1:0")
        m = _atomd("migrate", "--data-dir", str(tmp_path), "--downgrade", "base")
    finally:
        os.close(held)
    for answer in (r, m):
        assert answer.returncode == 2, answer.stderr
        assert f"is in use by another atomd (pid {os.getpid()})" in answer.stderr


def test_a_daemon_started_during_a_migration_waits_for_it(daemons: Any) -> None:
    """``atomd migrate`` holds the data directory for seconds; a daemon started meanwhile
    (systemd, a launcher) waits for it, says so, and starts once it is done."""
    d: DaemonProcess = daemons()
    d.data_dir.mkdir(parents=True)
    held = lock_data_dir(d.data_dir, "migrate")  # as `atomd migrate` holds it
    try:
        d.start(wait=False)
        wait_for(
            lambda: (
                f"waiting for atomd migrate (pid {os.getpid()}) to finish" in d.log()
                or not d.running()
            ),
            what="the daemon to say it waits for the migration",
        )
        assert d.running(), d.log()
    finally:
        os.close(held)
    d.wait_ready()
    assert (d.data_dir / "atomd.pid").read_text().split() == [str(d.pid), "run"]


def test_cli_clients_talk_to_the_daemon(daemons: Any, tmp_path: Path) -> None:
    d: DaemonProcess = daemons().start()
    url = ["--url", d.url]
    r = _atomd(
        "job",
        "start",
        *url,
        "--json",
        "--set",
        f"seq_len={FAST_JOB['seq_len']}",
        "--set",
        "micro_batch_size=4",
        "--max-steps",
        "100000",
    )
    assert r.returncode == 0, r.stderr
    jid = json.loads(r.stdout)["id"]
    with d.client() as c:
        wait_for(lambda: _job(c, jid)["step"] >= 2, what="steps")
    r = _atomd("status", *url)
    assert r.returncode == 0 and jid in r.stdout
    status = json.loads(_atomd("status", *url, "--json").stdout)
    assert status["peer_id"] in r.stdout and status["public_key"] in r.stdout  # as the README says
    r = _atomd("job", "list", *url)
    assert r.returncode == 0 and jid in r.stdout and "running" in r.stdout
    r = _atomd("job", "show", jid, *url)
    assert r.returncode == 0 and "tokens/s" in r.stdout
    r = _atomd("job", "stop", jid, *url)
    assert r.returncode == 0 and "stopping" in r.stdout
    r = _atomd("plot", jid, *url, "--out", str(tmp_path / "loss.png"))  # a job's curves by id
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG")
    r = _atomd("job", "show", "nope", *url)
    assert r.returncode == 2 and "404" in r.stderr
    r = _atomd("status", "--url", "http://127.0.0.1:9")
    assert r.returncode == 2 and "cannot reach atomd" in r.stderr


@pytest.mark.skipif(not shutil.which("ss"), reason="ss (iproute2) reads another process's sockets")
def test_the_peer_plane_serves_with_the_chosen_congestion_control(daemons: Any) -> None:
    """``ATOMD_TCP_CONGESTION`` reaches the connections the daemon's peer plane accepts (they
    inherit it from its listening socket), and its start-up line says what is in force."""
    from atomd_bench.swarm_daemon import tcp_congestion_of

    _, name = another_congestion()
    d: DaemonProcess = daemons(env={"ATOMD_TCP_CONGESTION": name}).start()
    wait_for(lambda: f"TCP {name}," in d.log(), what="the start-up line")
    assert tcp_congestion_of(d.log_path) == f"TCP {name}"  # what `bench swarm` reports
    with socket.create_connection(("127.0.0.1", d.listen_port), timeout=10) as s:
        here = s.getsockname()[1]
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0") != (
            name.encode()
        )  # this end keeps the system's: what the daemon's end shows is the daemon's doing
        accepted = subprocess.run(
            ["ss", "-tinH", "state", "established", "dport", "=", f":{here}"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout  # fmt: skip
    assert f" {name} " in f" {accepted.replace(chr(10), ' ').replace(chr(9), ' ')} ", accepted
