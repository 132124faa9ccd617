"""The data hash across a swarm (issue #17), on real daemons: a swarm job started without a
``data_sha256`` gets its origin's hash in its spec (measured by the trainer, off the request
path) before it is announced, and a peer whose copy of the data hashes differently is refused
with the reason."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from atomd.launch import DaemonProcess, stop_all, wait_until
from tests.integration.conftest import FAST_JOB

# Several training daemons: one such test at a time under `make test`'s two workers.
pytestmark = pytest.mark.xdist_group("swarm")


def _corpus(path: Path, word: str) -> Path:
    lines = [f"line {i % 17}: the quick {word} fox jumps over the lazy dog.\n" for i in range(3000)]
    path.write_text("".join(lines))
    return path


def _env(data: Path) -> dict[str, str]:
    return {"ATOMD_DATA_NAMES": f"corpus={data}", "OMP_NUM_THREADS": "1"}


def _job(d: DaemonProcess, job_id: str) -> dict[str, Any] | None:
    r = httpx.get(f"{d.url}/v1/jobs/{job_id}", headers=d.headers, timeout=10)
    return dict(r.json()) if r.status_code == 200 else None


def test_a_peer_whose_data_differs_is_refused_with_the_reason(tmp_path: Path) -> None:
    ours = _corpus(tmp_path / "ours.txt", "brown")
    theirs = _corpus(tmp_path / "theirs.txt", "green")  # same name, other content
    prepared = subprocess.run(
        [sys.executable, "-m", "atomd", "data", "prepare", str(ours), "--tokenizer", "bytes"],
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    (expected,) = [
        line.split(": ", 1)[1]
        for line in prepared.stdout.splitlines()
        if line.startswith("data_sha256: ")
    ]
    started: list[DaemonProcess] = []
    try:
        # Each daemon's operator registered "corpus": a's file on a, b's on b.
        a = DaemonProcess(tmp_path / "a", env=_env(ours))
        b = DaemonProcess(tmp_path / "b", env=_env(theirs), extra_args=["--peer", a.peer_url])
        started += [a, b]
        a.start()
        b.start()
        with a.client() as c:
            r = c.post("/v1/jobs", json={**FAST_JOB, "max_steps": 100000, "data": "corpus"})
            assert r.status_code == 201, r.text
            created = r.json()
        job_id = created["id"]
        assert created["spec"]["data_sha256"] is None  # the 201 did not wait for hashing
        wait_until(
            lambda: ((_job(a, job_id) or {}).get("spec") or {}).get("data_sha256"),
            timeout=180, what="the origin pins its data hash",
        )  # fmt: skip
        pinned = _job(a, job_id)
        assert pinned is not None and pinned["spec"]["data_sha256"] == expected

        wait_until(
            lambda: (_job(b, job_id) or {}).get("state") == "failed",
            timeout=180, what="the peer with other data refuses the job",
        )  # fmt: skip
        refused = _job(b, job_id)
        assert refused is not None and refused["spec"]["data_sha256"] == expected
        reason = refused["reason"]
        assert f"the job's data_sha256 is {expected}" in reason, reason
        assert "this peer's copy of the data or its tokenizer differs" in reason, reason
        theirs_sha = reason.split("has sha256 ", 1)[1].split(",", 1)[0]
        assert len(theirs_sha) == 64 and theirs_sha != expected
        # The origin trains on; the refusal is in b's events, with the reason.
        assert (_job(a, job_id) or {}).get("state") == "running"
        with b.client() as c:
            events = c.get("/v1/events", params={"kind": "job.failed"}).json()
        assert any(e["job_id"] == job_id and expected in e["message"] for e in events), events
    finally:
        stop_all(started)
