"""gVisor: the Docker engine with the ``runsc`` runtime (Debian's runsc 20221219, registered by
scripts/setup with ``--network=none --host-uds=all``).

One wall: gVisor's user-space kernel (the Sentry) between the agent and the host's kernel.
bubblewrap cannot run in this runsc, so layer 2 is built by sandman's supervisor itself, inside
gVisor (``supervisor.py --gvisor``): it runs as root *in the Sentry* (capabilities that exist
only there; the host sees the Sentry's own unprivileged, filtered process) and gives every exec
a root of its own with bubblewrap's layout (chroot: this gVisor's mount namespaces share one
mount table), new pid/ipc/uts/net namespaces, the deny-list masks, pinned and read-only
workspace paths, a private /tmp and HOME, sandman's layer-2 seccomp filter, and the command as
the workspace uid with no capabilities. Those are gVisor's mechanisms, so they are not a second
wall: a Sentry bug crosses both.

What this runsc does differently from runc, measured (see ``capabilities().notes``):
- SO_PEERCRED on host-backed sockets reports the listener's own credentials: the supervisor
  cannot tell the host from the agent by pid, so the socket's directory is not in any exec's root.
- unshare(CLONE_NEWNS) gives no private mount table (a mount after it shows everywhere): each
  exec is chrooted into a root of its own, detached when it ends.
- Landlock: ENOSYS. The command allowlist is advisory (warned at start; never sent to the shim).
- The container's seccomp profile is accepted but not enforced (runsc without --oci-seccomp;
  with it, every refusal is EPERM and clone3 -> EPERM breaks threads); the supervisor loads the
  layer-2 profile on every command instead, which gVisor enforces (errno values included).
- ``PidsLimit`` counts the Sentry's host threads (about 66 idle, about 8 per guest process): the
  cap is scaled, and RLIMIT_NPROC (which gVisor counts per sandbox) is the agent's process cap.
- An OOM kills the whole sandbox (a session ends); ``docker update`` fails (no ``runsc update``);
  tmpfs ``nr_inodes`` is ignored; MS_RDONLY on a bind is ignored (read-only file binds come from
  a read-only view of the workspace instead); a bind of a workspace directory is never made,
  because this gVisor lets ``..`` climb past a bind's root once a directory under it is renamed
  away (red team: a masked .env read through the pinned .git); ``statx(AT_NO_AUTOMOUNT)`` is EINVAL, so coreutils
  ``ls PATH`` and ``stat`` fail.
"""

from __future__ import annotations

import copy
import os
import subprocess
from typing import Any

from sandman.backends.base import WALL_GVISOR, Availability, Capabilities, ContainerSpec
from sandman.backends.docker import DockerBackend
from sandman.core.bwrap import GVISOR_ROOTS, SKELETON, SKELETON_DIRS, SKELETON_LINKS, WORKSPACE_RO
from sandman.errors import UsageError

RUNTIME = "runsc"
# Capabilities of root inside the Sentry, for the supervisor's per-exec namespaces: mount and
# unshare, drop to the workspace uid, chown nothing but its own, empty the bounding set. They
# never reach the host kernel; the agent's commands hold none of them.
SENTRY_CAPS = ["SYS_ADMIN", "SYS_CHROOT", "SETUID", "SETGID", "CHOWN", "SETPCAP"]
SENTRY_THREADS_BASE = 100  # idle Sentry + gofer host threads (about 66 measured), with margin
SENTRY_THREADS_PER_PROCESS = 10  # host threads per guest process (about 8 measured)


def host_pids(pids: int) -> int:
    """The cgroup pids cap for a sandbox of ``pids`` guest processes (it counts host threads)."""
    return SENTRY_THREADS_BASE + SENTRY_THREADS_PER_PROCESS * pids


def gvisor_adjust(kwargs: dict[str, Any], spec: ContainerSpec) -> dict[str, Any]:
    """``container_kwargs`` output -> the gvisor backend's (pure)."""
    kw = copy.deepcopy(kwargs)
    hc = kw["host_config"]
    hc["Runtime"] = RUNTIME
    pids = spec.resources.pids
    hc["PidsLimit"] = host_pids(pids)
    hc["Ulimits"] = [u for u in hc["Ulimits"] if u["Name"] != "nproc"] + [{"Name": "nproc", "Soft": pids, "Hard": pids}]
    # Root inside the Sentry only: the supervisor builds layer 2; commands run as the uid.
    kw["user"] = "0:0"
    hc["CapAdd"] = list(SENTRY_CAPS)
    # The workspace again, read-only: the source of read-only binds (gVisor keeps a bind's
    # source mount flags and ignores MS_RDONLY on it). Covered in every exec.
    hc["Mounts"] = [
        *hc["Mounts"],
        {"Target": WORKSPACE_RO, "Source": spec.workspace, "Type": "bind", "ReadOnly": True},
    ]
    # The Sentry's /proc and /sys are emulated; Docker's masks have nothing of the host's to hide.
    hc.pop("MaskedPaths", None)
    hc.pop("ReadonlyPaths", None)
    return kw


class GVisorBackend(DockerBackend):
    """Docker + runsc: gVisor's kernel, with sandman's supervisor building layer 2 inside it."""

    name = "gvisor"
    summary = "Docker engine, runsc (gVisor): user-space kernel; per-exec namespaces by sandman's supervisor"
    WALLS: tuple[str, ...] = (WALL_GVISOR,)
    layer2_mode = "gvisor"

    def _check(self, version: dict[str, Any]) -> Availability:
        runtimes = (self.api.info().get("Runtimes") or {}).keys()
        if RUNTIME not in runtimes:
            return Availability(
                False,
                f"the Docker engine at {self.base_url()} has no {RUNTIME!r} runtime "
                f"(it has: {', '.join(sorted(runtimes))})",
                "run scripts/setup (installs Debian's runsc and registers it with dockerd)",
            )
        return Availability(True, detail=f"Docker {version.get('Version')} at {self.base_url()}, runtime runsc")

    def capabilities(self) -> Capabilities:
        return Capabilities(
            walls=self.WALLS,
            layer2=False,
            limits=("cpus", "memory"),
            live_update=False,
            notes=(
                "One wall: gVisor's kernel. bubblewrap cannot run in this runsc; per-exec namespaces and masks "
                "are built by sandman's supervisor inside gVisor, so they are gVisor's too, not a second wall.",
                "No Landlock (ENOSYS in gVisor): a policy's command allowlist is advisory (checked on the "
                "top-level command only).",
                "seccomp: the container's profile is not enforced by this runsc (without --oci-seccomp; with "
                "it every refusal is EPERM and threads break), so the supervisor runs unfiltered inside gVisor; "
                "every command runs under sandman's layer-2 profile (no user namespaces, no mount), which the "
                "supervisor loads and gVisor's kernel enforces.",
                "gVisor's /proc/self/status has no NoNewPrivs line (prctl(PR_GET_NO_NEW_PRIVS) is 1).",
                "Read-only workspace FILES are bound from a read-only view of the workspace (this gVisor "
                "ignores MS_RDONLY on a bind); read-only and pinned workspace DIRECTORIES (.git, .git/hooks, "
                ".sandman, ...) are not applied: a bind of a workspace directory lets this gVisor's `..` climb "
                "past the bind's root into an unmasked view of the workspace. What the agent changes there is "
                "still caught by the host after the session (poisoning check, campaign acceptance).",
                "This gVisor's mount namespaces share one mount table: each exec is chrooted into a root of "
                "its own (detached when it ends), so execs never see each other's mounts at their paths.",
                "memory: an OOM kills the whole sandbox, so a session ends with the command.",
                "pids: the agent's process cap is RLIMIT_NPROC (= pids, counted per sandbox by gVisor): a fork "
                "bomb gets EAGAIN, but the host cannot see that hit, so it ends as exit or timeout, never as "
                "pids-limit; the cgroup cap counts gVisor's own host threads and is scaled "
                f"({SENTRY_THREADS_BASE} + {SENTRY_THREADS_PER_PROCESS} x pids) as a backstop.",
                "Limits cannot change on a running sandbox (runsc has no `update`): start a new session.",
                "/tmp and HOME are capped in size, not in inodes (gVisor ignores nr_inodes).",
                "This runsc's statx(AT_NO_AUTOMOUNT) fails with EINVAL: coreutils `stat` and `ls PATH` "
                "(e.g. `ls /sys/class/net`) fail; plain `ls`, find, git and Python's os.stat work.",
                "POSIX message queues (msgqueue) are gVisor's own kernel objects: they use none of the host "
                "user's budget, so they are not limited to 0 here.",
            ),
        )

    def runtime_name(self) -> str:
        return f"runsc ({runsc_version()})"

    def versions(self) -> dict[str, Any]:
        return {**super().versions(), "runsc": runsc_version()}

    def kwargs(self, spec: ContainerSpec) -> dict[str, Any]:
        from sandman.backends.docker import container_kwargs

        kwargs = gvisor_adjust(container_kwargs(spec), spec)
        kwargs["labels"]["io.sandman.backend"] = self.name
        return kwargs

    def create(self, spec: ContainerSpec) -> str:
        # The read-only view's mount point, made by the host in the host-owned runtime dir (the
        # container sees that dir read-only, so the runtime could not make it there).
        run = spec.runtime_dir
        for name in (WORKSPACE_RO, GVISOR_ROOTS):
            os.makedirs(os.path.join(run, os.path.basename(name)), mode=0o755, exist_ok=True)
        # Each exec's root: empty mount points only, read-only inside (the runtime dir's mount).
        skel = os.path.join(run, os.path.basename(SKELETON))
        for d in (*SKELETON_DIRS, *(t.lstrip("/") for _, t, _ in spec.extra_mounts)):
            os.makedirs(os.path.join(skel, d), mode=0o755, exist_ok=True)
        for name, target in SKELETON_LINKS:
            if not os.path.lexists(os.path.join(skel, name)):
                os.symlink(target, os.path.join(skel, name))
        return super().create(spec)

    def host_addresses(self) -> list[str]:
        return []  # --network=none: the sandbox has no network stack at all

    def update_limits(
        self, handle: str, *, cpus: float | None = None, memory: int | None = None, pids: int | None = None
    ) -> None:
        if cpus is None and memory is None and pids is None:
            return
        raise UsageError(
            "the gvisor backend cannot change limits on a running sandbox (runsc has no `update`): "
            "start a new session with the new limits"
        )


def runsc_version() -> str:
    """`runsc --version`'s first line, e.g. "runsc version 0.0~20221219.0" ("unknown" if absent)."""
    try:
        out = subprocess.run(["runsc", "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.splitlines()[0].removeprefix("runsc version ").strip() if out.strip() else "unknown"
