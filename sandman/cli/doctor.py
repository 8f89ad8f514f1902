"""``sandman doctor``: can ``sandman run`` work on this host, and if not, what to change.

Each check is pass/fail with the fix; ``required`` checks decide the exit status.
"""

from __future__ import annotations

import platform
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sandman import resources
from sandman.core import bwrap
from sandman.errors import SandmanError
from sandman.settings import Settings

MIN_FREE_GB = 2.0


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True


def _cgroup_version() -> str:
    if Path("/sys/fs/cgroup/cgroup.controllers").exists():
        return "v2"
    return "v1" if Path("/sys/fs/cgroup").exists() else "unknown"


def run_checks(settings: Settings, backend: str | None = None) -> list[Check]:
    """The host checks for ``backend`` (default: the ``backend`` setting)."""
    from sandman import backends

    name = backend or settings.backend
    cls = backends.backend_class(name)
    if name == "docker":
        return _docker_checks(settings)
    avail = cls.availability(settings)
    checks = [Check(f"backend {name}", avail.available, avail.detail or avail.reason, avail.fix)]
    if avail.available:
        checks += _backend_checks(cls(settings))
    checks.extend(_wall_checks())
    checks.append(Check("host", True, f"{platform.system()} {platform.release()} {platform.machine()}", required=False))
    return checks


def _walls_check(caps: Any) -> Check:
    """Which walls this backend gives, and what it cannot do: never dropped silently."""
    detail = " + ".join(caps.walls) + (f"; {' '.join(caps.notes)}" if caps.notes else "")
    return Check("walls", True, detail, required=False)


def _backend_checks(backend: Any) -> list[Check]:
    """A non-Docker backend: its walls, its image, and the real start of a sandbox with `true`."""
    import tempfile

    from sandman.backends.image import load_campaign
    from sandman.core.runner import Runner

    checks = [_walls_check(backend.capabilities())]
    runner = Runner(backend.settings, backend=backend)
    try:
        with tempfile.TemporaryDirectory(prefix="sandman-doctor-") as tmp:
            image = runner.images().ensure(load_campaign(Path(tmp), None))
        checks.append(Check("image", True, image))
    except SandmanError as exc:
        return [*checks, Check("image", False, str(exc), "run scripts/setup")]
    checks.append(_probe(runner, image))
    return checks


def _docker_checks(settings: Settings) -> list[Check]:
    from sandman.backends.docker import DockerBackend, connect
    from sandman.core.runner import Runner

    checks: list[Check] = []
    try:
        api = connect(settings.docker_base_url(), settings.engine_timeout_s)
    except SandmanError as exc:
        return [Check("engine", False, str(exc), "run scripts/setup (as root) or start dockerd")]
    info = api.info()
    version = api.version()
    checks.append(
        Check(
            "engine",
            True,
            f"Docker {version.get('Version')} (API {api.api_version}) at {settings.docker_base_url()}",
        )
    )
    runtimes = sorted((info.get("Runtimes") or {}).keys())
    checks.append(
        Check(
            "runtime runc",
            "runc" in runtimes,
            f"runtimes: {', '.join(runtimes) or 'none'}",
            "install runc (Debian: apt-get install runc)",
        )
    )
    has_runsc = "runsc" in runtimes
    checks.append(
        Check(
            "runtime runsc (gVisor)",
            has_runsc,
            "registered"
            if has_runsc
            else ("runsc binary present, not registered with dockerd" if shutil.which("runsc") else "not installed"),
            'optional: apt-get install runsc, then add it to /etc/docker/daemon.json "runtimes"',
            required=False,
        )
    )
    checks.append(
        Check(
            "cgroups",
            True,
            f"{info.get('CgroupVersion') or _cgroup_version()} ({info.get('CgroupDriver', '?')} driver)",
        )
    )
    sec = [s for s in info.get("SecurityOptions") or [] if "seccomp" in s]
    checks.append(
        Check(
            "seccomp",
            bool(sec),
            sec[0] if sec else "engine reports no seccomp support",
            "use an engine built with seccomp (libseccomp)",
        )
    )
    profile = resources.seccomp_profile_path()
    checks.append(
        Check(
            "seccomp profile",
            profile.is_file(),
            str(profile),
            "reinstall sandman: the profile file is missing",
        )
    )
    runner = Runner(settings, backend=DockerBackend(settings, api=api))
    checks.append(_walls_check(runner.backend.capabilities()))
    images = runner.images()
    base = None
    try:
        base = images.resolve_base(allow_build=False)
        checks.append(Check("base image", True, base))
    except SandmanError as exc:
        checks.append(Check("base image", False, str(exc), "run scripts/setup or `sandman image build`"))
    if base is not None:
        tag = images.base_tag(base)
        present = bool(api.images(name=tag))
        checks.append(
            Check(
                "agent image",
                present,
                tag if present else f"{tag} not built yet",
                "`sandman image build` (run builds it on first use)",
                required=False,
            )
        )
        if present:
            checks.append(_probe(runner, tag))
    usage = shutil.disk_usage(info.get("DockerRootDir") or "/")
    free_gb = usage.free / 1e9
    checks.append(
        Check(
            "free disk",
            free_gb >= MIN_FREE_GB,
            f"{free_gb:.1f} GB free under {info.get('DockerRootDir', '/')}",
            f"free at least {MIN_FREE_GB} GB for images and sandboxes",
        )
    )
    checks.extend(_wall_checks())
    checks.append(Check("host", True, f"{platform.system()} {platform.release()} {platform.machine()}", required=False))
    return checks


def _wall_checks(workspace: Path | None = None) -> list[Check]:
    """Landlock (the command allowlist), the disk watchdog, and the host git jail's bubblewrap."""
    from sandman.core import quota
    from sandman.policy.enforce import landlock_abi

    abi = landlock_abi()
    checks = [
        Check(
            "landlock",
            abi >= 1,
            f"Landlock ABI {abi}: a policy's command allowlist is enforced by the kernel inside the sandbox"
            if abi
            else "no Landlock: a policy's command allowlist is advisory (checked on the top-level command only)",
            "use a kernel with Landlock enabled (5.13+, `lsm=...,landlock`) to enforce command allowlists",
            required=False,
        )
    ]
    mech = quota.mechanism(workspace or Path.cwd())
    checks.append(
        Check(
            "disk quota",
            True,
            f"{mech.name}: {mech.detail}" + (f"; stronger: {mech.stronger}" if mech.stronger else ""),
            mech.stronger or "",
            required=False,
        )
    )
    host_bwrap = shutil.which("bwrap")
    checks.append(
        Check(
            "host bubblewrap",
            host_bwrap is not None,
            f"{host_bwrap}: host-side git (git-push, history scans) runs jailed"
            if host_bwrap
            else "bwrap is missing on the host: git-push and the git-history check cannot run",
            "apt-get install bubblewrap (scripts/setup does)",
            required=False,
        )
    )
    return checks


def _probe(runner: Any, image: str) -> Check:
    """The real layer-2 argv with `true`, in a container with our profile; a scratch workspace."""
    import os
    import tempfile

    from sandman.core.workspace import resolve_workspace
    from sandman.policy import load_policy

    with tempfile.TemporaryDirectory(prefix="sandman-doctor-") as tmp:
        owner = runner.backend.workspace_owner(runner.settings)
        uid, gid = owner or ((os.geteuid() or 65534),) * 2
        os.chmod(tmp, 0o755)
        if os.geteuid() == 0:
            os.chown(tmp, uid, gid)
        ws = resolve_workspace(tmp)
        err = bytearray()
        try:
            res = runner._run_container(
                ["true"],
                ws,
                "doctor",
                image,
                load_policy(runner.settings.default_policy),
                60.0,
                lambda b: None,
                err.extend,
                kind="probe",
            )
        except SandmanError as exc:
            return Check("bwrap probe", False, str(exc), "see the message")
    if res.exit_code == 0:
        layer2 = runner.backend.capabilities().layer2
        return Check(
            "bwrap probe" if layer2 else "sandbox probe",
            True,
            f"bubblewrap runs inside the {runner.backend.name} sandbox with sandman's profile ({res.duration_s:.2f}s)"
            if layer2
            else f"a command runs in the {runner.backend.name} sandbox ({res.duration_s:.2f}s)",
        )
    failure = bwrap.classify_probe(res.exit_code, err.decode(errors="replace"))
    text = err.decode(errors="replace").strip()
    return Check(
        "bwrap probe",
        False,
        f"{failure.value if failure else 'failed'}: {text[-300:]}",
        bwrap.probe_fix(failure) if failure else "",
    )


def as_json(checks: list[Check]) -> dict[str, Any]:
    return {"ok": all(c.ok for c in checks if c.required), "checks": [asdict(c) for c in checks]}


def workspace_checks(settings: Settings, workspace: Path, policy: Any) -> list[Check]:
    """What this workspace holds that a sandbox start would warn about or refuse: deny-listed
    files in its git history (``filesystem.git_history``), and the disk quota's mechanism."""
    from sandman.secrets import githistory

    fs = policy.filesystem
    checks = [c for c in _wall_checks(workspace) if c.name == "disk quota"]
    scan = githistory.find_history_secrets(workspace, fs.deny, fs.allow, cache_dir=settings.state_dir / "githistory")
    if scan.error:
        checks.append(Check("git history", False, scan.error, "see the message", required=False))
    elif scan.found:
        checks.append(
            Check(
                "git history",
                False,
                githistory.describe(scan) + f" (filesystem.git_history = {fs.git_history!r})",
                "rewrite the history (e.g. git filter-repo --path FILE --invert-paths) or rotate the secret",
                required=fs.git_history == "refuse",
            )
        )
    else:
        checks.append(Check("git history", True, "no deny-listed file in the repository's history", required=False))
    return checks
