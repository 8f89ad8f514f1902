"""Host-side file access to a session's workspace: read, write, list, refusals audited.

The workspace is agent-writable, so every path in it is hostile input (DESIGN.md, "Trust
boundary"); a check-then-open on a host path loses to a ``renameat2(RENAME_EXCHANGE)`` loop.
Hence:

- the path is checked lexically only (normalised, inside the workspace, the deny list; for a write
  also the protected globs, any ``.git`` component and ``.sandman/``), never through realpath;
- every open is relative to a descriptor of the workspace root and follows no symlink in any
  component: ``openat2(RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS|RESOLVE_NO_MAGICLINKS)``, or, on a
  kernel without it (ENOSYS), a walk that opens one component at a time with ``O_NOFOLLOW`` and
  holds each directory by descriptor; a symlink anywhere is refused (PathDenied);
- the work is done as the workspace owner, never as root: a process running as root forks a child
  that drops to the owner's uid and gid (no supplementary groups, so no capabilities), does the
  open/read/write/list and hands the result back over a pipe. What it creates is the owner's.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import platform
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sandman.core.workspace import Workspace
from sandman.errors import SandmanError, UsageError, WorkspaceError
from sandman.policy import Policy
from sandman.policy.paths import PathDenied, denied_by

MAX_READ = 64 << 20

# Writes never touch these, whatever the policy says: git on the host obeys what is in any `.git`
# (hooks, config, commondir, modules, worktrees, info/attributes, a `.git` file's gitdir:), and a
# campaign image and policy built from `.sandman/` run as root with network.
GIT_RULE = "**/.git"
SANDMAN_RULE = ".sandman"
_WHY = {
    GIT_RULE: " (git on the host obeys what a .git holds: hooks, config, commondir, modules, worktrees)",
    SANDMAN_RULE: " (the campaign's image and policy)",
}

# -- descriptor-relative opens that never follow a symlink -------------------------------------
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
_RESOLVE = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
# Syscalls added since Linux 5.1 share one number on every architecture but alpha.
_SYS_OPENAT2 = None if platform.machine().startswith("alpha") else 437
_DIR_PATH = os.O_PATH | os.O_DIRECTORY


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long

# None: not probed yet; False: the O_NOFOLLOW walk (tests set it to exercise the fallback).
_openat2_ok: bool | None = None if _SYS_OPENAT2 is not None else False


def _openat2(dirfd: int, path: str, flags: int, mode: int = 0) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, mode, _RESOLVE)
    raw = os.fsencode(path)
    for _ in range(64):  # EAGAIN: a concurrent rename while resolving ".." (there is none here)
        fd = _syscall(
            ctypes.c_long(_SYS_OPENAT2 or -1),
            ctypes.c_long(dirfd),
            ctypes.c_char_p(raw),
            ctypes.byref(how),
            ctypes.c_size_t(ctypes.sizeof(how)),
        )
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err not in (errno.EINTR, errno.EAGAIN):
            raise OSError(err, os.strerror(err), path)
    raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN), path)


def _have_openat2(root_fd: int) -> bool:
    global _openat2_ok
    if _openat2_ok is None:
        try:
            os.close(_openat2(root_fd, ".", _DIR_PATH))
        except OSError as exc:
            # ENOSYS: kernel older than 5.6; EPERM: an old seccomp profile that denies unknown calls.
            if exc.errno not in (errno.ENOSYS, errno.EPERM):
                raise
            _openat2_ok = False
        else:
            _openat2_ok = True
    return _openat2_ok


def _open_nofollow(dirfd: int, name: str, flags: int, mode: int = 0) -> int:
    """One component, relative to ``dirfd``; a symlink fails (ELOOP, ENOTDIR with O_DIRECTORY)."""
    return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dirfd)


def _walk(dirfd: int, parts: tuple[str, ...], *, create: bool = False) -> int:
    """An O_PATH descriptor of the directory ``dirfd/parts``, opened one component at a time
    without following a symlink; missing components are made (as the caller) when ``create``."""
    cur = os.dup(dirfd)
    try:
        for name in parts:
            try:
                nxt = _open_nofollow(cur, name, _DIR_PATH)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):  # made meanwhile: opened and checked below
                    os.mkdir(name, 0o755, dir_fd=cur)
                nxt = _open_nofollow(cur, name, _DIR_PATH)
            if not stat.S_ISDIR(os.fstat(nxt).st_mode):
                os.close(nxt)
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), name)
            os.close(cur)
            cur = nxt
    except BaseException:
        os.close(cur)
        raise
    return cur


def _open_beneath(dirfd: int, parts: tuple[str, ...], flags: int, mode: int = 0) -> int:
    """``dirfd/parts`` opened with ``flags``, no symlink followed in any component."""
    if _openat2_ok:
        return _openat2(dirfd, "/".join(parts) or ".", flags, mode)
    if not parts:
        return _open_nofollow(dirfd, ".", flags, mode)
    parent = _walk(dirfd, parts[:-1])
    try:
        return _open_nofollow(parent, parts[-1], flags, mode)
    finally:
        os.close(parent)


def _diagnose(root_fd: int, parts: tuple[str, ...], dir_wanted: bool) -> tuple[str, str] | None:
    """For the message only, what is wrong with ``parts`` now: ("symlink", prefix) for the first
    component that is a symlink, ("notdir", prefix) for a parent (or, when ``dir_wanted``, the last
    component) that is not a directory, or None."""
    cur = os.dup(root_fd)
    try:
        for i, name in enumerate(parts):
            prefix = "/".join(parts[: i + 1])
            try:
                st = os.stat(name, dir_fd=cur, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    return ("symlink", prefix)
                if not stat.S_ISDIR(st.st_mode):
                    return ("notdir", prefix) if dir_wanted or i < len(parts) - 1 else None
                nxt = _open_nofollow(cur, name, _DIR_PATH)
            except OSError:
                return None
            os.close(cur)
            cur = nxt
        return None
    finally:
        os.close(cur)


def _explain(
    root_fd: int, text: str, parts: tuple[str, ...], exc: OSError, *, dir_wanted: bool = False
) -> SandmanError:
    err = exc.errno
    if err in (errno.ELOOP, errno.ENOTDIR, errno.EXDEV):
        found = _diagnose(root_fd, parts, dir_wanted)
        if found and found[0] == "symlink":
            return PathDenied(
                f"{text!r} goes through the symlink {found[1]!r}: the files API never follows a symlink in the "
                "workspace; name the real path"
            )
        if found and err == errno.ENOTDIR:
            return UsageError(f"{text!r}: {found[1]!r} is not a directory")
        # Nothing wrong any more: a component was a symlink when opened and was swapped back since.
        return PathDenied(
            f"{text!r} went through a symlink when opened (it has changed since): the files API never "
            "follows a symlink in the workspace"
        )
    if err == errno.ENOENT:
        return UsageError(f"{text!r} does not exist in the workspace")
    if err in (errno.EACCES, errno.EPERM):
        return PathDenied(f"{text!r}: permission denied to the workspace owner (uid {os.geteuid()})")
    if err == errno.EISDIR:
        return UsageError(f"{text!r} is a directory")
    if err == errno.ENXIO:
        return UsageError(f"{text!r} is not a regular file")
    return UsageError(f"{text!r}: {exc.strerror}")


def _read_at(root_fd: int, text: str, parts: tuple[str, ...], max_bytes: int) -> bytes:
    try:
        # O_NONBLOCK: a FIFO planted by the agent must not hang the host.
        fd = _open_beneath(root_fd, parts, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as exc:
        raise _explain(root_fd, text, parts, exc) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UsageError(f"{text!r} is not a regular file")
        chunks, total = [], 0
        while total <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as exc:
        raise UsageError(f"{text!r}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if total > max_bytes:
        raise UsageError(f"{text!r} is larger than {max_bytes} bytes")
    return b"".join(chunks)


def _write_at(root_fd: int, text: str, parts: tuple[str, ...], payload: bytes, make_dirs: bool) -> None:
    try:
        if not _openat2_ok:
            parent = _walk(root_fd, parts[:-1], create=make_dirs)
        else:
            try:
                parent = _open_beneath(root_fd, parts[:-1], _DIR_PATH)
            except FileNotFoundError:
                if not make_dirs:
                    raise
                parent = _walk(root_fd, parts[:-1], create=True)
    except FileNotFoundError:
        raise UsageError(f"{text!r}: its directory does not exist in the workspace (pass make_dirs=True)") from None
    except OSError as exc:
        raise _explain(root_fd, text, parts, exc) from None
    try:
        # No O_TRUNC before the type is known: a FIFO or device is refused untouched.
        flags = os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY
        fd = _open_beneath(parent, parts[-1:], flags, 0o644)
    except OSError as exc:
        raise _explain(root_fd, text, parts, exc) from None
    finally:
        os.close(parent)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UsageError(f"{text!r} is not a regular file")
        os.ftruncate(fd, 0)
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view) :]
    except OSError as exc:
        raise UsageError(f"{text!r}: {exc.strerror}") from None
    finally:
        os.close(fd)


def _list_at(root_fd: int, text: str, parts: tuple[str, ...]) -> list[tuple[str, bool, bool, int]]:
    """(name, is_dir, is_symlink, size) of each entry, nothing followed."""
    try:
        fd = _open_beneath(root_fd, parts, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise _explain(root_fd, text, parts, exc, dir_wanted=True) from None
    out = []
    try:
        with os.scandir(fd) as it:  # scandir works on a dup of fd; fd stays ours to close
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # gone meanwhile
                out.append((entry.name, stat.S_ISDIR(st.st_mode), stat.S_ISLNK(st.st_mode), st.st_size))
    except OSError as exc:
        raise UsageError(f"{text!r}: {exc.strerror}") from None
    finally:
        os.close(fd)
    return out


# -- running as the workspace owner ------------------------------------------------------------
_ERRORS: dict[str, type[SandmanError]] = {"PathDenied": PathDenied, "UsageError": UsageError}


def _as_owner(uid: int, gid: int, op: Callable[..., Any], root_fd: int, *args: Any) -> Any:
    """``op(root_fd, *args)`` in a forked child that runs as ``uid:gid`` with no supplementary groups; its
    result (bytes, None or a JSON-able list) or its error comes back over a pipe."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: whatever happens, it ends in os._exit and never returns
        status = 1
        try:
            os.close(r)
            try:
                # Only what the work needs stays open: not the engine socket, state store, ...
                low, high = sorted((root_fd, w))
                os.closerange(3, low)
                os.closerange(low + 1, high)
                os.closerange(high + 1, 1 << 20)
                os.setgroups([])
                os.setgid(gid)
                os.setuid(uid)
                if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid) or os.getgroups():
                    raise OSError(errno.EPERM, "could not drop to the workspace owner")
                result = op(root_fd, *args)
                if isinstance(result, bytes):
                    head, body = {"ok": "bytes"}, result
                else:
                    head, body = {"ok": "json", "value": result}, b""
            except SandmanError as exc:
                kind = type(exc).__name__ if type(exc).__name__ in _ERRORS else "UsageError"
                head, body = {"error": kind, "message": str(exc)}, b""
            except BaseException as exc:  # reported to the parent, which raises
                head, body = {"error": "internal", "message": f"{type(exc).__name__}: {exc}"}, b""
            encoded = json.dumps(head).encode()
            view = memoryview(struct.pack("!I", len(encoded)) + encoded + body)
            while view:
                view = view[os.write(w, view) :]
            status = 0
        finally:
            os._exit(status)
    os.close(w)
    try:
        chunks = []
        while chunk := os.read(r, 1 << 20):
            chunks.append(chunk)
    finally:
        os.close(r)
        try:
            _, wstatus = os.waitpid(pid, 0)
        except ChildProcessError:  # reaped by someone else's waitpid(-1): the answer is what counts
            wstatus = -1
    data = b"".join(chunks)
    if len(data) < 4 or len(data) < 4 + struct.unpack("!I", data[:4])[0]:
        raise SandmanError(f"the files worker (pid {pid}) ended without an answer (wait status {wstatus})")
    size = struct.unpack("!I", data[:4])[0]
    head = json.loads(data[4 : 4 + size])
    if "error" in head:
        if head["error"] in _ERRORS:
            raise _ERRORS[head["error"]](head["message"])
        raise SandmanError(f"the files worker failed: {head['message']}")
    return data[4 + size :] if head["ok"] == "bytes" else head.get("value")


@dataclass(frozen=True)
class FileInfo:
    path: str  # relative to the workspace
    is_dir: bool
    size: int
    is_symlink: bool = False  # listed, never followed: read/write/list through it are refused


class Files:
    """``sb.files``: the workspace as the policy lets the host touch it on the agent's behalf."""

    def __init__(
        self,
        workspace: Workspace,
        policy: Callable[[], Policy],
        audit: Callable[..., None],
        scrub: Callable[[bytes], bytes] | None = None,
    ) -> None:
        self._ws = workspace
        self._policy = policy
        self._audit = audit
        self._scrub = scrub  # the session's known secrets (e.g. from the git history) never leave

    def _refused(self, path: str | os.PathLike[str], exc: PathDenied) -> PathDenied:
        self._audit("path.refused", "refused", path=os.fsdecode(os.fspath(path)), reason=str(exc))
        return exc

    def _parts(self, path: str | os.PathLike[str]) -> tuple[str, tuple[str, ...]]:
        """The path as given and its components relative to the workspace, checked lexically:
        nothing is resolved here, the open follows no symlink instead."""
        text = os.fsdecode(os.fspath(path))
        if not text:
            raise PathDenied("path is empty: name a file inside the workspace")
        if "\x00" in text:
            raise PathDenied(f"path {text!r} contains a NUL byte")
        root = os.fspath(self._ws.path).rstrip("/") or "/"
        lexical = os.path.normpath(os.path.join(root, text))  # an absolute ``text`` replaces root
        if lexical != root and not lexical.startswith(root.rstrip("/") + "/"):
            raise PathDenied(f"{text!r} escapes the workspace {root!r}")
        return text, tuple(p for p in lexical[len(root) :].split("/") if p)

    def _checked(self, path: str | os.PathLike[str], *, writing: bool) -> tuple[str, tuple[str, ...]]:
        fs = self._policy().filesystem
        try:
            text, parts = self._parts(path)
            rel = "/".join(parts)
            if parts and (rule := denied_by(rel, fs.deny, fs.allow)):
                raise PathDenied(f"{text!r} is denied by rule {rule!r}: it stays out of the sandbox's reach")
            if writing:
                if not parts:
                    raise PathDenied(f"{text!r} is the workspace root itself, not a file")
                if rule := self._write_rule(parts, fs.protected):
                    raise PathDenied(
                        f"{text!r} is protected by rule {rule!r}{_WHY.get(rule, '')}: it is read-only for the "
                        "sandbox, and the files API does not write it either"
                    )
        except PathDenied as exc:
            raise self._refused(path, exc) from None
        return text, parts

    @staticmethod
    def _write_rule(parts: tuple[str, ...], protected: list[str]) -> str | None:
        # casefold: on a case-insensitive mount `.GIT/hooks` is `.git/hooks`
        if any(p.casefold() == ".git" for p in parts):
            return GIT_RULE
        if parts[0].casefold() == ".sandman":
            return SANDMAN_RULE
        return denied_by("/".join(parts), protected, ())

    def _run(self, path: str | os.PathLike[str], op: Callable[..., Any], *args: Any) -> Any:
        """``op(root_fd, *args)`` on a descriptor of the workspace root, as the workspace owner."""
        try:
            root_fd = os.open(self._ws.path, _DIR_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise WorkspaceError(f"workspace {str(self._ws.path)!r} cannot be opened: {exc.strerror}") from None
        try:
            st = os.fstat(root_fd)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != self._ws.uid:
                raise WorkspaceError(
                    f"workspace {str(self._ws.path)!r} is no longer the directory owned by uid {self._ws.uid}"
                )
            _have_openat2(root_fd)
            try:
                if os.geteuid() != 0:
                    return op(root_fd, *args)
                if self._ws.uid == 0:
                    raise WorkspaceError(
                        f"workspace {str(self._ws.path)!r} is owned by root; the files API never acts as root"
                    )
                return _as_owner(self._ws.uid, self._ws.gid, op, root_fd, *args)
            except PathDenied as exc:
                raise self._refused(path, exc) from None
        finally:
            os.close(root_fd)

    def read(self, path: str | os.PathLike[str], max_bytes: int = MAX_READ) -> bytes:
        text, parts = self._checked(path, writing=False)
        data: bytes = self._run(path, _read_at, text, parts, max_bytes)
        return self._scrub(data) if self._scrub is not None else data

    def write(self, path: str | os.PathLike[str], data: bytes | str, *, make_dirs: bool = True) -> None:
        text, parts = self._checked(path, writing=True)
        payload = data.encode() if isinstance(data, str) else bytes(data)
        self._run(path, _write_at, text, parts, payload, make_dirs)
        self._audit("file.write", "ok", path=text, bytes=len(payload))

    def list(self, path: str | os.PathLike[str] = ".") -> list[FileInfo]:
        """Entries of a directory, denied ones left out (as the sandbox cannot see them either);
        symlinks are listed as such, never followed."""
        text, parts = self._checked(path, writing=False)
        fs = self._policy().filesystem
        entries = []
        for name, is_dir, is_link, size in sorted(self._run(path, _list_at, text, parts)):
            rel = "/".join((*parts, name))
            if denied_by(rel, fs.deny, fs.allow):
                continue
            entries.append(FileInfo(rel, bool(is_dir), int(size), bool(is_link)))
        return entries
