"""Policy enforcement at the controller, shared by one-shot runs and sessions: the command check
(with path-like arguments and the working directory), the deny-list masks and read-only
protected paths for layer 2, and the environment split into what may sit on bwrap's argv and
what must not (passthrough values and injected secrets go through a private file).
"""

from __future__ import annotations

import os
import secrets as _secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sandman import bwrap
from sandman.commands import check_command
from sandman.envpolicy import build_env, refusal
from sandman.errors import ConfigError, UsageError
from sandman.paths import DenyScan, PathDenied, denied_by, find_denied, validate_path
from sandman.policy import Policy
from sandman.scrub import EXAMPLE_KEYS, Scrubber
from sandman.settings import Settings
from sandman.workspace import Workspace

ENV_DIR = "env"  # under the session's runtime dir; bound file-by-file into layer 2


class CommandRefused(UsageError):
    """The policy refuses the command; the message names the rule."""

    exit_code = 126


@dataclass(frozen=True)
class Masks:
    """Denied paths to hide and protected paths to re-bind read-only, as container paths."""

    hidden: tuple[tuple[str, bool], ...] = ()  # (path, is_dir)
    read_only: tuple[str, ...] = ()
    scanned: int = 0


@dataclass(frozen=True)
class SandboxEnv:
    public: dict[str, str]  # set with --setenv (visible in bwrap's argv inside the container)
    private: dict[str, str] = field(default_factory=dict)  # passthrough and secrets: via a file
    refused: tuple[tuple[str, str], ...] = ()  # (name, reason), never values
    known_secrets: dict[str, str] = field(default_factory=dict)  # name -> value, for output scrubbing


def known_secrets(settings: Settings, policy: Policy, host_env: Mapping[str, str]) -> dict[str, str]:
    """Every secret the controller knows: the settings' secrets (injected ones and helper
    credentials) and the values of host variables the policy refuses (cloud keys, tokens, ...)."""
    known = {name: value.get_secret_value() for name, value in settings.secrets.items()}
    for name, value in host_env.items():
        if refusal(name, policy.environment) is not None and name not in known:
            known[name] = value
    return known


def make_scrubber(secrets: Mapping[str, str]) -> Scrubber:
    """Known values (and their encodings) plus the credential patterns; public example keys pass."""
    return Scrubber(secrets, patterns=True, allowlist=EXAMPLE_KEYS)


def text_scrubber(settings: Settings) -> Callable[[str], str]:
    """str -> str for the audit writer and error messages: settings secrets and patterns."""
    scrubber = make_scrubber({n: v.get_secret_value() for n, v in settings.secrets.items()})
    return lambda text: scrubber.scrub_text(text)[0]


def _to_container(ws: Workspace, real: Path) -> str:
    return str(Path(bwrap.WORKSPACE) / real.relative_to(ws.path)) if real != ws.path else bwrap.WORKSPACE


def scan_masks(ws: Workspace, policy: Policy) -> Masks:
    """Every denied path that exists now (hidden in layer 2) and the protected ones (read-only)."""
    fs = policy.filesystem
    scan: DenyScan = find_denied(ws.path, fs.deny, fs.allow, limit=max(fs.max_masks * 50, 20000))
    hidden = []
    for denied in scan.paths:
        if denied.path.is_symlink():
            # A bind over a symlink would follow it: the link's content is its target's, and a
            # target inside the workspace is masked under its own name when it is denied.
            continue
        hidden.append((_to_container(ws, denied.path), denied.is_dir))
    if len(hidden) > fs.max_masks:
        raise ConfigError(
            f"{ws.path}: {len(hidden)} paths match the deny list (filesystem.max_masks is {fs.max_masks}): "
            "narrow filesystem.deny or raise filesystem.max_masks"
        )
    hidden_set = {p for p, _ in hidden}
    read_only = []
    for rel in fs.protected:
        real = ws.path / rel
        if real.exists() and not real.is_symlink():
            path = _to_container(ws, real)
            if path not in hidden_set:
                read_only.append(path)
    return Masks(tuple(hidden), tuple(read_only), scan.scanned)


def check_argv(argv: Sequence[str], policy: Policy, ws: Workspace) -> None:
    """Refuse a command the policy does not allow, or one that names a denied workspace path."""
    if not argv:
        raise UsageError("no command given")
    verdict = check_command(argv, policy.commands)
    if not verdict.allowed:
        raise CommandRefused(f"command refused by {verdict.rule}: {verdict.reason}")
    for arg in argv[1:]:
        candidate = _workspace_path(arg, ws, policy)
        if candidate is None:
            continue
        try:
            validate_path(ws.path, candidate, deny=policy.filesystem.deny, allow=policy.filesystem.allow)
        except PathDenied as exc:
            raise CommandRefused(f"argument {arg!r} refused: {exc}") from None


_NOT_A_PATH = set(" \t\n;|&$()<>*?{}[]'\"`\\")


def _workspace_path(arg: str, ws: Workspace, policy: Policy) -> str | None:
    """The workspace-relative path an argument names, if it looks like one (else None).

    Words with spaces or shell syntax are scripts or messages, not paths (`sh -c '...'`); what
    they open is for layer 2 to show or hide."""
    value = arg.split("=", 1)[1] if arg.startswith("--") and "=" in arg else arg
    if not value or value.startswith("-") or len(value) > 4096 or _NOT_A_PATH.intersection(value):
        return None
    if value == bwrap.WORKSPACE or value.startswith(bwrap.WORKSPACE + "/"):
        return value[len(bwrap.WORKSPACE) :].lstrip("/") or "."
    if value.startswith("/") or "://" in value:
        return None  # a container path outside the workspace: layer 2 decides what it shows
    if value == ".." or value.startswith("../"):
        return value
    fs = policy.filesystem
    first = value.split("/", 1)[0]
    if denied_by(value, fs.deny, fs.allow) is not None or os.path.lexists(ws.path / first):
        return value
    return None


def container_cwd(cwd: str | os.PathLike[str] | None, ws: Workspace, policy: Policy) -> str:
    """The working directory inside the sandbox for a host- or workspace-relative ``cwd``."""
    if cwd is None:
        return bwrap.WORKSPACE
    text = os.fspath(cwd)
    if text == bwrap.WORKSPACE or text.startswith(bwrap.WORKSPACE + "/"):
        text = text[len(bwrap.WORKSPACE) :].lstrip("/") or "."
    try:
        real = validate_path(ws.path, text, deny=policy.filesystem.deny, allow=policy.filesystem.allow, must_exist=True)
    except PathDenied as exc:
        raise UsageError(f"cwd {os.fspath(cwd)!r} refused: {exc}") from None
    if not real.is_dir():
        raise UsageError(f"cwd {os.fspath(cwd)!r} is not a directory in the workspace")
    return _to_container(ws, real)


def sandbox_env(
    policy: Policy,
    settings: Settings,
    *,
    host_env: Mapping[str, str],
    controller_env: Mapping[str, str],
    extra: Mapping[str, str] | None = None,
) -> SandboxEnv:
    """Exactly: base + campaign + policy values + SANDMAN_* (public), passthrough + secrets (private)."""
    for key in extra or {}:
        if key.startswith("SANDMAN_"):
            raise UsageError(f"environment variable {key}: the SANDMAN_* namespace is reserved for sandman")
    built = build_env(policy.environment, host_env, controller_env)
    passthrough = set(policy.environment.passthrough)
    public = bwrap.base_env()
    public.update(extra or {})
    private = {}
    for name, value in built.env.items():
        if name in passthrough and name not in policy.environment.allow:
            private[name] = value
        else:
            public[name] = value
    for name in policy.secrets.inject:
        secret = settings.secrets.get(name)
        if secret is None:
            raise ConfigError(
                f"the policy injects secret {name!r}, which is not set: add it under [secrets] in "
                f"the settings file or SANDMAN_SECRETS (JSON)"
            )
        private[name] = secret.get_secret_value()
    for name in private:
        public.pop(name, None)
    known = known_secrets(settings, policy, host_env)
    # Injected secrets are scrubbed from output; passthrough values are configuration, not secrets
    # (scrubbing a value such as "fast" would mangle every output that says "fast").
    known.update({name: private[name] for name in policy.secrets.inject if name in private})
    return SandboxEnv(public, private, tuple(built.refused), known)


def _sh_quote(value: str) -> str:
    return "'" + value.replace("'", "'\\''") + "'"


def write_env_file(runtime_dir: Path, ws: Workspace, values: Mapping[str, str]) -> tuple[Path, str]:
    """A private, shell-sourceable file for the sandbox's exec shim: (host path, container path)."""
    env_dir = runtime_dir / ENV_DIR
    env_dir.mkdir(mode=0o700, exist_ok=True)
    name = f"{_secrets.token_hex(8)}.env"
    host = env_dir / name
    fd = os.open(host, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        for key, value in values.items():
            if "\x00" in value:
                raise UsageError(f"the value of {key} contains a NUL byte")
            f.write(f"{key}={_sh_quote(value)}\n")
    if os.geteuid() == 0:
        os.chown(env_dir, ws.uid, ws.gid)
        os.chown(host, ws.uid, ws.gid)
    return host, f"/run/sandman/{ENV_DIR}/{name}"


@dataclass(frozen=True)
class Layer2:
    """Everything decided about layer 2 before a command starts, except the env file's name."""

    env: SandboxEnv
    masks: Masks = Masks()
    cwd: str = bwrap.WORKSPACE
    writable: tuple[str, ...] = ()

    def spec(self, command: Sequence[str], env_file: str | None) -> bwrap.BwrapSpec:
        return bwrap.BwrapSpec(
            command=command,
            env=self.env.public,
            cwd=self.cwd,
            masks=self.masks.hidden,
            read_only=self.masks.read_only,
            writable=self.writable,
            env_file=env_file,
        )


def plain_layer2() -> Layer2:
    """The layer-2 plan of the probe: no masks, the base environment only."""
    return Layer2(SandboxEnv(bwrap.base_env()))


def extra_mounts(policy: Policy) -> tuple[tuple[str, str, bool], ...]:
    """(host source, container target, read-only) for the policy's extra paths and tools dir."""
    mounts = [(path, path, False) for path in policy.filesystem.writable]
    if policy.filesystem.tools_dir:
        mounts.append((policy.filesystem.tools_dir, bwrap.TOOLS_DIR, True))
    for source, _, _ in mounts:
        if not os.path.isdir(source):
            raise ConfigError(f"policy filesystem path {source!r} is not an existing directory on this host")
    return tuple(mounts)
