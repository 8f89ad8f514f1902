"""The local backend's syscall filter: a Docker-format seccomp profile compiled to classic BPF.

With no container engine there is no runc to turn ``policies/seccomp/sandman.json`` into a
filter, so this module does it, through libseccomp (the same library runc uses), never by
hand-assembled BPF. The result is what ``bwrap --seccomp FD`` reads: a bare array of
``struct sock_filter`` in native byte order, as ``seccomp_export_bpf(3)`` writes it. bubblewrap
sets NO_NEW_PRIVS and loads it right before it execs the command, so the filter binds the
command and everything it starts, not bubblewrap's own setup.

The binding: libseccomp's official Python module (``seccomp``, Debian's python3-seccomp) when it
is importable, else ``pyseccomp`` from PyPI, a ctypes binding to the system's libseccomp.so.2
with the same API. Both drive the same C library; only the C library compiles.

Supported, as Docker reads them, and exactly what sandman's profile needs (anything else is
refused with ProfileError, never silently dropped):
  top level: defaultAction, defaultErrnoRet, archMap, architectures, syscalls
  rules:     names, action, errnoRet, args, comment, includes/excludes by ``arches`` (Go names:
             amd64, arm64, ...) and ``caps`` (matched against ``caps``; the local backend runs
             with --cap-drop ALL, so by default no capability is held)
  actions:   SCMP_ACT_ALLOW, SCMP_ACT_ERRNO (errnoRet / defaultErrnoRet, EPERM when absent)
  args:      index, value, valueTwo, op in SCMP_CMP_EQ, SCMP_CMP_NE, SCMP_CMP_MASKED_EQ; at most
             one comparison per argument index within a rule
Refused: other actions (KILL*, TRAP, TRACE, LOG, NOTIFY), the LT/LE/GE/GT ops, repeated argument
indexes (Docker turns those into an OR, a trap), includes.minKernel, the legacy single ``name``,
top-level flags and listener settings.

Like Docker, a syscall name libseccomp does not know is skipped (it then gets the default
action); ``compile_profile_report`` lists them. Debian bookworm's libseccomp2 (2.5.4-1+deb12u1)
knows every name sandman's profile uses, up to futex_wake and map_shadow_stack (Linux 6.6-6.7).
"""

from __future__ import annotations

import errno as errno_mod
import fcntl
import importlib
import os
import platform
import tempfile
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BindingMissing",
    "CompiledProfile",
    "ProfileError",
    "binding_name",
    "compile_profile",
    "compile_profile_report",
    "write_filter_fd",
]


class ProfileError(ValueError):
    """The profile uses something this compiler does not support (or is malformed)."""


class BindingMissing(ImportError):
    """No libseccomp Python binding is importable."""


_INSTALL_HINT = (
    "no libseccomp Python binding: `pip install pyseccomp==0.1.2` (ctypes, needs the system "
    "library from the Debian package libseccomp2), or a Python that sees Debian's python3-seccomp"
)


_API = ("SyscallFilter", "Arg", "Arch", "Attr", "ALLOW", "ERRNO", "KILL_PROCESS", "EQ", "NE", "MASKED_EQ",
        "resolve_syscall", "system_arch")  # fmt: skip


def _binding() -> Any:
    """libseccomp's own module if importable *and* really it (any directory named ``seccomp`` on
    sys.path imports as an empty namespace package), else pyseccomp."""
    try:
        official = importlib.import_module("seccomp")  # Debian's python3-seccomp
        if all(hasattr(official, name) for name in _API):
            return official
    except ImportError:
        pass
    try:
        return importlib.import_module("pyseccomp")
    except (ImportError, RuntimeError) as exc:  # pyseccomp raises RuntimeError without libseccomp.so
        raise BindingMissing(f"{_INSTALL_HINT} ({exc})") from exc


def binding_name() -> str:
    """Which binding compiles: "seccomp" (libseccomp's own) or "pyseccomp"."""
    return str(_binding().__name__)


# Docker's SCMP_ARCH_* names -> the binding's Arch attribute, and the Go name Docker's
# ``includes.arches`` uses for it.
_ARCHES: dict[str, tuple[str, str]] = {
    "SCMP_ARCH_X86": ("X86", "386"),
    "SCMP_ARCH_X86_64": ("X86_64", "amd64"),
    "SCMP_ARCH_X32": ("X32", "x32"),
    "SCMP_ARCH_ARM": ("ARM", "arm"),
    "SCMP_ARCH_AARCH64": ("AARCH64", "arm64"),
    "SCMP_ARCH_PPC64LE": ("PPC64LE", "ppc64le"),
    "SCMP_ARCH_S390X": ("S390X", "s390x"),
    "SCMP_ARCH_RISCV64": ("RISCV64", "riscv64"),
}
_MACHINE_ALIASES = {
    "x86_64": "SCMP_ARCH_X86_64",
    "amd64": "SCMP_ARCH_X86_64",
    "aarch64": "SCMP_ARCH_AARCH64",
    "arm64": "SCMP_ARCH_AARCH64",
    "i386": "SCMP_ARCH_X86",
    "i686": "SCMP_ARCH_X86",
    "386": "SCMP_ARCH_X86",
    "armv7l": "SCMP_ARCH_ARM",
    "arm": "SCMP_ARCH_ARM",
    "ppc64le": "SCMP_ARCH_PPC64LE",
    "s390x": "SCMP_ARCH_S390X",
    "riscv64": "SCMP_ARCH_RISCV64",
}

_OPS = {"SCMP_CMP_EQ": "EQ", "SCMP_CMP_NE": "NE", "SCMP_CMP_MASKED_EQ": "MASKED_EQ"}
_ACTIONS = ("SCMP_ACT_ALLOW", "SCMP_ACT_ERRNO")
_TOP_KEYS = {"defaultAction", "defaultErrnoRet", "archMap", "architectures", "syscalls"}
_RULE_KEYS = {"names", "action", "errnoRet", "args", "comment", "includes", "excludes"}
_FILTER_KEYS = {"arches", "caps"}
_ARG_KEYS = {"index", "value", "valueTwo", "op"}
_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class CompiledProfile:
    bpf: bytes  # struct sock_filter[], native byte order: what `bwrap --seccomp FD` reads
    arch: str  # the target, e.g. SCMP_ARCH_X86_64
    arches: tuple[str, ...]  # every arch the filter accepts (target + archMap sub-architectures)
    unknown_syscalls: tuple[str, ...]  # names libseccomp does not know: skipped, as Docker does
    binding: str

    @property
    def instructions(self) -> int:
        return len(self.bpf) // 8


def _norm_arch(arch: str | None) -> str:
    name = platform.machine() if arch is None else arch
    if name in _ARCHES:
        return name
    if name.lower() in _MACHINE_ALIASES:
        return _MACHINE_ALIASES[name.lower()]
    raise ProfileError(f"unsupported architecture {name!r} (known: {', '.join(sorted(_ARCHES))})")


def _keys(where: str, obj: Any, allowed: set[str]) -> Mapping[str, Any]:
    if not isinstance(obj, Mapping):
        raise ProfileError(f"{where}: expected an object, got {type(obj).__name__}")
    extra = set(obj) - allowed
    if extra:
        raise ProfileError(f"{where}: unsupported key(s) {sorted(extra)} (supported: {sorted(allowed)})")
    return obj


def _int(where: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ProfileError(f"{where}: expected an integer in [{lo}, {hi}], got {value!r}")
    return value


def _action(sc: Any, where: str, name: Any, errno_ret: Any, default_errno: int) -> tuple[str, int, int]:
    """(action name, errno or 0, the binding's action value)."""
    if name not in _ACTIONS:
        raise ProfileError(f"{where}: unsupported action {name!r} (supported: {', '.join(_ACTIONS)})")
    if name == "SCMP_ACT_ALLOW":
        if errno_ret is not None:
            raise ProfileError(f"{where}: errnoRet given for SCMP_ACT_ALLOW")
        return name, 0, sc.ALLOW
    err = default_errno if errno_ret is None else _int(f"{where}.errnoRet", errno_ret, 1, 4095)
    return name, err, sc.ERRNO(err)


def _applies(where: str, rule: Mapping[str, Any], go_arch: str, caps: frozenset[str]) -> bool:
    """Docker's includes/excludes: arches against the target, caps against the held capabilities."""
    inc = _keys(f"{where}.includes", rule.get("includes") or {}, _FILTER_KEYS)
    exc = _keys(f"{where}.excludes", rule.get("excludes") or {}, _FILTER_KEYS)
    for part in (inc, exc):
        for key in ("arches", "caps"):
            if not isinstance(part.get(key, []), list):
                raise ProfileError(f"{where}: includes/excludes {key} must be a list")
    if inc.get("arches") and go_arch not in inc["arches"]:
        return False
    if inc.get("caps") and not all(c in caps for c in inc["caps"]):
        return False
    if exc.get("arches") and go_arch in exc["arches"]:
        return False
    return not (exc.get("caps") and any(c in caps for c in exc["caps"]))


def _args(sc: Any, where: str, raw: Any) -> list[Any]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ProfileError(f"{where}.args: expected a list")
    out, seen = [], set()
    for i, arg in enumerate(raw):
        a = _keys(f"{where}.args[{i}]", arg, _ARG_KEYS)
        index = _int(f"{where}.args[{i}].index", a.get("index"), 0, 5)
        if index in seen:
            raise ProfileError(
                f"{where}: two comparisons on argument {index} (Docker would OR them as separate rules): unsupported"
            )
        seen.add(index)
        op = a.get("op")
        if op not in _OPS:
            raise ProfileError(f"{where}.args[{i}]: unsupported op {op!r} (supported: {', '.join(_OPS)})")
        value = _int(f"{where}.args[{i}].value", a.get("value", 0), 0, _U64)
        value_two = _int(f"{where}.args[{i}].valueTwo", a.get("valueTwo", 0), 0, _U64)
        if op != "SCMP_CMP_MASKED_EQ" and value_two:
            raise ProfileError(f"{where}.args[{i}]: valueTwo is only meaningful with SCMP_CMP_MASKED_EQ")
        out.append(sc.Arg(index, getattr(sc, _OPS[op]), value, value_two))
    return out


def _resolve(sc: Any, name: str) -> int | None:
    """The native (or libseccomp pseudo-) number of ``name``; None when libseccomp does not know it."""
    try:
        num = sc.resolve_syscall(sc.Arch.NATIVE, name)
    except ValueError:  # the official binding raises; pyseccomp returns __NR_SCMP_ERROR (-1)
        return None
    return None if num == -1 else int(num)


def compile_profile_report(
    profile: Mapping[str, Any], arch: str | None = None, *, caps: Collection[str] = ()
) -> CompiledProfile:
    """Compile ``profile`` for ``arch`` (default: this machine's) and say what was skipped."""
    sc = _binding()
    top = _keys("profile", profile, _TOP_KEYS)
    target = _norm_arch(arch)
    go_arch = _ARCHES[target][1]
    held = frozenset(caps)

    if top.get("defaultAction") not in _ACTIONS:
        raise ProfileError(f"defaultAction: unsupported action {top.get('defaultAction')!r}")
    if "defaultErrnoRet" in top and top["defaultAction"] != "SCMP_ACT_ERRNO":
        raise ProfileError("defaultErrnoRet given but defaultAction is not SCMP_ACT_ERRNO")
    default_errno = _int("defaultErrnoRet", top.get("defaultErrnoRet", errno_mod.EPERM), 1, 4095)
    _, _, default = _action(sc, "defaultAction", top["defaultAction"], None, default_errno)

    arches = [target]
    arch_map = top.get("archMap") or []
    if not isinstance(arch_map, list):
        raise ProfileError("archMap: expected a list")
    for i, entry in enumerate(arch_map):
        e = _keys(f"archMap[{i}]", entry, {"architecture", "subArchitectures"})
        if e.get("architecture") not in _ARCHES:
            raise ProfileError(f"archMap[{i}]: unknown architecture {e.get('architecture')!r}")
        if e["architecture"] == target:
            arches += list(e.get("subArchitectures") or [])
    legacy = top.get("architectures") or []
    if not isinstance(legacy, list):
        raise ProfileError("architectures: expected a list")
    arches += legacy
    arches = list(dict.fromkeys(arches))
    for a in arches:
        if a not in _ARCHES:
            raise ProfileError(f"unknown architecture {a!r} (known: {', '.join(sorted(_ARCHES))})")

    f = sc.SyscallFilter(default)
    # A syscall made through an ABI the filter does not list never happens legitimately.
    f.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
    # The official binding's Arch values are signed, pyseccomp's unsigned: compare as u32.
    native = sc.system_arch() & 0xFFFFFFFF
    values = {a: getattr(sc.Arch, _ARCHES[a][0]) for a in arches}
    try:
        for value in values.values():
            if value & 0xFFFFFFFF != native:
                f.add_arch(value)
        if all(v & 0xFFFFFFFF != native for v in values.values()):
            f.remove_arch(sc.Arch.NATIVE)
    except (OSError, RuntimeError) as exc:  # the official binding raises RuntimeError
        raise ProfileError(f"libseccomp refused the architecture set {arches}: {exc}") from exc

    syscalls = top.get("syscalls") or []
    if not isinstance(syscalls, list):
        raise ProfileError("syscalls: expected a list")
    unknown: list[str] = []
    for i, raw_rule in enumerate(syscalls):
        where = f"syscalls[{i}]"
        rule = _keys(where, raw_rule, _RULE_KEYS)
        names = rule.get("names")
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise ProfileError(f"{where}.names: expected a non-empty list of syscall names")
        _, _, action = _action(sc, where, rule.get("action"), rule.get("errnoRet"), errno_mod.EPERM)
        args = _args(sc, where, rule.get("args"))
        if not _applies(where, rule, go_arch, held):
            continue
        if action == default:
            continue  # libseccomp refuses a rule whose action is the default's; runc skips it too
        for name in names:
            num = _resolve(sc, name)
            if num is None:
                unknown.append(name)
                continue
            try:
                f.add_rule(action, num, *args)
            except (OSError, RuntimeError) as exc:
                raise ProfileError(f"{where}: libseccomp refused the rule for {name!r}: {exc}") from exc

    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.flush()
        out.seek(0)
        bpf = out.read()
    if not bpf or len(bpf) % 8:
        raise ProfileError(f"libseccomp exported {len(bpf)} bytes: not a sock_filter array")
    if len(bpf) // 8 > 4096:  # BPF_MAXINSNS: the kernel would refuse to load it
        raise ProfileError(f"the filter has {len(bpf) // 8} instructions, above the kernel's 4096")
    return CompiledProfile(
        bpf=bpf,
        arch=target,
        arches=tuple(arches),
        unknown_syscalls=tuple(dict.fromkeys(unknown)),
        binding=str(sc.__name__),
    )


def compile_profile(profile: dict[str, Any], arch: str | None = None) -> bytes:
    """The classic BPF program (``struct sock_filter[]``) of a Docker-format seccomp profile.

    Feed it to bubblewrap on a descriptor: ``bwrap --seccomp 3 ... 3<file``."""
    return compile_profile_report(profile, arch).bpf


def write_filter_fd(bpf: bytes) -> int:
    """A close-on-exec memfd holding ``bpf``, sealed against change, at offset 0.

    Make it inheritable (or dup2 it to the number named in ``--seccomp N``) in the child that
    execs bubblewrap; bubblewrap reads it to the end."""
    fd = os.memfd_create("sandman-seccomp", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(bpf)
        while view:
            view = view[os.write(fd, view) :]
        seals = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd
