"""The sandbox's environment: built from the policy, never inherited from the host.

A command sees the policy's fixed values (``allow``), the host variables it names
(``passthrough``) when they are present and not refused, and the controller's own ``SANDMAN_*``
variables; nothing else from the host. Refusals are reported by name and reason, never by value.

Refused names cover credentials (cloud keys, tokens, agent sockets) and variables that make a
program load code (``LD_PRELOAD``, ``PYTHONPATH``, ``BASH_ENV``, ``GIT_CONFIG_*``, ...). Secrets
a policy means to inject are handled elsewhere, by the secrets mechanism; they never travel
through ``allow`` or ``passthrough``. Refusal matching ignores case (``aws_secret`` is refused
as ``AWS_*``): a false refusal costs a policy edit, a false pass leaks a credential.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sandman.errors import ConfigError

_NAME = re.compile(r"\A[A-Za-z_][A-Za-z0-9_]*\Z")  # \Z: a trailing newline is not a name
RESERVED_PREFIX = "SANDMAN_"  # set only by the controller

DEFAULT_REFUSED_NAMES: tuple[str, ...] = (
    "DATABASE_URL",
    "REDIS_URL",
    "SSH_AUTH_SOCK",
    "GPG_AGENT_INFO",
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    "LD_AUDIT",
    "PYTHONPATH",
    "PYTHONSTARTUP",
    "PYTHONHOME",
    "NODE_OPTIONS",
    "BASH_ENV",
    "ENV",
    "PERL5OPT",
    "PERL5LIB",
    "RUBYOPT",
    "DOCKER_HOST",
    "KUBECONFIG",
    # git runs these programs, and GIT_CONFIG_* (below) can define aliases the command check misses.
    "GIT_SSH",
    "GIT_SSH_COMMAND",
    "GIT_ASKPASS",
    "SSH_ASKPASS",
)
DEFAULT_REFUSED_PATTERNS: tuple[str, ...] = (
    "AWS_*",
    "GCP_*",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "AZURE_*",
    "*_TOKEN",
    "*_SECRET",
    "*_SECRET_*",
    "*_PASSWORD",
    "*_API_KEY",
    "*_ACCESS_KEY",
    "*_PRIVATE_KEY",
    "*_CREDENTIALS",
    "GIT_CONFIG*",
)


def _check_name(name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"{name!r} is not a variable name: use letters, digits and '_', not starting with a digit")
    return name


class EnvironmentPolicy(BaseModel):
    """What the sandbox's environment may hold; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    allow: dict[str, str] = Field(default_factory=dict)  # fixed values set for every command
    passthrough: list[str] = Field(default_factory=list)  # host variable names copied when present
    refuse_names: list[str] = Field(default_factory=lambda: list(DEFAULT_REFUSED_NAMES))
    refuse_patterns: list[str] = Field(default_factory=lambda: list(DEFAULT_REFUSED_PATTERNS))

    @field_validator("allow")
    @classmethod
    def _allow(cls, value: dict[str, str]) -> dict[str, str]:
        for name, text in value.items():
            _check_name(name)
            if "\x00" in text:
                raise ValueError(f"the value of {name!r} contains a NUL byte")
        return value

    @field_validator("passthrough")
    @classmethod
    def _passthrough(cls, value: list[str]) -> list[str]:
        for name in value:
            _check_name(name)
        return value

    @field_validator("refuse_patterns")
    @classmethod
    def _patterns(cls, value: list[str]) -> list[str]:
        if any(not p for p in value):
            raise ValueError("an empty pattern: write e.g. 'AWS_*'")
        return value


@dataclass(frozen=True)
class EnvResult:
    env: dict[str, str]
    refused: list[tuple[str, str]] = field(default_factory=list)  # (name, reason); never values


def refusal(name: str, policy: EnvironmentPolicy) -> str | None:
    """Why ``name`` may not come from ``allow`` or ``passthrough``, or None when it may."""
    found = _refusal(name, policy)
    return found[0] if found else None


def _refusal(name: str, policy: EnvironmentPolicy) -> tuple[str, str] | None:
    """(why, how to fix the policy), or None."""
    if not _NAME.match(name):
        return "is not a valid variable name", "rename it"
    upper = name.upper()
    if upper.startswith(RESERVED_PREFIX):
        return f"is reserved: only the controller sets {RESERVED_PREFIX}* variables", "remove it"
    if any(upper == n.upper() for n in policy.refuse_names):
        return (
            "is refused by environment.refuse_names",
            "remove it, or take it out of environment.refuse_names if you mean it",
        )
    for pattern in policy.refuse_patterns:
        if fnmatchcase(upper, pattern.upper()):
            return (
                f"is refused by pattern {pattern!r}",
                f"remove it (secrets have their own setting), or take {pattern!r} out of "
                "environment.refuse_patterns if it holds none",
            )
    return None


def _problems(policy: EnvironmentPolicy) -> Iterable[str]:
    for key, names in (("allow", list(policy.allow)), ("passthrough", policy.passthrough)):
        for name in names:
            if found := _refusal(name, policy):
                yield f"environment.{key}: {name!r} {found[0]}: {found[1]}"
    for name in policy.passthrough:
        if name in policy.allow:
            yield f"environment.passthrough: {name!r} is also in environment.allow: keep one of them"


def validate_policy(policy: EnvironmentPolicy) -> None:
    """Raise ConfigError naming the first ``allow`` or ``passthrough`` entry that is refused or reserved."""
    for problem in _problems(policy):
        raise ConfigError(problem)


def build_env(policy: EnvironmentPolicy, host_env: Mapping[str, str], controller_env: Mapping[str, str]) -> EnvResult:
    """The complete environment of a sandboxed command, and what was refused on the way.

    Refuses per variable rather than failing the run, so an unvalidated policy still leaks nothing.
    """
    env: dict[str, str] = {}
    refused: list[tuple[str, str]] = []

    def put(name: str, value: str, source: str) -> None:
        if "\x00" in value:
            refused.append((name, f"{source}: its value contains a NUL byte"))
        else:
            env[name] = value

    for name, value in policy.allow.items():
        if why := refusal(name, policy):
            refused.append((name, f"environment.allow: {why}"))
        else:
            put(name, value, "environment.allow")
    for name in policy.passthrough:
        if why := refusal(name, policy):
            refused.append((name, f"environment.passthrough: {why}"))
        elif name in host_env:
            put(name, host_env[name], "environment.passthrough")
    for name, value in controller_env.items():
        if not (_NAME.match(name) and name.startswith(RESERVED_PREFIX)):
            refused.append((name, f"controller: only {RESERVED_PREFIX}* variables may come from the controller"))
        else:
            put(name, value, "controller")
    return EnvResult(env, refused)
