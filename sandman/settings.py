"""Host-side settings: SANDMAN_* environment variables over a TOML file in the XDG config dir.

``Settings.load()`` is the one entry point; ``describe()`` reports every effective value and the
place it came from, with secrets masked, for ``sandman config show``.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from sandman.errors import ConfigError

ENV_PREFIX = "SANDMAN_"


def _xdg(var: str, fallback: str) -> Path:
    value = os.environ.get(var)
    return Path(value) if value else Path.home() / fallback


def config_file() -> Path:
    """The TOML settings file: $SANDMAN_CONFIG, else $XDG_CONFIG_HOME/sandman/config.toml."""
    explicit = os.environ.get("SANDMAN_CONFIG")
    return Path(explicit) if explicit else _xdg("XDG_CONFIG_HOME", ".config") / "sandman" / "config.toml"


def _default_state_dir() -> Path:
    return _xdg("XDG_STATE_HOME", ".local/state") / "sandman"


def _default_runtime_dir() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "sandman"
    return Path("/tmp") / f"sandman-{os.getuid()}"


class Settings(BaseSettings):
    """Effective host settings. Every field can be set as SANDMAN_<FIELD> or in config.toml."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True)

    backend: str = Field(
        default="docker",
        description="what runs layer 1: docker, gvisor, podman, podman-rootless or local (see `sandman backends`)",
    )
    podman_host: str | None = Field(
        default=None, description="rootful podman API socket; unset means unix:///run/podman/podman.sock"
    )
    podman_rootless_host: str | None = Field(
        default=None, description="rootless podman API socket; unset means podman_user's /run/user/UID/podman"
    )
    podman_user: str = Field(default="sandman-podman", description="the user rootless podman runs as")
    docker_host: str | None = Field(
        default=None, description="Docker engine URL; unset means DOCKER_HOST or the local socket"
    )
    state_dir: Path = Field(default_factory=_default_state_dir, description="sessions and audit log")
    runtime_dir: Path = Field(
        default_factory=_default_runtime_dir, description="per-session runtime dirs (upcall sockets)"
    )
    base_image: str = Field(
        default="debian:bookworm-slim",
        description="image the sandbox image is built FROM; built offline when it cannot be pulled",
    )
    offline_base_image: str = Field(
        default="sandman/debian-bookworm:offline",
        description="tag of the debootstrap-built base used when base_image cannot be pulled",
    )
    default_policy: Path | None = Field(
        default=None, description="operator policy file; unset means policies/default.toml"
    )
    secrets: dict[str, SecretStr] = Field(
        default_factory=dict, description="host-side secrets a policy may inject by name"
    )
    engine_timeout_s: float = Field(default=60.0, gt=0, description="timeout of one engine API call")
    helpers_dir: Path | None = Field(default=None, description="operator upcall helpers (executables)")
    # -- upcall relay bulkheads: what one session may cost the host (see sandman/upcall/relay.py) --------
    relay_isolation: Literal["process", "shared"] = Field(
        default="process",
        description="'process': each session's relay is its own process (a flood, leak or crash stays in "
        "its session); 'shared': all relays on one event loop in the hosting process",
    )
    upcall_call_timeout_s: float = Field(default=120.0, gt=0, description="one upcall's deadline")
    upcall_scan_timeout_s: float = Field(
        default=10.0, gt=0, description="credential check of one upcall's arguments or output; slower is refused"
    )
    upcall_rate_per_s: float = Field(default=20.0, gt=0, description="upcalls per second per session")
    upcall_rate_burst: int = Field(default=50, ge=1, description="upcall burst per session")
    upcall_max_connections: int = Field(default=32, ge=1, description="open connections per session")
    upcall_max_pending: int = Field(default=8, ge=1, description="helper calls in progress per session")
    upcall_max_inflight_bytes: int = Field(
        default=32 << 20, ge=1 << 20, description="request and reply bytes buffered per session"
    )
    upcall_write_timeout_s: float = Field(default=10.0, gt=0, description="a reply not read by then is dropped")
    upcall_idle_timeout_s: float = Field(default=60.0, gt=0, description="a connection silent this long is closed")
    upcall_max_fds: int = Field(default=256, ge=64, description="descriptors of one session's relay process")
    upcall_memory_bytes: int = Field(
        default=1 << 30, ge=128 << 20, description="data memory of one session's relay process (RLIMIT_DATA)"
    )
    upcall_log_lines_per_min: int = Field(default=60, ge=1, description="host log lines per session per minute")
    # -- audit store bounds -------------------------------------------------------------------------
    audit_record_max_bytes: int = Field(
        default=4096, ge=512, description="one audit record; longer values are cut to a head, length and digest"
    )
    audit_records_per_min: int = Field(
        default=600, ge=10, description="audit records one session may write per minute; the rest are counted"
    )
    audit_coalesce_s: float = Field(
        default=60.0, ge=0, description="identical refusals within this window become one record with a count"
    )
    audit_max_bytes: int = Field(
        default=64 << 20, ge=1 << 20, description="state database size cap; the oldest audit records go first"
    )
    audit_retention_days: float = Field(default=90.0, gt=0, description="audit records older than this are deleted")
    log_rotation_bytes: int = Field(default=10 << 20, ge=1 << 16, description="a log file rotates at this size")
    log_retention_files: int = Field(default=3, ge=1, description="rotated log files kept")

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        from sandman.backends import REGISTRY

        if v not in REGISTRY:
            raise ValueError(f"unknown backend {v!r}: choose one of {', '.join(REGISTRY)}")
        return v

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls, toml_file=config_file()))

    @classmethod
    def load(cls, **overrides: Any) -> Settings:
        """Read settings, turning any invalid value into one ConfigError line."""
        path = config_file()
        try:
            return cls(**overrides)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
        except ValidationError as exc:
            err = exc.errors()[0]
            key = ".".join(str(p) for p in err["loc"])
            env = ENV_PREFIX + key.split(".")[0].upper()
            where = f"environment {env}" if env in os.environ else str(path)
            raise ConfigError(f"{where}: setting {key!r}: {err['msg']}") from None

    def docker_base_url(self) -> str:
        return self.docker_host or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


@dataclass(frozen=True)
class SettingView:
    name: str
    value: str
    source: str
    description: str


def describe(settings: Settings) -> list[SettingView]:
    """Every setting with its effective value (secrets masked) and where it came from."""
    path = config_file()
    try:
        file_values = tomllib.loads(path.read_text()) if path.is_file() else {}
    except (OSError, tomllib.TOMLDecodeError):
        file_values = {}
    views = []
    for name, field in Settings.model_fields.items():
        env = ENV_PREFIX + name.upper()
        if env in os.environ:
            source = f"env {env}"
        elif name in file_values:
            source = f"file {path}"
        else:
            source = "default"
        value: Any = getattr(settings, name)
        if isinstance(value, dict):
            shown = ", ".join(f"{k}=********" for k in sorted(value)) or "(none)"
        elif value is None:
            shown = "(unset)"
        else:
            shown = str(value)
        if name == "docker_host" and value is None:
            shown = f"(unset) -> {settings.docker_base_url()}"
        views.append(SettingView(name, shown, source, field.description or ""))
    return views
