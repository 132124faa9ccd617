"""A hostile member (its own valid key, admitted to the swarm) against two honest daemons.

It joins with signed requests, then sends well-formed, correctly signed delta frames that carry
poison: every value 5.0, in the job's codec (top-k) and in another (fp32, the attack of issue
#15 that took the honest loss 2.75 -> 11.48). The honest peers must refuse them, quarantine the
sender (403 before decoding), train on with a loss below the untrained model's at every
validation until the swarm's job is stopped, and checkpoint a model that is not poisoned. Then the
operator bans and unbans its key (CLI and REST)."""

from __future__ import annotations

import asyncio
import math
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file

from atomd.launch import (
    READY_TIMEOUT,
    DaemonProcess,
    free_port,
    peer_id,
    start_swarm,
    stop_all,
    wait_until,
)
from atomd.model.presets import get_preset
from atomd.p2p import paths
from atomd.p2p.client import PeerClient
from atomd.p2p.identity import Identity
from atomd.p2p.messages import (
    Ack,
    DeltaAccepted,
    Gossip,
    JoinReply,
    MemberRecord,
    StopJob,
    StopNotice,
    sign_record,
    sign_stop,
)
from atomd.p2p.signing import Admission
from atomd.sync.codecs import Encoded, make_codec
from atomd.sync.wire import encode_frame
from tests.integration.conftest import FAST_JOB, restarted_while_database_held

# Several training daemons: one such test at a time under `make test`'s two workers.
pytestmark = pytest.mark.xdist_group("swarm")

JOB = {
    **FAST_JOB,
    "max_steps": 5000,  # stopped once the checks are done: it must not end before they are
    "eval_interval": 20,
    "checkpoint_interval": 20,
    "sync": {"every": 5, "codec": "topk"},
    # Every validation from the attack on is checked, and at the tiny preset's 3e-3 a job of
    # 4 x 32 bytes a step spikes on its own, with no swarm at all: a lone job's validation
    # reached 10.1 at step 10 and 9.0 at step 15 (2 of 8 seeds, warm-up 2 or 20). At 1e-3 it
    # still does now and then: one process without any sync, 8 seeds, validations every 5
    # steps up to 40, reached 5.78 at step 15 in one (training loss 6.75), 4.16 in another.
    "lr": 1e-3,
}
UNTRAINED = math.log(256)  # nats per byte of a model that knows nothing (5.55)


class Hostile:
    """A member of the swarm with a valid key that sends poison."""

    def __init__(self) -> None:
        self.last_error = ""  # of the last refused send
        self.identity = Identity.generate()
        self.url = f"https://127.0.0.1:{free_port()}"  # nobody answers there: it never gossips
        self.record = sign_record(MemberRecord(
            id=self.identity.peer_id, url=self.url, public_key=self.identity.public_key_hex,
            state="alive", incarnation=1,
        ), self.identity, "default")  # fmt: skip

    def _client(self) -> PeerClient:
        return PeerClient(self.identity, Admission("default", None, frozenset()), timeout=30)

    def join(self, d: DaemonProcess, target: str) -> int:
        """A signed join; the HTTP status (200, or the refusal's)."""

        async def go() -> int:
            async with self._client() as c:
                try:
                    await c.post(d.peer_url, paths.JOIN, Gossip(sender=self.record), JoinReply,
                                 target=target)  # fmt: skip
                    return 200
                except Exception as e:
                    return int(getattr(e, "status", None) or 0)

        return asyncio.run(go())

    def send(self, d: DaemonProcess, target: str, frame: bytes) -> int:
        """POST one frame; the HTTP status (202 accepted, 4xx refused)."""

        async def go() -> int:
            async with self._client() as c:
                try:
                    await c.post_bytes(d.peer_url, paths.job_deltas(JOB_ID[0]), frame,
                                       DeltaAccepted, target=target)  # fmt: skip
                    return 202
                except Exception as e:
                    self.last_error = str(e)
                    return int(getattr(e, "status", None) or 0)

        return asyncio.run(go())

    def stop(self, d: DaemonProcess, target: str, notice: StopNotice) -> int:
        """Pass ``notice`` on to ``d`` as a member that kept it would; the HTTP status."""

        async def go() -> int:
            async with self._client() as c:
                try:
                    msg = StopJob(sender=self.record, notice=notice)
                    await c.post(d.peer_url, paths.job_stop(notice.job_id), msg, Ack, target=target)
                    return 200
                except Exception as e:
                    self.last_error = str(e)
                    return int(getattr(e, "status", None) or 0)

        return asyncio.run(go())

    def frame(self, job_id: str, base_version: int, codec: str, round: int = -1) -> bytes:
        enc = make_codec(codec, topk_fraction=0.01)
        tensors: list[tuple[str, Encoded]] = [
            (name, enc.encode(torch.full(shape, 5.0))) for name, shape in SHAPES.items()
        ]
        rnd = base_version if round < 0 else round
        return encode_frame(identity=self.identity, job_id=job_id, round=rnd,
                            base_version=base_version, tensors=tensors)  # fmt: skip


JOB_ID: list[str] = []
SHAPES: dict[str, tuple[int, ...]] = {}


def _rounds(d: DaemonProcess, jid: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{d.url}/v1/jobs/{jid}/rounds", timeout=10)
    return list(r.json()) if r.status_code == 200 else []


def _peer(d: DaemonProcess, pid: str) -> dict[str, Any]:
    rows = httpx.get(f"{d.url}/v1/peers", timeout=10).json()
    return next((p for p in rows if p["id"] == pid), {})


def _job(d: DaemonProcess, jid: str) -> dict[str, Any]:
    return dict(httpx.get(f"{d.url}/v1/jobs/{jid}", timeout=10).json())


def _story(d: DaemonProcess) -> str:
    """What the daemon's log says of its job (steps, rounds, merges, warnings): the evidence
    a failed assertion on its losses needs."""
    keep = ("step ", "round ", "refused", "WARNING", "fetched", "continues", "final model")
    lines = d.log_path.read_text(errors="replace").splitlines()
    return "\n".join(ln for ln in lines if any(k in ln for k in keep))[-6000:]


def test_hostile_member_is_refused_quarantined_and_banned(tmp_path: Path) -> None:
    from atomd.engine_choice import build_model

    cfg = get_preset("tiny")
    SHAPES.update({n: tuple(p.shape) for n, p in build_model(cfg, 0).named_parameters()})
    started: list[DaemonProcess] = []
    try:
        honest = start_swarm(tmp_path, 2, started=started)
        ids = [peer_id(d) for d in honest]
        wait_until(lambda: all(len(httpx.get(d.url + "/v1/peers").json()) == 2 for d in honest),
                   timeout=READY_TIMEOUT, what="the honest peers know each other")  # fmt: skip
        evil = Hostile()
        for d, pid in zip(honest, ids, strict=True):
            assert evil.join(d, pid) == 200
        assert all(_peer(d, evil.identity.peer_id) for d in honest), "the member was admitted"

        jid = httpx.post(f"{honest[0].url}/v1/jobs", json=JOB, timeout=60).json()["id"]
        JOB_ID.append(jid)
        wait_until(lambda: all(_job(d, jid).get("state") == "running" for d in honest),
                   timeout=120, what="both train")  # fmt: skip

        def closed(d: DaemonProcess) -> int:
            sent = [r["round"] for r in _rounds(d, jid) if r["direction"] == "sent"]
            return max(sent, default=-1)

        wait_until(lambda: min(closed(d) for d in honest) >= 0, timeout=300, what="a round")
        statuses: list[int] = []
        sent_versions: set[tuple[int, int]] = set()
        attacked_at: dict[str, int] = {}  # each honest peer's step when its first frame was sent

        def attack() -> bool:
            """Poison every honest peer: a frame in another codec, then frames for the rounds
            just ahead of its own (each judged when the peer closes that round); True once both
            have quarantined the attacker (their refusals say so)."""
            done = True
            for i, (d, pid) in enumerate(zip(honest, ids, strict=True)):
                if _peer(d, evil.identity.peer_id).get("excluded") == "quarantined":
                    continue
                # Tiny rounds close every ~0.3 s: one that ended before the three strikes
                # landed would leave nothing to refuse them in (say so, not a 600 s wait).
                assert _job(d, jid)["state"] == "running", f"{d.name} finished first"
                done = False
                v = closed(d)
                attacked_at.setdefault(d.name, _job(d, jid)["step"])
                if (i, -1) not in sent_versions:  # once, first: another codec is a strike at once
                    sent_versions.add((i, -1))
                    statuses.append(evil.send(d, pid, evil.frame(jid, v + 1, "fp32", round=v + 7)))
                for base in (v + 1, v + 2):  # then two the merge refuses: the third strike
                    if (i, base) in sent_versions:
                        continue
                    sent_versions.add((i, base))
                    statuses.append(evil.send(d, pid, evil.frame(jid, base, "topk")))
            return done

        wait_until(attack, timeout=600, interval=1.0, what="the attacker quarantined by both")
        assert 202 in statuses, "the top-k frames pass the wire checks: the merge refuses them"
        # Each daemon's /metrics says how long its checks held the answers to the uploads.
        for d in honest:
            text = httpx.get(f"{d.url}/metrics", timeout=10).text
            held = re.search(r"^atomd_sync_answer_held_seconds_count (\S+)$", text, re.M)
            assert held is not None and float(held.group(1)) >= 1, text[-2000:]
        for d in honest:
            p = _peer(d, evil.identity.peer_id)
            assert p["excluded"] == "quarantined" and "refused" in p["excluded_reason"], p
            refused = [r for r in _rounds(d, jid)
                       if r["peer_id"] == evil.identity.peer_id and not r["applied"]]  # fmt: skip
            reasons = " ".join(r["reason"] or "" for r in refused)
            assert "outlier" in reasons and "wrong_codec" in reasons, reasons
            applied = [r for r in _rounds(d, jid)
                       if r["peer_id"] == evil.identity.peer_id and r["applied"]]  # fmt: skip
            assert applied == [], "no poisoned delta was merged"
            # Quarantined: refused before decoding.
            status = evil.send(d, ids[honest.index(d)], evil.frame(jid, closed(d), "topk"))
            assert status == 403, (status, evil.last_error)

        # Both train on, 40 steps (two validations) past the attack, then the swarm stops.
        goal = {d.name: _job(d, jid)["step"] + 40 for d in honest}
        wait_until(lambda: all(_job(d, jid)["step"] >= goal[d.name] for d in honest),
                   timeout=600, interval=1.0, what="both train on")  # fmt: skip
        stop = httpx.post(f"{honest[0].url}/v1/jobs/{jid}/stop", params={"scope": "swarm"})
        assert stop.status_code == 200, stop.text
        wait_until(lambda: all(_job(d, jid)["state"] == "stopped" for d in honest),
                   timeout=300, interval=1.0, what="both stop")  # fmt: skip
        for d in honest:
            job = _job(d, jid)
            points = httpx.get(f"{d.url}/v1/jobs/{jid}/progress", timeout=10).json()
            # The validations from the attack on: the poison's effect. Not the ones before it:
            # the first steps spike on their own now and then (see JOB; here 2 of 30 runs gave
            # a first validation of 4.9 and 5.2, both before any frame was sent; CI once 7.9).
            since = attacked_at[d.name]
            vals = [(p["step"], p["val_loss"]) for p in points
                    if p.get("val_loss") is not None and p["step"] >= since]  # fmt: skip
            assert vals and all(math.isfinite(v) and v < UNTRAINED - 0.5 for _, v in vals), (
                f"{d.name}, attacked from step {since}: validations {vals}\n{_story(d)}"
            )
            assert job["val_loss"] < UNTRAINED - 0.5, job
            print(f"honest {d.name}: val {job['val_loss']:.4f} at step {job['step']}")
            ckpts = sorted((d.data_dir / "jobs" / jid / "checkpoints").glob("step-*"))
            assert ckpts, "checkpoints were written"
            model = load_file(str(ckpts[-1] / "model.safetensors"))
            worst = max(float(t.float().abs().max()) for t in model.values())
            assert math.isfinite(worst) and worst < 4.0, f"{ckpts[-1]}: max |w| {worst}"

        # The operator bans the key (CLI), the peer plane refuses it, then lifts it (REST).
        a, key = honest[0], evil.identity.public_key_hex
        out = subprocess.run(
            [sys.executable, "-m", "atomd", "ban", key, "--reason", "poisoned deltas",
             "--url", a.url], capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        p = _peer(a, evil.identity.peer_id)
        assert p["excluded"] == "banned" and p["public_key"] == key
        assert [b["public_key"] for b in httpx.get(a.url + "/v1/bans").json()] == [key]
        assert evil.join(a, ids[0]) == 403, "a banned key is refused on the whole peer plane"
        assert httpx.delete(f"{a.url}/v1/bans/{key}").status_code == 204
        assert httpx.get(a.url + "/v1/bans").json() == []
        assert _peer(a, evil.identity.peer_id).get("excluded") is None, "unbanned: no quarantine"
        assert evil.join(a, ids[0]) == 200
    finally:
        stop_all(started)


def test_a_ban_holds_from_the_first_answer_after_a_restart(tmp_path: Path) -> None:
    """A restarted daemon refuses a banned key from its peer plane's first answer. The bans
    were loaded as the swarm started, after the daemon was ready: meanwhile (0.3 s or more on
    a busy host, as long as it took to take up an interrupted job) a banned key's join was
    answered. The test widens that window: the daemon is SIGKILLed during a job and restarts
    while a writer holds its database, so it cannot take the job up."""
    d = DaemonProcess(tmp_path / "d0").start()
    try:
        evil = Hostile()
        target = peer_id(d)
        r = httpx.post(f"{d.url}/v1/bans", json={"public_key": evil.identity.public_key_hex},
                       timeout=10)  # fmt: skip
        assert r.status_code == 201, r.text
        jid = httpx.post(f"{d.url}/v1/jobs", json={**FAST_JOB, "max_steps": 100000},
                         timeout=60).json()["id"]  # fmt: skip
        wait_until(lambda: _job(d, jid).get("step", 0) >= 1, timeout=READY_TIMEOUT,
                   what="a step")  # fmt: skip
        d.signal(signal.SIGKILL)
        d.wait(timeout=30)

        with restarted_while_database_held(d) as first:
            assert first.status_code == 503, first.text  # not ready: the window is open
            assert evil.join(d, target) == 403, "a banned key is refused while starting"
        d.wait_ready()
        assert evil.join(d, target) == 403
    finally:
        d.stop()


def test_a_kept_stop_ends_no_copy_of_a_later_run(tmp_path: Path) -> None:
    """An origin stops its job swarm-wide and resumes it: a new run (``StopNotice.run``). A
    member that kept the origin's signed stop of the first run passes it to a daemon that
    joined the new run; that daemon answers 409 and trains on (before, it stopped, for good: a
    peer never rejoins a job it had). The origin's stop of the new run, passed on the same way,
    stops it; when the origin resumes the job again, the copy the swarm stopped goes on in
    that run."""
    started: list[DaemonProcess] = []
    try:
        origin = start_swarm(tmp_path, 1, started=started)[0]
        jid = httpx.post(f"{origin.url}/v1/jobs", json=JOB, timeout=60).json()["id"]
        wait_until(lambda: _job(origin, jid).get("state") == "running", timeout=READY_TIMEOUT,
                   what="the origin trains")  # fmt: skip
        stop = httpx.post(f"{origin.url}/v1/jobs/{jid}/stop", params={"scope": "swarm"})
        assert stop.status_code == 200, stop.text
        wait_until(lambda: _job(origin, jid).get("state") == "stopped", timeout=READY_TIMEOUT,
                   what="the origin stopped")  # fmt: skip
        resumed = httpx.post(f"{origin.url}/v1/jobs/{jid}/resume", timeout=60)
        assert resumed.is_success, resumed.text
        joiner = DaemonProcess(tmp_path / "joiner", extra_args=["--peer", origin.peer_url])
        started.append(joiner)
        joiner.start()
        wait_until(lambda: _job(joiner, jid).get("step", 0) > 0, timeout=READY_TIMEOUT,
                   what="the joiner trains the new run")  # fmt: skip
        target = peer_id(joiner)
        evil = Hostile()
        assert evil.join(joiner, target) == 200
        key = Identity.load_or_create(origin.data_dir)  # what the first run's members heard
        assert evil.stop(joiner, target, sign_stop(jid, key, "default", run=0)) == 409
        assert "run 0" in evil.last_error and "run 1" in evil.last_error, evil.last_error
        step = _job(joiner, jid)["step"]
        wait_until(lambda: _job(joiner, jid)["step"] > step + 5, timeout=READY_TIMEOUT,
                   what="the joiner trains on")  # fmt: skip
        assert _job(joiner, jid)["state"] == "running" and _job(joiner, jid)["run"] == 1
        assert evil.stop(joiner, target, sign_stop(jid, key, "default", run=1)) == 200
        wait_until(lambda: _job(joiner, jid).get("state") == "stopped", timeout=READY_TIMEOUT,
                   what="the joiner stopped")  # fmt: skip
        told = f"told by peer {evil.identity.peer_id[:12]}"
        assert told in str(_job(joiner, jid)["reason"])
        # The origin stops run 1 and resumes the job again: the copy the swarm stopped here
        # goes on in run 2 (it had the job, so it never joined it again before runs).
        stop = httpx.post(f"{origin.url}/v1/jobs/{jid}/stop", params={"scope": "swarm"})
        assert stop.status_code == 200, stop.text
        wait_until(lambda: _job(origin, jid).get("state") == "stopped", timeout=READY_TIMEOUT,
                   what="the origin stopped again")  # fmt: skip
        resumed = httpx.post(f"{origin.url}/v1/jobs/{jid}/resume", timeout=60)
        assert resumed.is_success and resumed.json()["run"] == 2, resumed.text
        step = _job(joiner, jid)["step"]
        wait_until(lambda: _job(joiner, jid)["run"] == 2 and _job(joiner, jid)["step"] > step,
                   timeout=READY_TIMEOUT, what="the copy trains run 2")  # fmt: skip
        assert _job(joiner, jid)["state"] == "running"
    finally:
        stop_all(started)
