"""Layer-1 seccomp: the shipped file is exactly what the generator makes, and its shape is right."""

from __future__ import annotations

import json

from sandman import resources
from sandman.policy.seccomp import CLONE_NEWUSER, Relaxation, build_profile, render


def test_shipped_profile_matches_the_generator() -> None:
    shipped = resources.seccomp_profile_path().read_text()
    assert shipped == render(build_profile()), "run: python -m sandman.policy.seccomp > policies/seccomp/sandman.json"


def _rules(profile: dict, name: str) -> list[dict]:  # type: ignore[type-arg]
    return [r for r in profile["syscalls"] if name in r["names"]]


def test_default_is_deny_with_eperm() -> None:
    p = build_profile()
    assert p["defaultAction"] == "SCMP_ACT_ERRNO" and p["defaultErrnoRet"] == 1


def test_dangerous_syscalls_are_not_allowed() -> None:
    p = build_profile()
    allowed = {n for r in p["syscalls"] if r["action"] == "SCMP_ACT_ALLOW" and not r["args"] for n in r["names"]}
    for name in (
        "keyctl",
        "add_key",
        "bpf",
        "perf_event_open",
        "userfaultfd",
        "io_uring_setup",
        "kexec_load",
        "init_module",
        "finit_module",
        "open_by_handle_at",
        "setns",
        "reboot",
        "unshare",
        "clone",
        "clone3",
        "fsopen",
        "move_mount",
        "open_tree",
    ):
        assert name not in allowed, name


def test_user_namespace_relaxation_is_conditional_on_clone_newuser() -> None:
    p = build_profile()
    [clone_userns] = [r for r in _rules(p, "clone") if r["args"][0]["valueTwo"] == CLONE_NEWUSER]
    assert clone_userns["args"] == [
        {"index": 0, "value": CLONE_NEWUSER, "valueTwo": CLONE_NEWUSER, "op": "SCMP_CMP_MASKED_EQ"}
    ]
    [unshare] = _rules(p, "unshare")
    assert unshare["args"] == clone_userns["args"]
    [clone3] = _rules(p, "clone3")
    assert clone3["action"] == "SCMP_ACT_ERRNO" and clone3["errnoRet"] == 38  # ENOSYS: glibc falls back


def test_af_vsock_sockets_are_refused() -> None:
    [sock] = _rules(build_profile(), "socket")
    assert sock["args"] == [{"index": 0, "value": 40, "valueTwo": 0, "op": "SCMP_CMP_NE"}]


def test_each_relaxation_can_be_removed_alone() -> None:
    full = build_profile()
    for relaxation in Relaxation:
        less = build_profile(frozenset({relaxation}))
        assert len(less["syscalls"]) == len(full["syscalls"]) - 1, relaxation
    json.dumps(full)  # serialisable
