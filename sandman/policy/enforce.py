"""Policy enforcement at the controller, shared by one-shot runs and sessions: the command check
(with path-like arguments and the working directory), the deny-list masks and read-only
protected paths for layer 2, and the environment split into what may sit on bwrap's argv and
what must not (passthrough values and injected secrets go through a private file).
"""

from __future__ import annotations

import json
import os
import secrets as _secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandman.core import bwrap
from sandman.core.workspace import Workspace
from sandman.errors import ConfigError, UsageError
from sandman.policy import Policy
from sandman.policy.commands import check_command
from sandman.policy.environment import _refusal as env_refusal
from sandman.policy.environment import build_env, refusal
from sandman.policy.paths import DEFAULT_PROTECTED, PathDenied, WorkspaceScanner, denied_by, validate_path
from sandman.secrets.scrub import EXAMPLE_KEYS, Scrubber
from sandman.settings import Settings

ENV_DIR = "env"  # under the session's runtime dir; bound file-by-file into layer 2


class CommandRefused(UsageError):
    """The policy refuses the command; the message names the rule."""

    exit_code = 126


class EnvRefused(CommandRefused):
    """A per-exec (or campaign) environment variable the policy's environment rules refuse."""


@dataclass(frozen=True)
class Masks:
    """Denied paths to hide and protected paths to re-bind read-only, as container paths."""

    hidden: tuple[tuple[str, bool], ...] = ()  # (path, is_dir)
    read_only: tuple[str, ...] = ()
    scanned: int = 0
    pinned: tuple[str, ...] = ()  # bound onto themselves: cannot be renamed or replaced inside
    warnings: tuple[str, ...] = ()  # said at start (e.g. denied files collapsed into a masked dir)


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


def text_scrubber(settings: Settings, extra: Mapping[str, str] | None = None) -> Callable[[str], str]:
    """str -> str for the audit writer and error messages: settings secrets and patterns (and
    ``extra`` known secrets, e.g. a repository's historical secret files; read at each call, so a
    dict filled in later counts too)."""
    base = {n: v.get_secret_value() for n, v in settings.secrets.items()}
    built: dict[str, Scrubber] = {}

    def scrub(text: str) -> str:
        key = str(len(extra)) if extra else "0"
        if key not in built:
            built.clear()
            built[key] = make_scrubber({**base, **(extra or {})})
        return built[key].scrub_text(text)[0]

    return scrub


def history_secrets(
    ws: Workspace,
    policy: Policy,
    settings: Settings,
    *,
    progress: Callable[[str], None],
    audit: Callable[..., None],
) -> dict[str, str]:
    """Deny-listed files in the repository's history (``filesystem.git_history``): ``scrub``
    returns every version as a known secret (and warns), ``refuse`` raises, ``allow`` audits."""
    from sandman.secrets import githistory

    fs = policy.filesystem
    scan = githistory.find_history_secrets(ws.path, fs.deny, fs.allow, cache_dir=settings.state_dir / "githistory")
    if scan.error:
        text = f"the repository's history could not be checked for deny-listed files: {scan.error}"
        if fs.git_history == "refuse":
            raise HistoryRefused(f"{ws.path}: {text}; filesystem.git_history is 'refuse', so nothing was started")
        progress(f"warning: {text}")
        audit("git_history.unchecked", "warning", reason=scan.error)
        return {}
    if not scan.found:
        return {}
    text = githistory.describe(scan)
    files = [f.path for f in scan.files]
    if fs.git_history == "refuse":
        audit("git_history.refused", "refused", files=files)
        raise HistoryRefused(f"{ws.path}: {text} (filesystem.git_history is 'refuse', so nothing was started)")
    if fs.git_history == "allow":
        audit("git_history.allowed", "ok", files=files)
        return {}
    progress(f"warning: {text}")
    audit("git_history.scrubbed", "ok", files=files)
    return githistory.secrets_from(scan)


class HistoryRefused(ConfigError):
    """Deny-listed files are in the repository's history and the policy refuses such a workspace."""


def _to_container(ws: Workspace, real: Path) -> str:
    return str(Path(bwrap.WORKSPACE) / real.relative_to(ws.path)) if real != ws.path else bwrap.WORKSPACE


def workspace_scanner(ws: Workspace, policy: Policy) -> WorkspaceScanner:
    """The incremental scanner for ``scan_masks`` (keep one per session: rescans are cheap)."""
    fs = policy.filesystem
    protected = list(dict.fromkeys([*fs.protected, *DEFAULT_PROTECTED]))  # a policy can only add
    return WorkspaceScanner(ws.path, fs.deny, fs.allow, protected, limit=fs.scan_limit)


def scan_masks(ws: Workspace, policy: Policy, scanner: WorkspaceScanner | None = None) -> Masks:
    """Every denied path that exists now (hidden in layer 2), the protected ones (read-only) and
    the pinned ones; fails closed, naming the path and the fix, on anything it cannot mask safely."""
    fs = policy.filesystem
    scan = (scanner or workspace_scanner(ws, policy)).scan()
    if scan.truncated:
        raise ConfigError(
            f"{ws.path}: the deny-list scan stopped after {scan.scanned} entries (filesystem.scan_limit is "
            f"{fs.scan_limit}), so denied files could go unmasked: the sandbox does not start. Raise "
            "filesystem.scan_limit, or run on a smaller workspace"
        )
    if scan.failed:
        raise ConfigError(
            f"{ws.path}: the deny-list scan could not walk the whole workspace ({'; '.join(scan.failed[:3])}), "
            "so denied files could go unmasked: the sandbox does not start. Make those directories readable "
            "(or remove them), then start again"
        )
    problems = []
    for denied in scan.paths:
        rel = denied.path.relative_to(ws.path).as_posix()
        if denied.is_link:
            problems.append(
                f"{rel!r} is a symlink under a denied name (the host's next write of that file would land "
                "where it points)"
            )
        elif denied.nlink > 1:
            problems.append(f"{rel!r} has {denied.nlink} hard links (its content is readable under another name)")
    for prot in scan.protected:
        if prot.is_link:
            rel = prot.path.relative_to(ws.path).as_posix()
            problems.append(f"{rel!r} is protected (read-only inside) but is a symlink")
    if problems:
        raise PathDenied(
            f"{ws.path}: "
            + "; ".join(problems[:5])
            + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            + ": replace each with a plain file or directory (or remove it), then start again"
        )
    hidden = [(denied.path, denied.is_dir) for denied in scan.paths]
    warnings: list[str] = []
    if len(hidden) > fs.max_masks:
        hidden, warnings = _collapse(ws, hidden, fs.max_masks)
    hidden_paths = {p for p, _ in hidden}
    read_only = [
        _to_container(ws, prot.path)
        for prot in scan.protected
        if prot.path not in hidden_paths and not any(prot.path.is_relative_to(h) for h, d in hidden if d)
    ]
    return Masks(
        tuple((_to_container(ws, p), is_dir) for p, is_dir in hidden),
        tuple(sorted(read_only, key=lambda p: (p.count("/"), p))),
        scan.scanned,
        tuple(_to_container(ws, pin.path) for pin in scan.pinned),
        tuple(warnings),
    )


def _collapse(ws: Workspace, hidden: list[tuple[Path, bool]], limit: int) -> tuple[list[tuple[Path, bool]], list[str]]:
    """More denied paths than masks allowed: hide whole directories (the ones holding the most)
    instead, so no number of planted files locks the workspace out, and none goes unmasked."""
    by_parent: dict[Path, int] = {}
    for path, _ in hidden:
        by_parent[path.parent] = by_parent.get(path.parent, 0) + 1
    collapsed: set[Path] = set()
    count = len(hidden)
    for parent, n in sorted(by_parent.items(), key=lambda kv: -kv[1]):
        if count <= limit:
            break
        if parent == ws.path:
            continue
        collapsed.add(parent)
        count -= n - 1
    if count > limit:
        raise ConfigError(
            f"{ws.path}: {len(hidden)} paths match the deny list, more than filesystem.max_masks "
            f"({limit}), even with whole directories hidden: move the denied files out of the workspace's "
            "top directory, narrow filesystem.deny, or raise filesystem.max_masks"
        )
    kept = [(p, d) for p, d in hidden if p.parent not in collapsed]
    kept += [(parent, True) for parent in sorted(collapsed)]
    names = ", ".join(repr(p.relative_to(ws.path).as_posix()) for p in sorted(collapsed)[:5])
    return kept, [
        f"{len(hidden)} denied paths exceed filesystem.max_masks ({limit}): whole directories are hidden "
        f"instead ({names}{', ...' if len(collapsed) > 5 else ''}); move the denied files or raise the limit"
    ]


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
        # Per-exec and campaign variables obey the same rules as the policy's own: a refused name
        # or pattern (cloud keys, tokens, LD_PRELOAD, ...) and the reserved SANDMAN_* namespace.
        if found := env_refusal(key, policy.environment):
            why, fix = found
            raise EnvRefused(f"environment variable {key!r} {why}: {fix}")
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
    if policy.commands.allow is not None:
        # The exec shim turns the allowlist into a Landlock execute rule: whatever spawns them (a
        # shell, an interpreter, xargs), only these programs run.
        public["SANDMAN_EXEC_ALLOW"] = ":".join(policy.commands.allow)
    known = known_secrets(settings, policy, host_env)
    # Injected secrets are scrubbed from output; passthrough values are configuration, not secrets
    # (scrubbing a value such as "fast" would mangle every output that says "fast").
    known.update({name: private[name] for name in policy.secrets.inject if name in private})
    return SandboxEnv(public, private, tuple(built.refused), known)


def write_env_file(runtime_dir: Path, ws: Workspace, values: Mapping[str, str]) -> tuple[Path, str]:
    """A private file for the sandbox's exec shim (NUL-separated KEY, VALUE pairs): (host path,
    container path).

    It goes in the runtime dir's ``env`` directory, which only the host can write (the container
    sees the runtime dir read-only): created beneath that directory's descriptor with O_EXCL and
    O_NOFOLLOW, 0400, and handed to the sandbox uid with fchown, never by a path."""
    for key, value in values.items():
        if "\x00" in value or "\x00" in key:
            raise UsageError(f"the value of {key} contains a NUL byte")
    name = f"{_secrets.token_hex(8)}.env"
    dir_fd = os.open(runtime_dir / ENV_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o400, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    with os.fdopen(fd, "wb") as f:
        if os.geteuid() == 0:
            os.fchown(f.fileno(), ws.uid, ws.gid)
        f.write(b"".join(os.fsencode(k) + b"\0" + os.fsencode(v) + b"\0" for k, v in values.items()))
    return runtime_dir / ENV_DIR / name, f"/run/sandman/{ENV_DIR}/{name}"


@dataclass(frozen=True)
class Layer2:
    """Everything decided about layer 2 before a command starts, except the env file's name."""

    env: SandboxEnv
    masks: Masks = Masks()
    cwd: str = bwrap.WORKSPACE
    writable: tuple[str, ...] = ()

    def spec(
        self,
        command: Sequence[str],
        env_file: str | None,
        private: tuple[str, str] | None = None,
    ) -> bwrap.BwrapSpec:
        """The bwrap spec; ``private``: the container dirs shown as /tmp and HOME for this exec."""
        tmp, home = private or ("/tmp", bwrap.HOME)
        return bwrap.BwrapSpec(
            command=command,
            env=self.env.public,
            cwd=self.cwd,
            masks=self.masks.hidden,
            read_only=self.masks.read_only,
            pinned=self.masks.pinned,
            writable=self.writable,
            env_file=env_file,
            tmp_source=tmp,
            home_source=home,
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


def poison_check(
    ws: Workspace,
    baseline: Any,
    policy: Policy,
    settings: Settings,
    session_id: str,
    store: Any,
    progress: Callable[[str], None],
) -> list[str]:
    """After a sandbox: what it left that would make the host user's git or editor run code
    (new or changed since ``baseline``), reported loudly and, by policy, quarantined."""
    from sandman.core import poison

    findings = poison.scan_workspace(ws.path, baseline)
    if not findings:
        return []
    report = None
    if policy.filesystem.on_poison == "quarantine":
        try:
            report = poison.quarantine(ws.path, findings, poison.quarantine_dir(settings.state_dir, session_id))
        except OSError as exc:
            progress(f"warning: could not quarantine what the sandbox left: {exc}")
    poison.audit(store, session_id, findings, report)
    lines = [f.line() for f in findings]
    where = (
        f"; moved to {poison.quarantine_dir(settings.state_dir, session_id)}"
        if report is not None and report.moved
        else f"; review with `sandman inspect -w {ws.path}` before running git there"
    )
    progress(
        f"WARNING: the sandbox left {len(lines)} thing(s) in {ws.path} that would make your own git, editor "
        f"or shell run its code: {'; '.join(lines[:5])}{' ...' if len(lines) > 5 else ''}{where}"
    )
    return lines


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: none). A runc sandbox shares the host's kernel, so
    this says whether the exec shim can enforce a command allowlist."""
    import ctypes
    import platform

    if platform.system() != "Linux":
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        version = int(libc.syscall(ctypes.c_long(444), None, ctypes.c_size_t(0), ctypes.c_uint32(1)))
    except (OSError, AttributeError):
        return 0
    return max(version, 0)


def advisory_warnings(policy: Policy, *, landlock: bool = True) -> list[str]:
    """What of the policy this host cannot enforce, said at every start (never silently).
    ``landlock``: False where the sandbox's kernel has none whatever the host's (gVisor)."""
    if policy.commands.allow is not None and not landlock:
        return [
            "warning: gVisor has no Landlock, so on this backend the command allowlist is advisory: it is "
            "checked on the top-level command only, and a shell or interpreter can still start any program"
        ]
    if policy.commands.allow is not None and landlock_abi() < 1:
        return [
            "warning: this kernel has no Landlock, so the command allowlist is advisory: it is checked on "
            "the top-level command only, and a shell or interpreter can still start any program"
        ]
    return []


# What a finding must be to stop the next start: something the host's own tools would run or obey,
# and anything the scan could not see through (a config too big to read whole, a line it could
# not parse, a tree too deep or too large): an incomplete check fails closed. A nested repository
# or a look-alike git dir alone runs nothing; what its config holds is a finding of its own.
GATED_KINDS = frozenset(
    {"exec", "redirect", "include", "hook", "gitdir", "autorun", "special", "unparsed", "truncated", "error"}
)


def _gate_key(finding: Any) -> str:
    """A finding's identity for acceptance; a truncated scan is one thing whatever its counts."""
    if finding.kind in ("truncated", "error"):
        import hashlib

        return hashlib.sha256(f"{finding.kind}:{finding.path}:{finding.key}".encode()).hexdigest()[:32]
    return str(finding.fingerprint())


class PoisonedWorkspace(ConfigError):
    """The workspace holds what would make the host's tools run code, new since last accepted."""

    exit_code = 65


def _accepted_path(settings: Settings, ws: Workspace) -> Path:
    import hashlib

    key = hashlib.sha256(os.fsencode(str(ws.path))).hexdigest()[:24]
    return settings.state_dir / "poison-accepted" / f"{key}.json"


def accept_poison(settings: Settings, ws: Workspace, fingerprints: Sequence[str]) -> None:
    """Record ``fingerprints`` as the operator's own (their hooks, their configs)."""
    path = _accepted_path(settings, ws)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(f".{os.getpid()}.{_secrets.token_hex(4)}.tmp")
    tmp.write_text(json.dumps({"workspace": str(ws.path), "accepted": sorted(set(fingerprints))}))
    os.replace(tmp, path)


def poison_gate(settings: Settings, ws: Workspace, baseline: Any) -> None:
    """Refuse to start on a workspace where an earlier sandbox left what the host's git or editor
    would run (a new .git/commondir, hook, config key), until the operator removes or accepts it:
    the end-of-session report can be missed, the next start cannot. The first time sandman sees a
    workspace, what is there is the operator's own and is recorded as accepted."""
    findings = [f for f in getattr(baseline, "findings", []) if f.kind in GATED_KINDS]
    path = _accepted_path(settings, ws)
    try:
        known = set(json.loads(path.read_text()).get("accepted", []))
    except (OSError, ValueError):
        accept_poison(settings, ws, [_gate_key(f) for f in findings])
        return
    new = [f for f in findings if _gate_key(f) not in known]
    if new:
        lines = "; ".join(f.line() for f in new[:5]) + (" ..." if len(new) > 5 else "")
        raise PoisonedWorkspace(
            f"{ws.path} holds what would make your own git, editor or shell run code, and it appeared "
            f"since sandman last accepted this workspace (an earlier sandbox could have left it): {lines}. "
            f"Review it with `sandman inspect -w {ws.path}`, then remove it (`sandman inspect -w {ws.path} "
            f"--quarantine`) or accept it as yours (`sandman inspect -w {ws.path} --accept`)"
        )
