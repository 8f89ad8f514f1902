"""The policy: one typed, strict model that every layer reads — files, commands, environment,
secrets, resources, network, runtime and upcalls.

Policies are TOML files. The operator's policy is sandman's ``policies/default.toml``, the
``default_policy`` setting, or ``--policy``; a campaign's ``<workspace>/.sandman/policy.toml`` is
merged on top and may only tighten it, unless the operator grants more with
``[campaign] may_loosen = ["section", ...]``. Unknown keys are errors; every error names the
file, the key and the reason.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tomllib
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from sandman import resources
from sandman.errors import ConfigError, UsageError
from sandman.policy.commands import DEFAULT_COMMANDS, CommandsPolicy
from sandman.policy.environment import EnvironmentPolicy
from sandman.policy.environment import validate_policy as validate_env_policy
from sandman.policy.paths import DEFAULT_ALLOW, DEFAULT_DENY, DEFAULT_PROTECTED

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
    tmpfs_size: Size = Field(default=256 << 20, description="size of /tmp and of HOME; below memory / 2")
    max_output: Size = Field(default=256 << 20, description="stdout+stderr passed on per command, then truncated")
    tmpfs_inodes: int = Field(default=65536, ge=64)
    max_file_size: Size = Field(default=4 << 30, description="RLIMIT_FSIZE of every process")
    open_files: int = Field(default=4096, ge=64)
    exec_timeout_s: float | None = Field(default=3600.0, gt=0, description="per exec / run")
    idle_timeout_s: float | None = Field(default=1800.0, gt=0, description="a session with no exec ends")
    session_timeout_s: float | None = Field(default=86400.0, gt=0, description="absolute session lifetime")
    workspace_quota: Size | None = Field(
        default=10 << 30, description="how much a command may grow the workspace's filesystem; then cause disk-quota"
    )
    host_reserve: str = Field(
        default="1g", description="free space always left on the workspace's filesystem: a size (2g) or a share (5%)"
    )
    workspace_inode_quota: int | None = Field(
        default=1_000_000, ge=1, description="files a command may create on the workspace's filesystem; then disk-quota"
    )
    host_inode_reserve: str = Field(
        default="5%", description="free inodes always left on the workspace's filesystem: a count or a share (5%)"
    )

    @field_validator("host_inode_reserve", mode="before")
    @classmethod
    def _inode_reserve(cls, value: object) -> str:
        from sandman.core.quota import parse_inode_reserve

        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ValueError("expected a number of inodes such as 100000 or a share such as 5%")
        parse_inode_reserve(str(value))
        return str(value)

    @field_validator("host_reserve", mode="before")
    @classmethod
    def _reserve(cls, value: object) -> str:
        from sandman.core.quota import parse_reserve

        text = str(value) if isinstance(value, int | str) and not isinstance(value, bool) else None
        if text is None:
            raise ValueError("expected a size such as 2g or a share such as 5%")
        parse_reserve(text if text.strip().endswith("%") else value)  # type: ignore[arg-type]
        return text

    @model_validator(mode="after")
    def _tmpfs_below_memory(self) -> Resources:
        if 2 * self.tmpfs_size >= self.memory:
            raise ValueError(
                f"tmpfs_size ({self.tmpfs_size} bytes) must be below half of memory ({self.memory} bytes): "
                "/tmp and HOME each get one, and full ones must not be able to exhaust the memory cap"
            )
        return self


class FilesystemPolicy(_Strict):
    """What the sandbox may see of the workspace, and what else it gets."""

    deny: list[str] = Field(default_factory=lambda: list(DEFAULT_DENY))
    allow: list[str] = Field(default_factory=lambda: list(DEFAULT_ALLOW))
    protected: list[str] = Field(default_factory=lambda: list(DEFAULT_PROTECTED))
    writable: list[str] = Field(default_factory=list, description="extra host dirs, read-write")
    tools_dir: str | None = Field(default=None, description="host dir of durable tools, read-only on PATH")
    max_masks: int = Field(
        default=2000, ge=1, description="above this many denied paths, whole directories are hidden instead"
    )
    scan_limit: int = Field(
        default=1_000_000, ge=1000, description="workspace entries the deny-list scan may walk; beyond, fail closed"
    )
    share_tmp_home: bool = Field(
        default=False,
        description="sessions: let every exec share /tmp and HOME (default: each exec gets its own, so "
        "a file one command plants there, such as ~/.gitconfig, cannot capture the next one's secrets)",
    )
    git_history: Literal["scrub", "refuse", "allow"] = Field(
        default="scrub",
        description="deny-listed files found in the repository's git history (readable inside with "
        "`git show`): scrub registers every version as a known secret, refuse does not start, "
        "allow only audits",
    )
    on_poison: Literal["report", "quarantine"] = Field(
        default="report",
        description="after a session, what the agent left that makes the host user's git, editor or "
        "shell run code (sandman.core.poison): report it, or also move the flagged files to "
        "<state_dir>/quarantine/<session>",
    )

    @field_validator("writable", "tools_dir")
    @classmethod
    def _absolute(cls, value: Any) -> Any:
        for item in value if isinstance(value, list) else [value] if value else []:
            if not os.path.isabs(item) or "\x00" in item:
                raise ValueError(f"{item!r} must be an absolute host path")
        return value


class SecretsPolicy(_Strict):
    """Host-side secrets (from settings) injected into every command's environment by name."""

    inject: list[str] = Field(default_factory=list)


class UpcallsPolicy(_Strict):
    """Which host helpers the session may call over the upcall socket, with their config."""

    helpers: dict[str, dict[str, Any]] = Field(default_factory=dict)


class CampaignGrant(_Strict):
    """Operator-only: sections a campaign's policy may loosen, not just tighten."""

    may_loosen: list[Literal["filesystem", "commands", "environment", "secrets", "resources", "upcalls", "runtime"]] = (
        Field(default_factory=list)
    )


class Policy(_Strict):
    """Everything the sandbox obeys; the layers read only this model."""

    name: str = "default"
    filesystem: FilesystemPolicy = FilesystemPolicy()
    commands: CommandsPolicy = DEFAULT_COMMANDS
    environment: EnvironmentPolicy = EnvironmentPolicy()
    secrets: SecretsPolicy = SecretsPolicy()
    resources: Resources = Resources()
    network: Literal["none"] = "none"
    runtime: Runtime = Runtime.RUNC
    upcalls: UpcallsPolicy = UpcallsPolicy()
    campaign: CampaignGrant = CampaignGrant()

    @model_validator(mode="after")
    def _environment_consistent(self) -> Policy:
        try:
            validate_env_policy(self.environment)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return self

    def with_resources(self, **changes: Any) -> Policy:
        """A copy with some resource values replaced (CLI overrides), validated again."""
        data = self.resources.model_dump()
        data.update({k: v for k, v in changes.items() if v is not None})
        _fit_tmpfs(data, changes)
        try:
            return self.model_copy(update={"resources": Resources(**data)})
        except ValidationError as exc:
            raise UsageError(_first_error(exc)) from None

    def digest(self) -> str:
        """A stable hash of the effective policy (recorded with sessions)."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]


def _fit_tmpfs(merged: dict[str, Any], changed: dict[str, Any]) -> None:
    """A lower memory cap alone shrinks /tmp and HOME to a quarter of it each, not an error."""
    memory = changed.get("memory")
    if memory is None or changed.get("tmpfs_size") is not None:
        return
    with contextlib.suppress(ValueError):
        if 2 * parse_size(merged["tmpfs_size"]) >= parse_size(memory):
            merged["tmpfs_size"] = max(parse_size(memory) // 4, 1 << 20)


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    key = ".".join(str(p) for p in err["loc"]) or "(top level)"
    msg = str(err["msg"]).removeprefix("Value error, ")
    return f"key {key!r}: {msg}"


def default_policy_path() -> Path:
    return resources.policies_dir() / "default.toml"


def named_policy_path(name_or_path: str | os.PathLike[str], cwd: str | os.PathLike[str] | None = None) -> Path:
    """What ``--policy`` means in every command: a shipped policy by name ("default", "strict"),
    else a policy file's path (relative to ``cwd``); ConfigError naming both when it is neither."""
    text = os.fspath(name_or_path)
    shipped = resources.policies_dir() / f"{text}.toml"
    if "/" not in text and not text.endswith(".toml") and shipped.is_file():
        return shipped
    path = Path(cwd or os.getcwd()) / text if not os.path.isabs(text) else Path(text)
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in resources.policies_dir().glob("*.toml")))
        raise ConfigError(
            f"--policy {text!r} is neither a built-in policy ({names}) nor an existing policy file: "
            "name one of those, or give the path of a TOML policy file"
        )
    return path


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


# -- layering: the operator's policy, then the campaign's, which may only tighten it -------------

CAMPAIGN_POLICY = Path(".sandman") / "policy.toml"
_ADDITIVE = (
    "filesystem.deny",
    "filesystem.protected",
    "environment.refuse_names",
    "environment.refuse_patterns",
)
_ADDITIVE_RULE_KEYS = ("blocked", "blocked_subcommands")


@dataclass(frozen=True)
class EffectivePolicy:
    """The policy every layer obeys, with where each value came from."""

    policy: Policy
    sources: dict[str, str]  # dotted key -> "built-in default" | "<kind> <file>"
    files: tuple[Path, ...]


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: policy file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read policy: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def _validate(data: dict[str, Any], path: Path) -> Policy:
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{path}: {_first_error(exc)}") from None


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys to leaf values (lists are leaves)."""
    if not isinstance(data, dict) or (prefix and not data):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _is_additive(key: str) -> bool:
    parts = key.split(".")
    return key in _ADDITIVE or (
        len(parts) == 4 and parts[0] == "commands" and parts[1] == "rules" and parts[3] in _ADDITIVE_RULE_KEYS
    )


def _merge(base: dict[str, Any], over: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if dotted == "upcalls.helpers":
            merged[key] = value  # replaced as a whole, then checked as a subset
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value, dotted)
        elif _is_additive(dotted) and isinstance(value, list):
            merged[key] = list(dict.fromkeys([*(merged.get(key) or []), *value]))
        else:
            merged[key] = value
    return merged


def _at(policy: Policy, dotted: str) -> Any:
    value: Any = policy.model_dump(mode="python")
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _loosening(key: str, op: Policy, cp: Policy) -> str | None:
    """Why the campaign's value for ``key`` is looser than the operator's (None: it is not)."""
    section = key.split(".")[0]
    old, new = _at(op, key), _at(cp, key)
    if key == "resources.host_reserve":
        from sandman.core.quota import parse_reserve

        (ob, of), (nb, nf) = parse_reserve(old), parse_reserve(new)
        return None if nb >= ob and nf >= of else f"operator: {old}, campaign: {new} (a smaller reserve)"
    if key == "resources.host_inode_reserve":
        from sandman.core.quota import parse_inode_reserve

        (ob, of), (nb, nf) = parse_inode_reserve(old), parse_inode_reserve(new)
        return None if nb >= ob and nf >= of else f"operator: {old}, campaign: {new} (a smaller reserve)"
    if section == "resources":
        if old is None:
            return None
        if new is None or new > old:
            return f"operator: {old}, campaign: {new}"
        return None
    if key == "runtime":
        return None if new == old or (old == Runtime.RUNC and new == Runtime.RUNSC) else "gVisor cannot be dropped"
    if key == "filesystem.max_masks":
        return None if new <= old else f"operator: {old}, campaign: {new}"
    if key == "filesystem.on_poison":
        return None if new == old or new == "quarantine" else "only the operator can turn quarantine off"
    if key == "filesystem.share_tmp_home":
        return None if not new or old else "sharing /tmp and HOME across execs is the operator's choice"
    if key == "filesystem.git_history":
        order = ("allow", "scrub", "refuse")  # loosest first
        return None if order.index(new) >= order.index(old) else f"operator: {old}, campaign: {new}"
    if key == "filesystem.tools_dir":
        return None if new in (None, old) else "a campaign cannot choose host directories"
    if key in ("filesystem.allow", "filesystem.writable", "environment.passthrough", "secrets.inject"):
        extra = sorted(set(new or []) - set(old or []))
        return f"not granted by the operator: {', '.join(map(repr, extra))}" if extra else None
    if key == "commands.allow":
        if old is None:
            return None
        extra = sorted(set(new or []) - set(old)) if new is not None else ["(any program)"]
        return f"not in the operator's allowlist: {', '.join(map(repr, extra))}" if extra else None
    if key.startswith("commands.rules.") and key.endswith(".allowed_subcommands"):
        if old is None:
            return None
        extra = sorted(set(new or []) - set(old)) if new is not None else ["(any subcommand)"]
        return f"not allowed by the operator: {', '.join(map(repr, extra))}" if extra else None
    if key == "upcalls.helpers":
        for name, config in (new or {}).items():
            if name not in (old or {}):
                return f"helper {name!r} is not granted by the operator"
            if config != old[name]:
                return f"helper {name!r}: a campaign cannot change a helper's config"
        return None
    return None  # additive lists, environment.allow values, name: free for a campaign


def effective_policy(operator: Path | None = None, workspace: Path | None = None) -> EffectivePolicy:
    """The operator's policy (sandman's default when None) with the workspace's campaign policy."""
    op_path = operator or default_policy_path()
    op_data = _read_toml(op_path)
    op_data.setdefault("name", op_path.stem)
    op = _validate(op_data, op_path)
    kind = "sandman default" if op_path == default_policy_path() else "operator"
    files = [op_path]
    campaign_keys: set[str] = set()
    campaign_path = workspace / CAMPAIGN_POLICY if workspace is not None else None
    policy = op
    campaign_text = None
    if workspace is not None:
        from sandman.policy import campaign

        campaign_text = campaign.read(workspace, "policy.toml")
    if campaign_path is not None and campaign_text is not None:
        try:
            c_data = tomllib.loads(campaign_text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{campaign_path}: not valid TOML: {exc}") from None
        if "campaign" in c_data:
            raise ConfigError(f"{campaign_path}: key 'campaign': only the operator's policy can grant loosening")
        merged = _merge(op.model_dump(mode="json"), c_data)
        _fit_tmpfs(merged["resources"], c_data.get("resources") or {})
        policy = _validate(merged, campaign_path)
        granted = set(op.campaign.may_loosen)
        for key in flatten(c_data):
            head = "commands" if key.startswith("commands.rules.") else key.split(".")[0]
            check = ".".join(key.split(".")[:4]) if key.startswith("commands.rules.") else key
            if key.startswith("upcalls.helpers"):
                check = "upcalls.helpers"
            if head in granted:
                continue
            why = _loosening(check, op, policy)
            if why:
                raise ConfigError(
                    f"{campaign_path}: key {check!r}: a campaign may only tighten the operator's policy "
                    f"({why}); the operator can allow it with [campaign] may_loosen = [{head!r}]"
                )
        campaign_keys = set(flatten(c_data))
        files.append(campaign_path)
    operator_keys = set(flatten(op_data))
    sources = {
        key: f"campaign {campaign_path}"
        if key in campaign_keys
        else f"{kind} {op_path}"
        if key in operator_keys
        else "built-in default"
        for key in flatten(policy.model_dump(mode="json"))
    }
    return EffectivePolicy(policy, sources, tuple(files))
