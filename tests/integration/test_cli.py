"""The ``atomd`` console script, run as a real subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

ATOMD = [sys.executable, "-m", "atomd"]
COMMANDS = [
    "train", "sample", "presets", "demo", "version", "export", "import", "plot", "tokenizer",
    "run", "events", "bans", "job",
]  # fmt: skip


def run(
    *args: str, cwd: Path | None = None, timeout: float = 900
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ATOMD_LOG_LEVEL": "INFO"}
    return subprocess.run(
        [*ATOMD, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env
    )


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_everywhere(command: str | None) -> None:
    proc = run(*([command] if command else []), "--help")
    assert proc.returncode == 0, proc.stderr
    assert "Usage" in proc.stdout
    assert "<bool>" not in proc.stdout  # a flag takes no value
    if command is None:
        for c in COMMANDS:
            assert c in proc.stdout


def test_train_then_resume_then_sample(tmp_path: Path, text_file: Path) -> None:
    out = tmp_path / "run"
    common = [
        "--data",
        str(text_file),
        "--out",
        str(out),
        "--device",
        "cpu",
        "--seq-len",
        "32",
        "--micro-batch-size",
        "4",
        "--eval-interval",
        "5",
        "--quiet",
    ]
    proc = run("train", "--max-steps", "6", *common)
    assert proc.returncode == 0, proc.stderr
    assert "finished at step 6" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 6 and "val_loss" in rows[-1]

    again = run("train", "--max-steps", "6", *common)  # an existing run is not overwritten
    assert again.returncode == 2
    assert "--resume" in again.stderr

    more = run("train", "--max-steps", "9", "--resume", *common)
    assert more.returncode == 0, more.stderr
    assert "resumed from" in more.stderr and "finished at step 9" in more.stdout

    text = run(
        "sample",
        "--checkpoint",
        str(out),
        "--prompt",
        "line",
        "--max-new-tokens",
        "40",
        "--device",
        "cpu",
    )
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith("line") and len(text.stdout) >= 40


def test_bad_spec_is_explained(tmp_path: Path) -> None:
    proc = run("train", "--preset", "gpt5", "--out", str(tmp_path))
    assert proc.returncode == 2
    assert "preset" in proc.stderr and "known presets" in proc.stderr
    spec = tmp_path / "spec.json"
    spec.write_text('{"micro_batch_size": -3}')
    proc = run("train", "--spec", str(spec), "--out", str(tmp_path))
    assert proc.returncode == 2 and "micro_batch_size" in proc.stderr


@pytest.mark.parametrize("command", [["train", "--out", "o"], ["job", "start"]])
def test_missing_spec_file_is_named(tmp_path: Path, command: list[str]) -> None:
    missing = tmp_path / "missing.json"
    proc = run(*command, "--spec", str(missing), cwd=tmp_path)
    assert proc.returncode == 2
    assert f"cannot read job spec {missing}: No such file or directory" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_ctrl_c_stops_training_at_a_checkpoint_and_says_how_to_resume(tmp_path: Path) -> None:
    out = tmp_path / "run"
    p = subprocess.Popen(
        [*ATOMD, "train", "--out", str(out), "--max-steps", "100000", "--quiet",
         "--micro-batch-size", "2", "--seq-len", "16", "--checkpoint-interval", "100000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not (out / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        stdout, stderr = p.communicate(timeout=300)
    finally:
        p.kill()
    assert p.returncode == 130, stderr
    assert "Ctrl-C: stopping at the next step boundary" in stderr
    assert f"continue with: atomd train --out {out} --resume" in stderr
    assert "stopped at step" in stdout and "Traceback" not in stderr
    assert list((out / "checkpoints").glob("step-*"))


def test_missing_data_and_checkpoint_are_clear_errors(tmp_path: Path) -> None:
    proc = run("train", "--data", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and "not found" in proc.stderr
    proc = run("sample", "--checkpoint", str(tmp_path))
    assert proc.returncode == 2 and "no checkpoint" in proc.stderr


@pytest.mark.xdist_group("swarm")  # several training daemons: see test_swarm.py
def test_swarm_demo_runs_to_the_end(tmp_path: Path) -> None:
    """What `make demo` runs, on a small budget: daemons start, train together, stop cleanly."""
    proc = run("demo", "--out", str(tmp_path), "--peers", "2", "--max-steps", "24",
               "--every", "8", timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "the job has finished on every peer" in proc.stdout
    assert "all 3 daemons stopped." in proc.stdout  # the two peers and the lone one
    assert proc.stdout.count(" after SIGTERM in ") == 3  # each daemon, and how it ended
    last = [line for line in proc.stdout.splitlines() if "deltas merged" in line][-2:]
    assert all("finished" in line for line in last)
    assert any("deltas merged   0" not in line for line in last)  # deltas were merged
    # The lone peer trained beside them, and the verdict compares their final losses.
    alone = [line for line in proc.stdout.splitlines() if line.startswith("  alone  ")]
    assert alone and "finished" in alone[-1] and "step   24" in alone[-1]
    verdict = [line for line in proc.stdout.splitlines() if "final validation loss" in line]
    assert len(verdict) == 1 and "one peer alone (the same steps" in verdict[0]


def test_migrate_from_a_folder_with_its_own_migrations_package(tmp_path: Path) -> None:
    """Another project's ``migrations/`` in the working directory is not ours."""
    (tmp_path / "migrations").mkdir()
    (tmp_path / "migrations" / "__init__.py").write_text("raise SystemExit('the wrong one')\n")
    proc = run("migrate", "--data-dir", str(tmp_path / "data"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    from atomd.db.migrate import head_revision

    assert f"revision {head_revision()}" in proc.stdout


@contextmanager
def serving(answer: Callable[[str, dict[str, str]], Any]) -> Iterator[str]:
    """A stand-in for a daemon's control API on loopback: ``answer(path, query)``'s JSON."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path, _, query = self.path.partition("?")
            body = json.dumps(answer(path, dict(urllib.parse.parse_qsl(query)))).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def control_api_answering(answers: dict[str, Any]) -> AbstractContextManager[str]:
    """Each path's JSON answer, whatever the query."""
    return serving(lambda path, _query: answers[path])


def progress_api(job: dict[str, Any], steps: int) -> AbstractContextManager[str]:
    """A job of ``steps`` logged points (a val_loss every 100th), ``/progress`` answered as
    the daemon does: ``after_step``, ``limit`` (at most 10,000), ``newest``."""
    points = [
        {"step": i, "tokens": 32 * i, "loss": 5.0 / i,
         "val_loss": 5.0 / i if i % 100 == 0 else None, "tokens_per_s": 1000.0, "lr": 1e-3,
         "at": "2026-12-06T10:00:00Z", "sync": None}
        for i in range(1, steps + 1)
    ]  # fmt: skip

    def answer(path: str, q: dict[str, str]) -> Any:
        if not path.endswith("/progress"):
            return job
        limit = min(int(q.get("limit", 1000)), 10000)
        after = [p for p in points if p["step"] > int(q.get("after_step", -1))]
        return after[-limit:] if q.get("newest") == "true" else after[:limit]

    return serving(answer)


def test_job_show_and_plot_read_a_long_jobs_newest_points(tmp_path: Path) -> None:
    """A job of 25,000 logged steps, more than the API's default page of 1,000 points:
    `atomd job show` asks for the newest points and `atomd plot <job id>` pages through the
    whole run."""
    job_id = "d" * 32
    job = {
        "id": job_id, "state": "running", "reason": None, "spec": {"preset": "tiny"},
        "out_dir": str(tmp_path), "step": 25000, "tokens": 800000, "loss": 0.0002,
        "val_loss": 0.0002, "created_at": "2026-12-06T10:00:00Z", "started_at": None,
        "finished_at": None,
    }  # fmt: skip
    with progress_api(job, 25000) as api:
        shown = run("job", "show", job_id, "--url", api, "--json", timeout=120)
        assert shown.returncode == 0, shown.stderr
        steps = [p["step"] for p in json.loads(shown.stdout)["progress"]]
        assert steps == [24996, 24997, 24998, 24999, 25000]
        plotted = run("plot", job_id, "--url", api, "--out", str(tmp_path / "l.png"), timeout=120)
        assert plotted.returncode == 0, plotted.stderr
        assert "25000 training points to step 25000" in plotted.stdout, plotted.stdout
        assert (tmp_path / "l.png").stat().st_size > 1000


def test_a_peers_words_are_printed_as_they_are(tmp_path: Path) -> None:
    """`atomd peers` and `atomd job show` print what members chose: a member's URL (printable
    ASCII, signed by itself), a reason quoting its frame (a tensor's name), a joined job's spec
    (its advert's text_field). None is read as rich markup (`[/x]` would end the command with
    a MarkupError, `[link=...]` and `[blink]` style the operator's terminal, `:skull:` become an
    emoji) and no ESC goes through: each is printed as sent, a control character escaped."""
    me, evil = "a" * 32, "b" * 32
    url = "https://evil.example:7071/[/x]"
    reason = "quarantined here: tensor '[link=https://evil.example/]x[/link]' \x1b[2J :skull:"
    peers = [
        {"id": me, "url": "https://10.0.0.1:7071", "state": "alive", "is_self": True,
         "last_seen_at": "2026-12-06T10:00:00Z", "rtt_ms": None},
        {"id": evil, "url": url, "state": "alive", "is_self": False,
         "last_seen_at": "2026-12-06T10:00:00Z", "rtt_ms": 1.5, "excluded": "quarantined",
         "excluded_reason": reason},
    ]  # fmt: skip
    job_id = "c" * 32
    job = {
        "id": job_id, "state": "running", "reason": "[blink]from the swarm[/blink]",
        "spec": {"preset": "tiny", "text_field": "[/x]"}, "out_dir": str(tmp_path), "step": 3,
        "tokens": 96, "loss": 2.5, "val_loss": None, "created_at": "2026-12-06T10:00:00Z",
        "started_at": None, "finished_at": None,
    }  # fmt: skip
    answers = {"/v1/peers": peers, f"/v1/jobs/{job_id}": job, f"/v1/jobs/{job_id}/progress": []}
    with control_api_answering(answers) as api:
        shown = run("peers", "--url", api, timeout=120)
        assert shown.returncode == 0, shown.stderr
        assert url in shown.stdout
        assert "[link=https://evil.example/]x[/link]" in shown.stdout and ":skull:" in shown.stdout
        assert "\x1b" not in shown.stdout and "\\x1b[2J" in shown.stdout
        shown = run("job", "show", job_id, "--url", api, timeout=120)
        assert shown.returncode == 0, shown.stderr
        assert "[blink]from the swarm[/blink]" in shown.stdout
        assert '"text_field":"[/x]"' in shown.stdout


def test_job_logs_events_and_bans_of_a_real_daemon(daemons: Any) -> None:
    """A daemon started with JSON logs and ATOMD_WANDB_PROJECT trains a job; `atomd job logs
    --follow` prints its steps until it ends, `atomd events` and `atomd bans` read the rest."""
    d = daemons(
        env={"ATOMD_WANDB_PROJECT": "atomd-test", "WANDB_MODE": "offline"},
        extra_args=["--log-format", "json"],
    ).start()
    url = ["--url", d.url]
    spec = {"max_steps": 6, "seq_len": 32, "micro_batch_size": 4, "log_interval": 1,
            "eval_interval": 3, "warmup_steps": 1}  # fmt: skip
    started = run("job", "start", *url, "--json", *(f"--set={k}={v}" for k, v in spec.items()))
    assert started.returncode == 0, started.stderr
    job_id = json.loads(started.stdout)["id"]
    logs = run("job", "logs", job_id, "--follow", *url, timeout=600)
    assert logs.returncode == 0, logs.stderr
    steps = [int(line.split("step ")[1].split()[0]) for line in logs.stdout.splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6], logs.stdout
    assert f"job {job_id} finished at step 6" in logs.stderr
    events = run("events", *url, "--kind", "job.finished")
    assert events.returncode == 0 and "job.finished" in events.stdout, events.stderr
    bans = run("bans", *url, "--json")
    assert bans.returncode == 0 and json.loads(bans.stdout) == [], bans.stderr
    assert run("job", "logs", job_id, "--url", "http://127.0.0.1:9").returncode == 2
    entries = [json.loads(line) for line in d.log().splitlines() if line.startswith("{")]
    assert entries and {"time", "level", "logger", "message"} <= set(entries[0])
    assert not [e for e in entries if "W&B" in e["message"]], entries  # no warning
    assert list((d.data_dir / "jobs").glob("*/wandb")), "the job logged no W&B run"
