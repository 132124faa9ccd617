"""Quarantine of repeat offenders, operator bans, per-sender inbox bounds, the job's codec."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from atomd.errors import WireError
from atomd.p2p.identity import Identity
from atomd.p2p.quarantine import Quarantine
from atomd.sync.codecs import make_codec
from atomd.sync.frame_decoder import FrameDecoder, check_codec
from atomd.sync.inbox import Inbox
from atomd.sync.intake import Contribution
from atomd.sync.wire import encode_frame

KEY_A, KEY_B = "aa" * 32, "bb" * 32


def _q(now: list[float]) -> Quarantine:
    keys = {"a": KEY_A, "b": KEY_B}
    return Quarantine(strikes=3, window=5, hold_s=100.0, key_of=keys.get, clock=lambda: now[0])


def test_three_strikes_in_the_window_quarantine_then_the_hold_ends() -> None:
    now = [0.0]
    q = _q(now)
    for strike in (True, False, True, False):
        assert q.judged("a", strike, "outlier: norm 1e3") is None
    assert not q.excluded("a")
    verdict = q.judged("a", True, "outlier: norm 1e3")
    assert verdict is not None and verdict.kind == "quarantined"
    assert "3 of its last 5" in verdict.reason and "outlier" in verdict.reason
    assert q.excluded("a") and not q.excluded("b")
    now[0] = 99.0
    assert q.excluded("a")
    now[0] = 100.0
    assert not q.excluded("a"), "the hold is over: a clean record"
    assert q.judged("a", True) is None


def test_old_strikes_leave_the_window() -> None:
    q = _q([0.0])
    q.judged("a", True)
    q.judged("a", True)
    for _ in range(5):  # five good deltas push both strikes out of the window of 5
        assert q.judged("a", False) is None
    assert q.judged("a", True) is None and not q.excluded("a")


def test_ban_by_key_and_unban_ends_a_quarantine() -> None:
    q = _q([0.0])
    q.ban(KEY_B, "poisoned deltas")
    v = q.verdict("b")
    assert v is not None and v.kind == "banned" and v.reason == "poisoned deltas"
    assert q.is_banned_key(KEY_B) and not q.is_banned_key(KEY_A)
    for _ in range(3):
        q.judged("a", True)
    assert q.excluded("a")
    q.unban(KEY_A)  # a key that was quarantined, not banned: the quarantine ends
    q.unban(KEY_B)
    assert not q.excluded("a") and not q.excluded("b")
    q.set_bans({KEY_A: "stored"})
    assert q.verdict("a") is not None and q.verdict("a").reason == "stored"  # type: ignore[union-attr]


def test_the_strike_rule_is_checked() -> None:
    with pytest.raises(ValueError, match="strikes"):
        Quarantine(strikes=4, window=3)


def _c(sender: str, base: int) -> Contribution:
    return Contribution(sender, base, base, {"w": torch.zeros(2)})


def test_one_sender_cannot_push_out_the_others() -> None:
    inbox = Inbox(per_sender=2, max_senders=3)
    assert inbox.put(_c("honest", 7)) is None
    out = [inbox.put(_c("flood", base)) for base in range(100)]  # a flood from one member
    assert [c.base_version for c in out if c is not None] == list(range(98)), "its oldest go"
    assert inbox.put(_c("other", 7)) is None
    taken = inbox.take()
    assert [c.sender for c in taken].count("flood") == 2, "only its newest two wait"
    assert {(c.sender, c.base_version) for c in taken} >= {("honest", 7), ("other", 7)}
    assert [c.base_version for c in taken if c.sender == "flood"] == [98, 99]
    assert inbox.dropped == 98 and len(inbox) == 0


def test_senders_beyond_the_bound_are_refused_not_the_waiting_ones() -> None:
    inbox = Inbox(per_sender=1, max_senders=2)
    assert inbox.put(_c("a", 1)) is None and inbox.put(_c("b", 1)) is None
    refused = _c("c", 1)
    assert inbox.put(refused) is refused  # what leaves is the newcomer
    assert inbox.drop_sender("a") == 1
    assert inbox.put(_c("c", 1)) is None
    assert sorted(c.sender for c in inbox.take()) == ["b", "c"]


def test_a_frame_in_another_codec_than_the_jobs_is_refused() -> None:
    ident = Identity.generate()
    t = torch.full((4, 8), 5.0)
    for codec, ok in (("topk", True), ("fp32", False)):
        frame = encode_frame(
            identity=ident, job_id="j" * 32, round=0, base_version=0,
            tensors=[("w", make_codec(codec, topk_fraction=0.25).encode(t))],
        )  # fmt: skip
        dec = FrameDecoder(
            job_id="j" * 32,
            public_key_of=lambda _pid: ident.public_key_hex,
            expected_shapes={"w": (4, 8)},
            max_bytes=1 << 20,
        )
        dec.feed(frame)
        decoded = dec.finish()
        if ok:
            check_codec(decoded, "topk")
        else:
            with pytest.raises(WireError, match=r"wrong_codec.*topk.*w: fp32"):
                check_codec(decoded, "topk")


async def test_a_quarantine_survives_a_restart_and_still_ends(tmp_path: Path) -> None:
    """The quarantine is persisted (a real SQLite file). A restarted daemon still
    refuses the member, shows it in /v1/peers with the reason and the same end; a quarantine
    whose hour is over is not restored; unbanning the key lifts the stored one too."""
    from datetime import UTC, datetime, timedelta
    from typing import Any, cast

    from atomd.config import Settings
    from atomd.db import migrate, repo
    from atomd.db.connection import make_engine, make_sessionmaker
    from atomd.p2p.membership import Member
    from atomd.p2p.node import SwarmNode
    from atomd.telemetry import Telemetry

    settings = Settings(data_dir=tmp_path, device="cpu")
    migrate.upgrade(settings.db_path)
    evil, other = Identity.generate(), Identity.generate()

    async def start() -> tuple[SwarmNode, Any]:
        engine = make_engine(settings.db_path)
        node = SwarmNode(settings=settings, identity=me, sessions=make_sessionmaker(engine),
                         telemetry=Telemetry(), jobs=cast(Any, None))  # fmt: skip
        await node.load_records()
        for i in (evil, other):  # the members, as gossip brings them back
            node.membership.members[i.peer_id] = Member(
                i.peer_id, "https://127.0.0.1:42001", i.public_key_hex, "alive", 1
            )
        return node, engine

    me = Identity.generate()
    node, engine = await start()
    for _ in range(3):
        await node.judge(evil.peer_id, True, "opposed: its cosine with this peer's own delta")
    verdict = node.verdict(evil.peer_id)
    assert verdict is not None and verdict.kind == "quarantined" and verdict.until is not None
    async with node.sessions() as s, s.begin():  # and one whose hour is over
        await repo.add_quarantine(
            s,
            peer_id=other.peer_id,
            public_key=other.public_key_hex,
            reason="old",
            until=datetime.now(UTC) - timedelta(seconds=1),
        )
    await engine.dispose()

    node, engine = await start()  # the restart
    again = node.verdict(evil.peer_id)
    assert again is not None and again.kind == "quarantined"
    assert again.reason == verdict.reason and "opposed" in again.reason
    assert again.until is not None and abs(again.until - verdict.until) < 1e-3, "not extended"
    assert node.excluded(evil.peer_id) and not node.excluded(other.peer_id)
    row = next(p for p in node.peers() if p["id"] == evil.peer_id)
    assert row["excluded"] == "quarantined" and "opposed" in row["excluded_reason"]
    assert next(p for p in node.peers() if p["id"] == other.peer_id)["excluded"] is None
    end = verdict.until
    node.quarantine.clock = lambda: end + 1.0
    assert not node.excluded(evil.peer_id), "the hold still ends"
    node.quarantine.clock = time.time

    await node.unban(evil.public_key_hex)  # the operator lifts it: the stored one goes too
    assert not node.excluded(evil.peer_id)
    await engine.dispose()
    node, engine = await start()
    assert not node.excluded(evil.peer_id)
    await engine.dispose()
