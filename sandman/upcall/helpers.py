"""Upcall helpers: what a sandbox may ask the host to do, and nothing else.

A helper is allowed when the session's policy names it under ``[upcalls.helpers.NAME]`` (its
table is the helper's config). Built-ins are Python classes with typed config; operators add
executables from the ``helpers_dir`` setting. Helpers run on the host with no shell, a sanitized
environment holding only the credentials they need, a cwd outside the agent's control, a
timeout and bounded output.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fnmatch
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sandman.core.workspace import Workspace
from sandman.errors import ConfigError
from sandman.policy import Policy
from sandman.settings import Settings

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
    policy: Policy | None = None  # the session's effective policy (git-push's deny list); None: read the record


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Helper:
    """A built-in helper: ``config`` comes from the policy, ``run`` from one upcall."""

    name: ClassVar[str]
    description: ClassVar[str]
    Config: ClassVar[type[_Config]] = _Config
    # True only for a helper that can neither block nor take long (no I/O, bounded work): it runs
    # on the relay's own loop. Every other helper runs in a thread of its own (HelperThreads).
    inline: ClassVar[bool] = False

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
    with _LIVE_LOCK:
        _LIVE_GROUPS.add(proc.pid)
    try:
        return await _collect(proc, stdin, timeout)
    finally:
        with _LIVE_LOCK:
            _LIVE_GROUPS.discard(proc.pid)


_LIVE_GROUPS: set[int] = set()  # process groups run_process started and has not yet reaped
_LIVE_LOCK = threading.Lock()


def kill_live_groups() -> int:
    """Kill every helper process group still running: a relay that stops leaves none behind."""
    with _LIVE_LOCK:
        groups = list(_LIVE_GROUPS)
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, 9)
    return len(groups)


async def _collect(proc: asyncio.subprocess.Process, stdin: str | None, timeout: float) -> HelperResult:
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

    gathered = asyncio.gather(read(proc.stdout), read(proc.stderr), feed())
    # When cancelled, the gathered future's outcome is never asked for: say it is handled.
    gathered.add_done_callback(lambda f: f.cancelled() or f.exception())
    try:
        out, err, _ = await asyncio.wait_for(gathered, timeout)
        code = await asyncio.wait_for(proc.wait(), timeout)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        await proc.wait()
        return HelperResult(124, "", f"helper timed out after {timeout:.0f}s", True)
    except BaseException:  # cancelled (the relay's deadline) or failed: nothing is left running
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        with contextlib.suppress(BaseException):  # reaped here, not by a loop that may be gone
            await asyncio.wait_for(proc.wait(), 5)
        raise
    return HelperResult(code, out.decode(errors="replace"), err.decode(errors="replace"), truncated)


class HelperThreads:
    """Where one relay's helper calls run: threads that each run an event loop of their own.

    Whatever a helper does -- a synchronous read of a FIFO the agent made, a CPU-bound parse, a
    loop that never awaits -- it blocks only its thread, never the relay's loop nor another call.
    On ``timeout`` the helper's task is cancelled, which kills the processes ``run_process``
    started. A helper stuck in a blocking call cannot be cancelled: its thread is busy until that
    call returns, and the caller counts it as in progress until then (the per-session budget of
    pending calls). Threads and loops are reused: a call costs no thread start."""

    KEEP = 16  # idle threads kept (those running are bounded by the relay's pending-calls budget)

    def __init__(self, name: str, report: Callable[[str], None] | None = None) -> None:
        self.name = name
        self.report = report  # one line per event-loop error (never a traceback per line)
        self.lock = threading.Lock()
        self.idle: list[asyncio.AbstractEventLoop] = []
        self.running: set[concurrent.futures.Future[HelperResult]] = set()
        self.closed = False

    def _spawn(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.new_event_loop()
        if self.report is not None:
            report = self.report
            loop.set_exception_handler(
                lambda _loop, c: report(f"helper loop: {c.get('message')}: {c.get('exception')!r}"[:500])
            )

        def main() -> None:
            asyncio.set_event_loop(loop)
            loop.run_forever()  # not closed after: a child watcher may still call it

        threading.Thread(target=main, name=f"helper-{self.name}", daemon=True).start()
        return loop

    def submit(
        self, helper: Helper, args: list[str], stdin: str | None, ctx: HelperContext, timeout: float
    ) -> concurrent.futures.Future[HelperResult]:
        """Start one call; the future gets its result or its exception."""
        with self.lock:
            loop = self.idle.pop() if self.idle else None
        if loop is None:
            loop = self._spawn()

        async def bounded() -> HelperResult:
            return await asyncio.wait_for(helper.run(args, stdin, ctx), timeout)

        future = asyncio.run_coroutine_threadsafe(bounded(), loop)
        with self.lock:
            self.running.add(future)

        def release(_: concurrent.futures.Future[HelperResult]) -> None:
            with self.lock:
                self.running.discard(future)
                if not self.closed and len(self.idle) < self.KEEP:
                    self.idle.append(loop)
                    return
            loop.call_soon_threadsafe(loop.stop)

        future.add_done_callback(release)
        return future

    def close(self, timeout: float = 2.0) -> None:
        """Cancel the calls in progress (their processes are killed) and stop the threads."""
        with self.lock:
            self.closed = True
            idle, self.idle = self.idle, []
            running = list(self.running)
        for future in running:
            future.cancel()
        concurrent.futures.wait(running, timeout)
        for loop in idle:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(loop.stop)


class NoopHelper(Helper):
    """Answers at once with its arguments: for health checks and the round-trip benchmark."""

    name = "noop"
    description = "echo the arguments back (health check)"
    inline = True  # no I/O; its work is bounded by the frame size

    async def run(self, args: list[str], stdin: str | None, ctx: HelperContext) -> HelperResult:
        return HelperResult(0, " ".join(args) + ("\n" if args else ""), "")


# -- git-push -----------------------------------------------------------------------------------

# A branch name, matched against the whole string (re.fullmatch; no "$" that lets a newline through).
_REF = re.compile(r"(?!.*\.\.)(?!.*@\{)(?!/)(?!.*//)(?!.*\.lock\Z)[A-Za-z0-9._/-]{1,200}(?<![./])")
# For the host-side git (remote fetch, push) that reads only the controller's bare repository; the
# git that reads the workspace runs in sandman.upcall.gitjail with its own, stricter set.
HARDENED_GIT = [
    "-c", "core.hooksPath=/dev/null",
    "-c", "core.fsmonitor=false",
    "-c", "protocol.ext.allow=never",
    "-c", "credential.helper=",
    "-c", "core.sshCommand=ssh -o BatchMode=yes",
    "-c", "uploadpack.packObjectsHook=",
    "-c", "transfer.fsckObjects=true",
    "-c", "fetch.unpackLimit=1",  # packs only: no loose-object directories owned by the controller
    "-c", "gc.auto=0",
    "-c", "maintenance.auto=false",
    "-c", "http.followRedirects=false",
]  # fmt: skip
MAX_PUSH_ERROR = 4000  # characters of git's error text shown to the agent
MAX_CHECKED_PATHS = 16 << 20  # bytes of path names listed for the deny check
_BARE_CONFIG = "[core]\n\trepositoryformatversion = 0\n\tfilemode = true\n\tbare = true\n\tlogallrefupdates = false\n"


class GitPushConfig(_Config):
    remote: str = Field(description="the one remote pushes may go to (URL or path)")
    branch_prefix: str = Field(default="sandman/", description="every pushed branch starts with this")
    protected: list[str] = Field(default_factory=lambda: ["main", "master", "trunk", "develop", "release/*"])
    token_secret: str | None = Field(default=None, description="settings secret holding an HTTPS token")


class GitPushHelper(Helper):
    """Push the workspace's branch to the allowed remote under the branch prefix; never force.

    The host never runs git on the agent's ``.git``: the branch is fetched into the session's
    controller-owned bare repository by a git jailed with bubblewrap (``sandman.upcall.gitjail``: it sees
    the workspace's ``.git``, read-only, and the bare repository, nothing else of the host). A
    ``.git`` that is not a plain directory, or that borrows refs or objects from elsewhere
    (``commondir``, alternates), is refused up front. Then the remote's branches are fetched into
    the bare repository, every path added or modified by the commits the remote lacks is checked
    against the session's deny list, and the push goes from the bare repository, never forced,
    only under the branch prefix. A pushed branch is recorded (audit event ``git.pushed``): the gh
    helper opens draft PRs only from those."""

    name = "git-push"
    description = "push the current (or a named) branch to the campaign's remote under the branch prefix"
    Config = GitPushConfig

    def __init__(self, config: _Config, settings: Settings) -> None:
        super().__init__(config, settings)
        # One push at a time per session: each jailed git may hold up to gitjail.GIT_DATA_BYTES,
        # and concurrent calls would share the session's bare repository.
        self._busy = threading.Lock()

    async def run(self, args: list[str], stdin: str | None, ctx: HelperContext) -> HelperResult:
        if not self._busy.acquire(blocking=False):
            raise HelperError("git-push: another git-push of this session is running; try again when it ends")
        bare = self.settings.state_dir / "git" / f"{ctx.session_id}.git"
        kept = False
        try:
            result = await self._run(args, stdin, ctx)
            kept = result.exit_code == 0 and _tree_size(bare) <= MAX_BARE_BYTES
            return result
        finally:
            if not kept:
                # The host's disk is not the agent's: what a refused or failed push fetched is gone
                # with it (and a bare repository past its cap starts afresh at the next push).
                await asyncio.to_thread(shutil.rmtree, bare, True)
            self._busy.release()

    async def _run(self, args: list[str], stdin: str | None, ctx: HelperContext) -> HelperResult:
        from sandman.policy.paths import denied_by
        from sandman.upcall import gitjail

        cfg = self.config
        assert isinstance(cfg, GitPushConfig)
        forceful = [a for a in args if a.startswith("-") or a.startswith("+") or ":" in a]
        if forceful:
            raise HelperError(f"git-push: {forceful[0]!r} refused: no options, refspecs or force pushes")
        if len(args) > 1:
            raise HelperError("git-push: at most one argument, the local branch to push")
        git_dir = ctx.workspace.path / ".git"
        try:
            branch = args[0] if args else await asyncio.to_thread(_current_branch, git_dir)
            await asyncio.to_thread(lambda: os.close(gitjail.open_git_dir(git_dir)))  # refuse early, clearly
        except gitjail.GitJailError as exc:
            raise HelperError(f"git-push: {exc}") from None
        if not _REF.fullmatch(branch):
            raise HelperError(f"git-push: {branch!r} is not a valid branch name")
        dest = branch if branch.startswith(cfg.branch_prefix) else cfg.branch_prefix + branch
        for pattern in cfg.protected:
            if fnmatch.fnmatchcase(dest, pattern) or fnmatch.fnmatchcase(branch, pattern):
                raise HelperError(f"git-push: {dest!r} is a protected branch ({pattern!r})")
        if not dest.startswith(cfg.branch_prefix) or not _REF.fullmatch(dest):
            raise HelperError(f"git-push: branches must start with {cfg.branch_prefix!r}")
        deny, allow = await asyncio.to_thread(self._deny_rules, ctx)
        root = os.geteuid() == 0
        uid, gid = (ctx.workspace.uid, ctx.workspace.gid) if root else (None, None)
        bare = self.settings.state_dir / "git" / f"{ctx.session_id}.git"
        with tempfile.TemporaryDirectory(prefix="sandman-git-") as home:
            env = self._env(home, bare)
            try:
                await asyncio.to_thread(_prepare_bare, bare, env, uid, gid)
                fetch = await asyncio.to_thread(
                    gitjail.run_git, git_dir,
                    ["fetch", "--no-tags", "--no-write-fetch-head", "--update-shallow", gitjail.SOURCE,
                     f"+refs/heads/{branch}:refs/heads/{branch}"],
                    writable=bare, uid=uid, gid=gid, timeout=60,
                )  # fmt: skip
            except gitjail.GitJailError as exc:
                raise HelperError(f"git-push: {exc}") from None
            if fetch.exit_code != 0:
                return HelperResult(fetch.exit_code, "", self._shown(f"git-push: fetch failed: {fetch.stderr}"))
            scheme = "file" if "://" not in cfg.remote else cfg.remote.split("://", 1)[0]
            allow_remote = ["-c", "protocol.allow=never", "-c", f"protocol.{scheme}.allow=always"]
            await asyncio.to_thread(_prepare_bare, bare, env, uid, gid)  # checked again after the jail wrote
            remote = await run_process(
                ["git", *HARDENED_GIT, *allow_remote, f"--git-dir={bare}", "fetch", "--no-tags", "--prune",
                 "--no-write-fetch-head", cfg.remote, "+refs/heads/*:refs/remotes/origin/*"],
                env=env, cwd=home,
            )  # fmt: skip
            if remote.exit_code != 0:
                msg = f"git-push: cannot read the remote's branches: {remote.stderr}"
                return HelperResult(remote.exit_code, "", self._shown(msg))
            await asyncio.to_thread(_prepare_bare, bare, env, uid, gid)  # the fetch wrote as us: hand it back
            try:
                listed = await asyncio.to_thread(
                    gitjail.run_git, bare,
                    ["log", "--no-renames", "--diff-merges=dense-combined", "--name-only", "-z", "--format=",
                     "--diff-filter=d", f"refs/heads/{branch}", "--not", "--remotes=origin", "--"],
                    uid=uid, gid=gid, timeout=60, max_output=MAX_CHECKED_PATHS,
                )  # fmt: skip
            except gitjail.GitJailError as exc:
                raise HelperError(f"git-push: {exc}") from None
            if listed.exit_code != 0:
                msg = f"git-push: cannot list the commits to push: {listed.stderr}"
                return HelperResult(listed.exit_code, "", self._shown(msg))
            if listed.truncated:
                raise HelperError("git-push: refused: the push changes too many paths to check against the deny list")
            for raw in dict.fromkeys(listed.stdout.split(b"\0")):
                path = raw.decode("utf-8", "surrogateescape")
                if path and (rule := denied_by(path, deny, allow)) is not None:
                    shown = path.encode("utf-8", "replace").decode()
                    raise HelperError(
                        f"git-push: refused: a commit on {branch!r} adds or changes {shown!r}, which the "
                        f"session's deny list covers ({rule!r}); remove it from the branch's history"
                    )
            push = await run_process(
                ["git", *HARDENED_GIT, *allow_remote, f"--git-dir={bare}", "push", "--no-verify", "--porcelain",
                 cfg.remote, f"refs/heads/{branch}:refs/heads/{dest}"],
                env=env, cwd=home,
            )  # fmt: skip
        if push.exit_code != 0:
            return HelperResult(push.exit_code, self._shown(push.stdout), self._shown(push.stderr), push.truncated)
        if ctx.record is not None:
            ctx.record("git.pushed", branch=dest, source=branch)
        return HelperResult(0, f"pushed {branch} to {dest}\n" + self._shown(push.stdout), self._shown(push.stderr))

    def _shown(self, text: str) -> str:
        """git's text on its way to the agent: the token removed, no control characters, capped."""
        from sandman.upcall import gitjail

        cfg = self.config
        assert isinstance(cfg, GitPushConfig)
        if cfg.token_secret and (token := self.settings.secrets.get(cfg.token_secret)) is not None:
            text = text.replace(token.get_secret_value(), "[REDACTED]")
        return gitjail.clean_error(text, MAX_PUSH_ERROR)

    def _deny_rules(self, ctx: HelperContext) -> tuple[list[str], list[str]]:
        """The session's filesystem deny and allow globs: from the context, else the policy the
        session was recorded with, else the defaults."""
        policy = ctx.policy or self.session_policy(self.settings, ctx.session_id) or Policy()
        return list(policy.filesystem.deny), list(policy.filesystem.allow)

    @staticmethod
    def session_policy(settings: Settings, session_id: str) -> Policy | None:
        """The effective policy a session was recorded with, or None."""
        from sandman.core.state import StateStore

        try:
            store = StateStore(settings.state_dir)
            try:
                rec = store.get_session(session_id)
            finally:
                store.close()
            if rec is None or rec.policy in ("", "{}"):
                return None
            return Policy.model_validate_json(rec.policy)
        except Exception:  # a record from another version: the caller falls back to the defaults
            return None

    @staticmethod
    def pushed_branches(settings: Settings, session_id: str) -> set[str] | None:
        """The remote branches this session pushed (audit events ``git.pushed``); None when the
        record cannot be read."""
        from sandman.core.state import StateStore

        try:
            store = StateStore(settings.state_dir)
            try:
                events = store.events(session=session_id, limit=1_000_000)
            finally:
                store.close()
        except Exception:
            return None
        return {str(e.detail.get("branch")) for e in events if e.event == "git.pushed" and e.verdict == "ok"}

    def _env(self, home: str, bare: Path) -> dict[str, str]:
        cfg = self.config
        assert isinstance(cfg, GitPushConfig)
        gitconfig = Path(home) / ".gitconfig"
        # The bare repository belongs to the workspace owner when the controller is root.
        gitconfig.write_text(f"[safe]\n\tdirectory = {bare}\n")
        env = {
            "PATH": SAFE_PATH, "HOME": home, "GIT_CONFIG_GLOBAL": str(gitconfig), "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "/bin/false", "SSH_ASKPASS": "/bin/false", "LANG": "C",
            "GIT_NO_REPLACE_OBJECTS": "1",
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


def _prepare_bare(bare: Path, env: Mapping[str, str], uid: int | None, gid: int | None) -> None:
    import subprocess

    try:
        _prepare_bare_unchecked(bare, env, uid, gid)
    except (OSError, subprocess.SubprocessError) as exc:
        raise HelperError(f"git-push: the session's push repository cannot be prepared: {exc}") from None


def _prepare_bare_unchecked(bare: Path, env: Mapping[str, str], uid: int | None, gid: int | None) -> None:
    """Create the session's bare repository, or check it before host-side git reads it: the jail
    may write into it, so it must hold no symlink, device or FIFO, nothing that borrows from
    elsewhere (commondir, alternates, grafts), and the config is sandman's. When the controller is
    root the repository is handed to the jail's uid (the workspace owner)."""
    import shutil
    import stat
    import subprocess

    if not bare.exists():
        bare.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        subprocess.run(
            ["git", "init", "--bare", "-q", str(bare)], env=dict(env), cwd=env["HOME"],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip
        shutil.rmtree(bare / "hooks", ignore_errors=True)
    st = bare.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise HelperError(f"git-push: the session's push repository {bare.name} is not a directory")
    for name in ("commondir", "objects/info/alternates", "objects/info/http-alternates", "info/grafts"):
        if os.path.lexists(bare / name):
            raise HelperError(f"git-push: the session's push repository has {name}: refused (tampered with?)")
    for top, dirs, files in os.walk(bare):
        for name in (*dirs, *files):
            path = os.path.join(top, name)
            mode = os.lstat(path).st_mode
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                rel = os.path.relpath(path, bare)
                raise HelperError(f"git-push: the session's push repository holds {rel!r}, not a file: refused")
            if uid is not None and gid is not None and name != "config":
                os.lchown(path, uid, gid)
    config = bare / "config"
    tmp = bare / f"config.sandman-{os.urandom(6).hex()}"  # concurrent pushes each write their own
    tmp.write_text(_BARE_CONFIG)
    tmp.chmod(0o644)
    tmp.replace(config)  # root-owned when the controller is root; the jail sees its own copy anyway
    if uid is not None and gid is not None:
        os.lchown(bare, uid, gid)


MAX_BARE_BYTES = 2 << 30  # a session's bare repository kept between pushes, at most


def _tree_size(path: Path) -> int:
    """Bytes under ``path`` (not following symlinks); 0 when it does not exist."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def bare_repository(state_dir: Path, session_id: str) -> Path:
    """Where git-push keeps a session's bare repository (removed when the session ends)."""
    return state_dir / "git" / f"{session_id}.git"


def _current_branch(git_dir: Path) -> str:
    """The branch ``.git/HEAD`` names: read without following a symlink, without blocking on a FIFO
    or opening a device, at most 4 KiB. Blocking: call it off the event loop."""
    from sandman.upcall import gitjail

    try:
        fd = os.open(git_dir, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        raise HelperError("git-push: the workspace's .git must be a directory inside the workspace") from None
    try:
        head = gitjail.read_small(fd, "HEAD", 4096).decode("utf-8", "replace").strip()
    except gitjail.GitJailError as exc:
        raise HelperError(f"git-push: cannot read .git/HEAD ({exc})") from None
    finally:
        os.close(fd)
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
        from sandman.upcall.ghhelper import GhHelper

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
