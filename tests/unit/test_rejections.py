"""Refused requests: per-source rate limit, aggregated counts (atomd.rejections)."""

from __future__ import annotations

from atomd.rejections import Rejections


def test_a_source_is_limited_after_its_burst_and_recovers_at_the_rate() -> None:
    now = [0.0]
    r = Rejections(burst=3, rate=2.0, clock=lambda: now[0])
    assert r.retry_after("1.2.3.4") is None
    for _ in range(3):
        r.refused("peer", "1.2.3.4", 401, "unsigned")
    wait = r.retry_after("1.2.3.4")
    assert wait is not None and 0.4 <= wait <= 0.5
    assert r.retry_after("5.6.7.8") is None, "other sources are not limited"
    now[0] = 0.5  # one token back at 2 per second
    assert r.retry_after("1.2.3.4") is None


def test_refusals_are_one_aggregated_record() -> None:
    r = Rejections()
    assert r.flush() is None
    for i in range(5000):
        r.refused("peer", f"10.0.{i % 7}.1", 401, "/p2p/v1/ping: unsigned " + "x" * 8000)
    r.refused("control", "127.0.0.1", 401, "/v1/jobs: no token")
    out = r.flush()
    assert out is not None
    message, data = out
    assert message.startswith("5001 request(s) refused") and len(message) < 300
    assert data["counts"] == {"control 401": 1, "peer 401": 5000}
    assert len(data["sources"]) == 8 and all(len(v) <= 200 for v in data["examples"].values())
    assert r.flush() is None, "counted once"


def test_tracked_sources_are_bounded() -> None:
    r = Rejections(max_sources=100)
    for i in range(10_000):
        r.refused("peer", f"s{i}", 401, "x")
    assert len(r._buckets) == 100 and len(r._sources) <= 100
