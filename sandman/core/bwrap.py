"""Layer 2: the bubblewrap argv, built by one pure function, and the probe that classifies failures.

The root is built up, not hidden down: read-only /usr, /etc and /sys, fresh /proc and /dev, the
container's capped /tmp and HOME tmpfs (or an exec's private directories in them), the workspace
read-write, every namespace unshared, nested user namespaces disabled.

No workspace path is ever a bind *source* by name: the agent writes the workspace, and
bubblewrap follows symlinks. Pinned and read-only workspace paths are bound from descriptors the
launcher opens without following symlinks (``/proc/self/fd/N``, see images/base/supervisor.py),
and every guarded destination is re-checked inside the namespace by the exec shim.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

BWRAP = "/usr/bin/bwrap"
SANDBOX_EXEC = "/usr/lib/sandman/sandbox-exec"
WORKSPACE = "/workspace"
HOME = "/home/agent"
TOOLS_DIR = "/opt/sandman/tools"
SANDBOX_PATH = f"{TOOLS_DIR}/bin:/usr/local/bin:/usr/bin:/bin"
UPCALL_DIR = "/run/sandman/upcall"
# An empty regular file in the runtime dir: denied files read as empty (a /dev/null bind would
# fail to open, since bwrap's binds are nodev, and tools such as git treat that as fatal).
EMPTY_FILE = "/run/sandman/empty"  # the relay's directory (never the socket file itself)
ENV_FILE = "/run/sandman-env"  # where layer 2 sees the private env file; the shim reads, unsets
GUARD_FD_BASE = 3  # keep in step with images/base/supervisor.py
GUARD_PLACEHOLDER = "@SANDMAN_GUARD@"  # the launcher puts the checked parents' identities here


@dataclass(frozen=True)
class BwrapSpec:
    """What layer 2 shows the command: the container paths it binds and the environment it sets."""

    command: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str = WORKSPACE
    workspace: str = WORKSPACE
    home: str = HOME
    # Existing container paths bound read-only (tools dir, upcall dir, ...), in order.
    ro_binds: Sequence[str] = (TOOLS_DIR, UPCALL_DIR)
    # Denied workspace paths: (container path, is_dir); files read as empty, dirs as an empty tmpfs.
    masks: Sequence[tuple[str, bool]] = ()
    read_only: Sequence[str] = ()  # protected workspace paths, re-bound read-only (by descriptor)
    pinned: Sequence[str] = ()  # workspace paths bound onto themselves read-write: cannot be renamed
    writable: Sequence[str] = ()  # extra paths bound read-write at the same place
    env_file: str | None = None  # container path of the private env file (secrets, passthrough)
    tmp_source: str = "/tmp"  # the container dir shown as /tmp (an exec's private dir in sessions)
    home_source: str = HOME  # the container dir shown as HOME

    def bound(self) -> list[tuple[str, str]]:
        """Workspace paths bound by descriptor, in bind order: (container path, "rw" | "ro")."""
        return [(p, "rw") for p in self.pinned] + [(p, "ro") for p in self.read_only]


def _rel(path: str, workspace: str) -> str:
    if not path.startswith(workspace + "/"):
        raise ValueError(f"{path!r} is not under {workspace}")
    return path[len(workspace) + 1 :]


def guard_request(spec: BwrapSpec) -> dict[str, object]:
    """What the launcher must open (fd GUARD_FD_BASE + i, in ``bound()`` order) and check."""
    return {
        "workspace": spec.workspace,
        "open": [[_rel(p, spec.workspace), kind] for p, kind in spec.bound()],
        "check": [[_rel(p, spec.workspace), "mask"] for p, _ in spec.masks],
    }


# gVisor (whose runsc cannot run bubblewrap): the supervisor builds layer 2 from this plan.
WORKSPACE_RO = "/run/sandman/wsro"  # the workspace bound read-only: source of read-only binds
SKELETON = "/run/sandman/skel"  # the host's read-only tree of empty mount points: each exec's /
GVISOR_ROOTS = "/run/sandman/roots"  # keep in step with images/base/supervisor.py
# The skeleton's directories and symlinks (made by the gvisor backend in the runtime dir).
SKELETON_DIRS = ("usr", "etc", "sys", "dev", "dev/pts", "dev/shm", "proc", "tmp", "home/agent", "workspace",
                 "run/sandman/upcall", "opt/sandman/tools")  # fmt: skip
SKELETON_LINKS = (("bin", "usr/bin"), ("sbin", "usr/sbin"), ("lib", "usr/lib"), ("lib64", "usr/lib64"))


def supervisor_plan(
    spec: BwrapSpec, uid: int, gid: int, seccomp_bpf: bytes = b"", root_tag: str = "exec"
) -> dict[str, object]:
    """The gVisor mode's request (images/base/supervisor.py ``enter_namespaces``): the same
    spec as ``bwrap_argv``, as what the supervisor mounts, in order, by path. The host decides
    every path, mask, id and variable; the supervisor only executes it."""
    env = dict(spec.env)
    # gVisor has no Landlock: the allowlist is advisory there (warned at start), never half-applied.
    env.pop("SANDMAN_EXEC_ALLOW", None)
    env.pop("SANDMAN_EXEC_ALLOW_REQUIRED", None)
    if spec.masks or spec.read_only or spec.pinned:
        env["SANDMAN_GUARD"] = GUARD_PLACEHOLDER
    # bwrap_argv's layout, bound into the exec's own root: (container source, path, optional).
    binds = [
        ["/usr", "/usr", False],
        ["/usr/lib/sandman", "/usr/lib/sandman", False],  # the host's trusted copy, not the image's
        ["/etc", "/etc", False],
        *([f, f, True] for f in ("/etc/hosts", "/etc/hostname", "/etc/resolv.conf")),
        ["/sys", "/sys", False],
        ["/dev", "/dev", False],
        ["/dev/pts", "/dev/pts", False],
        [spec.tmp_source, "/tmp", False],
        [spec.home_source, spec.home, False],
        [spec.workspace, spec.workspace, False],
        *([path, path, False] for path in spec.writable),
        *([path, path, True] for path in spec.ro_binds),
    ]
    return {
        "ns": {
            "uid": uid,
            "gid": gid,
            "command": list(spec.command),
            "env": env,
            "env_file": spec.env_file,  # read by the supervisor as the uid (not in the exec's root)
            "cwd": spec.cwd,
            "workspace_ro": WORKSPACE_RO,
            "empty": EMPTY_FILE,
            "masks": [[path, is_dir] for path, is_dir in spec.masks],
            "skeleton": SKELETON,
            "root": f"{GVISOR_ROOTS}/{root_tag}",
            "binds": binds,
            # Classic BPF loaded right before the exec shim (gVisor enforces a guest's filter).
            "seccomp": base64.b64encode(seccomp_bpf).decode(),
        },
        "guard": guard_request(spec),
    }


def base_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment every sandboxed command starts from; nothing is inherited."""
    env = {"PATH": SANDBOX_PATH, "HOME": HOME, "LANG": "C.UTF-8", "TERM": "xterm-256color"}
    env.update(extra or {})
    return env


def bwrap_argv(spec: BwrapSpec) -> list[str]:
    """The complete argv of layer 2 (bwrap, its options, the exec shim, the command)."""
    argv = [
        BWRAP,
        "--unshare-all",
        # bwrap 0.8 refuses --disable-userns unless the user namespace is asked for explicitly.
        "--unshare-user",
        "--disable-userns",
        "--new-session",
        "--die-with-parent",
        "--clearenv",
        "--ro-bind", "/usr", "/usr",
        "--symlink", "usr/bin", "/bin",
        "--symlink", "usr/sbin", "/sbin",
        "--symlink", "usr/lib", "/lib",
        "--symlink", "usr/lib64", "/lib64",
        "--ro-bind", "/etc", "/etc",
        "--ro-bind", "/sys", "/sys",
        "--proc", "/proc",
        "--dev", "/dev",
        "--bind", spec.tmp_source, "/tmp",
        "--bind", spec.home_source, spec.home,
        "--bind", spec.workspace, spec.workspace,
    ]  # fmt: skip
    for i, (path, kind) in enumerate(spec.bound()):
        argv += ["--bind" if kind == "rw" else "--ro-bind", f"/proc/self/fd/{GUARD_FD_BASE + i}", path]
    for path, is_dir in spec.masks:
        argv += ["--tmpfs", path, "--remount-ro", path] if is_dir else ["--ro-bind", EMPTY_FILE, path]
    for path in spec.writable:
        argv += ["--bind", path, path]
    for path in spec.ro_binds:
        argv += ["--ro-bind-try", path, path]
    if spec.env_file:
        argv += ["--ro-bind", spec.env_file, ENV_FILE]
    # bwrap's own root is a tmpfs without caps: after the binds, make it read-only.
    argv += ["--remount-ro", "/", "--chdir", spec.cwd]
    env = dict(spec.env)
    if spec.env_file:
        env["SANDMAN_ENV_FILE"] = ENV_FILE
    if spec.masks or spec.read_only or spec.pinned:
        env["SANDMAN_GUARD"] = GUARD_PLACEHOLDER
    for key, value in sorted(env.items()):
        argv += ["--setenv", key, value]
    argv += ["--", SANDBOX_EXEC, *spec.command]
    return argv


class ProbeFailure(StrEnum):
    NO_USERNS = "no-userns"
    PROC_REFUSED = "proc-mount-refused"
    MOUNT_REFUSED = "mount-refused"
    BWRAP_MISSING = "bwrap-missing"
    BWRAP_TOO_OLD = "bwrap-too-old"
    UNKNOWN = "unknown"


_FIXES = {
    ProbeFailure.NO_USERNS: (
        "bubblewrap cannot create its user namespace: check that the host allows unprivileged user "
        "namespaces (sysctl user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1, "
        "kernel.apparmor_restrict_unprivileged_userns=0), that the container does not run as uid 0, "
        "and that sandman's seccomp profile (policies/seccomp/sandman.json) is in use"
    ),
    ProbeFailure.PROC_REFUSED: (
        "the kernel refused a fresh /proc inside the container: the container's /proc must be "
        "unmasked (security_opt systempaths=unconfined), which sandman sets; an engine or runtime "
        "that ignores it (or gVisor without --proc support) cannot run layer 2"
    ),
    ProbeFailure.MOUNT_REFUSED: (
        "mounts inside bubblewrap's namespace were refused: an AppArmor or SELinux profile is "
        "blocking mount(2); run the container with an AppArmor profile that allows mounts in user "
        "namespaces (see README, 'Hosts with AppArmor')"
    ),
    ProbeFailure.BWRAP_MISSING: "bubblewrap is not in the image: rebuild it with `sandman image build`",
    ProbeFailure.BWRAP_TOO_OLD: (
        "the image's bubblewrap is older than 0.8 (no --disable-userns): rebuild on Debian bookworm or newer"
    ),
    ProbeFailure.UNKNOWN: "bubblewrap failed for a reason sandman does not recognise; see its message",
}


def classify_probe(exit_code: int, stderr: str) -> ProbeFailure | None:
    """Map a failed `bwrap ... true` to a cause; None when the probe passed."""
    if exit_code == 0:
        return None
    text = stderr.lower()
    if "no such file" in text and "bwrap" in text and "execvp" not in text:
        return ProbeFailure.BWRAP_MISSING
    if "unrecognized option" in text or "unknown option" in text:
        return ProbeFailure.BWRAP_TOO_OLD
    if "proc" in text and ("mount" in text or "can't" in text):
        return ProbeFailure.PROC_REFUSED
    if any(
        s in text for s in ("uid map", "gid map", "new namespace", "user namespace", "max_user_namespaces", "clone")
    ):
        return ProbeFailure.NO_USERNS
    if any(s in text for s in ("mount", "pivot_root", "chroot", "make / slave", "remount")):
        return ProbeFailure.MOUNT_REFUSED
    return ProbeFailure.UNKNOWN


def probe_fix(failure: ProbeFailure) -> str:
    return _FIXES[failure]
