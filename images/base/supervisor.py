"""sandman's in-container supervisor: the main process of a session container (under tini).

Single-threaded on purpose: it forks bubblewrap for each exec and waits for it itself, so bwrap's
--die-with-parent follows a parent that cannot lose a thread. It listens on a control socket in a
runtime-dir subdirectory that is never bound into the bubblewrap layer, so the agent cannot reach
it. Stdlib only; the host builds every argv (this process runs what it is given, as its own uid).

Wire format: a request is one JSON line; then frames of (type byte, 4-byte big-endian length,
payload) both ways. Host -> here: b"i" stdin data, b"I" stdin EOF, b"k" kill. Here -> host:
b"o" stdout, b"e" stderr, b"r" the JSON result. A host that disconnects kills its exec.

Only the host may talk to it: a connection whose peer is a process of this container's PID
namespace (layer 1 or anything under it, bubblewrap's layer 2 included) is closed unanswered.

The launcher (``prepare``, also run alone with ``--launch`` for one-shot sandboxes) is where the
agent's workspace meets bubblewrap's mount setup. bubblewrap resolves bind sources and creates
destinations by following symlinks, and the agent writes the workspace, so every workspace path
bubblewrap binds is first opened here by a walk that follows no symlink (each component opened
with O_NOFOLLOW from the workspace's descriptor) and handed over as ``/proc/self/fd/N``; every
mask target is walked the same way; and the identity of each destination's parent directory is
passed to the exec shim, which checks inside the new namespace that every mount landed exactly
where it was meant to (a symlink swapped in mid-setup fails the exec, never opens it).

gVisor mode (``--gvisor``, passed by the host only for the gvisor backend, whose runsc cannot run
bubblewrap): this process runs as root inside gVisor's kernel (capabilities that exist only in
the Sentry) and builds each exec's isolation itself from the host's plan (``request["ns"]``):
a root of the exec's own (this gVisor's mount namespaces share one mount table, so nothing is
mounted over a path anyone else uses) holding bubblewrap's layout, the pinned and read-only
workspace paths and the deny-list masks, mounted BY PATH (gVisor ignores /proc/self/fd magic
links as mount sources and targets) after the same no-symlink walk, each bind's root checked
against the walked descriptor; new pid, ipc, uts and net namespaces; then a pid-1 reaper
chrooted there and the command as the workspace uid with no capabilities under sandman's
layer-2 seccomp filter and the exec shim (which still checks every guarded mount). The control
dir, the env dir and the read-only workspace view are not in that root. Requests without a plan
are refused in this mode, and plans are refused outside it. See ``enter_namespaces``.
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import errno
import fcntl
import json
import os
import selectors
import signal
import shutil
import socket
import stat
import struct
import sys
import termios
import time

HEADER = struct.Struct(">cI")
MAX_REQUEST = 4 << 20
READ_CHUNK = 1 << 16
EXIT_IDLE, EXIT_LIFETIME = 3, 4
GUARD_FD_BASE = 3  # guarded workspace paths are handed to bwrap as /proc/self/fd/3, 4, ...
GUARD_PLACEHOLDER = "@SANDMAN_GUARD@"
SANDBOX_EXEC = "/usr/lib/sandman/sandbox-exec"
REFUSED_EXIT = 126


class GuardError(Exception):
    """A workspace path bubblewrap would bind or mask is not what the host checked."""


def _open_beneath(root: int, rel: str) -> tuple[int, str]:
    """(descriptor of the parent directory, last name) of ``rel`` under ``root``, walking every
    component with O_NOFOLLOW: a symlink or a non-directory on the way is refused."""
    parts = rel.split("/")
    if not rel or any(p in ("", ".", "..") for p in parts):
        raise GuardError(f"{rel!r} is not a plain workspace-relative path")
    fd = os.dup(root)
    try:
        for name in parts[:-1]:
            try:
                nxt = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
            except OSError as exc:
                raise GuardError(
                    f"workspace path {rel!r}: component {name!r} is a symlink or not a directory ({exc.strerror})"
                ) from None
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd, parts[-1]


def prepare(request: dict) -> tuple[list[str], list[int]]:
    """The final bwrap argv and the descriptors it needs, from a host request (runs in the child).

    ``guard.open``: [path, kind] bound by descriptor (fd GUARD_FD_BASE + index, in order);
    ``guard.check``: [path, kind] mask targets; kind is "ro", "rw" or "mask" (read-only);
    ``mkdirs``: per-exec private dirs to create first."""
    guard_text, opened = walk(request)
    argv = [guard_text if a == GUARD_PLACEHOLDER else str(a) for a in request["argv"]]
    return argv, opened


def walk(request: dict) -> tuple[str, list[int]]:
    """``prepare`` without the argv: make the private dirs, walk the guarded paths; (the guard
    text for the exec shim, the descriptors opened for ``guard.open``, in order)."""
    guard = request.get("guard") or {}
    for path in request.get("mkdirs") or []:
        for attempt in range(100):
            try:
                os.mkdir(str(path), 0o700)  # fails on anything already there: nothing planted is reused
                break
            except OSError as exc:
                # The tmpfs may still be full of the previous exec's tree, which a child of the
                # supervisor is removing right now: give it a few seconds.
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or attempt == 99:
                    raise
                time.sleep(0.05)
    opened: list[int] = []
    expect: list[list] = []
    if guard.get("open") or guard.get("check"):
        root = os.open(str(guard.get("workspace", "/workspace")), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        items = [(str(r), str(k), "open") for r, k in guard.get("open") or []]
        items += [(str(r), str(k), "check") for r, k in guard.get("check") or []]
        for rel, kind, how in items:
            parent, name = _open_beneath(root, rel)
            try:
                pst = os.fstat(parent)
                if how == "open":
                    try:
                        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
                    except OSError as exc:
                        raise GuardError(f"workspace path {rel!r} cannot be opened ({exc.strerror})") from None
                    st = os.fstat(fd)
                    opened.append(fd)
                else:
                    try:
                        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
                    except OSError as exc:
                        raise GuardError(
                            f"workspace path {rel!r} changed during the sandbox's start ({exc.strerror})"
                        ) from None
            finally:
                os.close(parent)
            if stat.S_ISLNK(st.st_mode):
                raise GuardError(f"workspace path {rel!r} is a symlink: sandman never binds through one")
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                raise GuardError(f"workspace path {rel!r} is not a regular file or directory")
            expect.append([rel, kind, pst.st_dev, pst.st_ino])
        os.close(root)
    guard_text = "".join(f"{kind} {dev} {ino} {os.fsencode(rel).hex()}\n" for rel, kind, dev, ino in expect)
    return guard_text, opened


# -- gVisor mode ----------------------------------------------------------------------------------
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = (
    0x00020000,
    0x04000000,
    0x08000000,
    0x20000000,
    0x40000000,
)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MNT_DETACH = 1, 2, 4, 8, 4096, 2
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PTRACE_DETACH, PR_SET_NAME = 1, 24, 17, 15
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
COVER_OPTS = "size=4k,mode=555"
GVISOR_ROOTS = "/run/sandman/roots"  # a tmpfs the supervisor mounts: one root per exec under it


def mount_roots(libc: ctypes.CDLL) -> None:
    """The tmpfs that holds the exec roots (root's own: mode 0700)."""
    _mount(libc, "tmpfs", GVISOR_ROOTS, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=700")


def release_root(root: str) -> None:
    """An exec is over: detach its root and everything mounted in it (every namespace sees them)."""
    libc = _libc()
    libc.umount2(os.fsencode(root), MNT_DETACH)
    try:
        os.rmdir(root)
    except OSError:
        pass


class Creds:
    """The workspace uid/gid as the effective ids for a block (root again after it): what a
    process without CAP_DAC_OVERRIDE needs to walk the agent's workspace and read its env file."""

    def __init__(self, uid: int, gid: int) -> None:
        self.uid, self.gid = uid, gid

    def __enter__(self) -> None:
        os.setresgid(-1, self.gid, -1)
        os.setresuid(-1, self.uid, -1)

    def __exit__(self, *_: object) -> None:
        os.setresuid(-1, 0, -1)
        os.setresgid(-1, 0, -1)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _mount(libc: ctypes.CDLL, src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = [None if v is None else os.fsencode(v) for v in (src, dst, fstype, data)]
    if libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {src or fstype} on {dst}: {os.strerror(err)}")


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_dev, st.st_ino, stat.S_IFMT(st.st_mode)


def drop_privileges(libc: ctypes.CDLL, uid: int, gid: int) -> None:
    """Root -> the workspace uid: empty bounding set, no groups, every id, no capability left."""
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == errno.EPERM:
            raise OSError(errno.EPERM, "cannot empty the capability bounding set")
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable (x2): all empty
    if libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset")
    if os.getuid() == 0 or os.geteuid() == 0 or os.getgid() == 0 or os.getegid() == 0:
        raise OSError(errno.EPERM, "still root after dropping privileges")


def load_seccomp(libc: ctypes.CDLL, bpf: bytes) -> None:
    """The host's compiled filter (``struct sock_filter[]``) on this process and its children."""
    if not bpf:
        return
    if len(bpf) % 8:
        raise OSError(errno.EINVAL, "the seccomp filter is not a whole number of instructions")

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = Fprog(len(bpf) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "cannot load the seccomp filter")


def read_env_file(path: str) -> dict[str, str]:
    with open(path, "rb") as f:
        fields = f.read().split(b"\0")
    return {os.fsdecode(k): os.fsdecode(v) for k, v in zip(fields[0::2], fields[1::2], strict=False)}


def enter_namespaces(request: dict) -> tuple[list[str], dict[str, str], int]:
    """gVisor mode: build the exec's isolation from the host's plan; returns in the command's
    process, as the workspace uid with no capabilities: (argv, env, cwd fd) to exec. Its
    callers' process stays outside the new pid namespace and only waits (see ``run_plan``)."""
    ns = request["ns"]
    uid, gid = int(ns["uid"]), int(ns["gid"])
    if uid == 0 or gid == 0:
        raise GuardError("the plan asks for uid or gid 0")
    guard = request.get("guard") or {}
    workspace = str(guard.get("workspace", "/workspace"))
    libc = _libc()
    with Creds(uid, gid):  # the agent's files: walked and read as their owner
        guard_text, opened = walk(request)  # mkdirs, the no-symlink walk, the guard text
        env = {str(k): str(v) for k, v in (ns.get("env") or {}).items()}
        if ns.get("env_file"):
            env.update(read_env_file(str(ns["env_file"])))  # the command's root has no env dir
        # Read-only binds come from the workspace's read-only view (a bind keeps its source
        # mount's read-only flag; gVisor ignores MS_RDONLY on a bind): walked the same way.
        ro_root = os.open(str(ns["workspace_ro"]), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        bound: list[tuple[str, str, tuple[int, int, int]]] = []
        try:
            for i, (rel, kind) in enumerate(guard.get("open") or []):
                rel, kind = str(rel), str(kind)
                if kind == "rw":
                    bound.append((rel, kind, _identity(os.fstat(opened[i]))))
                    continue
                parent, name = _open_beneath(ro_root, rel)
                try:
                    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
                except OSError as exc:
                    raise GuardError(f"workspace path {rel!r} cannot be opened ({exc.strerror})") from None
                finally:
                    os.close(parent)
                bound.append((rel, kind, _identity(os.fstat(fd))))
                os.close(fd)
        finally:
            os.close(ro_root)
            for fd in opened:
                os.close(fd)
    # This gVisor's mount namespaces share one mount table (a mount made after unshare(NEWNS)
    # shows in every namespace): so nothing is mounted over a path another exec or the
    # supervisor uses. Each exec gets a root of its own (a bind of the host's read-only
    # skeleton at a fresh path), everything is bound into it, and the command is chrooted there.
    root = str(ns["root"])
    if os.path.dirname(root) != GVISOR_ROOTS:
        raise GuardError(f"the exec root {root!r} is not under {GVISOR_ROOTS}")
    os.mkdir(root, 0o700)
    _mount(libc, str(ns["skeleton"]), root, None, MS_BIND)  # read-only: a bind keeps its source's flags
    for source, target, optional in ns["binds"]:
        if optional and not os.path.exists(str(source)):
            continue
        _mount(libc, str(source), root + str(target), None, MS_BIND)
    _mount(libc, "tmpfs", root + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "size=64m,mode=1777")
    ro = MS_RDONLY | MS_NOSUID | MS_NODEV
    # Only FILES of the workspace are bound on their own. A bind of a workspace DIRECTORY is a
    # second mount of the workspace's filesystem rooted inside it, and this gVisor lets `..`
    # climb past a bind's root once a directory under it is renamed away (a red-team round read
    # a masked .env that way, through the pinned .git): pinned and read-only directories are
    # not applied here (files are), and the host says so in the backend's notes.
    skipped = {rel for rel, _kind, want in bound if stat.S_ISDIR(want[2])}
    bound = [b for b in bound if b[0] not in skipped]
    if skipped:
        guard_text = "".join(
            line + "\n"
            for line in guard_text.splitlines()
            if os.fsdecode(bytes.fromhex(line.split(" ")[3])) not in skipped
        )
    for rel, kind, want in bound:  # pinned (onto itself, read-write), then read-only
        target = f"{root}{workspace}/{rel}"
        source = target if kind == "rw" else f"{ns['workspace_ro']}/{rel}"
        _mount(libc, source, target, None, MS_BIND)
        if _identity(os.stat(target)) != want:
            raise GuardError(f"workspace path {rel!r} changed while the sandbox was set up (not what was walked)")
    for path, is_dir in ns.get("masks") or []:
        if is_dir:
            _mount(libc, "tmpfs", root + str(path), "tmpfs", ro, COVER_OPTS)
        else:
            _mount(libc, str(ns["empty"]), root + str(path), None, MS_BIND | MS_RDONLY)
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWNET
    if libc.unshare(flags) != 0:
        raise OSError(ctypes.get_errno(), "unshare")
    if "SANDMAN_GUARD" in env:
        env["SANDMAN_GUARD"] = guard_text
    pid = os.fork()  # pid 1 of the new pid namespace
    if pid:
        return [], {}, pid
    try:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        libc.prctl(PR_SET_NAME, b"sandman-init", 0, 0, 0)  # the layer's init, as probes see it
        if libc.chroot(os.fsencode(root)) != 0:
            raise OSError(ctypes.get_errno(), "chroot")
        os.chdir("/")
        _mount(libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        drop_privileges(libc, uid, gid)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # a credential change clears it
        child = os.fork()
        if child == 0:  # the command (pid 2), in a session of its own, like bwrap --new-session
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            os.setsid()
            os.chdir(str(ns.get("cwd") or workspace))
            load_seccomp(libc, base64.b64decode(ns.get("seccomp") or ""))
            return [SANDBOX_EXEC, *(str(a) for a in ns["command"])], env, -1
        os._exit(reap_until(child))
    except BaseException as exc:  # noqa: BLE001 - pid 1 never returns to the caller's loop
        try:
            os.write(2, f"sandman: cannot start the sandbox: {exc}\n".encode())
        finally:
            os._exit(127)
    raise AssertionError("unreachable")  # pragma: no cover


def reap_until(child: int) -> int:
    """Pid 1's loop: reap every orphan until the command exits; its status as an exit code."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return 127
        except InterruptedError:
            continue
        if os.WIFSTOPPED(status):  # the command made this process its tracer (PTRACE_TRACEME)
            _libc().ptrace(PTRACE_DETACH, pid, None, ctypes.c_void_p(os.WSTOPSIG(status)))
            continue
        if pid == child and (os.WIFEXITED(status) or os.WIFSIGNALED(status)):
            code = os.waitstatus_to_exitcode(status)
            return code if code >= 0 else 128 - code


def run_plan(request: dict) -> None:
    """gVisor mode, in the exec's own process (the supervisor's child, or the one-shot launcher):
    build the namespaces, then either become the command or wait for the namespace's pid 1 and
    exit with its status. Never returns."""
    signal.set_wakeup_fd(-1)
    for signum in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)
    os.closerange(3, 65536)  # the listener, the host's connections: nothing of the supervisor's
    argv, env, pid1 = enter_namespaces(request)
    if argv:
        os.execve(SANDBOX_EXEC, argv, env)
    while True:
        try:
            _, status = os.waitpid(pid1, 0)
        except InterruptedError:
            continue
        if os.WIFEXITED(status) or os.WIFSIGNALED(status):
            break
    code = os.waitstatus_to_exitcode(status)
    os._exit(code if code >= 0 else 128 - code)


def remove_tree(path: str) -> None:
    """Remove an exec's private dir whatever modes the agent left in it (a mode-000 directory
    would otherwise stay, and fill the session's /tmp for good): every directory is made
    0700 first (the agent's uid owns them all), walking by descriptor, never following links."""
    stack = [path]
    while stack:
        top = stack.pop()
        try:
            os.chmod(top, 0o700)  # the exec is over: nothing of its can swap this for a link now
            with os.scandir(top) as it:
                stack.extend(e.path for e in it if e.is_dir(follow_symlinks=False))
        except OSError:
            continue
    shutil.rmtree(path, ignore_errors=True)


def place_fds(opened: list[int]) -> None:
    """Move the guard descriptors to GUARD_FD_BASE.. (inheritable); close every other fd >= 3."""
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 1024) for fd in opened]
    for fd in opened:
        os.close(fd)
    os.closerange(3, 1024)
    for i, fd in enumerate(high):
        os.dup2(fd, GUARD_FD_BASE + i, inheritable=True)
    os.closerange(GUARD_FD_BASE + len(high), 65536)


class Exec:
    """One running command and the host connection that asked for it."""

    def __init__(self, sup: Supervisor, conn: socket.socket, request: dict) -> None:
        self.sup = sup
        self.conn = conn
        self.started = time.monotonic()
        timeout = request.get("timeout")
        self.deadline = self.started + float(timeout) if timeout else None
        self.timed_out = False
        self.killed = False
        self.inbuf = b""
        self.outq: list[bytes] = []
        self.status: int | None = None
        self.open_streams = 0
        want_stdin = bool(request.get("stdin"))
        tty = bool(request.get("tty"))
        if tty:
            # One pty for all three streams: an interactive shell (`sandman session shell`).
            master, slave = os.openpty()
            rows, cols = (request.get("winsize") or [24, 80])[:2]
            fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", int(rows), int(cols), 0, 0))
            out_r, out_w = master, slave
            err_r, err_w = -1, os.dup(slave)
            in_r, in_w = os.dup(slave), os.dup(master)
        else:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            in_r, in_w = os.pipe() if want_stdin else (os.open(os.devnull, os.O_RDONLY), -1)
        env = {str(k): str(v) for k, v in (request.get("env") or {}).items()}
        self.private_dirs = [str(p) for p in request.get("mkdirs") or []]
        self.root = str((request.get("ns") or {}).get("root") or "") if sup.gvisor is not None else ""
        try:
            pid = os.fork()
        except OSError:
            for fd in (out_r, out_w, err_r, err_w, in_r, in_w):
                if fd >= 0:
                    os.close(fd)
            raise
        if pid == 0:  # child: become the command (bwrap), with clean stdio
            code = 127
            try:
                os.setpgid(0, 0)
                os.dup2(in_r, 0)
                os.dup2(out_w, 1)
                os.dup2(err_w, 2)
                signal.signal(signal.SIGPIPE, signal.SIG_DFL)
                if sup.gvisor is not None or "ns" in request:
                    code = REFUSED_EXIT
                    if sup.gvisor is None or "ns" not in request or "argv" in request:
                        raise GuardError("this supervisor's mode and the request's do not match")
                    run_plan(request)  # never returns
                try:
                    argv, opened = prepare(request)
                except GuardError as exc:
                    code = REFUSED_EXIT
                    raise
                place_fds(opened)
                os.execve(argv[0], argv, env)
            except GuardError as exc:
                os.write(2, f"sandman: refused: {exc}\n".encode())
            except BaseException as exc:  # noqa: BLE001 - report and die, never return to the loop
                os.write(2, f"sandman: cannot start the sandbox: {exc}\n".encode())
            finally:
                os._exit(code)
        self.pid = pid
        self.pty_fd = out_r if tty else -1
        for fd in (in_r, out_w, err_w):
            os.close(fd)
        self.stdin_fd = in_w
        self.stdin_buf = b""
        self.stdin_eof = False
        if in_w >= 0:
            os.set_blocking(in_w, False)
        for fd, kind in ((out_r, b"o"), (err_r, b"e")):
            if fd < 0:
                continue
            os.set_blocking(fd, False)
            sup.sel.register(fd, selectors.EVENT_READ, ("pipe", self, kind))
            self.open_streams += 1

    # host -> command ----------------------------------------------------------------------
    def on_host_data(self, data: bytes) -> None:
        self.inbuf += data
        while len(self.inbuf) >= HEADER.size:
            kind, length = HEADER.unpack_from(self.inbuf)
            if len(self.inbuf) < HEADER.size + length:
                return
            payload = self.inbuf[HEADER.size : HEADER.size + length]
            self.inbuf = self.inbuf[HEADER.size + length :]
            if kind == b"i" and self.stdin_fd >= 0:
                self.stdin_buf += payload
                self.flush_stdin()
            elif kind == b"I":
                self.stdin_eof = True
                self.flush_stdin()
            elif kind == b"k":
                self.kill()

    def flush_stdin(self) -> None:
        """Write what the command will take now; the rest waits for the pipe to drain."""
        if self.stdin_fd < 0:
            return
        try:
            while self.stdin_buf:
                n = os.write(self.stdin_fd, self.stdin_buf[:READ_CHUNK])
                self.stdin_buf = self.stdin_buf[n:]
        except BlockingIOError:
            pass
        except OSError:
            self.stdin_buf = b""
            self.close_stdin()
            return
        registered = self.stdin_fd in self.sup.sel.get_map()
        if self.stdin_buf and not registered:
            self.sup.sel.register(self.stdin_fd, selectors.EVENT_WRITE, ("stdin", self, None))
        elif not self.stdin_buf:
            if registered:
                self.sup.sel.unregister(self.stdin_fd)
            if self.stdin_eof:
                self.close_stdin()

    def close_stdin(self) -> None:
        if self.stdin_fd >= 0:
            if self.stdin_fd in self.sup.sel.get_map():
                self.sup.sel.unregister(self.stdin_fd)
            os.close(self.stdin_fd)
            self.stdin_fd = -1

    def kill(self) -> None:
        # SIGKILL to bwrap: its child (PID 1 of the agent's namespace) has PDEATHSIG, and when
        # that init dies the kernel kills every process in the namespace.
        if self.status is None and not self.killed:
            self.killed = True
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except OSError:
                pass

    # command -> host ----------------------------------------------------------------------
    def send(self, kind: bytes, payload: bytes) -> None:
        try:
            self.conn.sendall(HEADER.pack(kind, len(payload)) + payload)
        except OSError:
            self.kill()  # the host is gone: nobody wants this command any more

    def on_pipe(self, fd: int, kind: bytes) -> None:
        try:
            data = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:  # EIO: the pty's last user is gone
            data = b""
        if data:
            self.send(kind, data)
            return
        self.sup.sel.unregister(fd)
        os.close(fd)
        if fd == self.pty_fd:
            self.pty_fd = -1
        self.open_streams -= 1
        self.maybe_finish()

    def drain_pty(self) -> None:
        """gVisor never reports EOF (nor EIO) on a pty's master once the shell is gone: with the
        command reaped, send what the pty still holds and close it, so the exec finishes (its
        root and private dirs are released, and the session's idle clock runs again)."""
        fd, self.pty_fd = self.pty_fd, -1
        if fd < 0:
            return
        while True:
            try:
                data = os.read(fd, READ_CHUNK)
            except OSError:  # BlockingIOError: nothing left; EIO: gone
                break
            if not data:
                break
            self.send(b"o", data)
        try:
            self.sup.sel.unregister(fd)
        except (KeyError, ValueError):
            return  # already closed by on_pipe
        os.close(fd)
        self.open_streams -= 1

    def maybe_finish(self) -> None:
        if self.status is None or self.open_streams:
            return
        code = os.waitstatus_to_exitcode(self.status)
        result = {
            "exit_code": code if code >= 0 else 128 - code,
            "signal": -code if code < 0 else None,
            "timed_out": self.timed_out,
            "killed": self.killed,
            "duration_s": round(time.monotonic() - self.started, 6),
        }
        self.send(b"r", json.dumps(result).encode())
        self.sup.finish(self)


class Supervisor:
    def __init__(
        self, path: str, idle_s: float | None, lifetime_s: float | None, gvisor: tuple[int, int] | None = None
    ) -> None:
        self.gvisor = gvisor  # (uid, gid) of the workspace in gVisor mode, else None
        self.sel = selectors.DefaultSelector()
        self.execs: dict[int, Exec] = {}
        self.by_conn: dict[int, Exec] = {}
        self.pending: dict[int, tuple[socket.socket, bytes]] = {}
        self.idle_s = idle_s
        self.started = self.last_active = time.monotonic()
        self.lifetime_s = lifetime_s
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if gvisor is not None:
            mount_roots(_libc())
            # Root here has no CAP_DAC_OVERRIDE: the control dir is the workspace uid's (0700).
            with Creds(*gvisor):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                self.listener.bind(path)
                os.chmod(path, 0o600)
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            self.listener.bind(path)
            os.chmod(path, 0o600)
        self.listener.listen(128)
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, ("accept", None, None))
        rfd, wfd = os.pipe()
        os.set_blocking(rfd, False)
        os.set_blocking(wfd, False)
        signal.set_wakeup_fd(wfd)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: None)
        self.wakeup = rfd
        self.sel.register(rfd, selectors.EVENT_READ, ("signal", None, None))
        self.stop_code: int | None = None

    def finish(self, ex: Exec) -> None:
        self.execs.pop(ex.pid, None)
        self.by_conn.pop(ex.conn.fileno(), None)
        ex.close_stdin()
        try:
            self.sel.unregister(ex.conn)
        except (KeyError, ValueError):
            pass
        ex.conn.close()
        self.last_active = time.monotonic()
        if ex.root and os.path.dirname(ex.root) == GVISOR_ROOTS:
            release_root(ex.root)
        if ex.private_dirs:
            # The exec's own /tmp and HOME go with it; removed by a child so a big tree never
            # stalls the other execs' streams.
            if os.fork() == 0:
                try:
                    if self.gvisor is not None:  # the agent's files: removed as their owner
                        os.setgroups([])
                        os.setresgid(self.gvisor[1], self.gvisor[1], self.gvisor[1])
                        os.setresuid(self.gvisor[0], self.gvisor[0], self.gvisor[0])
                    for path in ex.private_dirs:
                        remove_tree(path)
                finally:
                    os._exit(0)

    def on_accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # EMFILE and friends: nothing to serve now; the host retries
            time.sleep(0.01)
            return
        try:
            pid, _uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        except OSError:
            pid = -1
        if pid != 0 and self.gvisor is None:
            # (gVisor reports the listener's own credentials for every peer of a host-backed
            # socket, so there the wall is that no exec can reach the socket: its directory is
            # covered in every exec's mount namespace.)
            # The host's processes are outside this PID namespace, so the kernel reports pid 0
            # for them; any process of the container (layer 1, or bwrap's layer 2 under it) has
            # a pid here and gets nothing, not even an error.
            conn.close()
            return
        conn.setblocking(True)
        self.pending[conn.fileno()] = (conn, b"")
        self.sel.register(conn, selectors.EVENT_READ, ("request", None, None))
        self.last_active = time.monotonic()

    def on_request_data(self, conn: socket.socket) -> None:
        fd = conn.fileno()
        conn_, buf = self.pending[fd]
        try:
            data = conn.recv(READ_CHUNK)
        except OSError:
            data = b""
        if not data:
            self.sel.unregister(conn)
            del self.pending[fd]
            conn.close()
            return
        buf += data
        if b"\n" not in buf:
            if len(buf) > MAX_REQUEST:
                self.sel.unregister(conn)
                del self.pending[fd]
                self._reply_close(conn, {"error": f"request too large (over {MAX_REQUEST} bytes)"})
            else:
                self.pending[fd] = (conn, buf)
            return
        line, rest = buf.split(b"\n", 1)
        del self.pending[fd]
        self.sel.unregister(conn)
        if len(line) > MAX_REQUEST:
            self._reply_close(conn, {"error": f"request too large (over {MAX_REQUEST} bytes)"})
            return
        try:
            request = json.loads(line)
            op = request["op"]
        except (ValueError, KeyError, TypeError, RecursionError):
            self._reply_close(conn, {"error": "malformed request"})
            return
        if op == "ping":
            self._reply_close(
                conn,
                {"pid": os.getpid(), "execs": len(self.execs), "uptime_s": round(time.monotonic() - self.started, 3)},
            )
        elif op == "exec":
            try:
                ex = Exec(self, conn, request)
            except (KeyError, TypeError, ValueError, OSError, IndexError, AttributeError) as exc:
                self._reply_close(conn, {"error": f"cannot exec: {exc}"})
                return
            self.execs[ex.pid] = ex
            self.by_conn[conn.fileno()] = ex
            self.sel.register(conn, selectors.EVENT_READ, ("host", ex, None))
            if rest:
                ex.on_host_data(rest)
        elif op == "shutdown":
            self._reply_close(conn, {"ok": True})
            self.stop_code = 0
        else:
            self._reply_close(conn, {"error": f"unknown op {op!r}"})

    def _reply_close(self, conn: socket.socket, data: dict) -> None:
        payload = json.dumps(data).encode()
        try:
            conn.sendall(HEADER.pack(b"r", len(payload)) + payload)
        except OSError:
            pass
        conn.close()

    def on_host(self, ex: Exec) -> None:
        try:
            data = ex.conn.recv(READ_CHUNK)
        except OSError:
            data = b""
        if not data:
            self.sel.unregister(ex.conn)
            ex.kill()
            ex.close_stdin()
            return
        ex.on_host_data(data)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            ex = self.execs.get(pid)
            if ex is not None:
                ex.status = status
                if self.gvisor is not None:
                    ex.drain_pty()
                ex.maybe_finish()

    def check_timers(self) -> float | None:
        now = time.monotonic()
        waits = []
        for ex in list(self.execs.values()):
            if ex.deadline is not None and ex.status is None:
                if now >= ex.deadline and not ex.timed_out:
                    ex.timed_out = True
                    ex.kill()
                else:
                    waits.append(ex.deadline - now)
        if self.lifetime_s is not None:
            left = self.started + self.lifetime_s - now
            if left <= 0:
                self.stop_code = EXIT_LIFETIME
            waits.append(max(left, 0))
        if self.idle_s is not None and not self.execs:
            left = self.last_active + self.idle_s - now
            if left <= 0:
                self.stop_code = EXIT_IDLE
            waits.append(max(left, 0))
        return max(min(waits), 0.01) if waits else None

    def serve(self) -> int:
        while self.stop_code is None:
            timeout = self.check_timers()
            if self.stop_code is not None:
                break
            for key, _ in self.sel.select(timeout):
                what, ex, kind = key.data
                try:
                    self.dispatch(key, what, ex, kind)
                except Exception as exc:  # noqa: BLE001 - one bad connection never ends the session
                    print(f"supervisor: {what}: {exc!r}", file=sys.stderr, flush=True)
                    self.drop(key, ex)
        for ex in list(self.execs.values()):
            ex.kill()
        return self.stop_code

    def drop(self, key: selectors.SelectorKey, ex: Exec | None) -> None:
        """Forget a connection whose handler failed: kill its exec, close it."""
        if ex is not None:
            ex.kill()
        try:
            self.sel.unregister(key.fileobj)
        except (KeyError, ValueError):
            pass
        self.pending.pop(key.fd, None)
        if isinstance(key.fileobj, socket.socket) and key.fileobj is not self.listener:
            key.fileobj.close()

    def dispatch(self, key: selectors.SelectorKey, what: str, ex: Exec | None, kind: bytes | None) -> None:
        if what == "accept":
            self.on_accept()
        elif what == "signal":
            try:
                os.read(self.wakeup, 512)
            except BlockingIOError:
                pass
            self.reap()
        elif what == "request":
            self.on_request_data(key.fileobj)  # type: ignore[arg-type]
        elif what == "host":
            self.on_host(ex)
        elif what == "pipe":
            ex.on_pipe(key.fd, kind)
        elif what == "stdin":
            ex.flush_stdin()


def launch(request_json: str, gvisor: bool = False) -> int:
    """One-shot sandboxes: guard the workspace paths, then become bwrap (tini stays the parent);
    in gVisor mode, build the namespaces and wait for the command (``run_plan``)."""
    try:
        request = json.loads(request_json)
        if gvisor or "ns" in request:
            if not gvisor or "ns" not in request or "argv" in request:
                raise GuardError("this launcher's mode and the request's do not match")
            mount_roots(_libc())
            run_plan(request)  # never returns
        argv, opened = prepare(request)
    except GuardError as exc:
        print(f"sandman: refused: {exc}", file=sys.stderr, flush=True)
        return REFUSED_EXIT
    place_fds(opened)
    os.execve(argv[0], argv, {str(k): str(v) for k, v in (request.get("env") or {}).items()})
    return 127  # pragma: no cover - execve does not return


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--launch":
        return launch(sys.argv[2])
    if len(sys.argv) == 4 and sys.argv[1:3] == ["--gvisor", "--launch"]:
        return launch(sys.argv[3], gvisor=True)
    parser = argparse.ArgumentParser(description="sandman session supervisor")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--gvisor", metavar="UID:GID", default=None, help="gVisor mode (see the module's doc)")
    parser.add_argument("--idle", type=float, default=None)
    parser.add_argument("--lifetime", type=float, default=None)
    ns = parser.parse_args()
    gvisor = None
    if ns.gvisor is not None:
        uid, gid = (int(v) for v in ns.gvisor.split(":"))
        if uid == 0 or gid == 0 or os.geteuid() != 0:
            parser.error("--gvisor: the workspace uid:gid (non-zero), with this process root inside gVisor")
        gvisor = (uid, gid)
    sup = Supervisor(ns.socket, ns.idle, ns.lifetime, gvisor)
    print(f"supervisor {os.getpid()} ready on {ns.socket}", file=sys.stderr, flush=True)
    return sup.serve()


if __name__ == "__main__":
    sys.exit(main())
