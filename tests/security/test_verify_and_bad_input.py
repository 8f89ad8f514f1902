"""`sandman doctor --verify` on this host, and a table of hostile or broken inputs to every entry
point: each gets one clear line or works correctly, never a traceback, never a half-made sandbox."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import make_workspace, sandman, sandman_containers

pytestmark = pytest.mark.docker


def test_doctor_verify_passes_here_with_every_probe_and_control(
    engine: object, agent_image: str, cli_env: dict[str, str]
) -> None:
    res = sandman("doctor", "--verify", "--json", env=cli_env, timeout=300)
    report = json.loads(res.stdout)
    failed = [p["name"] for p in report["verify"]["probes"] if not (p["passed"] and p["control_passed"])]
    assert res.returncode == 0 and report["ok"] and not failed, failed
    assert len(report["verify"]["probes"]) >= 30
    assert report["verify"]["versions"]["engine"]
    text = sandman("doctor", "--verify", env=cli_env, timeout=300).stdout
    assert "probes passed with their controls" in text


def _no_traceback(res: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in res.stderr + res.stdout, res.stderr


@pytest.mark.parametrize(
    "name",
    ["with space", "new\nline", "ünïcödé-✓", "-starts-with-dash", "quote'and\"double", "$(touch pwned)"],
)
def test_odd_workspace_names_work(
    engine: object, agent_image: str, tmp_path: Path, cli_env: dict[str, str], name: str
) -> None:
    ws = make_workspace(tmp_path / name)
    res = sandman("run", "--workspace", str(ws), "--", "sh", "-c", "pwd; echo ok > out", env=cli_env)
    _no_traceback(res)
    assert res.returncode == 0 and res.stdout == "/workspace\n", res.stderr
    assert (ws / "out").read_text() == "ok\n"
    assert not (tmp_path / "pwned").exists()


def test_symlinked_workspace_root_and_a_mount_point(
    engine: object, agent_image: str, tmp_path: Path, cli_env: dict[str, str]
) -> None:
    real = make_workspace(tmp_path / "real")
    link = tmp_path / "link"
    link.symlink_to(real)
    res = sandman("run", "--workspace", str(link), "--", "sh", "-c", "echo via-link > f", env=cli_env)
    assert res.returncode == 0 and (real / "f").read_text() == "via-link\n", res.stderr
    mnt = make_workspace(tmp_path / "mnt")
    if os.geteuid() == 0:  # a workspace that is itself a mount point (a tmpfs here)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,uid=1000,gid=1000", "tmpfs", str(mnt)], check=True)
        try:
            res = sandman("run", "--workspace", str(mnt), "--", "sh", "-c", "echo on-mount > f", env=cli_env)
            assert res.returncode == 0 and (mnt / "f").read_text() == "on-mount\n", res.stderr
        finally:
            subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["run", "--cpus", "-1", "--", "true"], 2),
        (["run", "--cpus", "lots", "--", "true"], 2),
        (["run", "--pids", "3", "--", "true"], 2),
        (["run", "--timeout", "0", "--", "true"], 2),
        (["run", "--memory", "1k", "--", "true"], 2),
        (["run", "--memory", "99999999999999999999999g", "--", "true"], None),
        (["run", "--campaign", "../../etc", "--", "true"], 4),
        (["run", "--policy", "/dev/null/x", "--", "true"], 4),
        (["run", "--workspace", "/proc", "--", "true"], 3),
        (["run", "--workspace", "/etc/passwd", "--", "true"], 3),
        (["session", "exec", "sm-doesnotexist", "--", "true"], 6),
        (["session", "stop"], 2),
        (["session", "update", "sm-nope", "--memory", "1g"], 6),
        (["policy", "check", "/nonexistent.toml"], 4),
        (["scan", "/nonexistent"], 2),
        (["image", "build", "--workspace", "/nonexistent"], 3),
        (["audit", "--since", "yesterday-ish"], 2),
        (["no-such-command"], 2),
    ],
)
def test_bad_cli_arguments(
    engine: object, agent_image: str, workspace: Path, cli_env: dict[str, str], args: list[str], code: int | None
) -> None:
    if args[0] == "run" and "--workspace" not in args:
        args = [args[0], "--workspace", str(workspace), *args[1:]]
    before = {c["Id"] for c in sandman_containers(engine)}  # type: ignore[index]
    res = sandman(*args, env=cli_env, timeout=120)
    _no_traceback(res)
    assert res.returncode != 0 and (code is None or res.returncode == code), (args, res.returncode, res.stderr)
    assert res.stderr.strip(), args
    after = {c["Id"] for c in sandman_containers(engine)}  # type: ignore[index]
    assert not (after - before), "a half-made sandbox was left behind"


@pytest.mark.parametrize(
    "text",
    [
        "[resources\n",
        "[resources]\ncpus = 'many'\n",
        "[resources]\nmemory = -5\n",
        "[filesystem]\ndeny = '.env'\n",
        "[commands]\nallow = ['/usr/bin/rm']\n",
        "[commands.rules.git]\nblocked = ['']\n",
        "[environment]\npassthrough = ['LD_PRELOAD']\n",
        "[environment]\nallow = { 'BAD NAME' = 'x' }\n",
        "network = 'host'\n",
        "runtime = 'kata'\n",
        "[upcalls.helpers.unknown-helper]\n",
        "[upcalls.helpers.git-push]\nremote = 5\n",
        "\x00\x01binary",
        "[resources]\n" + "x = 1\n" * 10000,
    ],
)
def test_hostile_policy_files_get_one_line(
    engine: object, agent_image: str, workspace: Path, cli_env: dict[str, str], tmp_path: Path, text: str
) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text(text)
    res = sandman("run", "--workspace", str(workspace), "--policy", str(policy), "--", "true", env=cli_env)
    _no_traceback(res)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert (res.returncode in (2, 4) and len(lines) == 1 and str(policy) in lines[0]) or "upcalls" in lines[0], lines


@pytest.mark.parametrize(
    "text",
    [
        "apt_packages = 'jq'\n",
        "apt_packages = ['$(reboot)']\n",
        'env = { PATH = "a\\nb" }\n',
        "dockerfile_lines = ['FROM scratch']\n",
        "name = '../x'\n",
        "pip_packages = ['--index-url=http://x y']\n",
    ],
)
def test_hostile_image_toml_gets_one_line(
    engine: object, agent_image: str, workspace: Path, cli_env: dict[str, str], text: str
) -> None:
    (workspace / ".sandman").mkdir(exist_ok=True)
    (workspace / ".sandman" / "image.toml").write_text(text)
    res = sandman("run", "--workspace", str(workspace), "--", "true", env=cli_env)
    _no_traceback(res)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 4 and len(lines) == 1 and "image.toml" in lines[0], lines


def test_huge_argv_and_nul_bytes(engine: object, agent_image: str, workspace: Path, cli_env: dict[str, str]) -> None:
    big = ["x" * 1000] * 1000  # 1 MB of arguments: works, or a clear line
    res = sandman("run", "--workspace", str(workspace), "--", "sh", "-c", "echo $#", "sh", *big, env=cli_env)
    _no_traceback(res)
    assert (res.returncode == 0 and res.stdout.strip() == "1000") or len(res.stderr.strip().splitlines()) == 1
    from sandman.core.runner import Runner
    from sandman.errors import UsageError

    with pytest.raises(UsageError, match="NUL"):
        Runner().run(["echo", "a\x00b"], workspace)
