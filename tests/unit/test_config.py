from __future__ import annotations

import re
from pathlib import Path

import pytest

from atomd.config import Settings, check_environment, load_settings, split_host_port
from atomd.errors import ConfigError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for k in list(os.environ):
        if k.startswith("ATOMD_"):
            monkeypatch.delenv(k)


def test_defaults_follow_the_design() -> None:
    s = load_settings()
    assert s.control == "127.0.0.1:7070" and s.listen == "0.0.0.0:7071"
    assert s.device == "auto" and s.seeds == [] and s.swarm == "default"


def test_flags_beat_environment_beat_toml(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    toml = tmp_path / "atomd.toml"
    toml.write_text('swarm = "from-toml"\ndevice = "cpu"\nlog_level = "debug"\n')
    monkeypatch.setenv("ATOMD_CONFIG", str(toml))
    monkeypatch.setenv("ATOMD_DEVICE", "cuda")
    s = load_settings(swarm="from-flag")
    assert s.swarm == "from-flag"  # flag
    assert s.device == "cuda"  # environment over TOML
    assert s.log_level == "DEBUG"  # TOML over default, normalised


def test_seeds_from_a_comma_separated_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATOMD_SEEDS", "https://a:7071, https://b:7071,")
    assert load_settings().seeds == ["https://a:7071", "https://b:7071"]
    monkeypatch.setenv("ATOMD_SEEDS", "a:7071")
    with pytest.raises(ConfigError, match=r"ATOMD_SEEDS.*http"):
        load_settings()


def test_unknown_variable_is_named_with_a_suggestion() -> None:
    with pytest.raises(ConfigError, match=r"ATOMD_SWARM_SECRT \(did you mean ATOMD_SWARM_SECRET"):
        check_environment({"ATOMD_SWARM_SECRT": "x", "ATOMD_SWARM": "ok", "OTHER": "1"})
    check_environment({"ATOMD_CONFIG": "x", "ATOMD_URL": "y", "ATOMD_CONTROL_TOKEN": "z"})
    check_environment({"ATOMD_TEST_PORTS": "20000-20999"})  # the launcher's port range


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"control": "0.0.0.0:7070"}, "ATOMD_CONTROL_TOKEN"),
        ({"control": "nonsense"}, "--control / ATOMD_CONTROL"),
        ({"listen": "host:99999"}, "out of range"),
        ({"device": "tpu"}, "--device / ATOMD_DEVICE"),
        ({"advertise": "peer:7071"}, "http"),
    ],
)
def test_bad_values_stop_the_start(overrides: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_settings(**overrides)


def test_token_allows_binding_off_loopback() -> None:
    s = load_settings(control="0.0.0.0:7070", control_token="t")
    assert s.control_host_port == ("0.0.0.0", 7070)


def test_missing_config_file_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATOMD_CONFIG", "/nonexistent/atomd.toml")
    with pytest.raises(ConfigError, match="no such file"):
        load_settings()


def test_host_port_and_derived_paths(tmp_path: Path) -> None:
    assert split_host_port("[::1]:7070") == ("::1", 7070)
    s = Settings(data_dir=tmp_path, listen="127.0.0.1:9000")
    assert s.db_path == tmp_path / "atomd.db" and s.jobs_dir == tmp_path / "jobs"
    assert s.advertise_url == "https://127.0.0.1:9000"
    assert Settings(advertise="https://me:1/").advertise_url == "https://me:1"


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"seeds": ["ftp://x"]}, "--peer / ATOMD_SEEDS:"),
        ({"allowed_keys": ["zz"]}, "--allow-key / ATOMD_ALLOWED_KEYS:"),
        ({"gossip_interval": 0}, "  ATOMD_GOSSIP_INTERVAL:"),
        ({"rounds_keep": 10}, "  ATOMD_ROUNDS_KEEP:"),
        ({"progress_keep": 0}, "  ATOMD_PROGRESS_KEEP:"),
        ({"control": "nope"}, "--control / ATOMD_CONTROL:"),
    ],
)
def test_errors_name_the_flag_a_person_types(overrides: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_settings(**overrides)
    assert named in str(e.value)
    assert "--seeds" not in str(e.value) and "--allowed-keys" not in str(e.value)


def test_retention_of_a_jobs_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounds and progress kept per job (``atomd.db.retention``): defaults and variables."""
    s = load_settings()
    assert (s.rounds_keep, s.progress_keep) == (20_000, 10_000)
    monkeypatch.setenv("ATOMD_ROUNDS_KEEP", "50000")
    monkeypatch.setenv("ATOMD_PROGRESS_KEEP", "2000")
    s = load_settings()
    assert (s.rounds_keep, s.progress_keep) == (50_000, 2000)


def test_wandb_project_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ATOMD_WANDB_PROJECT``, the variable the trackers read, starts a daemon (no "unknown
    environment variable") and is its ``wandb_project``."""
    from atomd.train.tracking import WANDB_PROJECT_ENV

    monkeypatch.setenv(WANDB_PROJECT_ENV, "my-runs")
    check_environment()
    assert load_settings().wandb_project == "my-runs"
    assert load_settings(wandb_project="flag").wandb_project == "flag"


def test_log_format_is_text_or_json(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings().log_format == "text"
    monkeypatch.setenv("ATOMD_LOG_FORMAT", "json")
    assert load_settings().log_format == "json"
    monkeypatch.setenv("ATOMD_LOG_FORMAT", "xml")
    with pytest.raises(ConfigError, match="--log-format / ATOMD_LOG_FORMAT"):
        load_settings()


def test_every_setting_has_one_short_sentence_of_help() -> None:
    """The help of every setting is one sentence of at most 120 characters; `atomd run`'s
    options show it."""
    for name, field in Settings.model_fields.items():
        text = field.description
        assert text, f"{name} has no description"
        assert len(text) <= 120, f"{name}: {len(text)} characters"
        assert not re.search(r"[.!?:]\s+[A-Z]", text), f"{name}: more than one sentence"
