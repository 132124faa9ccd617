"""The command line's options: help from the models, one name per setting, `atomd run`."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest
import typer
from typer.core import TyperGroup, TyperOption
from typer.testing import CliRunner

from atomd.cli import app
from atomd.config import Settings
from atomd.logs import JsonFormatter
from atomd.spec import JobSpec

runner = CliRunner()
COMMAND = typer.main.get_command(app)
assert isinstance(COMMAND, TyperGroup)


def _options(*path: str) -> dict[str, TyperOption]:
    """The options of ``atomd PATH...`` by their parameter name."""
    cmd: Any = COMMAND
    for name in path:
        assert isinstance(cmd, TyperGroup)
        cmd = cmd.commands[name]
    return {p.name: p for p in cmd.params if p.name and isinstance(p, TyperOption)}


@pytest.mark.parametrize("command", [("train",), ("plan",), ("bench", "swap"), ("job", "start")])
def test_options_that_set_a_spec_field_show_its_description(command: tuple[str, ...]) -> None:
    checked = 0
    for name, param in _options(*command).items():
        field = JobSpec.model_fields.get(name)
        planner = command[0] in ("plan", "bench")
        if field is None or (planner and not name.startswith(("swap_", "preset"))):
            continue  # the planner's defaults for the batch shape differ from a job's
        if planner and name == "swap_resident_blocks" and command[0] == "bench":
            continue  # the benchmark swaps every block unless told
        assert param.help == field.description, name
        checked += 1
    assert checked >= 3


def test_run_options_show_the_settings_description() -> None:
    for name, param in _options("run").items():
        field = {"peer": "seeds", "allow_key": "allowed_keys"}.get(name, name)
        description = (Settings.model_fields[field].description or "").rstrip(".")
        assert param.help and param.help.startswith(description), name
        assert f"(env ATOMD_{field.upper()})" in param.help


def test_plan_and_train_name_the_swap_settings_alike() -> None:
    def swap_flags(*command: str) -> set[str]:
        flags = {f for p in _options(*command).values() for f in p.opts}
        return {f for f in flags if f.startswith("--swap-") or f == "--gpu-mem"}

    plan = swap_flags("plan")
    assert plan == swap_flags("bench", "swap")
    assert len(plan) == 8 and plan <= swap_flags("train")
    assert "--slots" not in runner.invoke(app, ["plan", "--help"]).output


def test_old_swap_spellings_still_work_with_a_warning() -> None:
    args = ["plan", "--preset", "gpt3-2.7b", "--gpu-mem", "24GiB", "--json"]
    new = runner.invoke(app, [*args, "--swap-slots", "3", "--swap-optimizer", "device"])
    old = runner.invoke(app, [*args, "--slots", "3", "--optimizer=device"])
    assert new.exit_code == 0 and old.exit_code == 0, old.output
    assert "warning: --slots is deprecated" in old.stderr
    assert "use --swap-optimizer" in old.stderr and "deprecated" not in new.stderr
    assert json.loads(old.stdout) == json.loads(new.stdout)
    assert json.loads(new.stdout)["slots"] == 3


def test_swap_optimizer_help_names_every_choice() -> None:
    help_text = " ".join(runner.invoke(app, ["train", "--help"]).output.split())
    for choice in ("auto", "host", "device", "split"):
        assert choice in help_text.split("--swap-optimizer", 1)[1].split("--swap-slots")[0]
    data = help_text.split("--data", 1)[1].split("--max-steps")[0]
    assert "JSON lines" in data and "Parquet" in data and "`datasets` folder" in data


class FakeDaemon:
    """Stands in for the daemon: records the settings it would run with."""

    started: ClassVar[list[Settings]] = []

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    async def run(self) -> None:
        FakeDaemon.started.append(self.settings)


@pytest.fixture
def daemon(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Any]:
    """`atomd run` with a stand-in daemon; returns the log setups it asked for."""
    import atomd.daemon
    import atomd.logs

    for k in list(os.environ):
        if k.startswith("ATOMD_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("ATOMD_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(atomd.daemon, "Daemon", FakeDaemon)
    setups: list[Any] = []
    monkeypatch.setattr(atomd.logs, "setup_logging", lambda *a: setups.append(a))
    FakeDaemon.started.clear()
    return setups


def test_run_takes_peers_with_peer_and_still_with_seed(daemon: list[Any]) -> None:
    ok = runner.invoke(app, ["run", "--peer", "https://a:7071", "--peer", "https://b:7071"])
    assert ok.exit_code == 0, ok.output
    assert FakeDaemon.started[-1].seeds == ["https://a:7071", "https://b:7071"]
    assert "deprecated" not in ok.stderr
    old = runner.invoke(app, ["run", "--seed", "https://c:7071"])
    assert old.exit_code == 0, old.output
    assert FakeDaemon.started[-1].seeds == ["https://c:7071"]
    assert "warning: --seed is deprecated" in old.stderr and "use --peer" in old.stderr
    assert "--seed" not in runner.invoke(app, ["run", "--help"]).output


def test_run_starts_with_the_wandb_variable_and_exports_the_flag(
    daemon: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from atomd.train.tracking import WANDB_PROJECT_ENV

    monkeypatch.setenv(WANDB_PROJECT_ENV, "from-env")
    result = runner.invoke(app, ["run"])
    assert result.exit_code == 0, result.output
    assert FakeDaemon.started[-1].wandb_project == "from-env"
    monkeypatch.delenv(WANDB_PROJECT_ENV)
    result = runner.invoke(app, ["run", "--wandb-project", "from-flag"])
    assert result.exit_code == 0, result.output
    assert os.environ[WANDB_PROJECT_ENV] == "from-flag"  # what the jobs' trackers read
    monkeypatch.delenv(WANDB_PROJECT_ENV)


def test_run_log_format(daemon: list[Any]) -> None:
    assert runner.invoke(app, ["run", "--log-format", "json"]).exit_code == 0
    assert daemon[-1] == ("INFO", "json")
    assert runner.invoke(app, ["run"]).exit_code == 0
    assert daemon[-1] == ("INFO", "text")
    bad = runner.invoke(app, ["run", "--log-format", "xml"])
    assert bad.exit_code != 0 and "--log-format / ATOMD_LOG_FORMAT" in str(bad.exception)


def test_json_log_lines_parse() -> None:
    logger = logging.getLogger("atomd.test")
    try:
        raise ValueError("bad\nvalue")
    except ValueError:
        record = logger.makeRecord(
            "atomd.test", logging.ERROR, __file__, 1, "job %s failed", ("j1",), sys.exc_info()
        )
    line = JsonFormatter().format(record)
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["level"] == "ERROR" and entry["logger"] == "atomd.test"
    assert entry["message"] == "job j1 failed"
    assert entry["time"].endswith("Z") and entry["time"][10] == "T"
    assert "ValueError: bad" in entry["exception"] and "Traceback" in entry["exception"]
    plain = json.loads(JsonFormatter().format(logger.makeRecord(
        "atomd.x", logging.INFO, __file__, 1, "hello", (), None)))  # fmt: skip
    assert set(plain) == {"time", "level", "logger", "message"}


def test_shell_completion_is_on() -> None:
    shown = runner.invoke(app, ["--show-completion", "bash"])
    assert shown.exit_code == 0 and "_atomd_completion" in shown.output
    assert "--install-completion" in runner.invoke(app, ["--help"]).output
