"""Deployment files: the systemd unit, its env file, the Dockerfile and the compose swarm.

External validators (systemd-analyze, docker compose, PyYAML) are used where installed and
skipped otherwise; the structural checks below run everywhere.
"""

from __future__ import annotations

import configparser
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

from atomd.config import ENV_PREFIX, Settings, check_environment

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "deploy" / "atomd.service"
TEMPLATE = REPO / "deploy" / "atomd@.service"  # one daemon per GPU: atomd@0, atomd@1, ...
ENV_EXAMPLE = REPO / "deploy" / "atomd.env.example"
DOCKERFILE = REPO / "deploy" / "Dockerfile"
COMPOSE = REPO / "docker-compose.yml"

# Every setting of `atomd run`: a field of Settings, read from ATOMD_<FIELD>.
KNOWN_VARS = {f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields}
_VAR = re.compile(r"\bATOMD_[A-Z0-9_]+")

Unit = dict[str, dict[str, list[str]]]


def parse_unit(text: str) -> Unit:
    """Sections → key → every value in order (systemd keys such as DeviceAllow= repeat)."""
    unit: Unit = {}
    section: dict[str, list[str]] | None = None
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):  # continuation: systemd joins it with a space
            pending += line[:-1].rstrip() + " "
            continue
        line, pending = pending + line, ""
        if line.startswith("[") and line.endswith("]"):
            section = unit.setdefault(line[1:-1], {})
            continue
        assert section is not None, f"setting outside a section: {line!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not KEY=VALUE: {line!r}"
        section.setdefault(key.strip(), []).append(value.strip())
    return unit


@pytest.fixture(scope="module")
def unit() -> Unit:
    return parse_unit(UNIT.read_text())


def _one(unit: Unit, section: str, key: str) -> str:
    values = unit[section].get(key)
    assert values, f"[{section}] {key}= is missing"
    return values[-1]  # the last assignment wins, as in systemd


def test_parse_unit_repeats_and_continuations() -> None:
    parsed = parse_unit("[Service]\n# c\nDeviceAllow=a rw\nDeviceAllow=b rw\nX=1 \\\n  2\n")
    assert parsed == {"Service": {"DeviceAllow": ["a rw", "b rw"], "X": ["1 2"]}}


def test_unit_is_a_notify_service_with_watchdog(unit: Unit) -> None:
    assert _one(unit, "Service", "Type") == "notify"
    assert _one(unit, "Service", "NotifyAccess") == "main"
    assert _one(unit, "Service", "WatchdogSec") == "30"
    assert _one(unit, "Service", "Restart") == "on-failure"
    assert _one(unit, "Service", "RestartSec") == "5"
    assert _one(unit, "Service", "KillSignal") == "SIGTERM"
    # Time for the SIGTERM checkpoint.
    assert int(_one(unit, "Service", "TimeoutStopSec")) >= 120
    assert _one(unit, "Install", "WantedBy") == "multi-user.target"
    assert "network-online.target" in _one(unit, "Unit", "After")


def test_unit_runs_the_daemon_with_its_state_directory(unit: Unit) -> None:
    exec_start = _one(unit, "Service", "ExecStart").split()
    assert exec_start[0].startswith("/") and exec_start[0].endswith("/atomd")
    assert exec_start[1:] == ["run"]
    assert _one(unit, "Service", "StateDirectory") == "atomd"
    assert "ATOMD_DATA_DIR=%S/atomd" in unit["Service"]["Environment"]
    assert _one(unit, "Service", "EnvironmentFile") == "-/etc/atomd/atomd.env"
    env_vars = set(_VAR.findall(" ".join(unit["Service"]["Environment"])))
    assert env_vars <= KNOWN_VARS
    assert int(_one(unit, "Service", "LimitNOFILE")) >= 4096


def test_unit_runs_unprivileged_and_hardened(unit: Unit) -> None:
    service = unit["Service"]
    assert _one(unit, "Service", "DynamicUser") == "yes" or _one(unit, "Service", "User") not in (
        "",
        "root",
        "0",
    )
    expected = {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "ProtectKernelTunables": "yes",
        "ProtectKernelModules": "yes",
        "ProtectControlGroups": "yes",
        "LockPersonality": "yes",
        "RestrictRealtime": "yes",
        # Deliberately off: CUDA needs /dev/nvidia*, torch's JITs need W+X memory.
        "PrivateDevices": "no",
        "MemoryDenyWriteExecute": "no",
        # AF_NETLINK: getifaddrs(3), which --zeroconf needs to list the interfaces.
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6 AF_NETLINK",
    }
    actual = {key: service.get(key, [""])[-1] for key in expected}
    assert actual == expected
    # Devices are an allow-list that includes the NVIDIA ones.
    assert _one(unit, "Service", "DevicePolicy") in ("closed", "strict")
    assert any("nvidia" in rule and rule.endswith("rw") for rule in service["DeviceAllow"])


@pytest.fixture(scope="module")
def template() -> Unit:
    return parse_unit(TEMPLATE.read_text())


@pytest.mark.parametrize("path", [UNIT, TEMPLATE], ids=["atomd.service", "atomd@.service"])
def test_units_are_ini_files(path: Path) -> None:
    """Both units read as INI (repeated keys such as Environment= allowed, as in systemd)."""
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys keep their case
    parser.read_string(path.read_text())
    assert parser.sections() == ["Unit", "Service", "Install"]
    assert parser["Service"]["ExecStart"].split()[1] == "run"


def run_help_options() -> set[str]:
    """The options `atomd run --help` lists, from the installed console script's entry point."""
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "atomd"]
    module, _, function = script.value.partition(":")
    done = subprocess.run(
        [sys.executable, "-c", f"from {module} import {function}; {function}()", "run", "--help"],
        capture_output=True, text=True, timeout=120, check=True,
        env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"},
    )  # fmt: skip
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", done.stdout))


def exec_start_options(unit: Unit) -> list[str]:
    command = _one(unit, "Service", "ExecStart").split()
    assert command[0].startswith("/") and command[0].endswith("/atomd"), command
    assert command[1] == "run", command
    return [word.split("=")[0] for word in command[2:] if word.startswith("-")]


def test_units_start_the_daemon_with_options_it_has(unit: Unit, template: Unit) -> None:
    known = run_help_options()
    assert {"--data-dir", "--control", "--listen", "--device"} <= known  # the help was read
    for parsed in (unit, template):
        options = exec_start_options(parsed)
        assert set(options) <= known, options
        assert "--seed" not in options  # peers to join come from the env file
    assert exec_start_options(template) == ["--device"]
    assert exec_start_options(parse_unit("[Service]\nExecStart=/x/atomd run --nope 1\n")) == [
        "--nope"
    ]
    assert "--nope" not in known


def test_template_runs_one_daemon_per_gpu(template: Unit) -> None:
    assert "%i" in _one(template, "Unit", "Description")
    environment = template["Service"]["Environment"]
    assert "CUDA_VISIBLE_DEVICES=%i" in environment
    assert "ATOMD_DATA_DIR=%S/atomd-%i" in environment
    assert _one(template, "Service", "StateDirectory") == "atomd-%i"
    assert _one(template, "Service", "CacheDirectory") == "atomd-%i"
    assert all("%C/atomd-%i" in v for v in environment if v.split("=")[0].endswith("CACHE_DIR"))
    # The shared settings (optional), then the instance's own (required: its ports) override.
    assert template["Service"]["EnvironmentFile"] == [
        "-/etc/atomd/atomd.env",
        "/etc/atomd/atomd-%i.env",
    ]
    assert _one(template, "Service", "User") == "atomd-%i"
    assert _one(template, "Service", "SyslogIdentifier") == "atomd-%i"
    assert set(_VAR.findall(" ".join(environment))) <= KNOWN_VARS


# The keys in which one instance of the template differs from atomd.service.
PER_INSTANCE = {
    "ExecStart", "Environment", "EnvironmentFile", "StateDirectory", "CacheDirectory",
    "SyslogIdentifier", "User",
}  # fmt: skip


def test_template_is_the_unit_otherwise(unit: Unit, template: Unit) -> None:
    """Hardening, watchdog and restart policy are the same as atomd.service's."""
    for section in ("Service", "Install"):
        same = {k: v for k, v in unit[section].items() if k not in PER_INSTANCE}
        assert {k: v for k, v in template[section].items() if k not in PER_INSTANCE} == same
    unit_env = [v for v in unit["Service"]["Environment"] if not v.startswith(("ATOMD_", "XDG_"))]
    unit_env = [v for v in unit_env if "CACHE_DIR" not in v]
    assert set(unit_env) <= set(template["Service"]["Environment"])


def _verify(unit_text: str, directory: Path, name: str = "atomd.service") -> list[str]:
    """Problems `systemd-analyze verify` reports about this unit (its own lines only); a
    template (``atomd@.service``) is verified through its instance ``atomd@0.service``."""
    # verify insists that ExecStart's binary exists: point it at one that does, so the check
    # judges the unit rather than this machine's install layout.
    venv_bin = Path(sys.executable).parent
    executable = shutil.which("atomd", path=str(venv_bin)) or sys.executable
    text = re.sub(r"(?m)^ExecStart=\S+", f"ExecStart={executable}", unit_text)
    assert text != unit_text or str(executable) in unit_text
    path = directory / name
    path.write_text(text)
    target = directory / name.replace("@.", "@0.")
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(target)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    output = (result.stdout + result.stderr).splitlines()
    problems = [line for line in output if "atomd" in line]
    if result.returncode != 0:
        problems.append(f"exit status {result.returncode}: {output}")
    return problems


needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed"
)


@needs_systemd_analyze
def test_systemd_analyze_verify_accepts_unit(tmp_path: Path) -> None:
    assert _verify(UNIT.read_text(), tmp_path) == []


@needs_systemd_analyze
def test_systemd_analyze_verify_catches_mistakes(tmp_path: Path) -> None:
    """The check above means something: a misspelt key is reported."""
    broken = UNIT.read_text().replace("[Service]\n", "[Service]\nWatchdogSecs=30\n", 1)
    assert any("WatchdogSecs" in line for line in _verify(broken, tmp_path))


@needs_systemd_analyze
def test_systemd_analyze_verify_accepts_the_template(tmp_path: Path) -> None:
    assert _verify(TEMPLATE.read_text(), tmp_path, TEMPLATE.name) == []
    broken = TEMPLATE.read_text().replace("[Service]\n", "[Service]\nWatchdogSecs=30\n", 1)
    assert any("WatchdogSecs" in line for line in _verify(broken, tmp_path, TEMPLATE.name))


def _env_example() -> dict[str, str]:
    """The example's settings, commented out or not: name → default value."""
    settings: dict[str, str] = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        match = re.fullmatch(r"#?\s*(ATOMD_[A-Z0-9_]+)=(\S*)", line.strip())
        if match:
            settings[match[1]] = match[2]
    return settings


def test_env_example_lists_every_setting_and_nothing_else() -> None:
    settings = _env_example()
    assert (
        sorted(set(Settings.model_fields) - {k[len(ENV_PREFIX) :].lower() for k in settings}) == []
    )
    assert set(settings) == KNOWN_VARS
    # Every mention anywhere in the file, prose included, is a real setting.
    assert set(_VAR.findall(ENV_EXAMPLE.read_text())) <= KNOWN_VARS
    assert settings["ATOMD_DATA_DIR"] == "/var/lib/atomd"
    assert settings["ATOMD_CONTROL"] == "127.0.0.1:7070"
    assert settings["ATOMD_LISTEN"] == "0.0.0.0:7071"
    assert settings["ATOMD_DEVICE"] == "auto"
    # systemd's EnvironmentFile= takes plain assignments, not shell.
    assert "export " not in ENV_EXAMPLE.read_text()


def test_env_example_explains_each_setting_in_one_comment_line() -> None:
    setting = re.compile(r"#?ATOMD_[A-Z0-9_]+=\S*")
    lines = ENV_EXAMPLE.read_text().splitlines()
    for i, line in enumerate(lines):
        if not setting.fullmatch(line):
            continue
        name, comment, before = line.lstrip("#").split("=")[0], lines[i - 1], lines[i - 2]
        assert comment.startswith("# ") and len(comment) > 10, f"{name}: no comment above"
        assert len(comment) <= 100, f"{name}: comment over 100 characters"
        # One line: above the comment, a blank line or the setting before.
        assert before == "" or setting.fullmatch(before), f"{name}: a comment of several lines"


def _settings(env: dict[str, str]) -> Settings:
    """The daemon's own validation of these ``ATOMD_*`` values (unknown names included)."""
    check_environment(env)
    prefix = len("ATOMD_")
    fields: dict[str, Any] = {name[prefix:].lower(): value for name, value in env.items()}
    return Settings(**fields)


def test_env_example_defaults_are_the_daemons() -> None:
    settings = _env_example()
    defaults = {name: field.default for name, field in Settings.model_fields.items()}
    for name, default in defaults.items():
        if isinstance(default, bool):
            assert settings[f"ATOMD_{name.upper()}"] == str(default).lower(), name
        elif isinstance(default, int | float | str):
            assert type(default)(settings[f"ATOMD_{name.upper()}"]) == default, name
    # The example values that are filled in are valid settings.
    _settings({name: value for name, value in settings.items() if value})


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined."""
    # As Docker does: comment lines go first, then continuation lines are joined.
    lines = [
        line for line in DOCKERFILE.read_text().splitlines() if not line.strip().startswith("#")
    ]
    instructions: list[tuple[str, str]] = []
    for line in re.sub(r"\\\n", " ", "\n".join(lines)).splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            instructions.append((word.upper(), rest.strip()))
    return instructions


def _dockerfile_arg(name: str) -> str:
    values = [rest for word, rest in _dockerfile() if word == name]
    assert values, f"no {name} in the Dockerfile"
    return values[-1]


def test_dockerfile_runs_the_daemon_unprivileged() -> None:
    assert _dockerfile_arg("USER") not in ("root", "0")
    assert json.loads(_dockerfile_arg("ENTRYPOINT")) == ["atomd"]
    cmd = json.loads(_dockerfile_arg("CMD"))
    assert cmd[0] == "run"
    # A control plane on 0.0.0.0 needs ATOMD_CONTROL_TOKEN, which an image cannot ship.
    assert "0.0.0.0:7070" not in " ".join(cmd)
    assert set(_dockerfile_arg("EXPOSE").split()) == {"7070", "7071"}
    assert "/var/lib/atomd" in _dockerfile_arg("VOLUME")
    args = [rest for word, rest in _dockerfile() if word == "ARG"]
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in args, "CPU torch by default"
    assert set(_VAR.findall(DOCKERFILE.read_text())) <= KNOWN_VARS


def _dockerfile_healthcheck() -> list[str]:
    rest = _dockerfile_arg("HEALTHCHECK")
    command: list[str] = json.loads(rest[rest.index("CMD ") + len("CMD ") :])
    return command


class _Control(http.server.BaseHTTPRequestHandler):
    """A stand-in control plane: /healthz answers 200 only with the right bearer token."""

    def do_GET(self) -> None:
        ok = self.path == "/healthz" and self.headers.get("Authorization") == "Bearer s3cret"
        self.send_response(200 if ok else 401)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def control_port() -> Iterator[int]:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Control)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    thread.join()
    server.server_close()


@pytest.mark.parametrize(("token", "healthy"), [("s3cret", True), ("wrong", False)])
def test_dockerfile_healthcheck_probes_healthz(
    control_port: int, token: str, healthy: bool
) -> None:
    command = _dockerfile_healthcheck()
    assert command[:2] == ["python", "-c"]
    env = {"ATOMD_CONTROL": f"0.0.0.0:{control_port}", "ATOMD_CONTROL_TOKEN": token}
    result = subprocess.run(
        [sys.executable, "-c", command[2]], env=env, capture_output=True, timeout=30, check=False
    )
    assert (result.returncode == 0) is healthy, result.stderr


def test_compose_uses_only_known_settings() -> None:
    assert set(_VAR.findall(COMPOSE.read_text())) <= KNOWN_VARS


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed")
    loaded: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return loaded


def _default(value: str) -> str:
    """Compose's `${NAME:-default}` with NAME unset."""
    return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", value)


def test_compose_is_a_three_peer_swarm(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert sorted(services) == ["peer1", "peer2", "peer3"]
    images = {service["image"] for service in services.values()}
    assert len(images) == 1, "one image for every peer"
    for name, service in services.items():
        env = {key: _default(str(value)) for key, value in service["environment"].items()}
        assert env["ATOMD_ADVERTISE"] == f"https://{name}:7071"
        assert env["ATOMD_LISTEN"].endswith(":7071")
        assert env["ATOMD_DEVICE"] == "cpu"
        assert env["ATOMD_SWARM"] and env["ATOMD_SWARM_SECRET"]
        # The control plane leaves loopback inside the container, so it must have a token.
        assert env["ATOMD_CONTROL"] == "0.0.0.0:7070"
        assert env["ATOMD_CONTROL_TOKEN"]
        _settings(env)  # what the daemon itself would accept
        assert service["healthcheck"]["test"][0] == "CMD"
        compile(service["healthcheck"]["test"][-1], f"{name} healthcheck", "exec")
    seeds = {name: service["environment"].get("ATOMD_SEEDS") for name, service in services.items()}
    assert seeds == {"peer1": None, "peer2": "https://peer1:7071", "peer3": "https://peer1:7071"}
    for name in ("peer2", "peer3"):
        assert "peer1" in services[name]["depends_on"]


def test_compose_ports_and_volumes_are_per_peer(compose: dict[str, Any]) -> None:
    published: list[str] = []
    mounts: list[str] = []
    for service in compose["services"].values():
        for mapping in service["ports"]:
            host_ip, host_port, container_port = mapping.split(":")
            assert host_ip == "127.0.0.1", "control planes are published on loopback only"
            assert container_port == "7070", "the peer plane stays inside the compose network"
            published.append(host_port)
        (volume,) = service["volumes"]
        source, target = volume.split(":")
        assert target == service["environment"]["ATOMD_DATA_DIR"] == "/var/lib/atomd"
        mounts.append(source)
    assert len(set(published)) == len(published) == 3
    assert len(set(mounts)) == 3
    assert set(mounts) == set(compose["volumes"])


def test_compose_documents_the_gpu_variant() -> None:
    text = COMPOSE.read_text()
    assert re.search(r"(?m)^\s*#\s*- driver: nvidia$", text)
    assert "capabilities: [gpu]" in text


def test_docker_compose_config_validates() -> None:
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("docker is not installed")
    probe = subprocess.run(
        [docker, "compose", "version"], capture_output=True, timeout=30, check=False
    )
    if probe.returncode != 0:
        pytest.skip("the docker compose plugin is not installed")
    result = subprocess.run(
        [docker, "compose", "-f", str(COMPOSE), "config", "-q"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
