"""Run git on an agent's repository inside a bubblewrap jail on the host.

The agent controls every byte of its ``.git``: config (``include.path``, ``core.fsmonitor``,
``diff.external``), ``commondir``, ``objects/info/alternates``, refs and ``packed-refs`` that are
symlinks. A git on the host that follows any of them reads (and may quote back, in an error
message) whatever the host user can read. So git never reads an agent's ``.git`` on the host:
``run_git`` runs it in a jail that holds nothing else worth reading.

The jail (``bwrap`` from Debian's ``bubblewrap``; ``scripts/setup`` installs it):

* every namespace unshared (``--unshare-all --unshare-user``: no network, own pid/ipc/uts/user
  namespaces), ``--die-with-parent``, ``--new-session`` (no terminal to inject into),
  ``--disable-userns``;
* ``git_dir`` read-only at ``SOURCE`` (``/source.git``); its ``config`` hidden under a neutral one
  that sandman writes (only the object format is kept, and a per-call nonce), so not even the
  agent's config is read inside the jail;
* ``writable`` (optional) read-write at ``TARGET`` (``/target.git``), its config hidden the same way;
* ``/usr/bin``, ``/usr/lib*``, ``/usr/libexec`` read-only (with the ``/bin``, ``/lib*`` symlinks of
  a merged-/usr system; not ``/usr/local`` or ``/usr/share``), a minimal ``/dev``, a 16 MiB tmpfs at
  ``/tmp`` that is also ``HOME``; no ``/etc``, no ``/proc``, nothing else of the host, so a symlink
  or path the agent wrote leads nowhere outside the two repositories and public program files;
* a clean environment (``PATH``, ``HOME``, ``LANG``, ``GIT_DIR`` and git's no-system-config,
  no-global-config, no-prompt, no-replace-objects switches) and hardened ``-c`` options (no hooks,
  no fsmonitor, no protocol but ``file``, no credential helper, fsck of transferred objects, no
  auto gc or maintenance);
* first in the jail, before git, a check that the directories bound are the very ones checked here
  (device and inode of the descriptor opened with ``O_NOFOLLOW``) and that git will read sandman's
  configs: bwrap 0.8 resolves what it binds back to a path, which the agent could swap between the
  check and the bind; a swap ends the call with ``GitJailError``;
* never as root: when the caller is root, the jail runs as ``uid``/``gid`` (default: the owner of
  ``git_dir``, i.e. the workspace owner), which must then own ``writable``. Root binds the two
  directories onto a staging directory in a private mount namespace (the workspace owner may not be
  able to walk a ``0700`` state dir), then drops to that uid for good (``setpriv``) and execs bwrap.
  Why not bwrap as root with ``--unshare-user --uid``: every file access would still be made by uid
  0 on the host (without capabilities, but a kernel bug away from them), and a ``0700`` ``.git``
  owned by the workspace owner could not be read. Run as the owner, the jail is no more privileged
  than the agent's own uid on the host, and reads the repository whatever its modes.

Interface::

    result = run_git(Path(ws) / ".git", ["log", "--format=%H", "--all"])          # read-only
    result = run_git(ws_git, ["fetch", SOURCE, "+refs/heads/b:refs/heads/b"], writable=bare)
    result.exit_code, result.stdout (bytes, capped), result.stderr (str: cleaned, capped), result.truncated

git runs with ``GIT_DIR=SOURCE`` (``TARGET`` when ``writable`` is given); arguments name the other
repository by its constant. For diffs, pass ``--no-ext-diff --no-textconv`` anyway (the configs are
neutral, so no driver is defined, but say what you mean). Blocking: from an event loop, call it
through ``asyncio.to_thread``. About 25 ms a call as root, 10 ms otherwise.

``check_git_dir`` refuses, before anything runs, a ``.git`` that is not a plain directory or that
has ``commondir``, ``objects/info/alternates`` or ``objects/info/http-alternates`` at all: a
repository that sandman's users push from or scan has no use for them (worktrees and
``clone --shared`` do, and are refused with the reason), and refusing on existence needs no
resolution of a path the agent wrote. The jail would make them point at nothing anyway; the check
turns a confusing git error into a clear refusal.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

SOURCE = "/source.git"  # git_dir, read-only
TARGET = "/target.git"  # writable, read-write
DEFAULT_TIMEOUT_S = 60.0
MAX_OUTPUT = 1 << 20  # stdout bytes kept
MAX_ERROR = 4000  # stderr characters kept (it may go back to the agent)
TMPFS_BYTES = 16 << 20
# Each git process in the jail: its heap may not pass this (RLIMIT_DATA; packs are mapped files and
# do not count). A ref that is /dev/zero or a FIFO fed without end then ends git, not the host.
GIT_DATA_BYTES = 512 << 20
MAX_REF_FILE = 64 << 10  # a loose ref, HEAD, shallow: a few lines
MAX_PACKED_REFS = 256 << 20
MAX_REFS = 200_000
# What git reads by name in a repository besides objects: each must be a regular file (refs/: files
# in plain directories), never a symlink, FIFO or device.
_REF_FILES = ("HEAD", "packed-refs", "shallow", "info/grafts", "FETCH_HEAD", "ORIG_HEAD", "MERGE_HEAD")
_REFUSED_FILES = ("commondir", "objects/info/alternates", "objects/info/http-alternates")
_MAX_CONFIG = 64 << 10
_CUT = "\n[... error output truncated]"

# Options for every jailed git: nothing in either repository's config could set them anyway (the
# configs are replaced), but a caller's args or a future git default cannot turn them back on.
JAIL_GIT_OPTIONS: tuple[str, ...] = (
    "-c", "core.hooksPath=/dev/null",
    "-c", "core.fsmonitor=false",
    "-c", "core.untrackedCache=false",
    "-c", "credential.helper=",
    "-c", "protocol.allow=never",
    "-c", "protocol.file.allow=always",  # only SOURCE and TARGET exist to be reached
    "-c", "uploadpack.packObjectsHook=",
    "-c", "transfer.fsckObjects=true",
    "-c", "gc.auto=0",
    "-c", "maintenance.auto=false",
    "-c", "fetch.writeCommitGraph=false",
    "-c", "fetch.recurseSubmodules=false",
    "-c", "core.pager=cat",
    "-c", "safe.directory=*",  # the jail holds two repositories, both meant to be read
)  # fmt: skip


class GitJailError(Exception):
    """The jail refused to run (the message says why), or bwrap is missing."""


@dataclass(frozen=True)
class JailResult:
    exit_code: int  # git's; 124 on timeout
    stdout: bytes  # at most max_output bytes
    stderr: str  # decoded, control characters dropped, at most max_error characters
    truncated: bool = False  # stdout or stderr was cut


def bwrap_path() -> str:
    path = shutil.which("bwrap", path="/usr/bin:/bin:/usr/local/bin")
    if path is None:
        raise GitJailError("bubblewrap (bwrap) is not installed on the host: apt-get install bubblewrap")
    return path


def open_git_dir(git_dir: Path) -> int:
    """An ``O_PATH`` descriptor of ``git_dir`` after ``check_git_dir``; the caller closes it."""
    try:
        fd = os.open(git_dir, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (20, 40):  # ENOTDIR, ELOOP
            kind = "a symlink" if os.path.islink(git_dir) else "not a directory (a 'gitdir:' file?)"
            raise GitJailError(f"{git_dir.name} is {kind}: only a plain .git directory is accepted") from None
        raise GitJailError(f"cannot open {git_dir.name}: {exc.strerror}") from None
    try:
        check_git_dir(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_git_dir(fd: int) -> None:
    """Refuse a git directory (descriptor) whose commondir or alternates files exist, or whose
    config is not a regular file."""
    for name in _REFUSED_FILES:
        try:
            os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        except NotADirectoryError:  # objects or objects/info is not a directory
            continue
        except OSError as exc:
            raise GitJailError(f".git/{name} cannot be checked ({exc.strerror}): refused") from None
        raise GitJailError(
            f".git/{name} exists: a repository that borrows refs or objects from elsewhere "
            "(a worktree, 'clone --shared', alternates) is refused; use a plain clone"
        )
    try:
        st = os.stat("config", dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        raise GitJailError(".git/config is missing: not a git repository") from None
    if not stat.S_ISREG(st.st_mode):
        raise GitJailError(".git/config is not a regular file (a symlink?): refused")
    _check_refs(fd)


def _check_refs(fd: int) -> None:
    """Every ref git could read is a regular file of a sane size: a symlink to /dev/zero or a FIFO
    the agent feeds would make git read without end. (A swap after this check meets the jail's
    memory cap instead.)"""
    for name in _REF_FILES:
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            continue
        limit = MAX_PACKED_REFS if name == "packed-refs" else MAX_REF_FILE
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            raise GitJailError(f".git/{name} is not a regular file of at most {limit} bytes: refused")
    try:
        top = os.open("refs", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    except OSError as exc:
        raise GitJailError(f".git/refs is not a plain directory ({exc.strerror}): refused") from None
    stack, seen = [(top, "refs")], 0
    try:
        while stack:
            dfd, rel = stack.pop()
            try:
                with os.scandir(dfd) as it:
                    entries = list(it)
                seen += len(entries)
                if seen > MAX_REFS:
                    raise GitJailError(f".git/refs holds more than {MAX_REFS} entries: refused")
                for entry in entries:
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISDIR(st.st_mode):
                        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
                        try:
                            child = os.open(entry.name, flags, dir_fd=dfd)
                        except OSError as exc:
                            raise GitJailError(
                                f".git/{rel}/{entry.name} changed while checked ({exc.strerror})"
                            ) from None
                        stack.append((child, f"{rel}/{entry.name}"))
                    elif not stat.S_ISREG(st.st_mode) or st.st_size > MAX_REF_FILE:
                        raise GitJailError(
                            f".git/{rel}/{entry.name} is not a regular file of at most {MAX_REF_FILE} bytes "
                            "(a symlink, FIFO or device): refused"
                        )
            finally:
                os.close(dfd)
    finally:
        for dfd, _ in stack:
            os.close(dfd)


def read_small(dir_fd: int, name: str, limit: int = 4096) -> bytes:
    """The first ``limit`` bytes of the regular file ``name`` under ``dir_fd``: never follows a
    symlink, never blocks on a FIFO, never opens a device."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError as exc:
        raise GitJailError(f"{name}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise GitJailError(f"{name} is not a regular file")
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        raise GitJailError(f"{name}: {exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped between the two looks
            raise GitJailError(f"{name} is not a regular file")
        return os.read(fd, limit)
    finally:
        os.close(fd)


_SHA256 = re.compile(rb"^\s*objectformat\s*=\s*sha256\s*$", re.IGNORECASE | re.MULTILINE)


def neutral_config(fd: int) -> bytes:
    """The config git sees in the jail: only the repository's object format survives."""
    try:
        text = read_small(fd, "config", _MAX_CONFIG)
    except GitJailError:
        text = b""
    fmt = "sha256" if _SHA256.search(text) else "sha1"
    return (
        f"[core]\n\trepositoryformatversion = 1\n\tbare = true\n\tlogallrefupdates = false\n"
        f"[extensions]\n\tobjectformat = {fmt}\n"
    ).encode()


def clean_error(text: str, limit: int = MAX_ERROR) -> str:
    """git's stderr, fit to be shown to the agent: no control characters, at most ``limit`` chars."""
    text = "".join(c for c in text if c in "\n\t" or (c.isprintable() and c != "\x7f"))
    if len(text) > limit:
        text = text[:limit] + _CUT
    return text


def drain(stream: IO[bytes], keep: list[bytes], limit: int, cut: list[bool]) -> None:
    """Read ``stream`` to its end, keeping at most ``limit`` bytes; ``cut`` is made true when more came."""
    size = 0
    while chunk := stream.read(65536):
        if size < limit:
            keep.append(chunk[: limit - size])
        if size + len(chunk) > limit:
            cut[:] = [True]
        size += len(chunk)
    stream.close()


def _data_fd(data: bytes) -> int:
    read, write = os.pipe()
    try:
        os.write(write, data)  # well under a pipe's buffer
    finally:
        os.close(write)
    return read


def _usr_binds() -> list[str]:
    """/usr's program and library directories, read-only, and the root symlinks into them (merged
    /usr); not /usr/local, /usr/share or /usr/src, where an operator may keep things."""
    args: list[str] = []
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32", "libexec"):
        path = Path("/usr") / name
        if path.is_dir() and not path.is_symlink():
            args += ["--ro-bind", str(path), str(path)]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = Path("/") / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), f"/{name}"]
        elif path.is_dir():
            args += ["--ro-bind", str(path), f"/{name}"]
    return args


# Run first inside the jail: the directories bwrap bound must be the very ones checked here (bwrap
# 0.8 resolves a bound descriptor back to a path, which the agent could swap in between), and the
# configs git will read must be sandman's (marked with a per-call nonce).
_VERIFY = r"""
src=$1 nonce=$2 dst=$3; shift 3
fail() { echo "sandman-jail: $1: refused" >&2; exit 125; }
[ "$(stat -c %d:%i /source.git)" = "$src" ] || fail "the repository was replaced while the jail was set up"
grep -qxF "# sandman $nonce" /source.git/config || fail "the repository's config was replaced while the jail was set up"
if [ -n "$dst" ]; then
  [ "$(stat -c %d:%i /target.git)" = "$dst" ] || fail "the target repository was replaced while the jail was set up"
  grep -qxF "# sandman $nonce" /target.git/config || fail "the target's config was replaced while the jail was set up"
fi
exec "$@"
"""
# Root controller: bwrap runs as the workspace owner, who may not be able to walk the paths to the
# repositories (a 0700 state dir). In a private mount namespace, root binds them onto a staging
# directory anyone can walk, drops its privileges for good and execs bwrap, which binds the staging
# copies. (A path, not the descriptor: a bind source must be in the caller's mount namespace. A
# swap of the path in between is caught by _VERIFY's device:inode check before git runs.)
_LAUNCH = r"""
stage=$1 src=$2 dst=$3 uid=$4 gid=$5; shift 5
mount --no-canonicalize --bind -- "$src" "$stage/src" || exit 126
if [ -n "$dst" ]; then mount --no-canonicalize --bind -- "$dst" "$stage/dst" || exit 126; fi
exec setpriv --reuid="$uid" --regid="$gid" --clear-groups --no-new-privs -- "$@"
"""


def _devino(fd: int) -> str:
    st = os.fstat(fd)
    return f"{st.st_dev}:{st.st_ino}"


def run_git(
    git_dir: Path,
    args: Sequence[str],
    *,
    writable: Path | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    uid: int | None = None,
    gid: int | None = None,
    max_output: int = MAX_OUTPUT,
    max_error: int = MAX_ERROR,
) -> JailResult:
    """Run ``git <args>`` in the jail on ``git_dir`` (read-only at ``SOURCE``) and, if given,
    ``writable`` (read-write at ``TARGET``). Blocking: call it through ``asyncio.to_thread`` from a
    loop. Raises ``GitJailError`` when the repository is refused or the jail cannot be set up;
    git's own failures come back as a non-zero ``exit_code`` with its (cleaned, capped) stderr."""
    bwrap = bwrap_path()
    fds: list[int] = []
    try:
        with tempfile.TemporaryDirectory(prefix="sandman-jail-") as stage:
            src = open_git_dir(Path(git_dir))
            fds.append(src)
            st = os.fstat(src)
            root = os.geteuid() == 0
            if root:
                uid = st.st_uid if uid is None else uid
                gid = (st.st_gid if uid == st.st_uid else uid) if gid is None else gid
                if uid == 0 or gid == 0:
                    raise GitJailError(
                        "git is never run as root on an agent's repository: give it to an unprivileged user"
                    )
            elif uid not in (None, os.geteuid()) or gid not in (None, os.getegid()):
                raise GitJailError("run_git: uid/gid can only be chosen when the caller is root")
            dst: int | None = None
            if writable is not None:
                dst = os.open(writable, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
                fds.append(dst)
                owner = os.fstat(dst).st_uid
                if owner != (uid if root else os.geteuid()):
                    raise GitJailError(f"run_git: {writable} must belong to the jail's user (uid {uid}), not {owner}")
            nonce = secrets.token_hex(16)
            marker = f"# sandman {nonce}\n".encode()
            src_cfg = _data_fd(marker + neutral_config(src))
            fds.append(src_cfg)
            if root:
                os.chmod(stage, 0o755)
                os.mkdir(os.path.join(stage, "src"), 0o755)
                os.mkdir(os.path.join(stage, "dst"), 0o755)
                src_bind = ["--ro-bind", os.path.join(stage, "src"), SOURCE]
                dst_bind = ["--bind", os.path.join(stage, "dst"), TARGET]
            else:
                src_bind = ["--ro-bind-fd", str(src), SOURCE]
                dst_bind = ["--bind-fd", str(dst), TARGET]
            jail = [
                bwrap,
                "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--disable-userns",
                "--clearenv", *_usr_binds(), "--dev", "/dev", "--size", str(TMPFS_BYTES), "--tmpfs", "/tmp",
                *src_bind, "--ro-bind-data", str(src_cfg), f"{SOURCE}/config",
            ]  # fmt: skip
            if dst is not None:
                dst_cfg = _data_fd(marker + neutral_config(dst))
                fds.append(dst_cfg)
                jail += [*dst_bind, "--ro-bind-data", str(dst_cfg), f"{TARGET}/config"]
            for key, value in _jail_env(writable is not None).items():
                jail += ["--setenv", key, value]
            dst_id = _devino(dst) if dst is not None else ""
            jail += ["--chdir", "/", "--", "/bin/sh", "-c", _VERIFY, "sh", _devino(src), nonce, dst_id]
            jail += ["/usr/bin/prlimit", f"--data={GIT_DATA_BYTES}:{GIT_DATA_BYTES}", "--"]
            jail += ["git", *JAIL_GIT_OPTIONS, *args]
            if root:
                argv = ["/usr/bin/unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", _LAUNCH,
                        "sh", stage, str(git_dir), str(writable or ""), str(uid), str(gid), *jail]  # fmt: skip
            else:
                argv = jail
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C"},
                cwd="/",
                pass_fds=fds,
                close_fds=True,
                start_new_session=True,
            )
            for fd in fds:
                os.close(fd)
            fds.clear()
            result = _collect(proc, timeout, max_output, max_error)
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
    if result.exit_code in (125, 126) and result.stderr.startswith(("sandman-jail:", "mount:", "setpriv:", "bwrap:")):
        raise GitJailError(f"the git jail could not be set up: {result.stderr.strip()}")
    return result


def _jail_env(writing: bool) -> dict[str, str]:
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": "/tmp",
        "LANG": "C",
        "GIT_DIR": TARGET if writing else SOURCE,
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": "/dev/null",
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_NO_REPLACE_OBJECTS": "1",
        "GIT_OPTIONAL_LOCKS": "0",
        "GIT_AUTHOR_NAME": "sandman",
        "GIT_AUTHOR_EMAIL": "sandman@localhost",
        "GIT_COMMITTER_NAME": "sandman",
        "GIT_COMMITTER_EMAIL": "sandman@localhost",
    }


def _collect(proc: subprocess.Popen[bytes], timeout: float, max_output: int, max_error: int) -> JailResult:
    out: list[bytes] = []
    err: list[bytes] = []
    out_cut: list[bool] = []
    err_cut: list[bool] = []
    assert proc.stdout is not None and proc.stderr is not None
    readers = [
        threading.Thread(target=drain, args=(proc.stdout, out, max_output, out_cut), daemon=True),
        threading.Thread(target=drain, args=(proc.stderr, err, 4 * max_error + 1024, err_cut), daemon=True),
    ]
    for reader in readers:
        reader.start()
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # bwrap (the launcher exec'd into it); git dies with it
        proc.wait()
        code = 124
    for reader in readers:
        reader.join(timeout=5)
    stderr = clean_error(b"".join(err).decode("utf-8", "replace"), max_error)
    if code == 124:
        stderr += f"\ngit timed out after {timeout:g}s and was killed"
    return JailResult(code, b"".join(out), stderr, bool(out_cut or err_cut or stderr.endswith(_CUT)))
