"""Host-side settings: SANDMAN_* environment variables over a TOML file in the XDG config dir.

``Settings.load()`` is the one entry point; ``describe()`` reports every effective value and the
place it came from, with secrets masked, for ``sandman config show``.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field, SecretStr, ValidationError
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
