"""What the emulated links of ``bench swarm`` carry without a daemon: the ceiling for a round.

``python -m atomd_bench link [--kbit 256] [--peers 4] [--frame 13500] [--rounds 8] [--busy N]``
(as root): the swarm benchmark's topology (``atomd_bench.netns``: one namespace a peer, ``tc
tbf`` on each upload), and in each namespace a bare asyncio peer instead of a daemon. Every peer
sends, each round, a frame of ``--frame`` bytes to every other peer over one kept TCP connection
each, the next upload starting once the previous is answered or its bytes should have left at
0.9 of the line's rate (the daemon paces the same way, at the fastest rate it has measured), and
each receiver answers 200 bytes (about an HTTP answer) through its own loaded uplink. Rounds
start every 3 s, each peer's at its own offset within 1.5 s (the daemons' rounds are not
aligned). JSON on stdout: the mean and median of a round's span (the first upload's start to the
last answer), the payload rate that gives, and the packets each uplink dropped. Every process
it starts is stopped and every namespace removed on every way out (SIGTERM included).

A daemon's round at the same link and frame size (``bench swarm``'s ``round_traffic_s_mean``)
minus this span is what its own path costs (TLS, HTTP, its event loop on a busy machine).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

from atomd.launch import die_with_parent, interrupts
from atomd_bench import load, netns
from atomd_bench.netns import Namespaces

PORT = 9100
ANSWER = 200
ROUND_S = 3.0
OFFSET_S = 1.5
START_S = 5.0  # for the peers' Pythons to start (a busy machine) before the agreed start
LEAD_S = 5.0  # from the agreed start to the first round: connections are made meanwhile


async def _peer(me: int, addrs: list[str], frame_bytes: int, rounds: int, t0: float) -> None:
    """One peer: serve the others' uploads, send this peer's rounds, print its spans (JSON).
    It exits on its own once the others' last rounds are done."""

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:
                n = int.from_bytes(await r.readexactly(4), "big")
                await r.readexactly(n)
                w.write(b"x" * ANSWER)
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            w.close()

    server = await asyncio.start_server(serve, addrs[me], PORT)
    await asyncio.sleep(max(0.0, t0 - time.time()))
    conns = {j: await asyncio.open_connection(a, PORT) for j, a in enumerate(addrs) if j != me}
    frame = os.urandom(frame_bytes)
    pace = frame_bytes / (0.9 * 1000 * float(os.environ["LINK_KBIT"]) / 8)

    async def upload(j: int) -> None:
        r, w = conns[j]
        w.write(len(frame).to_bytes(4, "big") + frame)
        await w.drain()
        await r.readexactly(ANSWER)

    rng = random.Random(me)
    spans = []
    for k in range(rounds):
        await asyncio.sleep(max(0.0, t0 + LEAD_S + k * ROUND_S + rng.uniform(0, OFFSET_S)
                                - time.time()))  # fmt: skip
        started = time.monotonic()
        order = sorted(conns, key=lambda j: (j - me - k) % len(addrs))  # first turns
        tasks = []
        for j in order:
            tasks.append(task := asyncio.create_task(upload(j)))
            await asyncio.wait({task}, timeout=pace)
        await asyncio.gather(*tasks)
        spans.append(time.monotonic() - started)
    print(json.dumps({"peer": me, "spans": spans}), flush=True)
    # Stay up to answer the others' last rounds; then every peer closes its connections, which
    # ends the others' serving tasks, before its server goes.
    await asyncio.sleep(max(0.0, t0 + LEAD_S + rounds * ROUND_S + OFFSET_S + 5 - time.time()))
    for _, w in conns.values():
        w.close()
    await asyncio.sleep(1.0)
    server.close()


def _drops(ns: str) -> int:
    out = subprocess.run(
        ["ip", "netns", "exec", ns, "tc", "-s", "-j", "qdisc", "show", "dev", "v0"],
        capture_output=True, text=True, timeout=10, check=True,
    ).stdout  # fmt: skip
    return int(json.loads(out)[0].get("drops", 0))


def run(
    kbit: int = 256, peers: int = 4, frame: int = 13500, rounds: int = 8, busy: int = 0
) -> dict[str, Any]:
    """The link's own round span (see the module docstring); ``busy``: CPU-bound processes
    beside the peers, each in a session of its own (``atomd_bench.load``), as the swarm
    benchmark's 4 daemons are on this machine's 2 cores."""
    if kbit < 1 or peers < 2 or frame < 1 or rounds < 2 or busy < 0:
        raise ValueError("need kbit >= 1, peers >= 2, frame >= 1, rounds >= 2, busy >= 0")
    if os.geteuid() != 0:
        raise SystemExit("bench link needs root (network namespaces and tc)")
    netns.sweep_stale()
    procs: list[subprocess.Popen[str]] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(interrupts())  # SIGTERM unwinds too: every finally runs
        ns = Namespaces(peers, upload_kbit=kbit)
        stack.callback(ns.close)
        stack.enter_context(load.beside(busy, "each", settle_s=0.0))

        @stack.callback
        def _stop() -> None:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()

        addrs = ",".join(ns.address(i) for i in range(peers))
        t0 = time.time() + START_S
        before = [_drops(n) for n in ns.names]
        argv = [sys.executable, "-m", "atomd_bench.link", "--peer"]
        env = {**os.environ, "LINK_KBIT": str(kbit)}
        for i in range(peers):
            command = ns.command(i, [*argv, str(i), addrs, str(frame), str(rounds), repr(t0)])
            procs.append(subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env,
                                          preexec_fn=die_with_parent(os.getpid())))  # fmt: skip
        limit = START_S + LEAD_S + rounds * ROUND_S + OFFSET_S + 60
        outs = []
        for i, p in enumerate(procs):
            out = p.communicate(timeout=limit)[0].splitlines()
            if p.returncode != 0 or not out:
                raise RuntimeError(f"link peer {i} exited {p.returncode} without its spans")
            outs.append(json.loads(out[0]))
        drops = [_drops(n) - b for n, b in zip(ns.names, before, strict=True)]
    spans = [s for o in outs for s in o["spans"][1:]]  # the first round opens the windows
    mean = statistics.fmean(spans)
    return {
        "bench": "link",
        "upload_kbit": kbit,
        "peers": peers,
        "frame_bytes": frame,
        "rounds": rounds,
        "round_span_s_mean": round(mean, 4),
        "round_span_s_median": round(statistics.median(spans), 4),
        "payload_bytes_per_s": round((peers - 1) * frame / mean, 1),
        "line_bytes_per_s": kbit * 1000 / 8,
        "drops_per_peer": drops,
        "busy_processes": busy,
        "load_avg": list(os.getloadavg()),
    }


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--peer"]:
        me, addrs, frame, rounds, t0 = args[1:6]
        asyncio.run(_peer(int(me), addrs.split(","), int(frame), int(rounds), float(t0)))
        return
    p = argparse.ArgumentParser(prog="python -m atomd_bench link", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--kbit", type=int, default=256, help="upload limit per peer (tc tbf)")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--frame", type=int, default=13500, help="bytes of one frame")
    p.add_argument("--rounds", type=int, default=8, help="rounds per peer (the first not counted)")
    p.add_argument("--busy", type=int, default=0,
                   help="CPU-bound processes beside the peers (a busy machine)")  # fmt: skip
    a = p.parse_args(args)
    print(json.dumps(run(a.kbit, a.peers, a.frame, a.rounds, a.busy)))


if __name__ == "__main__":
    main()
