"""CPU, memory and process-count limits for a session's process tree on the host, without systemd.

The local backend has no container engine to set limits, so this module does it with cgroups
directly, detected at run time:

cgroup v1 (a controller per mount, e.g. /sys/fs/cgroup/memory): one directory per session and
controller, ``<controller mount>/<our own cgroup>/sandman/<session-id>``, with
memory.limit_in_bytes (+ memory.memsw.limit_in_bytes, so swap cannot stretch the cap),
pids.max, cpu.cfs_quota_us/cpu.cfs_period_us, and a freezer directory for kill_all.

cgroup v2 (one unified mount with the controllers): ``<our own cgroup>/sandman/<session-id>``
with memory.max (+ memory.swap.max 0), pids.max, cpu.max, killed with cgroup.kill. v2 forbids
enabling controllers for children of a cgroup that holds processes (except the root): a sandman
that runs inside a non-root cgroup with processes gets the reason, not a silent half-limit.

The session directories are created under sandman's *own* cgroup, not at the hierarchy root,
so whatever limit sandman itself runs under still bounds its sessions (a session moved to the
root would escape it); ``HostLimits(parent="/")`` asks for the root instead.

Without root (or with no writable hierarchy) the fallback is rlimits, set on each added process
(prlimit) or, race-free, in the child before exec (``handle.preexec``). They are approximations,
and ``probe()`` says so for each resource:
  memory: RLIMIT_AS caps each process's *virtual* address space, not the tree's resident memory
          (N processes may use N times the cap; runtimes that reserve address space early, such
          as Go, the JVM, V8, or sanitizers, can fail well below it);
  pids:   RLIMIT_NPROC counts every process of the *real uid* on the host, not the session's,
          and is not enforced for uid 0 or holders of CAP_SYS_ADMIN/CAP_SYS_RESOURCE;
  cpu:    not enforced (RLIMIT_CPU caps total CPU seconds per process, not a share of a CPU);
  kill_all: SIGKILL to the added processes only; the whole tree dies with them only when the
          added process is bwrap with --unshare-pid (its namespace dies with its init).

A process must be in the cgroup before it forks, or its early children escape: spawn with
``preexec_fn=handle.preexec`` (it joins in the child, before exec, and before any uid drop, as
the cgroup files belong to root), or call ``handle.add(pid)`` on a process that has not yet run.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import resource
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["Enforcement", "HostLimits", "LimitError", "LimitHandle", "LimitSupport"]

Mode = Literal["cgroup-v1", "cgroup-v2", "rlimit"]
RESOURCES = ("cpu", "memory", "pids")
CFS_PERIOD_US = 100_000
MIN_QUOTA_US = 1_000  # the kernel's floor for cfs_quota_us
_SESSION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_V1_CONTROLLERS = ("memory", "pids", "cpu", "freezer")
_V2_CONTROLLERS = ("memory", "pids", "cpu")


class LimitError(RuntimeError):
    """A limit could not be set up or changed."""


@dataclass(frozen=True)
class Enforcement:
    resource: str  # "cpu" | "memory" | "pids"
    enforced: bool
    how: str  # e.g. "cgroup v1 memory.limit_in_bytes + memory.memsw.limit_in_bytes"
    exact: bool  # a real per-session limit (cgroup), not an approximation (rlimit)
    reason: str = ""  # why not enforced, or the approximation's caveat


@dataclass(frozen=True)
class LimitSupport:
    mode: Mode
    cpu: Enforcement
    memory: Enforcement
    pids: Enforcement
    kill_all: str  # how kill_all reaches the tree
    notes: tuple[str, ...] = ()

    def get(self, name: str) -> Enforcement:
        return {"cpu": self.cpu, "memory": self.memory, "pids": self.pids}[name]

    def summary(self) -> str:
        lines = [f"mode: {self.mode}; kill_all: {self.kill_all}"]
        for e in (self.cpu, self.memory, self.pids):
            state = "enforced" if e.enforced and e.exact else "approximated" if e.enforced else "NOT enforced"
            lines.append(
                f"{e.resource}: {state}" + (f" by {e.how}" if e.how else "") + (f" ({e.reason})" if e.reason else "")
            )
        return "\n".join(lines + list(self.notes))


# --- discovery ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Mount:
    point: str
    root: str  # the hierarchy path mounted there ("/" unless inside a cgroup namespace)
    fstype: str  # "cgroup" | "cgroup2"
    options: frozenset[str]


def _unescape(field_: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field_)


def _mounts(mountinfo: str = "/proc/self/mountinfo") -> list[_Mount]:
    out = []
    with open(mountinfo, encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            lf, rf = left.split(), right.split()
            if len(lf) >= 5 and len(rf) >= 3 and rf[0] in ("cgroup", "cgroup2"):
                out.append(_Mount(_unescape(lf[4]), _unescape(lf[3]), rf[0], frozenset(rf[2].split(","))))
    return out


def _own_cgroups(path: str = "/proc/self/cgroup") -> dict[str, str]:
    """controller (v1) or "" (v2) -> this process's cgroup path in that hierarchy."""
    own: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            _, controllers, cg = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                own[c] = cg
    return own


def _join(mount: _Mount, cg_path: str) -> str:
    if mount.root != "/" and cg_path.startswith(mount.root):
        cg_path = cg_path[len(mount.root) :] or "/"
    return os.path.normpath(mount.point + "/" + cg_path.lstrip("/"))


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read().strip()


def _writable_dir(path: str) -> str | None:
    """None when a subdirectory can really be made (and removed) in ``path``; else why not."""
    probe = os.path.join(path, f".sandman-probe-{os.getpid()}")
    try:
        os.mkdir(probe)
    except OSError as exc:
        return f"cannot create a cgroup in {path}: {exc.strerror}"
    with contextlib.suppress(OSError):
        os.rmdir(probe)
    return None


# --- handles -----------------------------------------------------------------------------


@dataclass
class LimitHandle:
    """One session's limits. ``dirs``: controller -> cgroup directory (empty for rlimits)."""

    session_id: str
    support: LimitSupport
    dirs: dict[str, str] = field(default_factory=dict)
    rlimits: dict[int, int] = field(default_factory=dict)
    pids_added: list[int] = field(default_factory=list)

    # joining ------------------------------------------------------------------------------
    def _procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in dict.fromkeys(self.dirs.values())]

    def add(self, pid: int) -> None:
        """Put ``pid`` under the limits (before it forks: its earlier children are not moved)."""
        for procs in self._procs_files():
            _write(procs, str(pid))
        for res, value in self.rlimits.items():
            resource.prlimit(pid, res, (value, value))
        self.pids_added.append(pid)

    def preexec(self) -> None:
        """For ``subprocess.Popen(preexec_fn=...)``: join in the child, before exec (and before
        any uid drop). Async-signal-unsafe only in the way every preexec_fn is."""
        for procs in self._procs_files():
            _write(procs, "0")  # "0": the writing process itself
        for res, value in self.rlimits.items():
            resource.setrlimit(res, (value, value))

    # inspecting ---------------------------------------------------------------------------
    def pids(self) -> list[int]:
        """Every process under the limits now (cgroup) or the added ones still alive (rlimit)."""
        if not self.dirs:
            return [p for p in self.pids_added if _alive(p)]
        seen: set[int] = set()
        for procs in self._procs_files():
            with contextlib.suppress(FileNotFoundError):
                seen.update(int(x) for x in _read(procs).split())
        return sorted(seen)

    def stats(self) -> dict[str, int]:
        """What the kernel counted: memory peak and OOM kills, pids now and refused, CPU throttling."""
        out: dict[str, int] = {}
        mem, pids, cpu = self.dirs.get("memory"), self.dirs.get("pids"), self.dirs.get("cpu")
        if mem and self.support.mode == "cgroup-v1":
            out["memory_peak"] = int(_read(f"{mem}/memory.max_usage_in_bytes"))
            out["memory_failcnt"] = int(_read(f"{mem}/memory.failcnt"))
            out["oom_kills"] = _kv(f"{mem}/memory.oom_control").get("oom_kill", 0)
        elif mem:
            out["oom_kills"] = _kv(f"{mem}/memory.events").get("oom_kill", 0)
            with contextlib.suppress(FileNotFoundError):
                out["memory_peak"] = int(_read(f"{mem}/memory.peak"))
        if cpu:
            out["nr_throttled"] = _kv(f"{cpu}/cpu.stat").get("nr_throttled", 0)
        if pids:
            out["pids_current"] = int(_read(f"{pids}/pids.current"))
            out["pids_refused"] = _kv(f"{pids}/pids.events").get("max", 0)  # forks refused at pids.max
        return out

    # changing -----------------------------------------------------------------------------
    def update(self, cpus: float | None = None, memory: int | None = None, pids: int | None = None) -> None:
        """Change limits in place (cgroups); rlimits only reach processes added afterwards."""
        if self.support.mode == "rlimit":
            self.rlimits.update(_rlimits(self.support, memory, pids))
            for pid in self.pids():
                for res, value in _rlimits(self.support, memory, pids).items():
                    with contextlib.suppress(ProcessLookupError):
                        resource.prlimit(pid, res, (value, value))
            return
        v1 = self.support.mode == "cgroup-v1"
        if memory is not None and "memory" in self.dirs:
            (_set_memory_v1 if v1 else _set_memory_v2)(self.dirs["memory"], memory)
        if pids is not None and "pids" in self.dirs:
            _write(f"{self.dirs['pids']}/pids.max", str(int(pids)))
        if cpus is not None and "cpu" in self.dirs:
            (_set_cpu_v1 if v1 else _set_cpu_v2)(self.dirs["cpu"], cpus)

    def kill_all(self, timeout: float = 5.0) -> bool:
        """SIGKILL every process under the limits; True when none is left within ``timeout``."""
        deadline = time.monotonic() + timeout
        if not self.dirs:
            for pid in self.pids_added:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return _wait_gone(self.pids, deadline)
        if self.support.mode == "cgroup-v2":
            kill_file = f"{self.dirs['pids' if 'pids' in self.dirs else next(iter(self.dirs))]}/cgroup.kill"
            if os.path.exists(kill_file):
                _write(kill_file, "1")
                return _wait_gone(self.pids, deadline)
        freezer = self.dirs.get("freezer")
        if freezer:  # v1: freeze so nothing forks between listing and killing
            _write(f"{freezer}/freezer.state", "FROZEN")
            while _read(f"{freezer}/freezer.state") != "FROZEN" and time.monotonic() < deadline:
                time.sleep(0.005)
        try:
            while True:
                left = self.pids()
                for pid in left:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                if not left or time.monotonic() >= deadline:
                    break
                if freezer:
                    break  # all were frozen: the one sweep got them; thaw lets them die
                time.sleep(0.005)
        finally:
            if freezer:
                with contextlib.suppress(OSError):
                    _write(f"{freezer}/freezer.state", "THAWED")
        return _wait_gone(self.pids, deadline)

    def remove(self, timeout: float = 5.0) -> None:
        """Kill what is left and remove the session's cgroups (idempotent)."""
        if self.dirs and self.pids():
            self.kill_all(timeout)
        deadline = time.monotonic() + timeout
        for d in dict.fromkeys(self.dirs.values()):
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:  # EBUSY while exiting tasks are still being detached
                    if exc.errno != errno.EBUSY or time.monotonic() >= deadline:
                        raise LimitError(f"cannot remove {d}: {exc.strerror}") from exc
                    time.sleep(0.01)
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(d))  # the shared "sandman" dir, once no session uses it


def _kv(path: str) -> dict[str, int]:
    """A flat-keyed cgroup file ("key value" lines), integer values only."""
    out = {}
    for line in _read(path).splitlines():
        key, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            out[key] = int(value)
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is not alive for our purposes.
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _wait_gone(pids: Callable[[], list[int]], deadline: float) -> bool:
    while pids():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def _set_memory_v1(d: str, memory: int) -> None:
    limit, memsw = f"{d}/memory.limit_in_bytes", f"{d}/memory.memsw.limit_in_bytes"
    if not os.path.exists(memsw):
        _write(limit, str(int(memory)))
        return
    # memsw must stay >= the memory limit: raise memsw first when growing, last when shrinking.
    current = int(_read(limit))
    order = [(memsw, memory), (limit, memory)] if memory >= current else [(limit, memory), (memsw, memory)]
    for path, value in order:
        _write(path, str(int(value)))


def _set_memory_v2(d: str, memory: int) -> None:
    _write(f"{d}/memory.max", str(int(memory)))
    if os.path.exists(f"{d}/memory.swap.max"):
        _write(f"{d}/memory.swap.max", "0")


def _quota(cpus: float) -> int:
    if cpus <= 0:
        raise LimitError(f"cpus must be > 0, got {cpus}")
    return max(MIN_QUOTA_US, round(cpus * CFS_PERIOD_US))


def _set_cpu_v1(d: str, cpus: float) -> None:
    _write(f"{d}/cpu.cfs_period_us", str(CFS_PERIOD_US))
    _write(f"{d}/cpu.cfs_quota_us", str(_quota(cpus)))


def _set_cpu_v2(d: str, cpus: float) -> None:
    _write(f"{d}/cpu.max", f"{_quota(cpus)} {CFS_PERIOD_US}")


def _rlimits(support: LimitSupport, memory: int | None, pids: int | None) -> dict[int, int]:
    out = {}
    if memory is not None and support.memory.enforced:
        out[resource.RLIMIT_AS] = int(memory)
    if pids is not None and support.pids.enforced:
        out[resource.RLIMIT_NPROC] = int(pids)
    return out


# --- the entry point ---------------------------------------------------------------------


class HostLimits:
    """Finds what this host can enforce and applies it per session.

    ``parent``: the cgroup path (in each hierarchy) under which ``sandman/<session>`` is made;
    None means sandman's own cgroup. ``force_rlimits`` skips cgroups (tests, or by choice)."""

    NAME = "sandman"

    def __init__(self, parent: str | None = None, *, force_rlimits: bool = False) -> None:
        self.parent = parent
        self.force_rlimits = force_rlimits
        self._support: LimitSupport | None = None
        self._bases: dict[str, str] = {}  # controller -> the directory holding sandman/

    # probing ------------------------------------------------------------------------------
    def probe(self, refresh: bool = False) -> LimitSupport:
        if self._support is None or refresh:
            self._support = self._probe()
        return self._support

    def _base(self, mount: _Mount, own: str) -> str:
        return _join(mount, self.parent if self.parent is not None else own)

    def _probe(self) -> LimitSupport:
        why_not = "forced to rlimits" if self.force_rlimits else ""
        if not why_not:
            mounts, own = _mounts(), _own_cgroups()
            v1 = {c: m for m in mounts if m.fstype == "cgroup" for c in _V1_CONTROLLERS if c in m.options}
            v2 = next((m for m in mounts if m.fstype == "cgroup2"), None)
            if any(c in v1 for c in _V2_CONTROLLERS):
                support = self._probe_v1(v1, own)
            elif v2 is not None:
                support = self._probe_v2(v2, own.get("", "/"))
            else:
                support = None
                why_not = "no cgroup hierarchy is mounted"
            if support is not None:
                if any(support.get(r).enforced for r in RESOURCES):
                    return support
                why_not = "; ".join(dict.fromkeys(support.get(r).reason for r in RESOURCES))
        return self._probe_rlimits(why_not)

    def _probe_v1(self, v1: dict[str, _Mount], own: dict[str, str]) -> LimitSupport:
        files = {
            "memory": ("memory.limit_in_bytes", "cgroup v1 memory.limit_in_bytes"),
            "pids": ("pids.max", "cgroup v1 pids.max"),
            "cpu": ("cpu.cfs_quota_us", "cgroup v1 cpu.cfs_quota_us/cpu.cfs_period_us"),
        }
        ens: dict[str, Enforcement] = {}
        notes: list[str] = []
        for c in (*_V2_CONTROLLERS, "freezer"):
            if c not in v1:
                if c != "freezer":
                    ens[c] = Enforcement(c, False, "", False, f"the cgroup v1 {c} controller is not mounted")
                continue
            base = self._base(v1[c], own.get(c, "/"))
            problem = _writable_dir(base)
            if c == "freezer":
                if problem is None:
                    self._bases[c] = base
                continue
            if problem is None and c == "cpu" and not os.path.exists(os.path.join(base, files[c][0])):
                problem = "the kernel has no CFS bandwidth control (CONFIG_CFS_BANDWIDTH)"
            if problem:
                ens[c] = Enforcement(c, False, "", False, problem)
                continue
            self._bases[c] = base
            how = files[c][1]
            reason = ""
            if c == "memory":
                if os.path.exists(os.path.join(base, "memory.memsw.limit_in_bytes")):
                    how += " + memory.memsw.limit_in_bytes"
                else:
                    reason = "swap is not capped (no memory.memsw: the kernel lacks swap accounting)"
                notes.append("memory: an allocation over the cap OOM-kills one process of the session (v1)")
            ens[c] = Enforcement(c, True, how, True, reason)
        kill = (
            "freezer (FROZEN), SIGKILL to every pid in cgroup.procs, THAWED"
            if "freezer" in self._bases
            else "SIGKILL sweeps over cgroup.procs until empty (no freezer: a forking tree is chased)"
        )
        return LimitSupport("cgroup-v1", ens["cpu"], ens["memory"], ens["pids"], kill, tuple(notes))

    def _probe_v2(self, mount: _Mount, own: str) -> LimitSupport:
        base = self._base(mount, own)
        ens: dict[str, Enforcement] = {}
        try:
            available = set(_read(os.path.join(base, "cgroup.controllers")).split())
        except OSError as exc:
            available, problem = set(), f"cannot read {base}/cgroup.controllers: {exc.strerror}"
        else:
            problem = _writable_dir(base) or ""
        if not problem:
            wanted = [c for c in _V2_CONTROLLERS if c in available]
            try:
                if wanted:
                    _write(os.path.join(base, "cgroup.subtree_control"), " ".join("+" + c for c in wanted))
            except OSError as exc:
                problem = (
                    f"cannot enable {wanted} for children of {base} ({exc.strerror}): cgroup v2 allows "
                    "that only in a cgroup without processes; run sandman in its own delegated cgroup "
                    "and give it a parent= whose subtree it owns"
                )
        for c, how in (("memory", "memory.max + memory.swap.max=0"), ("pids", "pids.max"), ("cpu", "cpu.max")):
            if problem:
                ens[c] = Enforcement(c, False, "", False, problem)
            elif c not in available:
                ens[c] = Enforcement(c, False, "", False, f"the {c} controller is not available in {base}")
            else:
                self._bases[c] = base
                ens[c] = Enforcement(c, True, f"cgroup v2 {how}", True)
        if not problem:
            self._bases.setdefault("procs", base)
        kill = (
            "cgroup.kill"
            if os.path.exists(os.path.join(base, "cgroup.kill"))
            else "SIGKILL sweeps over cgroup.procs until empty (no cgroup.kill before Linux 5.14)"
        )
        return LimitSupport("cgroup-v2", ens["cpu"], ens["memory"], ens["pids"], kill)

    def _probe_rlimits(self, why: str) -> LimitSupport:
        prefix = f"no cgroups ({why}); " if why else ""
        root = os.getuid() == 0
        return LimitSupport(
            "rlimit",
            cpu=Enforcement(
                "cpu",
                False,
                "",
                False,
                prefix + "rlimits have no CPU share (RLIMIT_CPU caps total CPU seconds per process)",
            ),
            memory=Enforcement(
                "memory",
                True,
                "RLIMIT_AS per process",
                False,
                "approximation: caps each process's virtual address space, not the tree's memory; "
                "runtimes that reserve address space (Go, JVM, V8, sanitizers) may fail below it",
            ),
            pids=Enforcement(
                "pids",
                True,
                "RLIMIT_NPROC",
                False,
                "approximation: counts every process of the real uid on the host, not the session's"
                + ("; NOT enforced while the processes run as uid 0 (or hold CAP_SYS_RESOURCE)" if root else ""),
            ),
            kill_all="SIGKILL to the added pids (the whole tree only if that pid is bwrap with --unshare-pid)",
        )

    # applying -----------------------------------------------------------------------------
    def apply(
        self, session_id: str, cpus: float | None = None, memory: int | None = None, pids: int | None = None
    ) -> LimitHandle:
        """Create the session's limits (no process in them yet: ``add`` or ``preexec``)."""
        if not _SESSION_ID.match(session_id):
            raise LimitError(f"invalid session id {session_id!r}")
        support = self.probe()
        if support.mode == "rlimit":
            return LimitHandle(session_id, support, rlimits=_rlimits(support, memory, pids))
        dirs: dict[str, str] = {}
        try:
            if support.mode == "cgroup-v1":
                for c, base in self._bases.items():
                    if c == "freezer" or support.get(c).enforced:
                        dirs[c] = _mkdirs(os.path.join(base, self.NAME), session_id)
            else:
                base = self._bases["procs"]
                parent = os.path.join(base, self.NAME)
                os.makedirs(parent, exist_ok=True)
                ctl = [c for c in _V2_CONTROLLERS if support.get(c).enforced]
                _write(os.path.join(parent, "cgroup.subtree_control"), " ".join("+" + c for c in ctl))
                d = _mkdirs(parent, session_id)
                dirs = {c: d for c in ctl} | {"procs": d}
            handle = LimitHandle(session_id, support, dirs=dirs)
            handle.update(cpus=cpus, memory=memory, pids=pids)
        except OSError as exc:
            for d in dict.fromkeys(dirs.values()):
                with contextlib.suppress(OSError):
                    os.rmdir(d)
            raise LimitError(f"cannot set up limits for session {session_id!r}: {exc}") from exc
        return handle


def _mkdirs(parent: str, session_id: str) -> str:
    os.makedirs(parent, exist_ok=True)
    d = os.path.join(parent, session_id)
    try:
        os.mkdir(d)  # never reuse a leftover: its limits and members are unknown
    except FileExistsError:
        raise LimitError(f"{d} already exists: a session with this id is live, or was not removed") from None
    return d
