"""Daemon settings: flags, ``ATOMD_*`` variables or a TOML file, in that order of precedence.

One typed object (pydantic-settings). Unknown ``ATOMD_*`` variables and bad values stop the
start with a message that names them, so a typo never passes silently.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import socket
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from atomd.errors import ConfigError

ENV_PREFIX = "ATOMD_"
# Variables read outside Settings (the config-file path itself, the CLI clients' target).
# Read by atomd itself, not settings of `atomd run`: ATOMD_TEST_PORTS (``launch.PORTS_ENV``) is
# the port range `atomd demo` and the test suite's daemons take theirs from.
_OTHER_VARS = {"ATOMD_CONFIG", "ATOMD_URL", "ATOMD_TEST_PORTS"}

# A job's records kept (``atomd.db.retention``): its newest sync rounds, and its newest
# progress points at full resolution (about as many older ones, thinned, besides).
ROUNDS_KEEP = 20_000
PROGRESS_KEEP = 10_000


def _default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "atomd"


def split_host_port(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 as ``[::1]:7070``) -> (host, port); raises ValueError."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{value!r} is not HOST:PORT")
    if not 0 <= int(port) <= 65535:
        raise ValueError(f"port {port} out of range")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Settings(BaseSettings):
    """Everything ``atomd run`` needs. Each field is also ``ATOMD_<NAME>``."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    data_dir: Path = Field(
        default_factory=_default_data_dir,
        description="Database, identity key and job folders (checkpoints, metrics).",
    )
    control: str = Field("127.0.0.1:7070", description="Control API HOST:PORT (REST, curl).")
    listen: str = Field("0.0.0.0:7071", description="Peer plane HOST:PORT (other daemons).")
    advertise: str | None = Field(
        None, description="URL peers use to reach this daemon; default: https://<hostname>:<port>."
    )
    seeds: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Peer-plane URLs of peers to join through (comma-separated).",
    )
    # Every member of a swarm must use the same setting.
    peer_tls: bool = Field(
        True,
        description="TLS 1.3 on the peer plane, bound to peer ids; off is unsafe plain HTTP, for "
        "loopback tests.",
    )
    swarm: str = Field("default", description="Swarm name; peers of other swarms are refused.")
    swarm_secret: SecretStr | None = Field(None, description="Shared secret admitting peers.")
    allowed_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Only peers with these Ed25519 public keys (hex, comma-separated) are "
        "admitted.",
    )
    # Where the kernel does not offer or allow it, the system's default stays (with a warning).
    # Cubic carried a slow uplink's frames much better than BBR (atomd.p2p.congestion).
    tcp_congestion: str = Field(
        "cubic",
        pattern=r"^[A-Za-z0-9_.]{1,15}$",
        description="TCP congestion control of peer-plane connections (Linux); 'system' keeps the "
        "kernel's.",
    )
    auto_join: bool = Field(True, description="Join jobs other peers announce to the swarm.")
    zeroconf: bool = Field(False, description="Find peers on the local network (mDNS).")
    gossip_interval: float = Field(
        0.5, gt=0, le=60, description="Seconds between membership probes (SWIM protocol period)."
    )
    # The gossip interval applies again as soon as anything changes.
    gossip_settled_interval: float = Field(
        1.5, gt=0, le=60,
        description="Seconds between membership probes while nothing changes and nobody is "
        "suspect.",
    )  # fmt: skip
    suspect_timeout: float = Field(
        5.0, gt=0, le=600, description="Seconds a suspected peer has to refute before it is dead."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Training device.")
    # On a busy machine the control API and the peer plane then answer before the next training
    # step; it costs no training speed when the CPU is otherwise free.
    trainer_nice: int = Field(
        10, ge=0, le=19,
        description="Niceness added to the training threads (Linux); 0 leaves them as they are.",
    )  # fmt: skip
    control_token: SecretStr | None = Field(
        None, description="Bearer token for the control API; required off loopback."
    )
    # A request with another Host header is refused (DNS rebinding).
    control_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="More host names the control API answers to, besides loopback and its bind "
        "address.",
    )
    events_keep: int = Field(
        100_000, ge=100, le=100_000_000,
        description="Events (audit log rows) kept; older ones are deleted every minute.",
    )  # fmt: skip
    rounds_keep: int = Field(
        ROUNDS_KEEP, ge=1_000, le=100_000_000,
        description="Sync rounds (a row per delta sent or received) kept per job, the newest.",
    )  # fmt: skip
    # Every minute the older points are thinned to about as many again, spread over the run; a
    # job's first point and its points with a validation loss are always kept.
    progress_keep: int = Field(
        PROGRESS_KEEP, ge=100, le=100_000_000,
        description="Progress points (logged steps) kept per job at full resolution, the newest.",
    )  # fmt: skip
    data_names: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict,
        description="Datasets a swarm job's `data` may name (NAME=PATH, comma-separated).",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="Least severe level logged (DEBUG, INFO, WARNING or ERROR)."
    )
    log_format: Literal["text", "json"] = Field(
        "text", description="Log lines as text, or as JSON objects (time, level, logger, message)."
    )
    wandb_project: str | None = Field(
        None,
        description="Log every job to this Weights & Biases project (offline unless WANDB_MODE).",
    )
    # Launchers such as `atomd demo` pass their own pid so that no daemon outlives them.
    parent_pid: int | None = Field(
        None,
        ge=1,
        description="Stop (the job checkpoints, as on SIGTERM) when this process exits.",
    )

    @field_validator("seeds", "allowed_keys", "control_hosts", mode="before")
    @classmethod
    def _split_seeds(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [s.strip() for s in v.split(",") if s.strip()]
        return v

    @field_validator("control_hosts")
    @classmethod
    def _lower_hosts(cls, v: list[str]) -> list[str]:
        return [h.lower().strip("[]") for h in v]

    @field_validator("data_names", mode="before")
    @classmethod
    def _split_names(cls, v: Any) -> Any:
        if isinstance(v, str):
            out: dict[str, str] = {}
            for item in (x.strip() for x in v.split(",")):
                if not item:
                    continue
                name, sep, path = item.partition("=")
                if not sep or not name.strip() or not path.strip():
                    raise ValueError(f"{item!r}: expected NAME=PATH")
                out[name.strip()] = path.strip()
            return out
        return v

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, v: Any) -> Any:
        return v.upper() if isinstance(v, str) else v

    @field_validator("control", "listen")
    @classmethod
    def _host_port(cls, v: str) -> str:
        split_host_port(v)
        return v

    @field_validator("advertise", "seeds")
    @classmethod
    def _urls(cls, v: Any) -> Any:
        for url in [v] if isinstance(v, str) else v or []:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{url!r} must be an http:// or https:// URL")
        return v

    @field_validator("allowed_keys")
    @classmethod
    def _hex_keys(cls, v: list[str]) -> list[str]:
        for key in v:
            try:
                raw = bytes.fromhex(key)
            except ValueError:
                raw = b""
            if len(raw) != 32:
                raise ValueError(f"{key!r} is not a 32-byte Ed25519 public key in hex")
        return [k.lower() for k in v]

    @model_validator(mode="after")
    def _peer_scheme(self) -> Settings:
        want = "https://" if self.peer_tls else "http://"
        for what, url in [("--advertise", self.advertise), *(("--peer", u) for u in self.seeds)]:
            if url is not None and not url.lower().startswith(want):
                why = (
                    "the peer plane uses TLS (ATOMD_PEER_TLS, the default)"
                    if self.peer_tls
                    else "the peer plane runs without TLS (--no-peer-tls)"
                )
                raise ValueError(
                    f"{what} {url!r}: {why}, so peer URLs start with {want}; every member of "
                    "a swarm must use the same setting"
                )
        return self

    @model_validator(mode="after")
    def _token_off_loopback(self) -> Settings:
        host, _ = split_host_port(self.control)
        if not is_loopback(host) and self.control_token is None:
            raise ValueError(
                f"the control API on {self.control} is reachable off this host: "
                "set ATOMD_CONTROL_TOKEN (a bearer token) or bind it to 127.0.0.1"
            )
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = os.environ.get("ATOMD_CONFIG")
        if path:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=Path(path)))
        return tuple(sources)

    @property
    def control_host_port(self) -> tuple[str, int]:
        return split_host_port(self.control)

    @property
    def allowed_control_hosts(self) -> frozenset[str]:
        """Host names (lower case, no port, no brackets) the control API answers to."""
        host, _ = split_host_port(self.control)
        names = {"localhost", "127.0.0.1", "::1", *self.control_hosts}
        if host not in ("0.0.0.0", "::", ""):
            names.add(host.lower().strip("[]"))
        return frozenset(names)

    @property
    def listen_host_port(self) -> tuple[str, int]:
        return split_host_port(self.listen)

    @property
    def advertise_url(self) -> str:
        if self.advertise:
            return self.advertise.rstrip("/")
        host, port = self.listen_host_port
        if host in ("0.0.0.0", "::", ""):
            host = socket.getfqdn()
        scheme = "https" if self.peer_tls else "http"
        return f"{scheme}://{host}:{port}"

    @property
    def db_path(self) -> Path:
        return self.data_dir / "atomd.db"

    @property
    def jobs_dir(self) -> Path:
        return self.data_dir / "jobs"


# Settings whose flag is not the field's name, and those that have no flag at all.
FLAGS: dict[str, str | None] = {
    "seeds": "--peer",
    "allowed_keys": "--allow-key",
    "gossip_interval": None,
    "gossip_settled_interval": None,
    "suspect_timeout": None,
    "control_token": None,
    "control_hosts": None,
    "events_keep": None,
    "rounds_keep": None,
    "progress_keep": None,
    "data_names": None,
    "trainer_nice": None,
    "tcp_congestion": None,
}


def setting_name(field: str) -> str:
    """How a person sets ``field``: ``--peer / ATOMD_SEEDS``, or only ``ATOMD_GOSSIP_INTERVAL``."""
    flag = FLAGS.get(field, f"--{field.replace('_', '-')}")
    env = f"{ENV_PREFIX}{field.upper()}"
    return f"{flag} / {env}" if flag else env


def check_environment(environ: dict[str, str] | None = None) -> None:
    """Refuse unknown ``ATOMD_*`` variables, suggesting the closest known name."""
    environ = dict(os.environ) if environ is None else environ
    known = {ENV_PREFIX + name.upper() for name in Settings.model_fields} | _OTHER_VARS
    unknown = sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in known)
    if unknown:
        hints = []
        for k in unknown:
            close = difflib.get_close_matches(k, sorted(known), n=1)
            hints.append(f"{k}" + (f" (did you mean {close[0]}?)" if close else ""))
        raise ConfigError("unknown environment variable(s): " + ", ".join(hints))


def load_settings(**overrides: Any) -> Settings:
    """Settings from flags (``overrides``, None = not given), environment and TOML file."""
    check_environment()
    config_path = os.environ.get("ATOMD_CONFIG")
    if config_path and not Path(config_path).is_file():
        raise ConfigError(f"ATOMD_CONFIG={config_path}: no such file")
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = err["loc"]
            name = setting_name(str(loc[0])) if loc else "settings"
            if len(loc) > 1:  # an item of a list: --peer / ATOMD_SEEDS (item 2)
                name += f" (item {int(loc[1]) + 1})" if isinstance(loc[1], int) else ""
            lines.append(f"  {name}: {err['msg']}")
        raise ConfigError("invalid settings:\n" + "\n".join(lines)) from None
