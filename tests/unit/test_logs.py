from __future__ import annotations

import io
import logging
import sys
from collections.abc import Iterator

import httpx
import pytest

from atomd.errors import PeerRequestError
from atomd.logs import Repeated, setup_logging
from atomd.p2p.client import PeerClient
from atomd.p2p.identity import Identity
from atomd.p2p.messages import Ack
from atomd.p2p.signing import Admission


def test_a_repeated_condition_is_logged_once_then_at_a_backoff(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    rep = Repeated(logging.getLogger("atomd.test"), first=2, longest=16, clock=lambda: now[0])
    logged = []
    with caplog.at_level(logging.INFO, logger="atomd.test"):
        for t in range(0, 120, 2):  # every 2 s for 2 minutes, as the rejoin loop does
            now[0] = float(t)
            if rep.log("alone", logging.INFO, "alone"):
                logged.append(t)
    assert logged == [0, 2, 6, 14, 30, 46, 62, 78, 94, 110]
    assert "seen 7 more time(s) in the last 16 s" in caplog.records[5].getMessage()


def test_clearing_logs_the_next_occurrence_at_once() -> None:
    now = [0.0]
    rep = Repeated(logging.getLogger("atomd.test"), clock=lambda: now[0])
    assert rep.log("k", logging.INFO, "x")
    now[0] = 1
    assert not rep.log("k", logging.INFO, "x")
    rep.clear("k")
    assert rep.log("k", logging.INFO, "x")


@pytest.fixture
def daemon_log(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    """What ``setup_logging`` (the daemon's one log setup) writes to stderr; the loggers as
    they were afterwards."""
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stderr", buf)
    loggers = [logging.getLogger(name) for name in ("atomd", "uvicorn")]
    saved = [(lg, lg.handlers[:], lg.propagate, lg.level) for lg in loggers]
    for lg in loggers:
        lg.handlers = [h for h in lg.handlers if not getattr(h, "_atomd", False)]
    setup_logging("INFO")
    yield buf
    for lg, handlers, propagate, level in saved:
        lg.handlers, lg.propagate = handlers, propagate
        lg.setLevel(level)


async def test_a_peers_words_cannot_forge_a_log_line_nor_reach_the_terminal(
    daemon_log: io.StringIO,
) -> None:
    """A member's error answer is peer text in this daemon's log (``PeerRequestError`` holds
    its ``detail``: a refused delta upload, announce or join is logged with it). Its line
    breaks forged whole log lines and its escape sequences reached the operator's terminal (a
    review of 2026-12-06): every line is one line, control characters shown escaped."""
    forged = "2026-12-07 10:00:00,000 INFO    atomd.jobs: job 1234: finished"
    detail = f"no\n{forged}\r\x1b]0;owned\x07\x1b[2J\u202e"

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": "invalid", "detail": detail})

    admission = Admission(swarm="lab", secret=None, allowed_keys=frozenset())
    client = PeerClient(Identity.generate(), admission, tls=False,
                        transport=httpx.MockTransport(answer))  # fmt: skip
    async with client:
        with pytest.raises(PeerRequestError) as caught:
            await client.post("http://peer", "/p2p/v1/announce", Ack(), Ack,
                              target=Identity.generate().peer_id)  # fmt: skip
    assert forged in str(caught.value)  # the peer's words, as it sent them
    logging.getLogger("atomd.p2p.gossip").info(
        "http://peer/p2p/v1/announce failed: %s", caught.value
    )
    out = daemon_log.getvalue()
    assert out.count("\n") == 1 and out.endswith("\n"), out
    assert not any(c in out for c in "\r\x1b\x07\u202e"), ascii(out)
    assert "\\n2026-12-07 10:00:00,000 INFO" in out and "\\x1b[2J" in out  # shown, escaped
