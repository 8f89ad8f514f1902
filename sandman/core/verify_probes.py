"""The in-sandbox half of ``sandman.core.verify``: escape probes, each with a positive control.

One file on purpose: its source is read whole and sent over stdin to a stdlib-only python3 in the
sandbox, so it cannot import siblings; splitting it would mean shipping and reassembling several
files.

This file is never imported on the host: ``sandman.core.verify`` sends its source on the stdin of
``python3 -I -S -c BOOT`` inside a sandbox session (both layers), preceded by one JSON line of
parameters (the host listener's port, the host workspace path, the host secrets to look for).
Host secrets never enter the sandbox: only their lengths and salted SHA-256 digests travel (an
agent sharing the session could read this process's memory), and only through a pipe, never an
argv or an environment the scan itself would read back.

Every probe is NON-destructive: kernel surfaces are opened for writing and closed, never written;
a ptrace that succeeds is detached at once; anything a probe creates lives in /tmp or the
workspace and is removed. Stdlib only (the image's python3); raw syscalls go through ctypes.

Each probe returns ``(observed, passed, control_observed, control_passed)``; ``main`` returns
``{name: {...}}`` and the host prints nothing it did not get from here.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import os
import platform
import re
import secrets
import signal
import socket
import stat
import subprocess
import termios
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

Outcome = tuple[str, bool, str, bool]

# Syscall numbers: x86_64 and aarch64 (asm-generic). None: the architecture has no such call.
SYSCALLS: dict[str, dict[str, int | None]] = {
    "x86_64": {
        "getpid": 39, "socket": 41, "ptrace": 101, "mount": 165, "init_module": 175,
        "kexec_load": 246, "add_key": 248, "request_key": 249, "keyctl": 250, "unshare": 272,
        "perf_event_open": 298, "open_by_handle_at": 304, "finit_module": 313, "bpf": 321,
        "userfaultfd": 323, "io_uring_setup": 425,
    },
    "aarch64": {
        "getpid": 172, "socket": 198, "ptrace": 117, "mount": 40, "init_module": 105,
        "kexec_load": 104, "add_key": 217, "request_key": 218, "keyctl": 219, "unshare": 97,
        "perf_event_open": 241, "open_by_handle_at": 265, "finit_module": 273, "bpf": 280,
        "userfaultfd": 282, "io_uring_setup": 425,
    },
}  # fmt: skip
MACHINE = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine(), platform.machine())

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUSER = 0x00020000, 0x02000000, 0x10000000
PTRACE_ATTACH, PTRACE_DETACH, PTRACE_CONT = 16, 17, 7
WALL = 0x40000000
AF_VSOCK = 40
UFFD_USER_MODE_ONLY = 1
KEY_SPEC_SESSION_KEYRING = -3
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
MNT_DETACH = 2

# Refused syscalls, with arguments chosen so that the kernel itself (were the call to get past
# seccomp) would answer something other than EPERM where it can: EPERM then means seccomp.
REFUSED: dict[str, tuple[tuple[int, ...], str]] = {
    "keyctl": ((0, KEY_SPEC_SESSION_KEYRING, 0), "a key id or ENOKEY (KEYCTL_GET_KEYRING_ID)"),
    "add_key": ((0, 0, 0, 0, 0), "EFAULT (NULL type)"),
    "request_key": ((0, 0, 0, 0), "EFAULT (NULL type)"),
    "bpf": ((0x7FFF, 0, 0), "EINVAL (unknown command)"),
    "perf_event_open": ((0, 0, -1, -1, 0), "EFAULT (NULL attr)"),
    "userfaultfd": ((UFFD_USER_MODE_ONLY | 0x40000000,), "EINVAL (unknown flag)"),
    "io_uring_setup": ((1, 0), "EFAULT (NULL params)"),
    "kexec_load": ((0, 0, 0, 0), "EPERM too (CAP_SYS_BOOT), or ENOSYS without kexec"),
    "init_module": ((0, 0, 0), "EPERM too (CAP_SYS_MODULE), or ENOSYS without modules"),
    "finit_module": ((-1, 0, 0), "EPERM too (CAP_SYS_MODULE), or ENOSYS without modules"),
    "open_by_handle_at": ((-1, 0, 0), "EBADF/EFAULT (bad fd, NULL handle) or EPERM"),
}

KERNEL_SURFACES = (
    "/proc/sys/kernel/core_pattern",
    "/proc/sys/kernel/modprobe",
    "/proc/sysrq-trigger",
    "/sys/kernel/uevent_helper",
    "/proc/sys/fs/binfmt_misc/register",
)
CGROUP_FILES = frozenset(
    {
        "release_agent", "notify_on_release", "pids.max", "memory.max", "memory.limit_in_bytes",
        "memory.memsw.limit_in_bytes", "cgroup.procs", "cgroup.subtree_control", "devices.allow",
        "cpu.max", "cgroup.max.descendants",
    }
)  # fmt: skip
ENGINE_SOCKETS = (
    "/var/run/docker.sock", "/run/docker.sock", "/run/containerd/containerd.sock",
    "/var/run/containerd/containerd.sock", "/run/podman/podman.sock", "/run/crio/crio.sock",
    "/run/buildkit/buildkitd.sock", "/run/user/1000/docker.sock", "/run/user/1000/podman/podman.sock",
)  # fmt: skip
ENGINE_ENV = ("DOCKER_HOST", "CONTAINER_HOST", "DOCKER_CERT_PATH", "CONTAINERD_ADDRESS", "BUILDKIT_HOST")
# Sockets the agent may legitimately see: sandman's upcall relay (bound into layer 2 when the
# upcall feature exists); everything else is a finding.
ALLOWED_SOCKET_PREFIXES = ("/run/sandman/upcall",)

# /proc/self/mountinfo rules (see verify.py's docstring for the reasoning).
UPCALL_DIR = "/run/sandman/upcall"
# sandman's own in-container programs, bound read-only from a host copy (runner.trusted_dir).
TRUSTED_DIR = "/usr/lib/sandman"
TRUSTED_ROOT = re.compile(r"/(?:.+/)?lib-[0-9a-f]{16}")
MOUNT_POINTS = frozenset(
    {
        "/", "/usr", "/etc", "/etc/resolv.conf", "/etc/hostname", "/etc/hosts", "/sys", "/proc",
        "/dev", "/tmp", "/home/agent", "/workspace", "/opt/sandman/tools", UPCALL_DIR,
        TRUSTED_DIR,
    }
)  # fmt: skip
MOUNT_PREFIXES = ("/sys/", "/dev/", "/proc/")
# "/" is bwrap's private tmpfs: rw in mountinfo; whether files can be created there is the rootfs
# probe's business (it should be remounted read-only).
RW_MOUNTS = frozenset({"/", "/proc", "/dev", "/tmp", "/home/agent", "/workspace"})
VIRTUAL_FS = frozenset({"tmpfs", "proc", "sysfs", "devpts", "cgroup", "cgroup2", "mqueue"})
# The engine's per-container resolv.conf/hostname/hosts: Docker's, or podman's (userdata/).
DOCKER_FILES = re.compile(
    r"/(?:.+/)?(?:overlay-)?containers/[0-9a-f]{64}(?:/userdata)?/(?:resolv\.conf|hostname|hosts)"
)
# The local backend's layer 1 is bubblewrap on the host: its /etc and tools are sandman's own
# generated host dirs. There, and in rootless podman (which cannot make device nodes), /dev holds
# binds of the host's harmless device nodes.
LOCAL_DIRS = {
    "/etc": re.compile(r"/(?:.+/)?etc-[0-9a-f]{16}"),
    "/opt/sandman/tools": re.compile(r"/(?:.+/)?tools-[0-9a-f]{16}"),
}
HOST_DEV_NODES = frozenset({"/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty"})
IMAGE_PATHS = frozenset({"/usr", "/etc", "/opt/sandman/tools"})

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def nr(name: str) -> int:
    number = SYSCALLS.get(MACHINE, {}).get(name)
    if number is None:
        raise RuntimeError(f"no syscall number for {name} on {MACHINE}")
    return number


def syscall(name: str, *args: int) -> tuple[int, int]:
    """(return value, errno) of a raw syscall."""
    ctypes.set_errno(0)
    ret = int(_libc.syscall(ctypes.c_long(nr(name)), *(ctypes.c_long(a) for a in args)))
    return ret, ctypes.get_errno() if ret == -1 else 0


def ename(err: int) -> str:
    return errno.errorcode.get(err, str(err))


def try_open(path: str, flags: int, mode: int = 0o600) -> str:
    """ "opened" (then closed at once, never written) or the errno name."""
    try:
        fd = os.open(path, flags, mode)
    except OSError as exc:
        return ename(exc.errno or 0)
    os.close(fd)
    return "opened"


def status_fields(pid: int | str = "self") -> dict[str, str]:
    out: dict[str, str] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key] = value.strip()
    return out


@contextlib.contextmanager
def child(argv: list[str], env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        yield proc
    finally:
        with contextlib.suppress(OSError):
            proc.kill()
        proc.communicate()


def wait_exec(pid: int, comm: str, timeout: float = 3.0) -> bool:
    """Until the child has exec'd ``comm`` (its /proc entry shows it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/comm") as f:
            if f.read().strip() == comm:
                return True
        time.sleep(0.005)
    return False


# -- identity and privilege -----------------------------------------------------------------------
def probe_identity(p: dict[str, Any]) -> Outcome:
    st = status_fields()
    uids, gids = st["Uid"].split(), st["Gid"].split()
    groups = st.get("Groups", "").split()
    ok = "0" not in uids and "0" not in gids and "0" not in groups
    ctl = int(uids[0]) == os.getuid() and int(gids[0]) == os.getgid()
    return (
        f"Uid {' '.join(uids)}; Gid {' '.join(gids)}; Groups {' '.join(groups) or '-'}",
        ok,
        f"/proc/self/status Uid/Gid agree with getuid()={os.getuid()}, getgid()={os.getgid()}",
        ctl,
    )


def probe_capabilities(p: dict[str, Any]) -> Outcome:
    st = status_fields()
    sets = {k: st.get(k, "?") for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")}
    if sets["CapAmb"] == "?":  # gVisor's status has no CapAmb line: ask for every capability
        ambient = [c for c in range(64) if _libc.prctl(47, 1, c, 0, 0) == 1]  # PR_CAP_AMBIENT_IS_SET
        sets["CapAmb"] = f"{sum(1 << c for c in ambient):016x} (no status line: prctl)"
    ok = all(v != "?" and int(v.split()[0], 16) == 0 for v in sets.values())
    # Control: capget(2) reports the same (zero) effective/permitted/inheritable sets.
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()
    ret = _libc.capget(header, data)
    eff = data[0] | (data[3] << 32)
    prm = data[1] | (data[4] << 32)
    ctl = ret == 0 and eff == int(sets["CapEff"], 16) and prm == int(sets["CapPrm"], 16)
    return (
        "; ".join(f"{k} {v}" for k, v in sets.items()),
        ok,
        f"capget() = {ret}: effective {eff:#x}, permitted {prm:#x} (agrees with /proc)",
        ctl,
    )


def probe_no_new_privs(p: dict[str, Any]) -> Outcome:
    value = status_fields().get("NoNewPrivs", "(no status line)")
    got = _libc.prctl(39, 0, 0, 0, 0)  # PR_GET_NO_NEW_PRIVS
    return f"NoNewPrivs {value}", value == "1", f"prctl(PR_GET_NO_NEW_PRIVS) = {got}", got == 1


def probe_seccomp_mode(p: dict[str, Any]) -> Outcome:
    st = status_fields()
    got = _libc.prctl(21, 0, 0, 0, 0)  # PR_GET_SECCOMP: 2 in filter mode
    return (
        f"Seccomp {st['Seccomp']}; filters {st.get('Seccomp_filters', '?')}",
        st["Seccomp"] == "2",
        f"prctl(PR_GET_SECCOMP) = {got}",
        got == 2,
    )


def _uid_line(pid: int) -> str | None:
    try:
        st = status_fields(pid)
    except OSError:
        return None
    return f"{st.get('Name')}: Uid {st.get('Uid')}"


def probe_setuid(p: dict[str, Any]) -> Outcome:
    """Run a root-owned setuid binary that blocks (su asks for a password on stdin), read the
    uids of the running process from /proc: escalation would show euid 0."""
    candidates = ["/usr/bin/su", "/usr/bin/passwd", "/usr/bin/chsh", "/usr/bin/newgrp"]
    target = next((c for c in candidates if os.path.exists(c) and os.stat(c).st_mode & stat.S_ISUID), None)
    if target is None:
        return "no setuid binary found in the image (nothing to escalate with)", True, "-", True
    st = os.stat(target)
    seen: list[str] = []
    with child([target, "root"] if target.endswith("su") else [target]) as proc:
        name = os.path.basename(target)
        if wait_exec(proc.pid, name):
            line = _uid_line(proc.pid)
            if line:
                seen.append(line)
    euids = [ln.split("Uid")[1].split()[1] for ln in seen]
    ok = bool(seen) and all(e != "0" for e in euids)
    # Control: the same observation of a non-setuid child (cat blocked on stdin) works.
    ctl_line = None
    with child(["cat"]) as proc:
        if wait_exec(proc.pid, "cat"):
            ctl_line = _uid_line(proc.pid)
    # Host root appears as the overflow uid inside bwrap's user namespace.
    root_ids = {0}
    with contextlib.suppress(OSError), open("/proc/sys/kernel/overflowuid") as f:
        root_ids.add(int(f.read()))
    return (
        f"{target} (mode {stat.filemode(st.st_mode)}, owner uid {st.st_uid}) ran as "
        + ("; ".join(seen) if seen else "(never observed running)"),
        ok,
        f"observing a plain child works: {ctl_line}; the binary is setuid and owned by root "
        f"(uid {st.st_uid} here: host root seen from bwrap's user namespace)",
        ctl_line is not None and st.st_uid in root_ids,
    )


# -- seccomp ---------------------------------------------------------------------------------------
def _getpid_control() -> tuple[str, bool]:
    ret, _ = syscall("getpid")
    return f"getpid via the same ctypes syscall path = {ret} (os.getpid() {os.getpid()})", ret == os.getpid()


def make_refused_probe(name: str) -> Callable[[dict[str, Any]], Outcome]:
    args, kernel = REFUSED[name]

    def probe(p: dict[str, Any]) -> Outcome:
        ret, err = syscall(name, *args)
        if ret >= 0 and name in ("userfaultfd", "io_uring_setup", "perf_event_open", "bpf"):
            os.close(ret)
        ctl, ctl_ok = _getpid_control()
        observed = f"{name}() = {ret}, errno {ename(err)}; the kernel itself would answer {kernel}"
        return observed, ret == -1 and err == errno.EPERM, ctl, ctl_ok

    return probe


def probe_socket_vsock(p: dict[str, Any]) -> Outcome:
    ret, err = syscall("socket", AF_VSOCK, socket.SOCK_STREAM, 0)
    if ret >= 0:
        os.close(ret)
    cret, cerr = syscall("socket", socket.AF_UNIX, socket.SOCK_STREAM, 0)
    if cret >= 0:
        os.close(cret)
    return (
        f"socket(AF_VSOCK) = {ret}, errno {ename(err)} (the kernel: EAFNOSUPPORT without vsock)",
        ret == -1 and err == errno.EPERM,
        f"socket(AF_UNIX) via the same path = {'fd' if cret >= 0 else ename(cerr)}",
        cret >= 0,
    )


# -- namespaces ------------------------------------------------------------------------------------
def probe_nested_userns(p: dict[str, Any]) -> Outcome:
    ret, err = syscall("unshare", CLONE_NEWUSER)
    cmd = subprocess.run(["unshare", "-U", "true"], capture_output=True, text=True, timeout=10)
    ok = ret == -1 and cmd.returncode != 0
    version = subprocess.run(["unshare", "--version"], capture_output=True, text=True, timeout=10)
    with open("/proc/self/uid_map") as f:
        uid_map = " ".join(f.read().split())
    return (
        f"unshare(CLONE_NEWUSER) = {ret}, errno {ename(err)}; `unshare -U true` exit "
        f"{cmd.returncode}: {cmd.stderr.strip()[-120:]}",
        ok,
        f"`unshare --version` exit {version.returncode}; the agent is itself in bwrap's user "
        f"namespace (uid_map {uid_map!r}), so user namespaces work here and only nesting is refused",
        version.returncode == 0 and bool(uid_map),
    )


def probe_cgroup_mount(p: dict[str, Any]) -> Outcome:
    """CVE-2022-0492: a new user+mount+cgroup namespace, then mount cgroupfs (release_agent)."""
    ret, err = syscall("unshare", CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWCGROUP)
    target = f"/tmp/sandman-verify-cg-{secrets.token_hex(4)}"
    os.mkdir(target)
    try:
        results = []
        for fstype, data in (("cgroup", "rdma"), ("cgroup", "memory"), ("cgroup2", "")):
            ctypes.set_errno(0)
            r = _libc.mount(
                b"cgroup", target.encode(), fstype.encode(), MS_NOSUID | MS_NODEV | MS_NOEXEC, data.encode()
            )
            e = ctypes.get_errno()
            if r == 0:
                _libc.umount2(target.encode(), MNT_DETACH)
            results.append((f"{fstype}{'(' + data + ')' if data else ''}", r, e))
        shell = subprocess.run(
            ["unshare", "-Urm", "sh", "-c", f"mount -t cgroup -o rdma cgroup {target}"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        # Control: mount(2) itself reaches the kernel (seccomp allows it for bwrap): a NULL target
        # is answered EFAULT/ENOENT, so the EPERMs above are the kernel's capability check.
        ctypes.set_errno(0)
        nr_ = _libc.mount(b"none", None, b"tmpfs", 0, None)
        ne = ctypes.get_errno()
    finally:
        os.rmdir(target)
    ok = ret == -1 and all(r != 0 for _, r, _ in results) and shell.returncode != 0
    return (
        f"unshare(NEWUSER|NEWNS|NEWCGROUP) errno {ename(err)}; "
        + ", ".join(f"mount {n}: {'MOUNTED' if r == 0 else ename(e)}" for n, r, e in results)
        + f"; `unshare -Urm mount -t cgroup` exit {shell.returncode}",
        ok,
        f"mount(2) with a NULL target: {'0' if nr_ == 0 else ename(ne)} (reaches the kernel)",
        nr_ != 0 and ne in (errno.EFAULT, errno.ENOENT, errno.EINVAL),
    )


def _proc_tree() -> dict[int, tuple[int, str, str]]:
    """pid -> (ppid, comm, argv[0]) of every visible process."""
    out: dict[int, tuple[int, str, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            st = status_fields(entry)
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv0 = f.read().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        out[int(entry)] = (int(st.get("PPid", "0")), st.get("Name", "?"), argv0)
    return out


def probe_process_visibility(p: dict[str, Any]) -> Outcome:
    me = os.getpid()
    with child(["sleep", "30"]) as proc:
        wait_exec(proc.pid, "sleep")
        tree = _proc_tree()
    strangers = []
    for pid, (_ppid, comm, argv0) in sorted(tree.items()):
        if pid == 1:  # bwrap's init (sandman's in gVisor mode), or the agent itself as pid 1
            if comm != p.get("init_comm", "bwrap") and me != 1:
                strangers.append(f"1:{comm}")
            continue
        cur, hops = pid, 0
        while cur not in (me, 0, 1) and hops < 64:
            cur, hops = tree.get(cur, (0, "", ""))[0], hops + 1
        if cur != me:
            strangers.append(f"{pid}:{comm}:{argv0}")
    listing = ", ".join(f"{pid}:{c}" for pid, (_, c, _) in sorted(tree.items()))
    return (
        f"visible: {listing}; outside the agent's tree (pid 1 = bwrap's init excepted): "
        f"{', '.join(strangers) or 'none'}",
        not strangers,
        f"the scan sees the probe's own child {proc.pid} (sleep): {proc.pid in tree}",
        proc.pid in tree,
    )


def _ptrace_attach(pid: int) -> tuple[int, int, str]:
    """PTRACE_ATTACH; on success wait for the attach stop and detach at once (never leave the
    target stopped: a tracer that exits during a group stop would leave it stopped)."""
    ret, err = syscall("ptrace", PTRACE_ATTACH, pid, 0, 0)
    if ret != 0:
        return ret, err, ""
    note = "attached"
    for _ in range(16):
        _, status = os.waitpid(pid, WALL)
        if not os.WIFSTOPPED(status):
            return ret, err, note + "; target ended"
        sig = os.WSTOPSIG(status)
        if sig == signal.SIGSTOP:
            syscall("ptrace", PTRACE_DETACH, pid, 0, 0)
            return ret, err, note + ", then detached (target resumed)"
        syscall("ptrace", PTRACE_CONT, pid, 0, sig)  # re-inject another signal, wait for SIGSTOP
    syscall("ptrace", PTRACE_DETACH, pid, 0, 0)
    return ret, err, note + ", detached"


def probe_ptrace_pid1(p: dict[str, Any]) -> Outcome:
    st = status_fields(1)

    def link(path: str) -> str:
        try:
            return os.readlink(path)
        except OSError as exc:
            return f"unreadable ({ename(exc.errno or 0)})"

    same_ns = all(link(f"/proc/1/ns/{n}") == link(f"/proc/self/ns/{n}") for n in ("user", "pid"))
    fds = []
    with contextlib.suppress(OSError):
        for fd in sorted(os.listdir("/proc/1/fd"), key=int):
            with contextlib.suppress(OSError):
                fds.append(f"{fd}:{os.readlink(f'/proc/1/fd/{fd}')}")
    mem = try_open("/proc/1/mem", os.O_RDWR)
    ret, err, note = _ptrace_attach(1)
    with child(["sleep", "30"]) as proc:
        wait_exec(proc.pid, "sleep")
        cret, cerr, cnote = _ptrace_attach(proc.pid)
    who = "this probe itself" if os.getpid() == 1 else st.get("Name")
    uid = " ".join(st.get("Uid", "").split())
    return (
        f"PTRACE_ATTACH(1) = {ret}{', errno ' + ename(err) if ret else ''}{'; ' + note if note else ''}"
        f" [pid 1 is {who}, Uid {uid}, CapEff {st.get('CapEff')}, "
        f"{'same' if same_ns else 'different'} user/pid namespace as the agent, fds {' '.join(fds) or '-'}, "
        f"root {link('/proc/1/root')}; /proc/1/mem O_RDWR: {mem}]",
        # bwrap's init is inside the agent's layer: tracing it is only safe because it holds nothing
        # the agent lacks (same uid, no capabilities, the same user and pid namespaces).
        ret == -1 or (same_ns and st.get("CapEff", "").strip("0") == "" and "0" not in uid.split()),
        f"PTRACE_ATTACH to the probe's own child = {cret}{', errno ' + ename(cerr) if cret else ''}"
        f"{'; ' + cnote if cnote else ''}",
        cret == 0,
    )


# -- engine sockets --------------------------------------------------------------------------------
def _walk_sockets(limit: int = 400_000) -> tuple[list[str], int, bool]:
    found: list[str] = []
    count = 0
    stack = ["/"]
    while stack:
        top = stack.pop()
        try:
            entries = list(os.scandir(top))
        except OSError:
            continue
        for entry in entries:
            count += 1
            if count > limit:
                return found, count, True
            path = entry.path
            try:
                mode = entry.stat(follow_symlinks=False).st_mode
            except OSError:
                continue
            if stat.S_ISDIR(mode):
                if path not in ("/proc", "/sys"):  # procfs/sysfs hold no socket files
                    stack.append(path)
            elif stat.S_ISSOCK(mode):
                found.append(path)
    return found, count, False


def probe_engine_sockets(p: dict[str, Any]) -> Outcome:
    canary = f"/tmp/sandman-verify-{secrets.token_hex(4)}.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(canary)
    try:
        found, count, truncated = _walk_sockets()
    finally:
        listener.close()
        os.unlink(canary)
    others = sorted(f for f in found if f != canary)
    disallowed = [f for f in others if not f.startswith(ALLOWED_SOCKET_PREFIXES)]
    known = [s for s in ENGINE_SOCKETS if os.path.lexists(s)]
    env_hits = [k for k in ENGINE_ENV if k in os.environ]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/environ", "rb") as f:
                names = {kv.split(b"=", 1)[0].decode(errors="replace") for kv in f.read().split(b"\0")}
                env_hits += [f"{k} (pid {entry})" for k in ENGINE_ENV if k in names]
    with open("/proc/net/unix") as unix:
        unix_lines = unix.read().splitlines()[1:]
    ok = not disallowed and not known and not env_hits and not truncated
    return (
        f"sockets outside /proc,/sys ({count} entries walked{', TRUNCATED' if truncated else ''}): "
        f"{', '.join(others) or 'none'}; engine socket paths present: {', '.join(known) or 'none'}; "
        f"DOCKER_HOST & co: {', '.join(env_hits) or 'unset'}; "
        f"/proc/net/unix of the sandbox's netns: {len(unix_lines)} socket(s)",
        ok,
        f"the walk finds a socket the probe bound itself ({canary}): {canary in found}",
        canary in found,
    )


# -- network ---------------------------------------------------------------------------------------
class _Listener:
    """A TCP listener on the sandbox's own 127.0.0.1 that accepts and closes (the controls)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = int(self.sock.getsockname()[1])
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                conn.close()


_LISTENER: _Listener | None = None


def listener() -> _Listener:
    global _LISTENER
    if _LISTENER is None:
        _LISTENER = _Listener()
    return _LISTENER


def connect(host: str, port: int, timeout: float = 1.0) -> str:
    """Connect only (never send): "connected" or the error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect((host, port))
        except TimeoutError:
            return "timeout"
        except OSError as exc:
            return ename(exc.errno or 0)
    return "connected"


def _control_connect() -> tuple[str, bool]:
    got = connect("127.0.0.1", listener().port)
    return (
        f"connect to a listener inside the sandbox on 127.0.0.1:{listener().port}: {got}",
        got == "connected",
    )


def probe_interfaces(p: dict[str, Any]) -> Outcome:
    names = sorted(n for _, n in socket.if_nameindex())
    with open("/proc/net/dev") as f:
        devs = sorted(line.split(":")[0].strip() for line in f.read().splitlines()[2:])
    return (
        f"interfaces: {', '.join(names)} (/proc/net/dev: {', '.join(devs)})",
        names == ["lo"] and devs == ["lo"],
        "if_nameindex() lists lo, the interface every network namespace has",
        "lo" in names,
    )


def probe_host_loopback(p: dict[str, Any]) -> Outcome:
    port = int(p["host_port"])
    targets = ["127.0.0.1", "::1", *p.get("host_addresses", [])]
    got = {t: connect(t, port) for t in targets}
    ctl, ctl_ok = _control_connect()
    return (
        "; ".join(f"{t}:{port} -> {r}" for t, r in got.items()),
        all(r != "connected" for r in got.values()),
        ctl,
        ctl_ok,
    )


def probe_dns(p: dict[str, Any]) -> Outcome:
    results = {}
    for name in ("example.com", "host.docker.internal", "metadata.google.internal"):
        try:
            results[name] = "RESOLVED " + str(socket.getaddrinfo(name, 80)[0][4][0])
        except OSError as exc:
            results[name] = f"fails ({exc})"
    try:
        local = str(socket.getaddrinfo("localhost", 80)[0][4][0])
    except OSError as exc:
        local = f"fails ({exc})"
    return (
        "; ".join(f"{n}: {r}" for n, r in results.items()),
        not any(r.startswith("RESOLVED") for r in results.values()),
        f"the resolver path works for /etc/hosts: localhost -> {local}",
        not local.startswith("fails"),
    )


def probe_metadata(p: dict[str, Any]) -> Outcome:
    got = {t: connect(t, 80, 1.0) for t in ("169.254.169.254", "fd00:ec2::254")}
    ctl, ctl_ok = _control_connect()
    return (
        "; ".join(f"{t}:80 -> {r}" for t, r in got.items()) + " (connect only, 1 s timeout, nothing sent)",
        all(r != "connected" for r in got.values()),
        ctl,
        ctl_ok,
    )


# -- kernel surfaces, cgroups, devices -------------------------------------------------------------
def _workspace_write_control() -> tuple[str, bool]:
    path = f"/workspace/.sandman-verify-{secrets.token_hex(4)}"
    with open(path, "w") as f:
        f.write("control\n")
    try:
        got = try_open(path, os.O_WRONLY)
    finally:
        os.unlink(path)
    return f"open O_WRONLY on a workspace file: {got}", got == "opened"


def make_surface_probe(path: str) -> Callable[[dict[str, Any]], Outcome]:
    def probe(p: dict[str, Any]) -> Outcome:
        got = try_open(path, os.O_WRONLY)
        observed = "absent" if got == "ENOENT" else f"open O_WRONLY: {got} (never written)"
        ctl, ctl_ok = _workspace_write_control()
        return observed, got != "opened", ctl, ctl_ok

    return probe


def probe_cgroup_files(p: dict[str, Any]) -> Outcome:
    found: list[str] = []
    for root, _dirs, files in os.walk("/sys/fs/cgroup"):
        found += [os.path.join(root, f) for f in files if f in CGROUP_FILES]
        if len(found) > 2000:
            break
    writable = [f for f in found if try_open(f, os.O_WRONLY) == "opened"]
    errors = sorted({try_open(f, os.O_WRONLY) for f in found[:50]})
    names = sorted({os.path.basename(f) for f in found})
    missing = sorted(n for n in ("release_agent", "pids.max", "memory.max", "memory.limit_in_bytes") if n not in names)
    readable = next((f for f in found if try_open(f, os.O_RDONLY) == "opened"), None)
    if not os.path.exists("/sys/fs") and p.get("backend") == "local":
        # The local backend mounts no /sys at all: nothing to open, and nothing for a control
        # to find; the control instead shows that the path really is absent.
        return (
            "no /sys mounted (local backend): no cgroup control file exists to open",
            not found,
            f"/sys/fs/cgroup lookup: {try_open('/sys/fs/cgroup', os.O_RDONLY)}",
            try_open("/sys/fs/cgroup", os.O_RDONLY) == "ENOENT",
        )
    return (
        f"{len(found)} control files ({', '.join(names) or 'none'}); opened for writing: "
        f"{', '.join(writable) or 'none'} (errors {', '.join(errors) or '-'}); "
        f"absent: {', '.join(missing) or 'none'}",
        not writable,
        f"the same files open read-only: {readable or 'none found'}",
        readable is not None,
    )


def probe_devices(p: dict[str, Any]) -> Outcome:
    blocks, chars = [], []
    for root, dirs, files in os.walk("/dev"):
        for name in files + dirs:
            path = os.path.join(root, name)
            with contextlib.suppress(OSError):
                mode = os.lstat(path).st_mode
                if stat.S_ISBLK(mode):
                    blocks.append(path)
                elif stat.S_ISCHR(mode):
                    chars.append(path)
    tag = secrets.token_hex(4)
    results = {}
    for kind, mode, dev in (
        ("block", stat.S_IFBLK, os.makedev(7, 0)),
        ("char /dev/mem", stat.S_IFCHR, os.makedev(1, 1)),
    ):
        path = f"/tmp/sandman-verify-{kind[:4]}-{tag}"
        try:
            os.mknod(path, mode | 0o600, dev)
        except OSError as exc:
            results[kind] = ename(exc.errno or 0)
        else:
            os.unlink(path)
            results[kind] = "CREATED"
    fifo = f"/tmp/sandman-verify-fifo-{tag}"
    try:
        os.mknod(fifo, stat.S_IFIFO | 0o600)
        fifo_ok = stat.S_ISFIFO(os.lstat(fifo).st_mode)
        os.unlink(fifo)
    except OSError as exc:
        fifo_ok = False
        results["fifo"] = ename(exc.errno or 0)
    null_char = stat.S_ISCHR(os.stat("/dev/null").st_mode)
    return (
        f"block devices in /dev: {', '.join(blocks) or 'none'}; char devices: {', '.join(sorted(chars))}; "
        + ", ".join(f"mknod {k}: {v}" for k, v in results.items()),
        not blocks and all(v != "CREATED" for v in results.values()),
        f"mknod of a FIFO in /tmp works: {fifo_ok}; /dev/null is classified as a char device: {null_char}",
        fifo_ok and null_char,
    )


def probe_rootfs(p: dict[str, Any]) -> Outcome:
    tag = secrets.token_hex(4)
    creates = {}
    for d in ("/usr", "/usr/bin", "/etc", "/opt/sandman/tools", "/sys"):
        path = f"{d}/.sandman-verify-{tag}"
        got = try_open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        if got == "opened":
            os.unlink(path)
        creates[d] = got
    existing = {f: try_open(f, os.O_WRONLY) for f in ("/etc/passwd", "/usr/bin/python3")}
    root = try_open(f"/.sandman-verify-{tag}", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    if root == "opened":
        os.unlink(f"/.sandman-verify-{tag}")
    ok = all(v != "opened" for v in [*creates.values(), *existing.values(), root])
    ctl, ctl_ok = _workspace_write_control()
    tmp = try_open(f"/tmp/.sandman-verify-{tag}", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    if tmp == "opened":
        os.unlink(f"/tmp/.sandman-verify-{tag}")
    return (
        "create: "
        + ", ".join(f"{d} {v}" for d, v in creates.items())
        + "; open existing O_WRONLY: "
        + ", ".join(f"{f} {v}" for f, v in existing.items())
        + f"; / (bwrap's private root tmpfs, uncapped): create {root}",
        ok,
        f"{ctl}; create in /tmp: {tmp}",
        ctl_ok and tmp == "opened",
    )


# -- mounts ----------------------------------------------------------------------------------------
def _unescape(text: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def parse_mountinfo(text: str) -> list[dict[str, str]]:
    mounts = []
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        f, r = left.split(), right.split()
        if len(f) < 6 or len(r) < 2:
            continue
        unescape = _unescape
        mounts.append(
            {
                "dev": f[2],
                "root": unescape(f[3]),
                "point": unescape(f[4]),
                "opts": f[5],
                "fstype": r[0],
                "source": r[1],
            }
        )
    return mounts


def _same_host_path(root: str, host_path: str) -> bool:
    """A bind's mount root is the host path relative to its filesystem: a suffix of it."""
    return root == "/" or host_path == root or host_path.endswith(root)


def mount_violations(
    mounts: list[dict[str, str]], host_workspace: str, host_upcall: str = "", backend: str = "docker"
) -> list[str]:
    """The rules: every mount point is one layer 2 makes; only the scratch places and the workspace
    are writable; image content appears only at its own path; the only host paths are the
    workspace, the session's upcall directory (read-only), sandman's own programs (read-only)
    and the engine's per-container resolv.conf/hostname/hosts files (read-only). On the local
    backend the "image" is the host's /usr: every other host path must be one of the above, or
    sandman's generated /etc and tools dirs (read-only), or bubblewrap's /dev nodes."""
    image_dev = next((m["dev"] for m in mounts if m["point"] == "/usr"), None)
    local = backend == "local"
    bad = []
    for m in mounts:
        point, root, fstype = m["point"], m["root"], m["fstype"]
        ro = "ro" in m["opts"].split(",")
        where = f"{point} ({fstype} {root})"
        if point not in MOUNT_POINTS and not point.startswith(MOUNT_PREFIXES):
            bad.append(f"unexpected mount point {where}")
        if not ro and point not in RW_MOUNTS and not point.startswith("/dev/"):
            bad.append(f"writable {where}")
        if local and point in LOCAL_DIRS:
            if not LOCAL_DIRS[point].fullmatch(root) or not ro:
                bad.append(f"{point} is {root} ({m['opts']}), not sandman's read-only host dir")
        elif backend in ("local", "podman-rootless") and point in HOST_DEV_NODES and fstype == "devtmpfs":
            if root != point.removeprefix("/dev"):
                bad.append(f"device node {where} is another node")
        elif m["dev"] == image_dev and not (local and point != "/usr"):
            if point not in IMAGE_PATHS or root != point:
                bad.append(f"image content at {where}")
        elif fstype in VIRTUAL_FS:
            pass
        elif point == "/workspace":
            if not _same_host_path(root, host_workspace):
                bad.append(f"workspace is {root}, not {host_workspace}")
        elif point == UPCALL_DIR:
            if not host_upcall or not _same_host_path(root, host_upcall) or not ro:
                bad.append(f"upcall dir is {root} ({m['opts']}), not {host_upcall} read-only")
        elif point == TRUSTED_DIR:
            if not TRUSTED_ROOT.fullmatch(root) or not ro:
                bad.append(f"sandman's programs are {root} ({m['opts']}), not its read-only host copy")
        elif point in ("/etc/resolv.conf", "/etc/hostname", "/etc/hosts"):
            if not DOCKER_FILES.fullmatch(root) or not ro:
                bad.append(f"unexpected host file {where}")
        else:
            bad.append(f"host path {where}")
    return bad


# gVisor mode: the supervisor binds bwrap's layout into a root of its own; host mounts are 9p
# (gofer) mounts, whose root is the path inside the container mount they were bound from.
GVISOR_9P_ROOTS = {
    "/": ("/skel",), "/usr": ("/usr",), "/etc": ("/etc",), TRUSTED_DIR: ("/",), "/workspace": ("/",),
    UPCALL_DIR: ("/upcall",), "/opt/sandman/tools": ("/", "/opt/sandman/tools"),
    "/etc/hosts": ("/",), "/etc/hostname": ("/",), "/etc/resolv.conf": ("/",),
}  # fmt: skip
GVISOR_FS = frozenset({"9p", "tmpfs", "proc", "sysfs", "devpts"})


def gvisor_mount_violations(mounts: list[dict[str, str]]) -> list[str]:
    """The rules in gVisor mode: bwrap's mount points only, host (9p) mounts only where layer 2
    binds them and from where it binds them, "/" read-only, writable only the scratch places and
    the workspace (and pinned paths in it)."""
    bad = []
    for m in mounts:
        point, fstype, root = m["point"], m["fstype"], m["root"]
        ro = "ro" in m["opts"].split(",")
        where = f"{point} ({fstype} {root})"
        in_ws = point.startswith("/workspace/")
        if point not in MOUNT_POINTS and not point.startswith(MOUNT_PREFIXES) and not in_ws:
            bad.append(f"unexpected mount point {where}")
        if fstype not in GVISOR_FS:
            bad.append(f"unexpected filesystem {where}")
        if fstype == "9p" and not in_ws and root not in GVISOR_9P_ROOTS.get(point, ()):
            bad.append(f"host path {where}")
        if not ro and (point == "/" or (point not in RW_MOUNTS and not point.startswith(("/dev/", "/workspace/")))):
            bad.append(f"writable {where}")
    return bad


def probe_mountinfo(p: dict[str, Any]) -> Outcome:
    with open("/proc/self/mountinfo") as f:
        mounts = parse_mountinfo(f.read())
    host_ws, host_upcall = str(p["host_workspace"]), str(p.get("host_upcall", ""))
    if p.get("layer2") == "gvisor":
        bad = gvisor_mount_violations(mounts)
        ws = [m for m in mounts if m["point"] == "/workspace"]
        synthetic = parse_mountinfo(
            "900 1 0:90 / /var/lib/docker rw - 9p none rw\n"
            "901 1 0:91 / /home/agent/host ro - ext4 /dev/vda ro\n"
            "902 1 0:92 /control /run/sandman/control rw - 9p none rw\n"
        )
        flagged = gvisor_mount_violations(mounts + synthetic)
        return (
            f"{len(mounts)} mounts (gVisor: host mounts are 9p, checked by mount point and root); "
            f"violations: {'; '.join(bad) or 'none'}",
            not bad and len(ws) == 1,
            "the rules flag a synthetic 9p /var/lib/docker, an ext4 mount and the control dir: "
            f"{len(flagged) - len(bad)} new findings; the workspace mount is found: {bool(ws)}",
            len(flagged) - len(bad) >= 3 and len(ws) == 1,
        )
    backend = str(p.get("backend", "docker"))
    bad = mount_violations(mounts, host_ws, host_upcall, backend)
    ws = [m for m in mounts if m["point"] == "/workspace"]
    host = sorted({m["root"] for m in mounts if m["fstype"] not in VIRTUAL_FS and m["point"] not in IMAGE_PATHS})
    synthetic = parse_mountinfo(
        "900 1 254:0 /var/lib/docker /mnt rw,relatime - ext4 /dev/vda rw\n"
        "901 1 254:0 /home /home/agent rw,relatime - ext4 /dev/vda rw\n"
    )
    flagged = mount_violations(mounts + synthetic, host_ws, host_upcall, backend)
    return (
        f"{len(mounts)} mounts; host paths exposed: {', '.join(host) or 'none'}; "
        f"violations: {'; '.join(bad) or 'none'}",
        not bad and len(ws) == 1,
        "the rules flag a synthetic /var/lib/docker and host /home bind: "
        f"{len(flagged) - len(bad)} new findings; "
        f"the workspace bind is found: {ws[0]['root'] if ws else 'NOT FOUND'}",
        len(flagged) - len(bad) >= 2 and len(ws) == 1,
    )


# -- terminal --------------------------------------------------------------------------------------
def _tiocsti(fd: int) -> str:
    try:
        fcntl.ioctl(fd, termios.TIOCSTI, b" ")
    except OSError as exc:
        return ename(exc.errno or 0)
    return "INJECTED"


def probe_tiocsti(p: dict[str, Any]) -> Outcome:
    ttys = {fd: os.isatty(fd) for fd in (0, 1, 2)}
    devtty = try_open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    on_stdio = {fd: _tiocsti(fd) for fd in (0, 1, 2)}
    master, slave = os.openpty()  # a terminal the sandbox owns, not its controlling terminal
    try:
        on_pty = _tiocsti(slave)
        name = os.ttyname(slave)
        # Control: in a new session where the same pty IS the controlling terminal, TIOCSTI works
        # (unless the kernel disables it for everyone: dev.tty.legacy_tiocsti=0 -> EIO).
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            os.setsid()
            fd = os.open(name, os.O_RDWR)
            r = _tiocsti(fd)
            num = 0 if r == "INJECTED" else int(getattr(errno, r, 0))
            os._exit(100 + num if 0 < num < 150 else (0 if r == "INJECTED" else 99))
        _, status = os.waitpid(pid, 0)
        code = os.WEXITSTATUS(status)
    finally:
        os.close(master)
        os.close(slave)
    try:
        with open("/proc/sys/dev/tty/legacy_tiocsti") as f:
            legacy = f.read().strip()
    except OSError:
        legacy = "absent (kernel < 6.2: always on)"
    ctl_result = "INJECTED" if code == 0 else ename(code - 100) if code > 100 else f"exit {code}"
    ok = devtty != "opened" and all(v != "INJECTED" for v in [*on_stdio.values(), on_pty])
    return (
        f"stdin/out/err ttys: {ttys}; open /dev/tty: {devtty} (no controlling terminal); TIOCSTI on "
        f"fds 0-2: {on_stdio}; on a pty that is not the controlling tty: {on_pty}",
        ok,
        f"TIOCSTI on the sandbox's own controlling pty: {ctl_result}; dev.tty.legacy_tiocsti = {legacy}",
        ctl_result == "INJECTED" or (legacy == "0" and ctl_result == "EIO"),
    )


# -- host secrets ----------------------------------------------------------------------------------
def digest(salt: str, value: bytes) -> str:
    """How a secret travels into the sandbox: a salted SHA-256, never the value itself."""
    return hashlib.sha256(salt.encode() + value).hexdigest()


def _find(blob: bytes, salt: str, needles: dict[str, tuple[int, str]]) -> list[str]:
    """Labels whose secret occurs anywhere in ``blob``: every window of each secret's length is
    hashed with the salt and compared with the secret's digest."""
    found = []
    by_length: dict[int, dict[str, str]] = {}
    for label, (length, hexdigest) in needles.items():
        by_length.setdefault(length, {})[hexdigest] = label
    for length, wanted in by_length.items():
        for i in range(len(blob) - length + 1):
            hit = wanted.get(digest(salt, blob[i : i + length]))
            if hit is not None:
                found.append(hit)
    return found


def _scan(salt: str, needles: dict[str, tuple[int, str]]) -> tuple[list[str], int, int]:
    hits, readable, unreadable = [], 0, 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        for what in ("environ", "cmdline"):
            try:
                with open(f"/proc/{entry}/{what}", "rb") as f:
                    blob = f.read()
            except OSError:
                unreadable += 1
                continue
            readable += 1
            hits += [f"{label} in /proc/{entry}/{what}" for label in _find(blob, salt, needles)]
    return hits, readable, unreadable


def probe_host_secrets(p: dict[str, Any]) -> Outcome:
    salt = str(p.get("salt", ""))
    needles = {str(k): (int(v[0]), str(v[1])) for k, v in p.get("secrets", {}).items()}
    hits, readable, unreadable = _scan(salt, needles)
    canary = secrets.token_hex(16)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SANDMAN_VERIFY_CANARY": f"x{canary}y"}
    with child(["sleep", "30"], env=env) as proc:
        wait_exec(proc.pid, "sleep")
        ctl_hits, _, _ = _scan(salt, {"canary": (len(canary), digest(salt, canary.encode()))})
    found = any(f"/proc/{proc.pid}/environ" in h for h in ctl_hits)
    return (
        f"{len(needles)} host secret(s) ({', '.join(sorted(needles)) or 'none given'}) searched (as salted "
        f"digests) in {readable} readable /proc/*/environ+cmdline ({unreadable} unreadable): "
        f"{', '.join(hits) or 'not found'}",
        bool(needles) and not hits,
        f"a canary planted in a child's environment is found by the same scan: {found}",
        found,
    )


PROBES: dict[str, Callable[[dict[str, Any]], Outcome]] = {
    "identity": probe_identity,
    "capabilities": probe_capabilities,
    "no_new_privs": probe_no_new_privs,
    "seccomp_mode": probe_seccomp_mode,
    "setuid": probe_setuid,
    **{f"seccomp_{name}": make_refused_probe(name) for name in REFUSED},
    "seccomp_socket_vsock": probe_socket_vsock,
    "nested_userns": probe_nested_userns,
    "cgroup_mount": probe_cgroup_mount,
    "process_visibility": probe_process_visibility,
    "ptrace_pid1": probe_ptrace_pid1,
    "engine_sockets": probe_engine_sockets,
    "interfaces": probe_interfaces,
    "host_loopback": probe_host_loopback,
    "dns": probe_dns,
    "metadata": probe_metadata,
    **{f"kernel_{os.path.basename(path).replace('-', '_')}": make_surface_probe(path) for path in KERNEL_SURFACES},
    "cgroup_files": probe_cgroup_files,
    "devices": probe_devices,
    "rootfs": probe_rootfs,
    "mountinfo": probe_mountinfo,
    "tiocsti": probe_tiocsti,
    "host_secrets": probe_host_secrets,
}


def main(params: dict[str, Any]) -> dict[str, dict[str, Any]]:
    wanted = params.get("only") or list(PROBES)
    results: dict[str, dict[str, Any]] = {}
    for name in wanted:
        started = time.monotonic()
        try:
            observed, passed, ctl, ctl_ok = PROBES[name](params)
        except Exception as exc:  # a probe that breaks is a failed probe, never a pass
            observed, passed, ctl, ctl_ok = f"probe error: {exc!r}", False, "-", False
        results[name] = {
            "observed": observed,
            "passed": bool(passed),
            "control_observed": ctl,
            "control_passed": bool(ctl_ok),
            "seconds": round(time.monotonic() - started, 3),
        }
    return results
