"""The local backend's seccomp compiler: Docker-format profile -> classic BPF -> bwrap --seccomp.

The bwrap tests run for real on the host and carry their own positive controls: each refused
probe succeeds without the filter, and the allowed probe succeeds with it.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from sandman import resources
from sandman.policy.seccomp import Relaxation, build_profile
from tests.conftest import skip_unless

try:
    from sandman.backends import local_seccomp as ls

    ls.binding_name()
    HAVE_BINDING = True
except ImportError:
    HAVE_BINDING = False

pytestmark = skip_unless(HAVE_BINDING, "no libseccomp binding: pip install pyseccomp==0.1.2")

BWRAP = shutil.which("bwrap")
needs_bwrap = skip_unless(BWRAP is not None, "bubblewrap (bwrap) is not installed")
X86_64 = platform.machine() == "x86_64"


def _profile() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(resources.seccomp_profile_path().read_text())
    return data


# --- compiling -----------------------------------------------------------------------------


def test_shipped_profile_compiles_to_a_sock_filter_array() -> None:
    report = ls.compile_profile_report(_profile())
    assert report.bpf and len(report.bpf) % 8 == 0
    assert 100 < report.instructions <= 4096
    assert report.unknown_syscalls == ()  # libseccomp knows every name the profile uses
    if X86_64:
        assert report.arches == ("SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32")
    assert ls.compile_profile(_profile()) == report.bpf  # deterministic


def test_the_filter_checks_the_architecture_first() -> None:
    # struct sock_filter {u16 code; u8 jt; u8 jf; u32 k}: libseccomp starts by loading
    # seccomp_data.arch (offset 4): BPF_LD|BPF_W|BPF_ABS = 0x20.
    bpf = ls.compile_profile(_profile())
    code, k = int.from_bytes(bpf[0:2], sys.byteorder), int.from_bytes(bpf[4:8], sys.byteorder)
    assert (code, k) == (0x20, 4)


def test_cross_compiles_for_the_other_arch_of_the_arch_map() -> None:
    other = "aarch64" if X86_64 else "x86_64"
    report = ls.compile_profile_report(_profile(), other)
    assert report.bpf != ls.compile_profile(_profile())
    assert report.arches[0] == ls._norm_arch(other)


def test_dropping_the_layer1_relaxations_changes_the_program() -> None:
    strict = build_profile(without=frozenset(Relaxation))
    assert ls.compile_profile(strict) != ls.compile_profile(_profile())


def test_rules_are_filtered_by_arch_and_caps_like_docker() -> None:
    base = _profile()
    want = ls.compile_profile(base)
    for extra in (
        {"names": ["bpf"], "action": "SCMP_ACT_ALLOW", "includes": {"caps": ["CAP_SYS_ADMIN"]}},
        {"names": ["bpf"], "action": "SCMP_ACT_ALLOW", "includes": {"arches": ["s390x"]}},
        {"names": ["bpf"], "action": "SCMP_ACT_ALLOW", "excludes": {"arches": ["amd64", "arm64"]}},
        {"names": ["bpf"], "action": "SCMP_ACT_ERRNO", "args": []},  # same as the default: skipped
    ):
        p = copy.deepcopy(base)
        p["syscalls"].append(extra)
        assert ls.compile_profile(p) == want, extra
    p = copy.deepcopy(base)
    p["syscalls"].append({"names": ["bpf"], "action": "SCMP_ACT_ALLOW", "excludes": {"caps": ["CAP_SYS_ADMIN"]}})
    assert ls.compile_profile(p) != want  # no capability is held: the rule applies


def test_unknown_syscall_names_are_skipped_and_reported() -> None:
    p = _profile()
    p["syscalls"].append({"names": ["no_such_syscall_x"], "action": "SCMP_ACT_ALLOW", "args": []})
    report = ls.compile_profile_report(p)
    assert report.unknown_syscalls == ("no_such_syscall_x",)
    assert report.bpf == ls.compile_profile(_profile())


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: p.update(defaultAction="SCMP_ACT_KILL_PROCESS"), "unsupported action"),
        (lambda p: p["syscalls"].append({"names": ["read"], "action": "SCMP_ACT_LOG"}), "unsupported action"),
        (lambda p: p["syscalls"].append({"names": ["read"], "action": "SCMP_ACT_TRACE"}), "unsupported action"),
        (
            lambda p: p["syscalls"].append(
                {"names": ["read"], "action": "SCMP_ACT_ALLOW", "args": [{"index": 0, "value": 1, "op": "SCMP_CMP_GT"}]}
            ),
            "unsupported op",
        ),
        (
            lambda p: p["syscalls"].append(
                {
                    "names": ["read"],
                    "action": "SCMP_ACT_ALLOW",
                    "args": [
                        {"index": 0, "value": 1, "op": "SCMP_CMP_EQ"},
                        {"index": 0, "value": 2, "op": "SCMP_CMP_EQ"},
                    ],
                }
            ),
            "two comparisons on argument 0",
        ),
        (
            lambda p: p["syscalls"].append(
                {"names": ["read"], "action": "SCMP_ACT_ALLOW", "args": [{"index": 6, "value": 1, "op": "SCMP_CMP_EQ"}]}
            ),
            "index",
        ),
        (
            lambda p: p["syscalls"].append(
                {"names": ["read"], "action": "SCMP_ACT_ALLOW", "includes": {"minKernel": "4.8"}}
            ),
            "minKernel",
        ),
        (lambda p: p["syscalls"].append({"name": "read", "action": "SCMP_ACT_ALLOW"}), "'name'"),
        (lambda p: p.update(flags=["SECCOMP_FILTER_FLAG_LOG"]), "flags"),
        (lambda p: p.update(listenerPath="/run/x.sock"), "listenerPath"),
        (lambda p: p["archMap"].append({"architecture": "SCMP_ARCH_MIPS"}), "unknown architecture"),
        (lambda p: p["syscalls"].append({"names": ["read"], "action": "SCMP_ACT_ERRNO", "errnoRet": 0}), "errnoRet"),
        (lambda p: p["syscalls"].append({"names": ["read"], "action": "SCMP_ACT_ALLOW", "errnoRet": 1}), "errnoRet"),
    ],
)
def test_what_the_profile_does_not_use_is_refused_clearly(mutate: Any, message: str) -> None:
    p = _profile()
    mutate(p)
    with pytest.raises(ls.ProfileError, match=message):
        ls.compile_profile(p)


def test_an_impostor_seccomp_module_is_not_taken_for_libseccomp(monkeypatch: pytest.MonkeyPatch) -> None:
    # Any directory named "seccomp" on sys.path imports as an empty namespace package.
    import types

    monkeypatch.setitem(sys.modules, "seccomp", types.ModuleType("seccomp"))
    assert ls.binding_name() == "pyseccomp"
    assert ls.compile_profile(_profile())


def test_unknown_target_arch_is_refused() -> None:
    with pytest.raises(ls.ProfileError, match="unsupported architecture"):
        ls.compile_profile(_profile(), "vax")


def test_write_filter_fd_is_sealed_and_rewound() -> None:
    bpf = ls.compile_profile(_profile())
    fd = ls.write_filter_fd(bpf)
    try:
        assert os.read(fd, len(bpf) + 1) == bpf
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"\0" * 8, 0)
    finally:
        os.close(fd)


# --- for real, under bubblewrap -----------------------------------------------------------

PROBE = textwrap.dedent(
    """
    import ctypes, json, os, platform
    NR = {  # syscall numbers per machine: fallocate, personality, ftruncate
        "x86_64": (285, 135, 77),
        "aarch64": (47, 92, 46),
    }[platform.machine()]
    libc = ctypes.CDLL(None, use_errno=True)

    def call(nr, *args):
        ret = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
        return 0 if ret >= 0 else ctypes.get_errno()

    fd = os.open("/tmp/probe", os.O_CREAT | os.O_RDWR, 0o600)
    out = {
        "fallocate": call(NR[0], fd, 0, 0, 4096),     # profile: SCMP_ACT_ERRNO, errnoRet 95
        "personality": call(NR[1], 0x1234),           # not an allowed value: default EPERM
        "ftruncate": call(NR[2], fd, 4096),           # allowed
        "status": {k: v.strip() for k, _, v in (l.partition(":") for l in open("/proc/self/status"))
                   if k in ("NoNewPrivs", "Seccomp", "Seccomp_filters")},
    }
    print(json.dumps(out))
    """
)


def _run(tmp_path: Path, bpf: bytes | None) -> dict[str, Any]:
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    argv = [
        str(BWRAP),
        "--ro-bind", "/usr", "/usr",
        "--symlink", "usr/bin", "/bin",
        "--symlink", "usr/lib", "/lib",
        "--symlink", "usr/lib64", "/lib64",
        "--ro-bind", str(probe), "/probe.py",
        "--proc", "/proc",
        "--dev", "/dev",
        "--tmpfs", "/tmp",
        "--unshare-all",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
    ]  # fmt: skip
    pass_fds: tuple[int, ...] = ()
    fd = -1
    if bpf is not None:
        fd = ls.write_filter_fd(bpf)
        os.set_inheritable(fd, True)
        argv += ["--seccomp", str(fd)]
        pass_fds = (fd,)
    argv += ["--", "/usr/bin/python3", "-I", "/probe.py"]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, pass_fds=pass_fds)
    finally:
        if fd >= 0:
            os.close(fd)
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


needs_known_machine = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "aarch64"), reason="probe syscall numbers for x86_64/aarch64 only"
)


@needs_bwrap
@needs_known_machine
def test_bwrap_without_the_filter_runs_every_probe(tmp_path: Path) -> None:
    out = _run(tmp_path, None)
    assert out["fallocate"] == 0 and out["personality"] == 0 and out["ftruncate"] == 0
    assert out["status"]["Seccomp"] == "0"


@needs_bwrap
@needs_known_machine
def test_bwrap_with_the_filter_refuses_what_the_profile_refuses(tmp_path: Path) -> None:
    out = _run(tmp_path, ls.compile_profile(_profile()))
    assert out["ftruncate"] == 0  # allowed: the filter is not just refusing everything
    assert out["fallocate"] == 95  # EOPNOTSUPP, the rule's errnoRet
    assert out["personality"] == 1  # EPERM, the profile's defaultErrnoRet
    assert out["status"] == {"NoNewPrivs": "1", "Seccomp": "2", "Seccomp_filters": "1"}


@needs_bwrap
@needs_known_machine
def test_bwrap_with_the_strict_profile(tmp_path: Path) -> None:
    """The local backend can drop layer 1's relaxations (bwrap's own setup is not filtered)."""
    out = _run(tmp_path, ls.compile_profile(build_profile(without=frozenset(Relaxation))))
    assert (out["ftruncate"], out["fallocate"], out["personality"]) == (0, 95, 1)
