"""Real daemons on loopback forming a swarm: discovery, failure detection, leave, restart,
job propagation, state transfer and peer-plane authentication."""

from __future__ import annotations

import contextlib
import json
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from atomd.launch import (
    READY_TIMEOUT,
    DaemonProcess,
    peer_id,
    peer_view,
    start_swarm,
    stop_all,
    wait_until,
)
from tests.integration.conftest import FAST_JOB

# Several training daemons: one such test at a time under `make test`'s two workers.
pytestmark = pytest.mark.xdist_group("swarm")


def _all_see(daemons: list[DaemonProcess], pid: str, state: str) -> bool:
    return all(peer_view(d).get(pid) == state for d in daemons)


def _states_of(d: DaemonProcess, pid: str) -> list[str]:
    """The state changes ``d`` recorded for member ``pid``, in order (its events)."""
    with contextlib.closing(sqlite3.connect(d.data_dir / "atomd.db")) as db:
        rows = db.execute("SELECT kind FROM events WHERE peer_id = ? AND kind LIKE 'peer.%' "
                          "ORDER BY id", (pid,)).fetchall()  # fmt: skip
    return [k for (k,) in rows]


@pytest.fixture
def swarm(tmp_path: Path) -> Any:
    started: list[DaemonProcess] = []

    def make(n: int, **kw: Any) -> list[DaemonProcess]:
        return start_swarm(tmp_path, n, started=started, **kw)

    yield make
    stop_all(started)


def test_membership_of_eight_daemons(swarm: Any, tmp_path: Path) -> None:
    ds = swarm(8)
    ids = [peer_id(d) for d in ds]
    # The timings are recorded, not bounded here: ``python -m atomd_bench membership`` measures
    # them (a bound on the clock fails on a busy machine: see "left" below). The bounds are
    # READY_TIMEOUT, what a failure needs.
    formed = wait_until(
        lambda: all(peer_view(d) == dict.fromkeys(ids, "alive") for d in ds),
        timeout=READY_TIMEOUT, what="8 daemons see 8 alive",
    )  # fmt: skip
    timings = {"formed_s": formed}

    # SIGTERM: marked left everywhere, from the leaver's own signed notice (sent to each,
    # then gossiped), never found dead by failure detection. No bound on the clock: the 8
    # daemons on 2 busy cores (load 6) took 1.3 s in one run and 2.9 s in the next, where a
    # 2 s bound failed the test although every peer went alive -> left.
    leaver, others = ds[3], [d for d in ds if d is not ds[3]]
    t0 = time.monotonic()
    leaver.signal(signal.SIGTERM)
    wait_until(lambda: _all_see(others, ids[3], "left"), timeout=READY_TIMEOUT, what="left")
    timings["left_s"] = time.monotonic() - t0
    assert leaver.wait(timeout=30) == 0
    wait_until(lambda: all(_states_of(d, ids[3])[-1:] == ["peer.left"] for d in others),
               timeout=READY_TIMEOUT, what="left recorded")  # fmt: skip
    for d in others:  # never found dead: the notice came before failure detection could tell
        assert "peer.dead" not in _states_of(d, ids[3]), (d.name, _states_of(d, ids[3]))

    # Restarted: alive again everywhere, with the same id.
    t0 = time.monotonic()
    leaver.start()
    assert peer_id(leaver) == ids[3]
    wait_until(lambda: _all_see(ds, ids[3], "alive"), timeout=READY_TIMEOUT, what="back alive")
    timings["rejoined_s"] = time.monotonic() - t0

    # SIGKILL of the seed: dead everywhere; the rest carry on (none found dead or gone).
    seed, rest = ds[0], ds[1:]
    t0 = time.monotonic()
    seed.signal(signal.SIGKILL)
    seed.wait(timeout=10)
    wait_until(lambda: _all_see(rest, ids[0], "dead"), timeout=READY_TIMEOUT, what="seed dead")
    timings["dead_s"] = time.monotonic() - t0
    views = [peer_view(d) for d in rest]
    assert all(v[i] in ("alive", "suspect") for v in views for i in ids[1:]), views

    # With its seed dead, a restarted daemon still joins through a peer it remembers.
    late = ds[5]
    late.stop()
    late.start()
    wait_until(lambda: _all_see(rest, ids[5], "alive"), timeout=READY_TIMEOUT,
               what="rejoin, seed dead")  # fmt: skip
    assert "could not join through " + seed.peer_url in late.log()

    events = (
        sqlite3.connect(ds[1].data_dir / "atomd.db")
        .execute("SELECT kind FROM events WHERE peer_id = ?", (ids[0],))
        .fetchall()
    )
    assert ("peer.dead",) in events  # state changes are recorded
    (tmp_path / "membership_timings.json").write_text(json.dumps(timings))
    print("membership timings:", timings)


def test_jobs_spread_to_the_swarm_and_newcomers_fetch_the_state(swarm: Any, daemons: Any) -> None:
    ds = swarm(3)
    a = ds[0]
    with a.client() as c:
        job = c.post("/v1/jobs", json={**FAST_JOB, "max_steps": 100000}).json()
        assert job["scope"] == "swarm"
    jid = job["id"]

    def job_of(d: DaemonProcess) -> dict[str, Any] | None:
        r = httpx.get(f"{d.url}/v1/jobs/{jid}", timeout=5)
        return dict(r.json()) if r.status_code == 200 else None

    # Each joins, then waits for its trainer (torch imported, model built) and a donor's answer:
    # 4 s on a quiet machine, over 30 s in CI beside another swarm's test (the xdist group had
    # not taken: tests/conftest.py). The bound is generous (it only matters on a failure); a
    # job that ends instead fails at once.
    wait_until(
        lambda: all((j := job_of(d)) and j["state"] != "pending" for d in ds),
        timeout=READY_TIMEOUT, what="all three leave pending",
    )  # fmt: skip
    assert [(job_of(d) or {}).get("state") for d in ds] == ["running"] * 3
    assert job_of(ds[1])["origin"] == peer_id(a)  # type: ignore[index]
    wait_until(lambda: (job_of(a) or {}).get("step", 0) >= 12, timeout=READY_TIMEOUT, what="steps")

    # A newcomer joins the running job from the donors' newest checkpoint, not from scratch.
    newcomer = daemons("late", extra_args=["--peer", a.peer_url])  # stopped at the end too
    ds.append(newcomer.start())
    wait_until(
        lambda: (j := job_of(newcomer)) and j["step"] > 0, timeout=READY_TIMEOUT, what="joined"
    )
    with newcomer.client() as c:
        first = c.get(f"/v1/jobs/{jid}/progress").json()[0]["step"]
    assert first > 5  # it started from a transferred checkpoint
    ckpts = list((newcomer.data_dir / "jobs" / jid / "checkpoints").iterdir())
    assert not [p for p in ckpts if p.name.startswith(".incoming")]

    # Stopping swarm-wide stops every copy, also that of a member asleep (SIGSTOP) until the
    # others held it dead, which the stop skipped: it is told again once it is heard training
    # the job (before, it woke up and trained on alone to the end), by the members that heard
    # the origin's signed stop, here with the origin itself gone by then.
    asleep, awake = ds[2], [d for d in ds if d is not ds[2]]
    sleeper, origin = peer_id(asleep), peer_id(a)[:12]
    asleep.signal(signal.SIGSTOP)
    try:
        wait_until(lambda: peer_view(a).get(sleeper) == "dead", timeout=READY_TIMEOUT,
                   what="the sleeper held dead")  # fmt: skip
        with a.client() as c:
            assert c.post(f"/v1/jobs/{jid}/stop", params={"scope": "swarm"}).status_code == 200
        wait_until(
            lambda: all((job_of(d) or {}).get("state") == "stopped" for d in awake),
            timeout=READY_TIMEOUT, what="all awake stopped",
        )  # fmt: skip
        a.stop()  # the origin is gone before the sleeper wakes
    finally:
        asleep.signal(signal.SIGCONT)
    wait_until(lambda: (job_of(asleep) or {}).get("state") == "stopped", timeout=READY_TIMEOUT,
               what="the sleeper stopped")  # fmt: skip
    assert f"stopped by the swarm (peer {origin})" == (job_of(ds[1]) or {})["reason"]
    assert f"stopped by the swarm (peer {origin}, told by peer" in (job_of(asleep) or {})["reason"]
    assert any(f"stopped swarm-wide by {origin}: telling it again" in d.log() for d in ds[1:])


def test_peer_plane_refuses_strangers_and_records_it(swarm: Any, tmp_path: Path) -> None:
    ds = swarm(2, env={"ATOMD_SWARM_SECRET": "right"})
    a = ds[0]
    r = httpx.post(a.peer_url + "/p2p/v1/ping", json={"from": {}}, timeout=5, verify=False)
    assert r.status_code == 401 and r.json()["error"] == "unauthorized"

    intruder = DaemonProcess(
        tmp_path / "intruder", env={"ATOMD_SWARM_SECRET": "wrong"},
        extra_args=["--peer", a.peer_url],
    ).start()  # fmt: skip
    try:
        # Its join is refused (the log says so at each try), and changes nothing.
        wait_until(lambda: "403" in intruder.log(), timeout=READY_TIMEOUT,
                   what="the intruder refused")  # fmt: skip
        assert peer_id(intruder) not in peer_view(a)
    finally:
        intruder.stop()
    for _ in range(50):  # refusals are counted, not written a row each
        httpx.post(a.peer_url + "/p2p/v1/ping", content=b"x" * 1000, timeout=5, verify=False)
    a.stop()  # writes what was counted since the last minute's event
    rows = (
        sqlite3.connect(a.data_dir / "atomd.db")
        .execute("SELECT message FROM events WHERE kind = 'auth.rejected'")
        .fetchall()
    )
    assert 1 <= len(rows) <= 3, rows
    text = " ".join(m for (m,) in rows)
    assert "peer 401" in text and "peer 403" in text, text
