"""``python -m atomd_bench attack``: real daemons against one hostile member (issue #15).

A first part of the issue's menu. Two honest daemons on loopback train the tiny GPT together
(top-k, H = 5); a hostile member with its own valid key joins them with signed requests and
runs one attack per run:

- ``none``: it joins and stays silent (the reference);
- ``const``: every round, correctly signed top-k frames whose every value is 5.0;
- ``fp32``: the same in dense fp32 (the attack that took the loss 2.75 -> 11.48 before #15);
- ``farfuture``: frames claiming round and base version 10^9 (must not change the pace);
- ``gossip``: membership lies about an honest member (left and dead, at the largest
  incarnation, with the attacker's URL), each round;
- ``flood``: 2 GB of unauthenticated bodies and 5,000 unsigned requests.

Reported per attack: each honest peer's final validation loss and its ratio to ``none``, the
rounds it closed, whether a daemon crashed, the largest |weight| of its last checkpoint, what
happened to the attacker's requests (HTTP statuses), how the honest peers list it, and for the
flood the resident memory before and after, events rows and /healthz latency.
Missing from the menu: honest deltas scaled by 10/100/1e30, sign-flipped, noise, stale rounds
and replays (see ``bench/robust_sim.py`` for the scaled, flipped and noise deltas in one
process, and the unit tests for replays and staleness).
"""

from __future__ import annotations

import asyncio
import json
import math
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from atomd.engines import build_model
from atomd.launch import DaemonProcess, peer_id, start_swarm, stop_all, wait_until
from atomd.model.presets import get_preset
from atomd.p2p import paths
from atomd.p2p.client import PeerClient
from atomd.p2p.identity import Identity
from atomd.p2p.messages import (
    MAX_COUNTER,
    DeltaAccepted,
    Gossip,
    JoinReply,
    MemberRecord,
    sign_record,
)
from atomd.p2p.signing import Admission
from atomd.sync.codecs import Encoded, make_codec
from atomd.sync.wire import encode_frame

ATTACKS = ("none", "const", "fp32", "farfuture", "gossip", "flood")
JOB: dict[str, Any] = {
    "preset": "tiny", "seq_len": 32, "micro_batch_size": 4, "eval_batches": 2,
    "eval_interval": 20, "log_interval": 1, "checkpoint_interval": 20, "warmup_steps": 2,
    "max_steps": 120, "sync": {"every": 5, "codec": "topk"},
}  # fmt: skip


class _Hostile:
    def __init__(self) -> None:
        self.identity = Identity.generate()
        url = "http://127.0.0.1:9"  # nobody answers there
        record = MemberRecord(id=self.identity.peer_id, url=url,
                              public_key=self.identity.public_key_hex, state="alive",
                              incarnation=1)  # fmt: skip
        self.record = sign_record(record, self.identity, "default")
        self.statuses: dict[str, int] = {}

    def _call(self, coro_fn: Any) -> None:
        async def go() -> None:
            async with PeerClient(self.identity, Admission("default", None, frozenset()),
                                  timeout=30) as c:  # fmt: skip
                try:
                    await coro_fn(c)
                    status = "2xx"
                except Exception as e:
                    status = str(getattr(e, "status", None) or type(e).__name__)
                self.statuses[status] = self.statuses.get(status, 0) + 1

        asyncio.run(go())

    def join(self, d: DaemonProcess, target: str, msg: Gossip | None = None) -> None:
        m = msg or Gossip(sender=self.record)
        self._call(lambda c: c.post(d.peer_url, paths.JOIN, m, JoinReply, target=target))

    def send(self, d: DaemonProcess, target: str, job_id: str, frame: bytes) -> None:
        self._call(lambda c: c.post_bytes(d.peer_url, paths.job_deltas(job_id), frame,
                                          DeltaAccepted, target=target))  # fmt: skip

    def frame(self, job_id: str, shapes: dict[str, tuple[int, ...]], base: int, codec: str,
              rnd: int | None = None) -> bytes:  # fmt: skip
        enc = make_codec(codec, topk_fraction=0.01)
        tensors: list[tuple[str, Encoded]] = [
            (n, enc.encode(torch.full(s, 5.0))) for n, s in shapes.items()
        ]
        return encode_frame(identity=self.identity, job_id=job_id,
                            round=base if rnd is None else rnd, base_version=base,
                            tensors=tensors)  # fmt: skip


def _get(url: str) -> Any:
    return httpx.get(url, timeout=10).json()


def _rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _flood(d: DaemonProcess) -> dict[str, Any]:
    out: dict[str, Any] = {"rss_before_mb": _rss_mb(d.pid)}

    def big() -> Any:
        for _ in range(200):
            yield b"x" * (1 << 20)

    codes: list[str] = []
    for target in (d.url + "/v1/jobs", d.peer_url + paths.PING):
        for declared in (True, False):
            for _ in range(5):
                headers = {"Content-Length": str(200 << 20)} if declared else {}
                try:
                    r = httpx.post(target, content=big(), headers=headers, timeout=30)
                    codes.append(str(r.status_code))
                except httpx.HTTPError as e:
                    codes.append(type(e).__name__)
    out["big_bodies"] = {c: codes.count(c) for c in sorted(set(codes))}
    latencies: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client() as c:
            while not stop.is_set():
                t = time.perf_counter()
                c.get(d.url + "/healthz")
                latencies.append((time.perf_counter() - t) * 1000)
                time.sleep(0.02)

    th = threading.Thread(target=probe)
    th.start()
    codes = []
    with httpx.Client() as c:
        for _ in range(5000):
            r = c.post(d.peer_url + paths.PING, content=b"{}", headers={"X-Pad": "p" * 8000})
            codes.append(str(r.status_code))
    stop.set()
    th.join()
    out["unsigned_5000"] = {c: codes.count(c) for c in sorted(set(codes))}
    out["healthz_ms_median"] = round(statistics.median(latencies), 2) if latencies else None
    out["rss_after_mb"] = _rss_mb(d.pid)
    return out


def _one(attack: str, root: Path, max_steps: int) -> dict[str, Any]:
    shapes = {n: tuple(p.shape) for n, p in build_model(get_preset("tiny"), 0).named_parameters()}
    started: list[DaemonProcess] = []
    res: dict[str, Any] = {"attack": attack}
    try:
        honest = start_swarm(root, 2, started=started)
        ids = [peer_id(d) for d in honest]
        wait_until(lambda: all(len(_get(d.url + "/v1/peers")) >= 2 for d in honest), timeout=60)
        evil = _Hostile()
        for d, pid in zip(honest, ids, strict=True):
            evil.join(d, pid)
        job = {**JOB, "max_steps": max_steps}
        jid = httpx.post(f"{honest[0].url}/v1/jobs", json=job, timeout=60).json()["id"]
        if attack == "flood":
            res["flood"] = _flood(honest[0])
        sent: set[tuple[int, int]] = set()
        t0 = time.time()
        while time.time() - t0 < 1800:
            jobs = [_get(f"{d.url}/v1/jobs/{jid}") for d in honest]
            if all(j.get("state") in ("finished", "failed") for j in jobs):
                break
            if not all(d.running() for d in honest):
                break
            for i, (d, pid) in enumerate(zip(honest, ids, strict=True)):
                rounds = _get(f"{d.url}/v1/jobs/{jid}/rounds")
                v = max([r["round"] for r in rounds if r["direction"] == "sent"], default=-1)
                if v < 0 or (i, v) in sent:
                    continue
                sent.add((i, v))
                if attack == "const":
                    evil.send(d, pid, jid, evil.frame(jid, shapes, v + 1, "topk"))
                elif attack == "fp32":
                    evil.send(d, pid, jid, evil.frame(jid, shapes, v + 1, "fp32"))
                elif attack == "farfuture":
                    evil.send(d, pid, jid, evil.frame(jid, shapes, 10**9, "topk", 10**9 + v))
                elif attack == "gossip":
                    victim = next(p for p in _get(d.url + "/v1/peers") if p["id"] == ids[1 - i])
                    for state in ("left", "dead"):
                        lie = MemberRecord(id=victim["id"], url="http://127.0.0.1:9",
                                           public_key=victim["public_key"], state=state,
                                           incarnation=MAX_COUNTER)  # fmt: skip
                        evil.join(d, pid, Gossip(sender=evil.record, updates=[lie]))
            time.sleep(1.0)
        res["crashed"] = [not d.running() for d in honest]
        res["honest"] = []
        for d in honest:
            j = _get(f"{d.url}/v1/jobs/{jid}")
            ck = sorted((d.data_dir / "jobs" / jid / "checkpoints").glob("step-*"))
            worst = None
            if ck:
                from safetensors.torch import load_file

                model = load_file(str(ck[-1] / "model.safetensors"))
                worst = round(max(float(t.float().abs().max()) for t in model.values()), 3)
            rounds = [r for r in _get(f"{d.url}/v1/jobs/{jid}/rounds") if r["direction"] == "sent"]
            res["honest"].append({
                "state": j.get("state"), "step": j.get("step"), "val_loss": j.get("val_loss"),
                "rounds_closed": len({r["round"] for r in rounds}), "ckpt_max_abs_w": worst,
                "view_of_attacker": next((p.get("excluded") for p in _get(d.url + "/v1/peers")
                                          if p["id"] == evil.identity.peer_id), None),
                "view_of_the_other": {p["id"][:8]: p["state"] for p in _get(d.url + "/v1/peers")
                                      if p["id"] in ids},
            })  # fmt: skip
        res["attacker_statuses"] = evil.statuses
    finally:
        stop_all(started)
    for d in started[:1]:
        db = sqlite3.connect(d.data_dir / "atomd.db")
        res["events_rows"] = db.execute("SELECT count(*) FROM events").fetchone()[0]
        db.close()
    return res


def run(*, attacks: tuple[str, ...] = ATTACKS, max_steps: int = 120) -> dict[str, Any]:
    results = []
    with tempfile.TemporaryDirectory(prefix="atomd-attack-") as tmp:
        for attack in attacks:
            r = _one(attack, Path(tmp) / attack, max_steps)
            results.append(r)
            print(f"[attack] {attack}: {json.dumps(r['honest'])[:300]}", file=sys.stderr,
                  flush=True)  # fmt: skip
    ref = [h["val_loss"] for h in results[0]["honest"]] if results[0]["attack"] == "none" else []
    for r in results:
        vals = [h["val_loss"] for h in r["honest"]]
        if ref and all(v is not None and math.isfinite(v) for v in vals):
            r["val_ratio_to_none"] = [round(v / w, 4) for v, w in zip(vals, ref, strict=True)]
    return {"max_steps": max_steps, "results": results}
