"""Layer 2: the bubblewrap argv, pinned on its exact output, and the probe's failure classifier."""

from __future__ import annotations

import pytest

from sandman.core.bwrap import BwrapSpec, ProbeFailure, base_env, bwrap_argv, classify_probe, guard_request, probe_fix


def test_bwrap_argv_exact_output() -> None:
    argv = bwrap_argv(BwrapSpec(command=["sh", "-c", "echo hi"], env={"HOME": "/home/agent", "PATH": "/usr/bin"}))
    assert argv == [
        "/usr/bin/bwrap",
        "--unshare-all", "--unshare-user", "--disable-userns", "--new-session", "--die-with-parent",
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
        "--bind", "/tmp", "/tmp",
        "--bind", "/home/agent", "/home/agent",
        "--bind", "/workspace", "/workspace",
        "--ro-bind-try", "/opt/sandman/tools", "/opt/sandman/tools",
        "--ro-bind-try", "/run/sandman/upcall", "/run/sandman/upcall",
        "--remount-ro", "/",
        "--chdir", "/workspace",
        "--setenv", "HOME", "/home/agent",
        "--setenv", "PATH", "/usr/bin",
        "--", "/usr/lib/sandman/sandbox-exec", "sh", "-c", "echo hi",
    ]  # fmt: skip


def test_command_words_cannot_become_bwrap_options() -> None:
    argv = bwrap_argv(BwrapSpec(command=["--bind", "/", "/"]))
    sep = argv.index("--")
    assert argv[sep + 1 :] == ["/usr/lib/sandman/sandbox-exec", "--bind", "/", "/"]


def test_base_env_inherits_nothing_from_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDMAN_TEST_SECRET", "hunter2")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    assert base_env() == {
        "PATH": "/opt/sandman/tools/bin:/usr/local/bin:/usr/bin:/bin",
        "HOME": "/home/agent",
        "LANG": "C.UTF-8",
        "TERM": "xterm-256color",
    }


@pytest.mark.parametrize(
    ("stderr", "expected"),
    [
        ("bwrap: setting up uid map: Operation not permitted", ProbeFailure.NO_USERNS),
        (
            "bwrap: No permissions to creating new namespace, likely because the kernel does not allow "
            "non-privileged user namespaces.",
            ProbeFailure.NO_USERNS,
        ),
        ("bwrap: Creating new namespace failed: Operation not permitted", ProbeFailure.NO_USERNS),
        ("bwrap: Can't mount proc on /newroot/proc: Operation not permitted", ProbeFailure.PROC_REFUSED),
        ("bwrap: Failed to make / slave: Permission denied", ProbeFailure.MOUNT_REFUSED),
        ("bwrap: pivot_root: Operation not permitted", ProbeFailure.MOUNT_REFUSED),
        ("bwrap: Unknown option --disable-userns", ProbeFailure.BWRAP_TOO_OLD),
        (
            'exec: "/usr/bin/bwrap": stat /usr/bin/bwrap: no such file or directory',
            ProbeFailure.BWRAP_MISSING,
        ),
        ("something else entirely", ProbeFailure.UNKNOWN),
    ],
)
def test_probe_failures_are_classified_with_a_fix(stderr: str, expected: ProbeFailure) -> None:
    assert classify_probe(1, stderr) is expected
    assert probe_fix(expected)


def test_probe_success_is_not_a_failure() -> None:
    assert classify_probe(0, "") is None


def test_masks_protected_paths_and_private_env_file() -> None:
    spec = BwrapSpec(
        command=["true"],
        env={"PATH": "/usr/bin"},
        masks=[("/workspace/.env", False), ("/workspace/.ssh", True)],
        read_only=["/workspace/.git/hooks"],
        pinned=["/workspace/.git"],
        env_file="/run/sandman/env/abc.env",
        ro_binds=(),
    )
    argv = bwrap_argv(spec)
    tail = argv[argv.index("/workspace") + 2 :]
    # Workspace paths are never bind sources by name: the launcher's descriptors, pinned first.
    assert tail == [
        "--bind", "/proc/self/fd/3", "/workspace/.git",
        "--ro-bind", "/proc/self/fd/4", "/workspace/.git/hooks",
        "--ro-bind", "/run/sandman/empty", "/workspace/.env",
        "--tmpfs", "/workspace/.ssh", "--remount-ro", "/workspace/.ssh",
        "--ro-bind", "/run/sandman/env/abc.env", "/run/sandman-env",
        "--remount-ro", "/",
        "--chdir", "/workspace",
        "--setenv", "PATH", "/usr/bin",
        "--setenv", "SANDMAN_ENV_FILE", "/run/sandman-env",
        "--setenv", "SANDMAN_GUARD", "@SANDMAN_GUARD@",
        "--", "/usr/lib/sandman/sandbox-exec", "true",
    ]  # fmt: skip
    assert guard_request(spec) == {
        "workspace": "/workspace",
        "open": [[".git", "rw"], [".git/hooks", "ro"]],
        "check": [[".env", "mask"], [".ssh", "mask"]],
    }


def test_private_tmp_and_home_are_the_execs_own_dirs() -> None:
    argv = bwrap_argv(BwrapSpec(command=["true"], tmp_source="/tmp/.x", home_source="/home/agent/.x"))
    assert argv[argv.index("/tmp") - 2 : argv.index("/tmp") + 1] == ["--bind", "/tmp/.x", "/tmp"]
    i = argv.index("/home/agent/.x")
    assert argv[i - 1 : i + 2] == ["--bind", "/home/agent/.x", "/home/agent"]
    assert "SANDMAN_GUARD" not in argv  # nothing guarded: nothing to check
