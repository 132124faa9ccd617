"""`atomd job logs`, `atomd events` and `atomd bans` against a stand-in control API."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

import atomd.cli.common
from atomd.cli import app
from atomd.client import ClientError, ControlClient

runner = CliRunner()
Handler = Callable[[httpx.Request], httpx.Response]


def _point(step: int) -> dict[str, Any]:
    return {
        "step": step, "tokens": step * 1024, "loss": 5.0 - step / 10, "tokens_per_s": 2000.0,
        "val_loss": 4.5 if step % 2 == 0 else None, "lr": 3e-3, "sync": None,
        "at": f"2026-01-01T00:00:{step:02d}+00:00",
    }  # fmt: skip


def _event(i: int, kind: str = "job.created") -> dict[str, Any]:
    at = f"2026-01-01T00:00:{i:02d}+00:00"
    return {"id": i, "at": at, "kind": kind, "job_id": "j1", "peer_id": None, "message": f"e{i}"}


@pytest.fixture
def daemon(monkeypatch: pytest.MonkeyPatch) -> Callable[[Handler], list[httpx.Request]]:
    """Point the CLI at ``handler`` instead of a daemon; returns the requests it got."""

    def serve(handler: Handler) -> list[httpx.Request]:
        seen: list[httpx.Request] = []

        def record(request: httpx.Request) -> httpx.Response:
            seen.append(request)
            return handler(request)

        def connect(url: str, token: str | None) -> ControlClient:
            return ControlClient(url, token=token, transport=httpx.MockTransport(record))

        monkeypatch.setattr(atomd.cli.common, "connect", connect)
        return seen

    return serve


class RunningJob:
    """A job that logs steps 1-2, then on the next poll step 3 and finishes."""

    def __init__(self) -> None:
        self.polls = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path, params = request.url.path, request.url.params
        if path == "/v1/jobs/j1":
            self.polls += 1
            state = "running" if self.polls == 1 else "finished"
            return httpx.Response(200, json={"id": "j1", "state": state, "step": 3, "reason": None})
        assert path == "/v1/jobs/j1/progress"
        after = int(params.get("after_step", 0))
        steps = [1, 2] if self.polls == 1 else [1, 2, 3]
        return httpx.Response(200, json=[_point(s) for s in steps if s > after])


def test_job_logs_prints_the_progress_lines(daemon: Any) -> None:
    daemon(RunningJob())
    result = runner.invoke(app, ["job", "logs", "j1"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 2
    assert "step 1" in lines[0] and "loss 4.9000" in lines[0] and "2,000 tokens/s" in lines[0]
    assert "val_loss 4.5000" in lines[1] and "val_loss" not in lines[0]


def test_job_logs_follow_until_the_job_ends(daemon: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    pauses: list[float] = []
    monkeypatch.setattr(atomd.cli.common, "pause", pauses.append)
    requests = daemon(RunningJob())
    result = runner.invoke(app, ["job", "logs", "j1", "--follow", "--json"])
    assert result.exit_code == 0, result.output
    assert [json.loads(line)["step"] for line in result.stdout.splitlines()] == [1, 2, 3]
    assert pauses == [atomd.cli.common.POLL_S]
    asked = [r.url.params.get("after_step") for r in requests if r.url.path.endswith("progress")]
    assert asked == [None, "2"]  # only the new points
    assert "job j1 finished at step 3" in result.stderr


def test_job_logs_last(daemon: Any) -> None:
    requests = daemon(RunningJob())
    result = runner.invoke(app, ["job", "logs", "j1", "--last", "1"])
    assert result.exit_code == 0, result.output
    progress = [r for r in requests if r.url.path.endswith("progress")]
    assert progress[0].url.params["newest"] == "true" and progress[0].url.params["limit"] == "1"


def test_events_oldest_first_then_follow(daemon: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    answers = [[_event(2), _event(1)], [_event(3, "job.finished"), _event(2), _event(1)]]

    def events(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/events"
        assert request.url.params["kind"] == "job.created"
        return httpx.Response(200, json=answers.pop(0) if len(answers) > 1 else answers[0])

    def pause(seconds: float) -> None:
        if len(answers) == 1 and calls:
            raise KeyboardInterrupt  # Ctrl-C ends following
        calls.append(seconds)

    calls: list[float] = []
    monkeypatch.setattr(atomd.cli.common, "pause", pause)
    daemon(events)
    result = runner.invoke(app, ["events", "--follow", "--kind", "job.created"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert [line.split()[-3] for line in lines] == ["e1", "e2", "e3"]  # each once, in order
    assert "job.finished" in lines[2] and "[job_id j1]" in lines[0]
    once = runner.invoke(app, ["events", "--last", "5", "--kind", "job.created"])
    assert once.exit_code == 0


def test_bans_list(daemon: Any) -> None:
    key = "ab" * 32
    rows = [{"public_key": key, "reason": "spam", "created_at": "2026-01-01T00:00:00+00:00"}]
    daemon(lambda r: httpx.Response(200, json=rows if r.url.path == "/v1/bans" else None))
    result = runner.invoke(app, ["bans"])
    assert result.exit_code == 0 and key in result.stdout and "spam" in result.stdout
    assert json.loads(runner.invoke(app, ["bans", "--json"]).stdout) == rows
    daemon(lambda r: httpx.Response(200, json=[]))
    assert runner.invoke(app, ["bans"]).stdout.strip() == "no bans"


def test_an_unreachable_daemon_is_a_clear_error(daemon: Any) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    daemon(refuse)
    for args in (["job", "logs", "j1"], ["events"], ["bans"]):
        result = runner.invoke(app, [*args, "--url", "http://127.0.0.1:9"])
        assert isinstance(result.exception, ClientError)
        assert "cannot reach atomd at http://127.0.0.1:9" in str(result.exception)


def test_every_call_has_a_timeout() -> None:
    with atomd.cli.common.connect("http://127.0.0.1:9", None) as c:
        timeout = c._http.timeout
    assert timeout.read is not None and timeout.connect is not None


def test_job_wait_returns_when_the_job_ends_with_its_state_as_exit_status(
    daemon: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    pauses: list[float] = []
    monkeypatch.setattr(atomd.cli.common, "pause", pauses.append)
    job = RunningJob()
    daemon(job)
    result = runner.invoke(app, ["job", "wait", "j1"])
    assert result.exit_code == 0, result.output
    assert job.polls == 2 and pauses == [atomd.cli.common.POLL_S]
    assert result.stdout.strip() == "job j1 finished at step 3"

    def failed(request: httpx.Request) -> httpx.Response:
        body = {"id": "j1", "state": "failed", "step": 7, "reason": "loss is NaN"}
        return httpx.Response(200, json=body)

    daemon(failed)
    result = runner.invoke(app, ["job", "wait", "j1"])
    assert result.exit_code == 1
    assert result.stdout.strip() == "job j1 failed at step 7: loss is NaN"
