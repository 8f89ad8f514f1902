"""The escape battery: non-destructive probes run inside a live sandbox session, each with a
positive control run in the same sandbox that shows the probe's mechanism works.

``run_battery(sandbox)`` sends ``sandman/core/verify_probes.py`` (stdlib only) to ``python3`` inside
both layers in ONE exec and returns a ``ProbeResult`` row per probe. ``runtime_versions(api)`` and
``runc_warnings(version)`` report the engine and runc, and warn about runc releases with known
container-escape CVEs.

Mount rules (``mountinfo``): every mount point is one bubblewrap makes (/, /usr, /etc and Docker's
/etc/{resolv.conf,hostname,hosts}, /sys and below, /proc, /dev and below, /tmp, /home/agent,
/workspace, /opt/sandman/tools, /run/sandman/upcall); only /, /proc, /dev, /tmp, /home/agent and
/workspace may be mounted writable (/ is bwrap's private tmpfs; the ``rootfs`` probe checks that
nothing can be created in it); image content appears only at its own path; the only host paths
are the workspace (its mount root is the host workspace path), the session's upcall directory
(read-only) and the three per-container files Docker writes under
``<data-root>/containers/<64 hex>/``, read-only. Anything else (a host
/home, /var/lib/docker, a socket directory, devtmpfs) is a violation. Overlay options still name
/var/lib/docker/overlay2 layer paths: that is information, not access, and is not flagged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandman.core import verify_probes
from sandman.upcall.relay import upcall_socket

if TYPE_CHECKING:
    import docker

    from sandman.backends.base import Backend
    from sandman.core.session import Sandbox

MARKER = "SANDMAN-VERIFY "
# The in-sandbox bootstrap: parameters on the first stdin line, the probe source after it.
BOOT = (
    "import sys,json;p=json.loads(sys.stdin.readline());g={'__name__':'sandman_verify'};"
    "exec(compile(sys.stdin.read(),'sandman/core/verify_probes.py','exec'),g);"
    f"sys.stdout.write({MARKER!r}+json.dumps(g['main'](p))+'\\n')"
)
# Host variables whose values are treated as secrets and searched for inside the sandbox.
SECRET_NAME = re.compile(
    r"TOKEN|SECRET|PASSW|API_?KEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL|AUTH|SESSION_KEY", re.IGNORECASE
)
MIN_SECRET_LEN = 8


@dataclass(frozen=True)
class ProbeResult:
    """One row: the probe (``passed``) and its positive control (``control_passed``)."""

    name: str
    expected: str
    observed: str
    passed: bool
    control: str = ""
    control_observed: str = ""
    control_passed: bool = True
    seconds: float = 0.0
    not_applicable: str = ""  # on this backend, why the probe or its control cannot apply

    @property
    def ok(self) -> bool:
        """The probe held AND its control showed that the probe could have seen a failure."""
        return self.passed and self.control_passed


_SECCOMP_CONTROL = "getpid through the same ctypes libc.syscall path returns os.getpid()"
_WS_CONTROL = "open O_WRONLY on a workspace file succeeds"
_NET_CONTROL = "TCP connect to a listener inside the sandbox on 127.0.0.1 succeeds"

# name -> (expected, control); names and order are verify_probes.PROBES'.
DESCRIPTIONS: dict[str, tuple[str, str]] = {
    "identity": (
        "real/effective/saved/fs uid and gid, and every group, are non-zero",
        "status agrees with getuid()",
    ),
    "capabilities": ("CapInh, CapPrm, CapEff, CapBnd and CapAmb are all 0", "capget(2) agrees with /proc"),
    "no_new_privs": ("NoNewPrivs: 1", "prctl(PR_GET_NO_NEW_PRIVS) = 1"),
    "seccomp_mode": ("Seccomp: 2 (filter mode)", "prctl(PR_GET_SECCOMP) = 2"),
    "setuid": (
        "a root-owned setuid binary (su) runs with euid != 0 (no-new-privileges, nosuid /usr)",
        "the same /proc observation of a plain child works; the binary really is setuid root",
    ),
    **{
        f"seccomp_{name}": (f"{name}() refused by seccomp: -1 EPERM", _SECCOMP_CONTROL)
        for name in verify_probes.REFUSED
    },
    "seccomp_socket_vsock": (
        "socket(AF_VSOCK) refused by seccomp: EPERM",
        "socket(AF_UNIX) on the same path works",
    ),
    "nested_userns": (
        "unshare(CLONE_NEWUSER) and `unshare -U` fail inside the agent's layer",
        "`unshare` runs; the agent is itself in bwrap's user namespace (only nesting is refused)",
    ),
    "cgroup_mount": (
        "CVE-2022-0492 path refused: no new user+mount+cgroup namespace, cgroup/cgroup2 mounts fail",
        "mount(2) reaches the kernel (EFAULT/ENOENT for a NULL target), so the refusals are real",
    ),
    "process_visibility": (
        "only bwrap's init (pid 1) and the agent's own processes are visible",
        "the scan sees the probe's own child",
    ),
    "ptrace_pid1": (
        "pid 1 (bwrap's init) is refused to ptrace, or holds nothing the agent lacks: same non-zero uid, "
        "no capabilities, same user and pid namespaces (processes outside the layer are not visible at all)",
        "PTRACE_ATTACH to the probe's own child succeeds (then detached)",
    ),
    "engine_sockets": (
        "no socket files outside /proc and /sys (only sandman's upcall relay would be allowed), no "
        "docker/containerd/podman socket path, DOCKER_HOST and friends unset in every visible process",
        "the walk finds a Unix socket the probe binds in /tmp",
    ),
    "interfaces": ("the only network interface is lo", "lo is listed"),
    "host_loopback": (
        "TCP to the host's 127.0.0.1 listener (and ::1, the bridge gateway) fails",
        _NET_CONTROL,
    ),
    "dns": ("name resolution of external names fails", "localhost resolves through /etc/hosts"),
    "metadata": (
        "169.254.169.254:80 (and the IPv6 IMDS) unreachable, 1 s timeout, nothing sent",
        _NET_CONTROL,
    ),
    **{
        f"kernel_{os.path.basename(path).replace('-', '_')}": (
            f"{path} cannot be opened for writing (absent is a pass); never written",
            _WS_CONTROL,
        )
        for path in verify_probes.KERNEL_SURFACES
    },
    "cgroup_files": (
        "no cgroup control file under /sys/fs/cgroup (release_agent, pids.max, memory.max, ...) "
        "opens for writing",
        "the files found open read-only",
    ),
    "devices": (
        "no block devices in /dev; mknod of a block device and of /dev/mem's char device refused",
        "mknod of a FIFO works; /dev/null is seen as a char device",
    ),
    "rootfs": (
        "files cannot be created in /, /usr, /etc, /opt/sandman/tools or /sys, nor existing ones "
        "opened for writing (only the workspace, /tmp and HOME are writable)",
        "a workspace file opens for writing; /tmp accepts a new file",
    ),
    "mountinfo": (
        "/proc/self/mountinfo shows only the intended mounts and host paths (see sandman.core.verify's docstring)",
        "the rules flag a synthetic /var/lib/docker and host /home bind; the workspace bind is found",
    ),
    "tiocsti": (
        "no controlling terminal (/dev/tty: ENXIO); TIOCSTI refused on stdio and on a non-controlling pty",
        "TIOCSTI on the sandbox's own controlling pty works (or EIO where dev.tty.legacy_tiocsti=0)",
    ),
    "host_secrets": (
        "no host secret appears in any readable /proc/*/environ or /proc/*/cmdline",
        "a canary planted in a child's environment is found by the same scan",
    ),
}  # fmt: skip

PROBE_NAMES: tuple[str, ...] = tuple(verify_probes.PROBES)

# Per layer-2 mode (``Backend.layer2_mode``): probe parts that cannot apply there, and why. The
# other part must still pass; the row says "not applicable" with the reason (never a silent pass).
NOT_APPLICABLE: dict[str, dict[str, tuple[str, str]]] = {
    "gvisor": {
        "no_new_privs": (
            "probe",
            "gVisor's /proc/self/status has no NoNewPrivs line; the control, prctl(PR_GET_NO_NEW_PRIVS) = 1, "
            "is the check here",
        ),
        "cgroup_mount": (
            "control",
            "the exec's seccomp filter refuses every mount(2) with EPERM before gVisor's kernel looks at its "
            "arguments, so no mount can reach the kernel to show the refusals are its own",
        ),
        "cgroup_files": (
            "control",
            "gVisor mounts no cgroup filesystem in the sandbox: there are no files to open read-only either",
        ),
        "tiocsti": (
            "control",
            "this gVisor does not implement TIOCSTI (ENOTTY on every terminal, its own pty included): there "
            "is nothing to inject with, so the control cannot succeed",
        ),
    },
}


def host_secrets_from_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Host variables that look like credentials (by name), long enough to search for."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if SECRET_NAME.search(k) and len(v) >= MIN_SECRET_LEN}


@contextlib.contextmanager
def host_listener() -> Iterator[int]:
    """A TCP listener on the host's 127.0.0.1 that accepts and closes; yields its port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield int(sock.getsockname()[1])
    finally:
        stop.set()
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
        thread.join(2)


def run_battery(
    sandbox: Sandbox,
    host_listener_port: int | None = None,
    *,
    host_secrets: Mapping[str, str] | None = None,
    only: list[str] | None = None,
    timeout: float = 120.0,
) -> list[ProbeResult]:
    """Run every probe (or ``only`` those) in ``sandbox`` in one exec; one row per probe.

    ``host_listener_port``: a listener on the host's 127.0.0.1 the sandbox must not reach (one is
    started for the duration when None). ``host_secrets``: label -> value searched for in every
    readable /proc/*/environ and cmdline inside the sandbox, on top of the secret-looking
    variables of this process's environment; only salted digests enter the sandbox."""
    names = list(only or PROBE_NAMES)
    unknown = [n for n in names if n not in verify_probes.PROBES]
    if unknown:
        raise ValueError(f"unknown probe(s): {', '.join(unknown)}")
    secrets = {**host_secrets_from_env(), **(host_secrets or {})}
    salt = os.urandom(16).hex()
    with contextlib.ExitStack() as stack:
        if host_listener_port is None:
            host_listener_port = stack.enter_context(host_listener())
        params = {
            "only": names,
            "host_port": host_listener_port,
            "host_addresses": sandbox.backend.host_addresses(),
            "backend": sandbox.backend.name,
            "host_workspace": str(sandbox.workspace.path),
            "layer2": sandbox.backend.layer2_mode,
            "init_comm": "sandman-init" if sandbox.backend.layer2_mode == "gvisor" else "bwrap",
            "host_upcall": str(upcall_socket(sandbox.record.runtime_dir).parent),
            "salt": salt,
            # Never the values: an agent sharing the session could read the probe's memory.
            "secrets": {k: [len(v.encode()), verify_probes.digest(salt, v.encode())] for k, v in secrets.items()},
        }
        source = Path(verify_probes.__file__).read_bytes()
        stdin = json.dumps(params).encode() + b"\n" + source
        res = sandbox.exec(["python3", "-I", "-S", "-c", BOOT], stdin=stdin, timeout=timeout)
    raw: dict[str, dict[str, Any]] = {}
    for line in res.stdout.decode(errors="replace").splitlines():
        if line.startswith(MARKER):
            raw = json.loads(line[len(MARKER) :])
    rows = []
    skip = NOT_APPLICABLE.get(sandbox.backend.layer2_mode, {})
    for name in names:
        expected, control = DESCRIPTIONS[name]
        got = raw.get(name)
        if got is None:
            err = res.stderr.decode(errors="replace").strip()[-600:]
            rows.append(
                ProbeResult(
                    name,
                    expected,
                    f"the probe did not report (exit {res.exit_code}, {res.cause.value}): {err}",
                    False,
                    control,
                    "-",
                    False,
                )
            )
            continue
        row = ProbeResult(
            name,
            expected,
            str(got["observed"]),
            bool(got["passed"]),
            control,
            str(got["control_observed"]),
            bool(got["control_passed"]),
            float(got.get("seconds", 0.0)),
        )
        if name in skip:
            part, why = skip[name]
            mode = sandbox.backend.layer2_mode
            note = f"not applicable on {mode}: {why} (observed: "
            if part == "probe":  # the control alone decides, and must pass
                row = dataclasses.replace(
                    row, observed=note + row.observed + ")", passed=row.control_passed, not_applicable=why
                )
            else:  # the probe alone decides, and must pass
                row = dataclasses.replace(
                    row, control_observed=note + row.control_observed + ")", control_passed=True, not_applicable=why
                )
        rows.append(row)
    return rows


def format_rows(rows: list[ProbeResult]) -> str:
    """A plain-text report: one block per probe."""
    out = []
    for r in rows:
        verdict = "PASS" if r.ok else ("FAIL" if r.control_passed else "NOT MEANINGFUL (control failed)")
        if r.ok and r.not_applicable:
            verdict = "PASS (part not applicable on this backend)"
        out.append(
            f"[{verdict}] {r.name}\n  expected: {r.expected}\n  observed: {r.observed}\n"
            f"  control:  {r.control}\n  control observed: {r.control_observed}"
        )
    return "\n".join(out)


# -- the runtime ------------------------------------------------------------------------------------
def runtime_versions(backend: Backend | docker.APIClient) -> dict[str, Any]:
    """Engine, containerd and runc versions as the engine reports them, plus ``runc --version``
    on this host when runc is on PATH (the engine's runc may be another binary). A backend
    without a Docker API (local) reports its own versions."""
    from sandman.backends.base import Backend

    if isinstance(backend, Backend):
        api = getattr(backend, "api", None)
        if api is None or backend.name not in ("docker", "gvisor"):
            return {**backend.versions(), "runc_effective": None}
        return {**_docker_versions(api), "backend": backend.name}
    return _docker_versions(backend)


def _docker_versions(api: docker.APIClient) -> dict[str, Any]:
    info = api.info()
    version = api.version()
    components = {str(c.get("Name", "")).lower(): c for c in version.get("Components") or []}
    runc_component = components.get("runc") or {}
    out: dict[str, Any] = {
        "engine": version.get("Version"),
        "api": getattr(api, "api_version", None),
        "kernel": version.get("KernelVersion"),
        "default_runtime": info.get("DefaultRuntime"),
        "runtimes": sorted((info.get("Runtimes") or {}).keys()),
        "containerd": (components.get("containerd") or {}).get("Version"),
        "runc": runc_component.get("Version"),
        "runc_commit": (info.get("RuncCommit") or {}).get("ID")
        or (runc_component.get("Details") or {}).get("GitCommit"),
        "runc_cli": None,
    }
    runc = shutil.which("runc")
    if runc:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            done = subprocess.run([runc, "--version"], capture_output=True, text=True, timeout=10)
            first = done.stdout.strip().splitlines()
            out["runc_cli"] = first[0].removeprefix("runc version ").strip() if first else None
    # The most specific string for runc_warnings: a distribution revision carries backports.
    candidates = [out["runc_commit"], out["runc"], out["runc_cli"]]
    out["runc_effective"] = next(
        (c for c in candidates if c and _parse_runc(str(c)) is not None), out["runc"] or out["runc_cli"]
    )
    return out


_VERSION = re.compile(r"^v?(\d+)\.(\d+)\.(\d+)(?:-rc\.?(\d+))?(.*)$")

# (CVE ids, what, fixed releases per minor branch). A branch newer than every listed one is fixed;
# an older one (or a missing branch between) is not.
RUNC_ADVISORIES: tuple[tuple[str, str, tuple[tuple[int, int, int, int | None], ...]], ...] = (
    (
        "CVE-2024-21626",
        "leaked host fd / process.cwd breakout (Leaky Vessels)",
        ((1, 1, 12, None), (1, 2, 0, None)),
    ),
    (
        "CVE-2025-31133, CVE-2025-52565, CVE-2025-52881",
        "masked-path / /dev/console / procfs write redirection breakouts",
        ((1, 2, 8, None), (1, 3, 3, None), (1, 4, 0, 3)),
    ),
)
# Distribution builds known to carry a backported fix (verified from the package changelog).
RUNC_BACKPORTS: dict[str, frozenset[str]] = {
    # Debian bookworm-security: "CVE-2024-21626: several container breakouts due to internally
    # leaked fds" (/usr/share/doc/runc/changelog.Debian.gz).
    "1.1.5+ds1-1+deb12u1": frozenset({"CVE-2024-21626"}),
}


def _parse_runc(version: str) -> tuple[int, int, int, int | None, str] | None:
    m = _VERSION.match(version.strip())
    if not m:
        return None
    rc = int(m.group(4)) if m.group(4) is not None else None
    return int(m.group(1)), int(m.group(2)), int(m.group(3)), rc, m.group(5)


def _key(major: int, minor: int, patch: int, rc: int | None) -> tuple[int, int, int, int]:
    return major, minor, patch, rc if rc is not None else 1 << 30  # a release sorts after its rcs


def _fixed(v: tuple[int, int, int, int | None], fixes: tuple[tuple[int, int, int, int | None], ...]) -> bool:
    branch = (v[0], v[1])
    for fix in fixes:
        if (fix[0], fix[1]) == branch:
            return _key(*v) >= _key(*fix)
    newest = max((f[0], f[1]) for f in fixes)
    return branch > newest


def runc_warnings(version_str: str | None) -> list[str]:
    """Warnings for a runc version with known container-escape CVEs (empty: none known).

    Fixed releases: CVE-2024-21626 in 1.1.12 (and 1.2.0 on); CVE-2025-31133, CVE-2025-52565 and
    CVE-2025-52881 in 1.2.8, 1.3.3 and 1.4.0-rc.3. A distribution build (``1.1.5+ds1-1+deb12u1``)
    may carry backports: known ones are honoured, others get a note to check the changelog."""
    if not version_str:
        return ["runc version unknown: cannot check it against known container-escape CVEs"]
    parsed = _parse_runc(version_str)
    if parsed is None:
        return [f"runc version {version_str!r} not understood: cannot check it against known CVEs"]
    major, minor, patch, rc, suffix = parsed
    v = (major, minor, patch, rc)
    backported = RUNC_BACKPORTS.get(version_str.strip(), frozenset())
    distro = bool(suffix.strip())
    warnings = []
    for cves, what, fixes in RUNC_ADVISORIES:
        if _fixed(v, fixes):
            continue
        ids = {c.strip() for c in cves.split(",")}
        if ids <= backported:
            continue
        releases = ", ".join(f"{f[0]}.{f[1]}.{f[2]}" + (f"-rc.{f[3]}" if f[3] is not None else "") for f in fixes)
        note = " (a distribution build: the fix may be backported; check the package changelog)" if distro else ""
        warnings.append(f"runc {version_str} is older than the fix for {cves} ({what}; fixed in {releases}){note}")
    return warnings
