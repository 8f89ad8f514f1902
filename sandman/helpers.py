"""Upcall helpers: what a sandbox may ask the host to do, and nothing else.

A helper is allowed when the session's policy names it under ``[upcalls.helpers.NAME]`` (its
table is the helper's config). Built-ins are Python classes with typed config; operators add
executables from the ``helpers_dir`` setting. Helpers run on the host with no shell, a sanitized
environment holding only the credentials they need, a cwd outside the agent's control, a
timeout and bounded output.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sandman.errors import ConfigError
from sandman.policy import Policy
from sandman.settings import Settings
from sandman.workspace import Workspace

MAX_OUTPUT = 1 << 20  # per stream
HELPER_TIMEOUT_S = 90.0
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"


class HelperError(Exception):
    """The helper refuses the call; the message says which rule refused it."""


@dataclass(frozen=True)
class HelperResult:
    exit_code: int
    stdout: str
    stderr: str
    truncated: bool = False


@dataclass
class HelperContext:
    session_id: str
    workspace: Workspace
    settings: Settings
    created_prs: set[int | tuple[str, int]] = field(default_factory=set)  # (repo, number) this session made
    record: Callable[..., None] | None = None  # writes an audit event for this session


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Helper:
    """A built-in helper: ``config`` comes from the policy, ``run`` from one upcall."""

    name: ClassVar[str]
    description: ClassVar[str]
    Config: ClassVar[type[_Config]] = _Config

    def __init__(self, config: _Config, settings: Settings) -> None:
        self.config = config
        self.settings = settings

    async def run(self, args: list[str], stdin: str | None, ctx: HelperContext) -> HelperResult:
        raise NotImplementedError


async def run_process(
    argv: list[str],
    *,
    env: Mapping[str, str],
    cwd: str,
    stdin: str | None = None,
    timeout: float = HELPER_TIMEOUT_S,
) -> HelperResult:
    """Run argv with no shell; stdout and stderr kept apart and capped; killed on timeout."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=dict(env),
        cwd=cwd,
        start_new_session=True,
    )
    truncated = False

    async def read(stream: asyncio.StreamReader | None) -> bytes:
        nonlocal truncated
        buf = bytearray()
        assert stream is not None
        while chunk := await stream.read(65536):
            if len(buf) < MAX_OUTPUT:
                buf += chunk[: MAX_OUTPUT - len(buf)]
            if len(buf) >= MAX_OUTPUT and chunk:
                truncated = True  # keep draining so the helper never blocks on a full pipe
        return bytes(buf)

    async def feed() -> None:
        if stdin is not None and proc.stdin is not None:
            with contextlib.suppress(ConnectionError, BrokenPipeError):
                proc.stdin.write(stdin.encode())
                await proc.stdin.drain()
                proc.stdin.close()

    try:
        out, err, _ = await asyncio.wait_for(asyncio.gather(read(proc.stdout), read(proc.stderr), feed()), timeout)
        code = await asyncio.wait_for(proc.wait(), timeout)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        await proc.wait()
        return HelperResult(124, "", f"helper timed out after {timeout:.0f}s", True)
    return HelperResult(code, out.decode(errors="replace"), err.decode(errors="replace"), truncated)


class NoopHelper(Helper):
    """Answers at once with its arguments: for health checks and the round-trip benchmark."""

    name = "noop"
    description = "echo the arguments back (health check)"

    async def run(self, args: list[str], stdin: str | None, ctx: HelperContext) -> HelperResult:
        return HelperResult(0, " ".join(args) + ("\n" if args else ""), "")


# -- git-push -----------------------------------------------------------------------------------

_REF = re.compile(r"^(?!.*\.\.)(?!.*@\{)(?!/)(?!.*//)(?!.*\.lock$)[A-Za-z0-9._/-]{1,200}(?<![./])$")
HARDENED_GIT = [
    "-c", "core.hooksPath=/dev/null",
    "-c", "core.fsmonitor=false",
    "-c", "protocol.ext.allow=never",
    "-c", "credential.helper=",
    "-c", "core.sshCommand=ssh -o BatchMode=yes",
    "-c", "uploadpack.packObjectsHook=",
    "-c", "transfer.fsckObjects=true",
]  # fmt: skip


class GitPushConfig(_Config):
    remote: str = Field(description="the one remote pushes may go to (URL or path)")
    branch_prefix: str = Field(default="sandman/", description="every pushed branch starts with this")
    protected: list[str] = Field(default_factory=lambda: ["main", "master", "trunk", "develop", "release/*"])
    token_secret: str | None = Field(default=None, description="settings secret holding an HTTPS token")


class GitPushHelper(Helper):
    """Push the workspace's branch to the allowed remote under the branch prefix; never force.

    The agent's repository is never run: its objects are fetched into a controller-owned bare
    repository with hardened git (no hooks, no fsmonitor, no ext protocol, no credential helper,
    a private global config), and the push goes from there."""

    name = "git-push"
    description = "push the current (or a named) branch to the campaign's remote under the branch prefix"
    Config = GitPushConfig

    async def run(self, args: list[str], stdin: str | None, ctx: HelperContext) -> HelperResult:
        cfg = self.config
        assert isinstance(cfg, GitPushConfig)
        forceful = [a for a in args if a.startswith("-") or a.startswith("+") or ":" in a]
        if forceful:
            raise HelperError(f"git-push: {forceful[0]!r} refused: no options, refspecs or force pushes")
        if len(args) > 1:
            raise HelperError("git-push: at most one argument, the local branch to push")
        git_dir = ctx.workspace.path / ".git"
        if git_dir.is_symlink() or not git_dir.is_dir():
            raise HelperError("git-push: the workspace's .git must be a directory inside the workspace")
        branch = args[0] if args else _current_branch(git_dir)
        if not _REF.match(branch):
            raise HelperError(f"git-push: {branch!r} is not a valid branch name")
        dest = branch if branch.startswith(cfg.branch_prefix) else cfg.branch_prefix + branch
        for pattern in cfg.protected:
            if fnmatch.fnmatchcase(dest, pattern) or fnmatch.fnmatchcase(branch, pattern):
                raise HelperError(f"git-push: {dest!r} is a protected branch ({pattern!r})")
        if not dest.startswith(cfg.branch_prefix):
            raise HelperError(f"git-push: branches must start with {cfg.branch_prefix!r}")
        bare = self.settings.state_dir / "git" / f"{ctx.session_id}.git"
        with tempfile.TemporaryDirectory(prefix="sandman-git-") as home:
            env = self._env(home, ctx)
            if not bare.exists():
                bare.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                init = await run_process(["git", "init", "--bare", "-q", str(bare)], env=env, cwd=home)
                if init.exit_code != 0:
                    return init
            fetch = await run_process(
                ["git", *HARDENED_GIT, "-c", "protocol.file.allow=always", f"--git-dir={bare}", "fetch",
                 "--no-tags", "--upload-pack=git-upload-pack", str(git_dir),
                 f"+refs/heads/{branch}:refs/heads/{branch}"],
                env=env, cwd=home,
            )  # fmt: skip
            if fetch.exit_code != 0:
                return HelperResult(fetch.exit_code, fetch.stdout, f"git-push: fetch failed: {fetch.stderr}")
            scheme = "file" if "://" not in cfg.remote else cfg.remote.split("://", 1)[0]
            push = await run_process(
                ["git", *HARDENED_GIT, "-c", "protocol.allow=never", "-c", f"protocol.{scheme}.allow=always",
                 f"--git-dir={bare}", "push", "--no-verify", "--porcelain", cfg.remote,
                 f"refs/heads/{branch}:refs/heads/{dest}"],
                env=env, cwd=home,
            )  # fmt: skip
        summary = f"pushed {branch} to {dest}\n" if push.exit_code == 0 else ""
        return HelperResult(push.exit_code, summary + push.stdout, push.stderr, push.truncated)

    def _env(self, home: str, ctx: HelperContext) -> dict[str, str]:
        cfg = self.config
        assert isinstance(cfg, GitPushConfig)
        gitconfig = Path(home) / ".gitconfig"
        # The agent's repo belongs to another uid when the host runs as root: trust it for reading.
        gitconfig.write_text(f"[safe]\n\tdirectory = {ctx.workspace.path}\n\tdirectory = {ctx.workspace.path}/.git\n")
        env = {
            "PATH": SAFE_PATH, "HOME": home, "GIT_CONFIG_GLOBAL": str(gitconfig), "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "/bin/false", "SSH_ASKPASS": "/bin/false", "LANG": "C",
        }  # fmt: skip
        if cfg.token_secret:
            token = self.settings.secrets.get(cfg.token_secret)
            if token is None:
                raise HelperError(f"git-push: secret {cfg.token_secret!r} is not set on the host")
            import base64

            basic = base64.b64encode(f"x-access-token:{token.get_secret_value()}".encode()).decode()
            # Through the environment, never argv: the host's process list is readable.
            env.update(
                {
                    "GIT_CONFIG_COUNT": "1",
                    "GIT_CONFIG_KEY_0": "http.extraHeader",
                    "GIT_CONFIG_VALUE_0": f"Authorization: Basic {basic}",
                }
            )
        return env


def _current_branch(git_dir: Path) -> str:
    try:
        head = (git_dir / "HEAD").read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        raise HelperError("git-push: cannot read .git/HEAD") from None
    if not head.startswith("ref: refs/heads/"):
        raise HelperError("git-push: HEAD is detached: name the branch to push")
    return head.removeprefix("ref: refs/heads/")


# -- operator executables -----------------------------------------------------------------------


class ExternalHelper(Helper):
    """An executable from the settings' helpers_dir: argv as given, config as SANDMAN_HELPER_* env."""

    description = "operator-provided helper"

    def __init__(self, name: str, path: Path, config: Mapping[str, Any], settings: Settings) -> None:
        super().__init__(_Config(), settings)
        self.helper_name, self.path, self.raw_config = name, path, dict(config)

    async def run(self, args: list[str], stdin: str | None, ctx: HelperContext) -> HelperResult:
        env = {"PATH": SAFE_PATH, "LANG": "C.UTF-8", "SANDMAN_SESSION": ctx.session_id}
        for key, value in self.raw_config.items():
            env[f"SANDMAN_HELPER_{re.sub(r'[^A-Z0-9_]', '_', key.upper())}"] = str(value)
        with tempfile.TemporaryDirectory(prefix="sandman-helper-") as cwd:
            return await run_process([str(self.path), *args], env=env, cwd=cwd, stdin=stdin)


BUILTINS: dict[str, type[Helper]] = {h.name: h for h in (NoopHelper, GitPushHelper)}


def _register_gh() -> None:
    with contextlib.suppress(ImportError):
        from sandman.ghhelper import GhHelper

        BUILTINS[GhHelper.name] = GhHelper


def available_helpers(policy: Policy, settings: Settings) -> dict[str, Helper]:
    """The helpers this policy allows, configured; a bad config is a ConfigError naming the key."""
    _register_gh()
    helpers: dict[str, Helper] = {}
    for name, raw in policy.upcalls.helpers.items():
        cls = BUILTINS.get(name)
        if cls is not None:
            try:
                helpers[name] = cls(cls.Config.model_validate(raw), settings)
            except ValidationError as exc:
                err = exc.errors()[0]
                key = ".".join(str(p) for p in err["loc"])
                raise ConfigError(f"policy key 'upcalls.helpers.{name}.{key}': {err['msg']}") from None
            continue
        path = settings.helpers_dir / name if settings.helpers_dir else None
        if path is None or not path.is_file() or not os.access(path, os.X_OK) or "/" in name:
            known = ", ".join(sorted(BUILTINS))
            raise ConfigError(
                f"policy key 'upcalls.helpers.{name}': no such helper (built-ins: {known}; "
                f"operator helpers live in the helpers_dir setting)"
            )
        helpers[name] = ExternalHelper(name, path, raw, settings)
    return helpers
