"""The local backend: no container engine; bubblewrap on the host.

One module on purpose: the outer bubblewrap argv, the generated /etc and tools dir and the backend
class that creates, starts and kills it must agree path for path; limits and seccomp compilation
already live apart (local_limits, local_seccomp).

Layer 1 here is an outer bubblewrap namespace built to look like sandman's container to the code
that runs in it: the host's /usr read-only (no image), a generated minimal /etc, a fresh /proc and
/dev, size-capped tmpfs /tmp and HOME, the workspace at /workspace, the runtime dir at
/run/sandman (read-only but for control/) and sandman's programs at /usr/lib/sandman; every
namespace unshared (network included), no capabilities, no-new-privileges, and sandman's own
seccomp profile compiled with libseccomp and loaded through ``--seccomp``. It runs as the
workspace owner (root drops to that uid before bubblewrap starts). Inside it, the supervisor,
launcher and exec shim run unchanged and start the same layer-2 bubblewrap as in a container.

Both namespaces are bubblewrap's, on the host kernel, set up by an unprivileged user: there is
no engine, no image and no cgroup a runtime made. sandman counts that as ONE wall and says so in
``sandman backends``, ``doctor`` and the README.

CPU, memory and pids caps come from sandman.backends.local_limits: per-session cgroup
directories when this process may create them (root on cgroup v1 or a delegated v2 tree), else
rlimits, which only approximate; ``capabilities()`` says which.

Sandboxes are found again from any process through a small registry under the state dir
(``local/<id>/``: labels, pids, cgroup dirs, bubblewrap's JSON status and the session's log).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sandman.backends.base import (
    CONTROL_DIR_IN_CONTAINER,
    LABEL_BACKEND,
    LABEL_SESSION,
    LABEL_STATE,
    RUNTIME_DIR_IN_CONTAINER,
    TRUSTED_DIR_IN_CONTAINER,
    WALL_BUBBLEWRAP,
    Availability,
    Backend,
    Capabilities,
    ContainerSpec,
    Frames,
    Listed,
    Status,
    labels_for,
)
from sandman.core.bwrap import HOME, SANDBOX_PATH, TOOLS_DIR, WORKSPACE
from sandman.errors import SandboxError, UsageError

BWRAP = "/usr/bin/bwrap"
TINI = "/usr/bin/tini"
SECCOMP_FD = 3
STATUS_FD = 4
HOSTNAME = "sandman"
# /etc entries copied into the sandbox's /etc (everything else of the host's /etc stays out).
ETC_COPY = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "alternatives",
    "services",
    "protocols",
    "debian_version",
)


def _parse_version(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.strip().split()[-1].split(".")[:3])
    except (ValueError, IndexError):
        return (0,)


def bwrap_version() -> tuple[int, ...]:
    try:
        out = subprocess.run([BWRAP, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return (0,)
    return _parse_version(out)


def strip_init(command: Sequence[str]) -> list[str]:
    """The sandbox command without the container's init: bubblewrap reaps as pid 1 itself."""
    argv = list(command)
    if argv[:2] == [TINI, "--"]:
        argv = argv[2:]
    return argv


def outer_argv(spec: ContainerSpec, etc_dir: str, *, die_with_parent: bool, tools_dir: str | None = None) -> list[str]:
    """Layer 1's bubblewrap argv (pure; the unit tests pin it). The seccomp filter is read from
    fd SECCOMP_FD, bubblewrap's JSON status goes to fd STATUS_FD."""
    res = spec.resources
    env = {"PATH": SANDBOX_PATH, "HOME": HOME, "LANG": "C.UTF-8", **spec.env}
    argv = [
        BWRAP,
        "--unshare-all",
        "--unshare-user",
        "--new-session",
        "--cap-drop", "ALL",
        "--hostname", HOSTNAME,
        "--ro-bind", "/usr", "/usr",
    ]  # fmt: skip
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = Path("/") / name
        if host.is_symlink():
            argv += ["--symlink", os.readlink(host), f"/{name}"]
        elif host.is_dir():
            argv += ["--ro-bind", str(host), f"/{name}"]
    tmpfs = ["--size", str(res.tmpfs_size), "--perms", "1777", "--tmpfs"]
    argv += [
        "--ro-bind", etc_dir, "/etc",
        # No /sys: the host's lists the host's network interfaces whatever the namespace.
        "--dir", "/sys",
        "--proc", "/proc",
        "--dev", "/dev",
        *tmpfs, "/tmp",
        *tmpfs, HOME,
        "--bind", spec.workspace, WORKSPACE,
        "--ro-bind", spec.runtime_dir, RUNTIME_DIR_IN_CONTAINER,
        "--bind", os.path.join(spec.runtime_dir, "control"), CONTROL_DIR_IN_CONTAINER,
    ]  # fmt: skip
    if spec.trusted_dir:
        argv += ["--ro-bind", spec.trusted_dir, TRUSTED_DIR_IN_CONTAINER]
    if tools_dir:  # sandman-upcall and the gh shim: the image has them in /usr/local/bin
        argv += ["--ro-bind", tools_dir, TOOLS_DIR]
    for source, target, read_only in spec.extra_mounts:
        argv += ["--ro-bind" if read_only else "--bind", source, target]
    argv += ["--remount-ro", "/", "--chdir", WORKSPACE, "--clearenv"]
    for key, value in sorted(env.items()):
        argv += ["--setenv", key, value]
    if die_with_parent:
        argv.append("--die-with-parent")
    argv += ["--seccomp", str(SECCOMP_FD), "--json-status-fd", str(STATUS_FD), "--", *strip_init(spec.command)]
    return argv


def publish_dir(root: Path, prefix: str, key: str, fill: Callable[[Path], None]) -> Path:
    """``root/prefix-key``, made once per content: filled in a private temporary dir, then
    renamed into place (a concurrent maker's rename wins and ours is dropped), 0755."""
    path = root / f"{prefix}-{key}"
    if path.is_dir() and not path.is_symlink():
        return path
    root.mkdir(parents=True, exist_ok=True, mode=0o711)
    tmp = root / f".{prefix}-{os.getpid()}-{threading.get_ident()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o755)
    tmp.chmod(0o755)  # whatever the umask said
    fill(tmp)
    try:
        os.rename(tmp, path)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def make_etc(root: Path, uid: int, gid: int) -> Path:
    """A minimal /etc for one uid: passwd and group naming the agent, loopback hosts, and the
    few host files programs need to start (the loader's cache, alternatives, time zone)."""
    files = {
        "passwd": f"root:x:0:0:root:/root:/bin/sh\nagent:x:{uid}:{gid}:agent:{HOME}:/bin/sh\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        "group": f"root:x:0:\nagent:x:{gid}:\nnogroup:x:65534:\n",
        "hosts": f"127.0.0.1 localhost {HOSTNAME}\n::1 localhost\n",
        "hostname": f"{HOSTNAME}\n",
        "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n",
        "resolv.conf": "",
    }

    def fill(tmp: Path) -> None:
        for name, text in files.items():
            (tmp / name).write_text(text)
            (tmp / name).chmod(0o644)
        for name in ETC_COPY:
            src = Path("/etc") / name
            if src.is_symlink():
                os.symlink(os.readlink(src), tmp / name)
            elif src.is_dir():
                shutil.copytree(src, tmp / name, symlinks=True)
            elif src.is_file():
                shutil.copy2(src, tmp / name)

    key = hashlib.sha256(f"{uid}:{gid}".encode() + b"".join(_etc_fingerprint())).hexdigest()[:16]
    return publish_dir(root, "etc", key, fill)


TOOLS = ("sandman-upcall", "gh")


def make_tools(root: Path) -> Path:
    """A host copy of the in-sandbox clients (sandman-upcall, gh), shown at TOOLS_DIR/bin."""
    from sandman import resources

    blobs = {name: (resources.images_dir() / "base" / name).read_bytes() for name in TOOLS}

    def fill(tmp: Path) -> None:
        (tmp / "bin").mkdir(mode=0o755)
        (tmp / "bin").chmod(0o755)
        for name, blob in blobs.items():
            (tmp / "bin" / name).write_bytes(blob)
            (tmp / "bin" / name).chmod(0o755)

    key = hashlib.sha256(b"".join(n.encode() + b"\0" + b for n, b in sorted(blobs.items()))).hexdigest()[:16]
    return publish_dir(root, "tools", key, fill)


def _etc_fingerprint() -> list[bytes]:
    out = []
    for name in ETC_COPY:
        with contextlib.suppress(OSError):
            st = os.lstat(Path("/etc") / name)
            out.append(f"{name}:{st.st_mtime_ns}:{st.st_size}".encode())
    return out


def _traversable(path: Path, uid: int, gid: int) -> Path | None:
    """The first directory on the way to ``path`` that ``uid`` cannot search, else None."""
    for parent in [*reversed(path.parents), path]:
        try:
            st = parent.stat()
        except OSError:
            return parent
        mode = st.st_mode
        if uid == st.st_uid:
            ok = mode & 0o100
        elif gid == st.st_gid:
            ok = mode & 0o010
        else:
            ok = mode & 0o001
        if not ok:
            return parent
    return None


class LocalImages:
    """No images: the host's /usr is the sandbox's. A campaign that installs packages needs an
    engine backend."""

    IMAGE = "host"

    def ensure(self, campaign: Any, progress: Any = None, rebuild: bool = False) -> str:
        spec = getattr(campaign, "spec", None)
        if spec is not None and not spec.is_empty():
            raise UsageError(
                f"campaign {campaign.name!r} builds an image (apt, pip or run steps), and the local backend "
                "runs the host's own programs without images: use an engine backend (--backend docker), "
                "or install what it needs on the host"
            )
        return self.IMAGE

    def list_images(self) -> list[dict[str, Any]]:
        return []

    def prune(self, everything: bool = False) -> list[str]:
        return []


class _Proc:
    """A sandbox this process started: its bubblewrap, and who reads its output."""

    def __init__(self) -> None:
        self.popen: subprocess.Popen[bytes] | None = None
        self.started = threading.Event()
        self.attached = False


class LocalBackend(Backend):
    """bubblewrap on the host, no engine: one wall (see the module's docstring)."""

    name = "local"
    summary = "no engine: bubblewrap on the host (one wall), sandman's seccomp via libseccomp"
    WALLS = (WALL_BUBBLEWRAP,)

    def __init__(self, settings: Any) -> None:
        super().__init__(settings)
        self._procs: dict[str, _Proc] = {}
        self._lock = threading.Lock()
        self._limits: Any = None
        self._filters: dict[str, bytes] = {}

    # -- what it is --------------------------------------------------------------------------
    @classmethod
    def availability(cls, settings: Any) -> Availability:
        if not os.path.exists(BWRAP):
            return Availability(False, "bubblewrap is not installed", "apt-get install bubblewrap (scripts/setup does)")
        version = bwrap_version()
        if version < (0, 8):
            return Availability(
                False,
                f"bubblewrap {'.'.join(map(str, version))} is older than 0.8 (no --disable-userns)",
                "install bubblewrap 0.8 or newer (Debian bookworm's)",
            )
        try:
            from sandman.backends import local_seccomp

            local_seccomp.binding_name()
        except ImportError as exc:
            return Availability(False, f"no libseccomp binding: {exc}", "reinstall sandman (scripts/setup)")
        if not os.path.isdir(TRUSTED_DIR_IN_CONTAINER):
            return Availability(
                False,
                f"the mount point {TRUSTED_DIR_IN_CONTAINER} does not exist on the host",
                f"create it once as root: mkdir -p {TRUSTED_DIR_IN_CONTAINER} (scripts/setup does)",
            )
        if not os.path.exists("/usr/bin/python3"):
            return Availability(False, "/usr/bin/python3 is missing", "apt-get install python3-minimal")
        links: list[str] = []
        for name in ("lib", "lib64", "bin"):
            if os.path.islink(f"/{name}"):
                links += ["--symlink", os.readlink(f"/{name}"), f"/{name}"]
        probe = subprocess.run(
            [BWRAP, "--unshare-user", "--unshare-net", "--ro-bind", "/usr", "/usr", *links, "--", "/usr/bin/true"],
            capture_output=True,
            text=True,
            timeout=30,
            **_as_nobody_kwargs(),
        )
        if probe.returncode != 0:
            return Availability(
                False,
                f"bubblewrap cannot create a user namespace here: {probe.stderr.strip()[-200:]}",
                "allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, "
                "user.max_user_namespaces > 0)",
            )
        return Availability(True, detail=f"bubblewrap {'.'.join(map(str, version))} on the host, {platform.release()}")

    def limit_support(self) -> Any:
        from sandman.backends.local_limits import HostLimits

        if self._limits is None:
            self._limits = HostLimits()
        return self._limits.probe()

    def capabilities(self) -> Capabilities:
        support = self.limit_support()
        names = {"cpu": "cpus", "memory": "memory", "pids": "pids"}
        enforced = tuple(names[e.resource] for e in (support.cpu, support.memory, support.pids) if e.enforced)
        notes = [
            "One wall: both namespaces are bubblewrap's on the host kernel (no engine, no image); "
            "the agent sees the host's /usr read-only.",
            "/tmp and HOME are capped in size, not in inodes.",
            "No /sys inside: the host's would list the host's network interfaces.",
        ]
        for e in (support.cpu, support.memory, support.pids):
            if not e.enforced:
                notes.append(f"{e.resource} is not limited: {e.reason}")
            elif not e.exact:
                notes.append(f"{e.resource} is approximated by {e.how}: {e.reason}")
        return Capabilities(walls=self.WALLS, layer2=True, limits=enforced, live_update=True, notes=tuple(notes))

    def versions(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "bwrap": ".".join(map(str, bwrap_version())),
            "kernel": platform.release(),
            "python3": os.path.realpath("/usr/bin/python3"),
            "limits": self.limit_support().mode,
        }

    # -- images ------------------------------------------------------------------------------
    def images(self) -> LocalImages:
        return LocalImages()

    def image_id(self, image: str) -> str:
        st = os.stat("/usr/bin/python3")
        return f"host:{bwrap_version()}:{st.st_ino}:{st.st_mtime_ns}"

    # -- registry ----------------------------------------------------------------------------
    def _dir(self, handle: str) -> Path:
        if not handle or "/" in handle or handle.startswith("."):
            raise SandboxError(f"not a local sandbox id: {handle!r}")
        return Path(self.settings.state_dir) / "local" / handle

    def _meta(self, handle: str) -> dict[str, Any]:
        try:
            meta: dict[str, Any] = json.loads((self._dir(handle) / "meta.json").read_text())
        except (OSError, ValueError):
            return {}
        return meta

    def _write_meta(self, handle: str, meta: dict[str, Any]) -> None:
        path = self._dir(handle) / "meta.json"
        tmp = path.with_name(f".meta-{os.getpid()}-{threading.get_ident()}")
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, path)

    def _status_lines(self, handle: str) -> dict[str, int]:
        out: dict[str, int] = {}
        with contextlib.suppress(OSError):
            for line in (self._dir(handle) / "status.json").read_text().splitlines():
                with contextlib.suppress(ValueError):
                    out.update({k: int(v) for k, v in json.loads(line).items() if isinstance(v, int)})
        return out

    def _handle_limits(self, meta: dict[str, Any]) -> Any:
        from sandman.backends.local_limits import LimitHandle

        return LimitHandle(
            meta["id"], self.limit_support(), dirs=dict(meta.get("cgroups") or {}), rlimits={}, pids_added=[]
        )

    # -- one sandbox -------------------------------------------------------------------------
    def _filter(self, profile: str) -> bytes:
        from sandman.backends import local_seccomp

        key = hashlib.sha256(profile.encode()).hexdigest()
        if key not in self._filters:
            self._filters[key] = local_seccomp.compile_profile(json.loads(profile))
        return self._filters[key]

    def create(self, spec: ContainerSpec) -> str:
        if spec.uid == 0:
            raise ValueError("the sandbox never runs as uid 0")
        if os.geteuid() not in (0, spec.uid):
            raise SandboxError(
                f"the local backend runs the sandbox as the workspace owner (uid {spec.uid}), and sandman runs "
                f"as uid {os.geteuid()}: run sandman as the workspace owner or as root"
            )
        for path in (Path(spec.workspace), Path(spec.runtime_dir) / "control"):
            blocked = _traversable(path, spec.uid, spec.gid)
            if blocked is not None and blocked != path:
                raise SandboxError(
                    f"the local backend runs the sandbox as uid {spec.uid}, which cannot reach {path}: "
                    f"{blocked} is not searchable by it (mode {blocked.stat().st_mode & 0o777:o}); "
                    "move the workspace, or let that uid search the directory (chmod o+x)"
                )
        handle = spec.session_id
        d = self._dir(handle)
        d.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            raise SandboxError(f"a local sandbox {handle} exists already") from None
        etc = make_etc(Path(self.settings.runtime_dir), spec.uid, spec.gid)
        one_shot = spec.kind in ("sandbox", "probe")
        tools = make_tools(Path(self.settings.runtime_dir))
        argv = outer_argv(spec, str(etc), die_with_parent=one_shot, tools_dir=str(tools))
        cgroups: dict[str, str] = {}
        rlimits: dict[str, int] = {}
        res = spec.resources
        try:
            from sandman.backends.local_limits import HostLimits

            self._limits = self._limits or HostLimits()
            lim = self._limits.apply(handle, cpus=res.cpus, memory=res.memory, pids=res.pids)
            cgroups = dict(lim.dirs)
            rlimits = {str(k): v for k, v in lim.rlimits.items()}
        except Exception as exc:
            shutil.rmtree(d, ignore_errors=True)
            raise SandboxError(f"the local backend could not set up limits: {exc}") from None
        labels = {
            **spec.extra_labels,
            **labels_for(spec.session_id, spec.campaign, spec.kind, spec.state_id),
            LABEL_BACKEND: self.name,
        }
        fsize = min(res.max_file_size, res.workspace_quota * 3 // 2) if res.workspace_quota else res.max_file_size
        self._write_meta(
            handle,
            {
                "id": handle,
                "labels": labels,
                "argv": argv,
                "uid": spec.uid,
                "gid": spec.gid,
                "cgroups": cgroups,
                "rlimits": rlimits,
                "ulimits": {"fsize": fsize, "nofile": res.open_files},
                "profile": hashlib.sha256(spec.seccomp_profile.encode()).hexdigest(),
                "one_shot": one_shot,
                "pid": 0,
                "start": None,
            },
        )
        (d / "seccomp.bpf").write_bytes(self._filter(spec.seccomp_profile))
        with self._lock:
            self._procs[handle] = _Proc()
        return handle

    def attach(self, handle: str) -> Frames:
        with self._lock:
            proc = self._procs.setdefault(handle, _Proc())
            proc.attached = True
        return self._frames(proc)

    def _frames(self, proc: _Proc) -> Frames:
        proc.started.wait()
        popen = proc.popen
        if popen is None or popen.stdout is None or popen.stderr is None:
            return
        sel = selectors.DefaultSelector()
        sel.register(popen.stdout, selectors.EVENT_READ, 1)
        sel.register(popen.stderr, selectors.EVENT_READ, 2)
        open_streams = 2
        try:
            while open_streams:
                for key, _ in sel.select():
                    data = os.read(key.fileobj.fileno(), 1 << 16)  # type: ignore[union-attr]
                    if not data:
                        sel.unregister(key.fileobj)
                        open_streams -= 1
                        continue
                    yield (data, None) if key.data == 1 else (None, data)
        finally:
            sel.close()

    def start(self, handle: str) -> None:
        meta = self._meta(handle)
        if not meta:
            raise SandboxError(f"no local sandbox {handle}")
        with self._lock:
            proc = self._procs.setdefault(handle, _Proc())
        d = self._dir(handle)
        lim = self._handle_limits(meta)
        rlimits = {int(k): v for k, v in (meta.get("rlimits") or {}).items()}
        ulimits = meta["ulimits"]
        uid, gid = int(meta["uid"]), int(meta["gid"])
        drop = os.geteuid() == 0

        def preexec() -> None:
            for procs in lim._procs_files():
                with open(procs, "w") as f:
                    f.write("0")
            for res_id, value in rlimits.items():
                resource.setrlimit(res_id, (value, value))
            resource.setrlimit(resource.RLIMIT_FSIZE, (ulimits["fsize"], ulimits["fsize"]))
            resource.setrlimit(resource.RLIMIT_NOFILE, (ulimits["nofile"], ulimits["nofile"]))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            resource.setrlimit(resource.RLIMIT_MSGQUEUE, (0, 0))  # counted per host uid: none
            if drop:
                os.setgroups([])
                os.setresgid(gid, gid, gid)
                os.setresuid(uid, uid, uid)
            # Above every number in play first, so neither dup2 can overwrite the other's source.
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 64) for fd in (seccomp_fd, status_fd)]
            os.dup2(high[0], SECCOMP_FD, inheritable=True)
            os.dup2(high[1], STATUS_FD, inheritable=True)

        seccomp_fd = os.open(d / "seccomp.bpf", os.O_RDONLY | os.O_CLOEXEC)
        status_fd = os.open(d / "status.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        log = None
        try:
            if proc.attached:
                out: Any = subprocess.PIPE
                err: Any = subprocess.PIPE
            else:
                log = open(d / "log", "ab")  # noqa: SIM115 - handed to the child, closed below
                out = err = log
            try:
                popen = subprocess.Popen(
                    meta["argv"],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    preexec_fn=preexec,
                    pass_fds=(SECCOMP_FD, STATUS_FD),  # kept open (as dup2'd above) when the rest close
                    start_new_session=True,
                    close_fds=True,
                    cwd="/",
                    env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
                )
            except OSError as exc:
                raise SandboxError(f"the local backend could not start bubblewrap: {exc}") from None
        finally:
            os.close(seccomp_fd)
            os.close(status_fd)
            if log is not None:
                log.close()
        proc.popen = popen
        meta["pid"] = popen.pid
        meta["start"] = _start_time(popen.pid)
        self._write_meta(handle, meta)
        proc.started.set()

    def wait(self, handle: str) -> int:
        proc = self._procs.get(handle)
        if proc is not None and proc.popen is not None:
            code = proc.popen.wait()
            return code if code >= 0 else 128 - code
        while self.status(handle).running:
            time.sleep(0.05)
        return self.status(handle).exit_code or 0

    def _alive(self, meta: dict[str, Any]) -> bool:
        pid = int(meta.get("pid") or 0)
        return bool(pid) and meta.get("start") is not None and _start_time(pid) == meta.get("start")

    def status(self, handle: str) -> Status:
        meta = self._meta(handle)
        if not meta:
            return Status(running=False)
        proc = self._procs.get(handle)
        if proc is not None and proc.popen is not None:
            code = proc.popen.poll()
            running = code is None
            exit_code = None if code is None else (code if code >= 0 else 128 - code)
        else:
            running = self._alive(meta)
            exit_code = None if running else self._status_lines(handle).get("exit-code")
        oom = False
        if meta.get("cgroups"):
            with contextlib.suppress(Exception):
                oom = self._handle_limits(meta).stats().get("oom_kills", 0) > 0
        return Status(
            running=running, exit_code=exit_code, oom_killed=oom, pid=int(meta.get("pid") or 0) if running else 0
        )

    def logs(self, handle: str, tail: int = 20) -> str:
        try:
            data = (self._dir(handle) / "log").read_bytes()[-65536:]
        except OSError:
            return ""
        return "\n".join(data.decode(errors="replace").splitlines()[-tail:])

    def kill(self, handle: str) -> None:
        meta = self._meta(handle)
        if not meta:
            return
        if meta.get("cgroups"):
            with contextlib.suppress(Exception):
                self._handle_limits(meta).kill_all()
        child = self._status_lines(handle).get("child-pid")
        proc = self._procs.get(handle)
        if proc is not None and proc.popen is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.popen.kill()
        elif self._alive(meta):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(meta["pid"]), signal.SIGKILL)
        if child and self._alive(meta):
            # pid 1 of the sandbox's PID namespace: the kernel takes every other process with it.
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)

    def remove(self, handle: str) -> None:
        meta = self._meta(handle)
        self.kill(handle)
        proc = self._procs.pop(handle, None)
        if proc is not None and proc.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(10)
        if meta.get("cgroups"):
            with contextlib.suppress(Exception):
                self._handle_limits(meta).remove()
        shutil.rmtree(self._dir(handle), ignore_errors=True)

    def update_limits(
        self, handle: str, *, cpus: float | None = None, memory: int | None = None, pids: int | None = None
    ) -> None:
        meta = self._meta(handle)
        if not meta:
            raise UsageError(f"no local sandbox {handle}")
        if not meta.get("cgroups"):
            raise UsageError(
                "the local backend limits this sandbox with rlimits, which cannot change for a running "
                "process tree: start a new session with the new limits"
            )
        try:
            self._handle_limits(meta).update(cpus=cpus, memory=memory, pids=pids)
        except OSError as exc:
            raise UsageError(f"the kernel refused the new limits: {exc}") from None

    def list(self, state_id: str) -> list[Listed]:
        root = Path(self.settings.state_dir) / "local"
        found = []
        if root.is_dir():
            for d in sorted(root.iterdir()):
                meta = self._meta(d.name)
                labels = meta.get("labels") or {}
                if labels.get(LABEL_STATE) == state_id and LABEL_SESSION in labels:
                    found.append(Listed(d.name, labels, self.status(d.name).running))
        return found

    def counters(self, handle: str) -> Any:
        from sandman.backends.causes import CgroupWatch

        watch = CgroupWatch(0)
        cg = self._meta(handle).get("cgroups") or {}
        if "pids" in cg:
            watch.pids_events = Path(cg["pids"]) / "pids.events"
        if "memory" in cg:
            mem = Path(cg["memory"])
            watch.memory_files = [
                (mem / "memory.oom_control", "oom_kill")
                if (mem / "memory.oom_control").exists()
                else (mem / "memory.events", "oom_kill")
            ]
        return watch


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2 :].split()[19].decode()


def _as_nobody_kwargs() -> dict[str, Any]:
    """The availability probe runs as nobody when sandman is root (root's bwrap proves nothing)."""
    if os.geteuid() != 0:
        return {}
    return {"user": 65534, "group": 65534, "extra_groups": [], "cwd": "/"}


if sys.platform != "linux":  # pragma: no cover
    raise ImportError("the local backend needs Linux")
