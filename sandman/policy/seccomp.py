"""Layer-1 seccomp profile: Docker-default-like, plus the smallest extension bubblewrap needs.

The profile is generated from the syscall table below (ours, not copied) and written to
``policies/seccomp/sandman.json``; a unit test keeps the file and this generator in step. Each
relaxation is named so the minimality tests can drop one at a time and watch bubblewrap fail.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

CLONE_NEWUSER = 0x10000000
# Every CLONE_NEW* flag: a clone without any of them is an ordinary fork/thread.
CLONE_NAMESPACE_FLAGS = 0x7E020000
AF_VSOCK = 40
S_IFMT, S_IFREG, S_IFIFO, S_IFSOCK = 0o170000, 0o100000, 0o010000, 0o140000
ENOSYS = 38
EPERM = 1
EOPNOTSUPP = 95


class Relaxation(StrEnum):
    """What sandman allows beyond Docker's default profile for an unprivileged container."""

    CLONE_NEWUSER = "clone-newuser"  # clone() that creates a user namespace (bwrap's sandbox)
    UNSHARE_NEWUSER = "unshare-newuser"  # unshare() that creates a user namespace
    MOUNT = "mount"  # mount() inside bwrap's own user namespace
    UMOUNT2 = "umount2"
    PIVOT_ROOT = "pivot_root"


# Allowed unconditionally: ordinary process, file, memory, signal, time and socket calls.
# Deliberately absent (refused with EPERM): keyctl/add_key/request_key, bpf, perf_event_open,
# userfaultfd, io_uring_*, kexec_*, init_module/finit_module/delete_module, open_by_handle_at,
# setns, fanotify_init, fsopen/fsmount/open_tree/move_mount, sethostname, syslog, acct, quotactl,
# reboot, swapon/swapoff, iopl/ioperm, clock_settime/settimeofday, lookup_dcookie, vhangup,
# ptrace's cousins kcmp/process_vm_*, mbind/set_mempolicy, nfsservctl, uselib, ustat, sysfs.
ALLOWED_SYSCALLS: tuple[str, ...] = (
    "accept", "accept4", "access", "alarm", "arch_prctl", "bind", "brk", "cachestat",
    "capget", "capset", "chdir", "chmod", "chown", "chown32", "clock_getres",
    "clock_getres_time64", "clock_gettime", "clock_gettime64", "clock_nanosleep",
    "clock_nanosleep_time64", "close", "close_range", "connect", "copy_file_range", "creat",
    "dup", "dup2", "dup3", "epoll_create", "epoll_create1", "epoll_ctl", "epoll_ctl_old",
    "epoll_pwait", "epoll_pwait2", "epoll_wait", "epoll_wait_old", "eventfd", "eventfd2",
    "execve", "execveat", "exit", "exit_group", "faccessat", "faccessat2", "fadvise64",
    "fadvise64_64", "fchdir", "fchmod", "fchmodat", "fchmodat2", "fchown",
    "fchown32", "fchownat", "fcntl", "fcntl64", "fdatasync", "fgetxattr", "flistxattr",
    "flock", "fork", "fremovexattr", "fsetxattr", "fstat", "fstat64", "fstatat64", "fstatfs",
    "fstatfs64", "fsync", "ftruncate", "ftruncate64", "futex", "futex_requeue", "futex_time64",
    "futex_wait", "futex_waitv", "futex_wake", "futimesat", "get_robust_list",
    "get_thread_area", "getcpu", "getcwd", "getdents", "getdents64", "getegid", "getegid32",
    "geteuid", "geteuid32", "getgid", "getgid32", "getgroups", "getgroups32", "getitimer",
    "getpeername", "getpgid", "getpgrp", "getpid", "getppid", "getpriority", "getrandom",
    "getresgid", "getresgid32", "getresuid", "getresuid32", "getrlimit", "getrusage",
    "getsid", "getsockname", "getsockopt", "gettid", "gettimeofday", "getuid", "getuid32",
    "getxattr", "inotify_add_watch", "inotify_init", "inotify_init1", "inotify_rm_watch",
    "io_cancel", "io_destroy", "io_getevents", "io_pgetevents", "io_pgetevents_time64",
    "io_setup", "io_submit", "ioctl", "ioprio_get", "ioprio_set", "ipc", "kill",
    "landlock_add_rule", "landlock_create_ruleset", "landlock_restrict_self", "lchown",
    "lchown32", "lgetxattr", "link", "linkat", "listen", "listxattr", "llistxattr", "_llseek",
    "lremovexattr", "lseek", "lsetxattr", "lstat", "lstat64", "madvise", "map_shadow_stack",
    "membarrier", "mincore", "mkdir", "mkdirat", "mknod", "mknodat", "mlock",
    "mlock2", "mlockall", "mmap", "mmap2", "mprotect", "mq_getsetattr", "mq_notify",
    "mq_open", "mq_timedreceive", "mq_timedreceive_time64", "mq_timedsend",
    "mq_timedsend_time64", "mq_unlink", "mremap", "msgctl", "msgget", "msgrcv", "msgsnd",
    "msync", "munlock", "munlockall", "munmap", "name_to_handle_at", "nanosleep",
    "newfstatat", "_newselect", "open", "openat", "openat2", "pause", "pidfd_getfd",
    "pidfd_open", "pidfd_send_signal", "pipe", "pipe2", "pkey_alloc", "pkey_free",
    "pkey_mprotect", "poll", "ppoll", "ppoll_time64", "prctl", "pread64", "preadv", "preadv2",
    "prlimit64", "process_mrelease", "pselect6", "pselect6_time64", "ptrace", "pwrite64",
    "pwritev", "pwritev2", "read", "readahead", "readlink", "readlinkat", "readv", "recv",
    "recvfrom", "recvmmsg", "recvmmsg_time64", "recvmsg", "remap_file_pages", "removexattr",
    "rename", "renameat", "renameat2", "restart_syscall", "rmdir", "rseq", "rt_sigaction",
    "rt_sigpending", "rt_sigprocmask", "rt_sigqueueinfo", "rt_sigreturn", "rt_sigsuspend",
    "rt_sigtimedwait", "rt_sigtimedwait_time64", "rt_tgsigqueueinfo", "sched_get_priority_max",
    "sched_get_priority_min", "sched_getaffinity", "sched_getattr", "sched_getparam",
    "sched_getscheduler", "sched_rr_get_interval", "sched_rr_get_interval_time64",
    "sched_setaffinity", "sched_setattr", "sched_setparam", "sched_setscheduler",
    "sched_yield", "seccomp", "select", "semctl", "semget", "semop", "semtimedop",
    "semtimedop_time64", "send", "sendfile", "sendfile64", "sendmmsg", "sendmsg", "sendto",
    "set_robust_list", "set_thread_area", "set_tid_address", "setfsgid", "setfsgid32",
    "setfsuid", "setfsuid32", "setgid", "setgid32", "setgroups", "setgroups32", "setitimer",
    "setpgid", "setpriority", "setregid", "setregid32", "setresgid", "setresgid32",
    "setresuid", "setresuid32", "setreuid", "setreuid32", "setrlimit", "setsid",
    "setsockopt", "setuid", "setuid32", "setxattr", "shmat", "shmctl", "shmdt", "shmget",
    "shutdown", "sigaltstack", "signalfd", "signalfd4", "sigprocmask", "sigreturn",
    "socketcall", "socketpair", "splice", "stat", "stat64", "statfs", "statfs64", "statx",
    "symlink", "symlinkat", "sync", "sync_file_range", "syncfs", "sysinfo", "tee", "tgkill",
    "time", "timer_create", "timer_delete", "timer_getoverrun", "timer_gettime",
    "timer_gettime64", "timer_settime", "timer_settime64", "timerfd_create",
    "timerfd_gettime", "timerfd_gettime64", "timerfd_settime", "timerfd_settime64", "times",
    "tkill", "truncate", "truncate64", "ugetrlimit", "umask", "uname", "unlink", "unlinkat",
    "utime", "utimensat", "utimensat_time64", "utimes", "vfork", "vmsplice", "wait4",
    "waitid", "waitpid", "write", "writev",
)  # fmt: skip

# personality(2) values Docker permits: PER_LINUX, PER_LINUX32, UNAME26 variants, and query.
PERSONALITY_VALUES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)

ARCH_MAP = [
    {"architecture": "SCMP_ARCH_X86_64", "subArchitectures": ["SCMP_ARCH_X86", "SCMP_ARCH_X32"]},
    {"architecture": "SCMP_ARCH_AARCH64", "subArchitectures": ["SCMP_ARCH_ARM"]},
]


def _allow(names: list[str], args: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"names": names, "action": "SCMP_ACT_ALLOW", "args": args or []}


def _arg(index: int, value: int, op: str, value_two: int = 0) -> dict[str, Any]:
    return {"index": index, "value": value, "valueTwo": value_two, "op": op}


def build_profile(without: frozenset[Relaxation] = frozenset(), *, exec_allowlist: bool = False) -> dict[str, Any]:
    """The profile as a dict; ``without`` drops relaxations (used only by minimality tests).

    ``exec_allowlist``: the policy restricts which programs run (Landlock, in the exec shim);
    memfd_create is then refused, since an anonymous memory file is outside every path rule and
    could be executed through /proc/self/fd."""
    rules: list[dict[str, Any]] = [_allow(list(ALLOWED_SYSCALLS))]
    if not exec_allowlist:
        rules.append(_allow(["memfd_create"]))
    # fallocate reserves gigabytes in microseconds, faster than any watchdog samples the disk:
    # EOPNOTSUPP makes posix_fallocate write the blocks instead, at the disk's own pace.
    rules.append({"names": ["fallocate"], "action": "SCMP_ACT_ERRNO", "errnoRet": EOPNOTSUPP, "args": []})
    rules += [_allow(["personality"], [_arg(0, v, "SCMP_CMP_EQ")]) for v in PERSONALITY_VALUES]
    # socket(2) for every family but AF_VSOCK (a path to the hypervisor host).
    rules.append(_allow(["socket"], [_arg(0, AF_VSOCK, "SCMP_CMP_NE")]))
    # clone(2) without namespace flags: threads and fork, as in Docker's default.
    rules.append(_allow(["clone"], [_arg(0, CLONE_NAMESPACE_FLAGS, "SCMP_CMP_MASKED_EQ", 0)]))
    # clone3 hides its flags in memory seccomp cannot read: ENOSYS makes glibc fall back to clone.
    rules.append({"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS, "args": []})
    newuser = [_arg(0, CLONE_NEWUSER, "SCMP_CMP_MASKED_EQ", CLONE_NEWUSER)]
    if Relaxation.CLONE_NEWUSER not in without:
        rules.append(_allow(["clone"], newuser))
    if Relaxation.UNSHARE_NEWUSER not in without:
        rules.append(_allow(["unshare"], newuser))
    for relaxation in (Relaxation.MOUNT, Relaxation.UMOUNT2, Relaxation.PIVOT_ROOT):
        if relaxation not in without:
            rules.append(_allow([relaxation.value]))
    return {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": EPERM,
        "archMap": ARCH_MAP,
        "syscalls": rules,
    }


def profile_for(exec_allowlist: bool) -> str:
    """The JSON text a sandbox's container gets: the shipped profile, or its allowlist variant."""
    from sandman import resources

    if not exec_allowlist:
        return resources.seccomp_profile_path().read_text()
    return render(build_profile(exec_allowlist=True))


def exec_profile(exec_allowlist: bool) -> dict[str, Any]:
    """Where sandman's supervisor builds layer 2 itself (the gvisor backend, whose runsc does not
    enforce the container's profile): the filter each command runs under, loaded by the
    supervisor right before the exec shim. No relaxation: no user namespaces, no mount."""
    profile = build_profile(frozenset(Relaxation), exec_allowlist=exec_allowlist)
    # mknod of FIFOs, sockets and regular files only: gVisor lets an unprivileged process create
    # device nodes (no CAP_MKNOD check), which the container's kernel would refuse.
    rules = []
    for rule in profile["syscalls"]:
        names = [n for n in rule["names"] if n not in ("mknod", "mknodat")]
        if names:
            rules.append({**rule, "names": names})
    for name, index in (("mknod", 1), ("mknodat", 2)):
        for kind in (0, S_IFREG, S_IFIFO, S_IFSOCK):
            rules.append(_allow([name], [_arg(index, S_IFMT, "SCMP_CMP_MASKED_EQ", kind)]))
    profile["syscalls"] = rules
    return profile


def render(profile: dict[str, Any]) -> str:
    """Stable JSON text: the exact bytes Docker receives and ``docker inspect`` shows back."""
    return json.dumps(profile, indent=1, sort_keys=True) + "\n"


if __name__ == "__main__":
    import sys

    sys.stdout.write(render(build_profile()))
