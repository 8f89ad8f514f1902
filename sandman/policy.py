"""The policy: one typed, strict model that every layer reads (resources, network, runtime).

Policies are TOML files: sandman's defaults live in ``policies/``; an operator names another with
the ``default_policy`` setting or ``--policy``. Unknown keys are errors, and every error names the
file, the key and the reason.
"""

from __future__ import annotations

import hashlib
import os
import re
import tomllib
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from sandman import resources
from sandman.errors import ConfigError, UsageError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: object) -> int:
    """Bytes from an int or a Docker-style size ("512m", "2g", "1.5GiB"); binary units."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 512m or 2g")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (m := _SIZE.match(value)):
        size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise ValueError(f"{value!r} is not a size: use bytes or a number with k, m, g or t (e.g. 512m)")
    if size <= 0:
        raise ValueError("a size must be positive")
    return size


def cli_size(value: str, flag: str) -> int:
    try:
        return parse_size(value)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None


Size = Annotated[int, BeforeValidator(parse_size)]


class Runtime(StrEnum):
    RUNC = "runc"
    RUNSC = "runsc"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Resources(_Strict):
    """Caps for the container (layer 1) and its processes."""

    cpus: float = Field(default=2.0, gt=0, le=512)
    memory: Size = Field(default=2 << 30)
    pids: int = Field(default=512, ge=16)
    tmpfs_size: Size = Field(default=256 << 20, description="size of /tmp; must stay below memory")
    tmpfs_inodes: int = Field(default=65536, ge=64)
    max_file_size: Size = Field(default=4 << 30, description="RLIMIT_FSIZE of every process")
    open_files: int = Field(default=4096, ge=64)
    exec_timeout_s: float | None = Field(default=3600.0, gt=0, description="per exec / run")
    idle_timeout_s: float | None = Field(default=1800.0, gt=0, description="a session with no exec ends")
    session_timeout_s: float | None = Field(default=86400.0, gt=0, description="absolute session lifetime")

    @model_validator(mode="after")
    def _tmpfs_below_memory(self) -> Resources:
        if self.tmpfs_size >= self.memory:
            raise ValueError(
                f"tmpfs_size ({self.tmpfs_size} bytes) must be below memory ({self.memory} bytes): "
                "a full /tmp must not be able to exhaust the memory cap"
            )
        return self


class Policy(_Strict):
    """Everything the sandbox obeys; the layers read only this model."""

    name: str = "default"
    resources: Resources = Resources()
    network: Literal["none"] = "none"
    runtime: Runtime = Runtime.RUNC

    def with_resources(self, **changes: Any) -> Policy:
        """A copy with some resource values replaced (CLI overrides), validated again."""
        data = self.resources.model_dump()
        data.update({k: v for k, v in changes.items() if v is not None})
        try:
            return self.model_copy(update={"resources": Resources(**data)})
        except ValidationError as exc:
            raise UsageError(_first_error(exc)) from None

    def digest(self) -> str:
        """A stable hash of the effective policy (recorded with sessions)."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    key = ".".join(str(p) for p in err["loc"]) or "(top level)"
    msg = str(err["msg"]).removeprefix("Value error, ")
    return f"key {key!r}: {msg}"


def default_policy_path() -> Path:
    return resources.policies_dir() / "default.toml"


def load_named_policy(name_or_path: str | os.PathLike[str]) -> Policy:
    """A shipped policy by name ("default", "strict") or a policy file by path."""
    text = os.fspath(name_or_path)
    shipped = resources.policies_dir() / f"{text}.toml"
    if "/" not in text and not text.endswith(".toml") and shipped.is_file():
        return load_policy(shipped)
    return load_policy(Path(text))


def load_policy(path: Path | None = None) -> Policy:
    """Load and validate a policy file (sandman's default when ``path`` is None)."""
    path = path or default_policy_path()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: policy file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read policy: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    data.setdefault("name", path.stem)
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{path}: {_first_error(exc)}") from None
