"""Policy that holds inside the sandbox: the command allowlist enforced by the kernel (Landlock's
execute right, applied by the exec shim) whatever spawns the program, and the environment rules
on every path (Python API, CLI, SandmanContainer), and one meaning of --policy."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandman.core.session import Sandbox
from sandman.policy import Policy
from sandman.policy.enforce import CommandRefused, landlock_abi
from sandman.settings import Settings
from tests.conftest import SANDMAN, make_workspace, skip_unless

pytestmark = skip_unless(landlock_abi() >= 1, "this kernel has no Landlock (doctor says so)")


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    tmp_path.chmod(0o755)
    return make_workspace(tmp_path / "ws")


def box(ws: Path, settings: Settings, allow: list[str]) -> Sandbox:
    return Sandbox(ws, settings=settings, policy=Policy.model_validate({"commands": {"allow": allow}}))


@pytest.fixture
def sh_python(engine: object, agent_image: str, ws: Path, settings: Settings) -> Iterator[Sandbox]:
    with box(ws, settings, ["sh", "python3", "find", "cp"]) as sb:
        yield sb


EXECV = "import os; os.execv('/usr/bin/git', ['git', '--version'])"
EXECV_PY = EXECV


@pytest.mark.parametrize(
    "script",
    [
        "git --version",
        f'python3 -c "{EXECV}"',
        "touch x 2>/dev/null || : > x; find . -name x -exec git --version \\;",
        # /tmp is noexec anyway: copy into the workspace, which is not
        "cp /usr/bin/git ./g && ./g --version",
        "python3 -c \"import shutil; shutil.copy('/usr/bin/git', 'g2')\" && chmod +x g2; ./g2 --version",
        # An anonymous memory file is outside every Landlock path rule: memfd_create is refused.
        "python3 -c \"import os; fd = os.memfd_create('x'); os.write(fd, open('/usr/bin/git', 'rb').read()); "
        "os.execve(f'/proc/self/fd/{fd}', ['git', '--version'], {})\"",
    ],
    ids=["shell", "python-execv", "find-exec", "copied-binary", "python-copy", "memfd"],
)
def test_a_program_outside_the_allowlist_cannot_run_whatever_spawns_it(sh_python: Sandbox, script: str) -> None:
    res = sh_python.exec(["sh", "-c", script])
    assert b"git version" not in res.stdout
    assert b"Permission denied" in res.stderr or b"PermissionError" in res.stderr, res.stderr


def test_the_execs_own_path_cannot_redefine_what_is_allowed(sh_python: Sandbox) -> None:
    # The red team's route: name git "sh" on a PATH of the agent's choosing, so resolving the
    # allowlist on that PATH allowed git. The shim resolves it on sandman's own PATH.
    sh_python.exec(
        ["python3", "-c", "import os; os.makedirs('bin', exist_ok=True); os.symlink('/usr/bin/git', 'bin/sh')"]
    )
    res = sh_python.exec(["python3", "-c", EXECV_PY], env={"PATH": "/workspace/bin:/usr/local/bin:/usr/bin:/bin"})
    assert b"git version" not in res.stdout and b"PermissionError" in res.stderr, res.stderr


def test_allowed_programs_and_builtins_still_run(sh_python: Sandbox) -> None:
    res = sh_python.exec(["sh", "-c", "echo ok; python3 -c 'print(6 * 7)'"])
    assert res.stdout == b"ok\n42\n", res.stderr


def test_positive_control_the_same_policy_with_git_allowed_runs_git(
    engine: object, agent_image: str, ws: Path, settings: Settings
) -> None:
    with box(ws, settings, ["sh", "python3", "git"]) as sb:
        res = sb.exec(["sh", "-c", f'git --version; python3 -c "{EXECV}"'])
    assert res.stdout.count(b"git version") == 2, res.stderr


def test_without_an_allowlist_nothing_is_restricted(
    engine: object, agent_image: str, ws: Path, settings: Settings
) -> None:
    with Sandbox(ws, settings=settings) as sb:
        res = sb.exec(["sh", "-c", "cp /usr/bin/true ./t && ./t && echo copied-ran"])
    assert res.stdout == b"copied-ran\n", res.stderr


# -- environment rules on every path ---------------------------------------------------------------
BAD_ENV = [
    ("AWS_SECRET_ACCESS_KEY", "AWS_*"),
    ("GH_TOKEN", "*_TOKEN"),
    ("SANDMAN_SESSION", "reserved"),
    ("LD_PRELOAD", "refuse_names"),
]


@pytest.mark.parametrize(("name", "rule"), BAD_ENV)
def test_per_exec_env_is_refused_through_the_python_api(
    engine: object, agent_image: str, ws: Path, settings: Settings, name: str, rule: str
) -> None:
    with Sandbox(ws, settings=settings) as sb:
        with pytest.raises(CommandRefused, match=re.escape(name) + ".*" + re.escape(rule)):
            sb.exec(["true"], env={name: "sm-value-1234567890"})
        assert sb.exec(["sh", "-c", "echo $FINE"], env={"FINE": "yes"}).stdout == b"yes\n"  # positive control
        events = [e for e in sb.state.events(session=sb.id) if e.event == "command.refused"]
        assert events and "sm-value" not in json.dumps([e.detail for e in events])


def test_per_exec_env_is_refused_through_the_cli(
    engine: object, agent_image: str, ws: Path, cli_env: dict[str, str]
) -> None:
    created = subprocess.run(
        [*SANDMAN, "session", "create", "-w", str(ws), "--json"], capture_output=True, text=True, env=cli_env
    )
    sid = json.loads(created.stdout)["session_id"]
    try:
        for name, rule in BAD_ENV[:3]:
            proc = subprocess.run(
                [*SANDMAN, "session", "exec", sid, "-e", f"{name}=sm-value", "--", "true"],
                capture_output=True,
                text=True,
                env=cli_env,
            )
            assert proc.returncode == 126, proc.stderr
            assert name in proc.stderr and rule.split("*")[0] in proc.stderr
        ok = subprocess.run(
            [*SANDMAN, "session", "exec", sid, "-e", "FINE=yes", "--", "sh", "-c", "echo $FINE"],
            capture_output=True,
            text=True,
            env=cli_env,
        )
        assert ok.stdout == "yes\n", ok.stderr
    finally:
        subprocess.run([*SANDMAN, "session", "stop", sid], capture_output=True, env=cli_env)


def test_per_exec_env_is_refused_through_sandman_container(
    engine: object, agent_image: str, ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from testcontainers.core.config import testcontainers_config

    from sandman.testing import SandmanContainer

    monkeypatch.setattr(testcontainers_config, "ryuk_disabled", True)  # no registry here: no reaper image

    with SandmanContainer(workspace=ws) as c:
        for name, rule in BAD_ENV[:3]:
            with pytest.raises(CommandRefused, match=re.escape(name) + ".*" + re.escape(rule)):
                c.exec(["true"], env={name: "sm-value"})
        assert c.exec(["sh", "-c", "echo $FINE"], env={"FINE": "yes"}).stdout == b"yes\n"


def test_policy_strict_means_the_same_in_run_and_session_create(ws: Path, cli_env: dict[str, str]) -> None:
    env = {**cli_env, "SANDMAN_IN_PROCESS": "1"}
    run = subprocess.run(
        [*SANDMAN, "run", "-w", str(ws), "--policy", "strict", "--", "sh", "-c", "cat /sys/fs/cgroup/pids/pids.max"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert run.returncode == 0 and run.stdout.strip() == "128", run.stderr
    created = subprocess.run(
        [*SANDMAN, "session", "create", "-w", str(ws), "--policy", "strict", "--json"],
        capture_output=True,
        text=True,
        env=cli_env,
    )
    sid = json.loads(created.stdout)["session_id"]
    try:
        pids = subprocess.run(
            [*SANDMAN, "session", "exec", sid, "--", "cat", "/sys/fs/cgroup/pids/pids.max"],
            capture_output=True,
            text=True,
            env=cli_env,
        )
        assert pids.stdout.strip() == "128", pids.stderr
    finally:
        subprocess.run([*SANDMAN, "session", "stop", sid], capture_output=True, env=cli_env)
    for argv in (
        ["run", "-w", str(ws), "--policy", "nosuch", "--", "true"],
        ["session", "create", "-w", str(ws), "--policy", "nosuch"],
    ):
        bad = subprocess.run([*SANDMAN, *argv], capture_output=True, text=True, env=env)
        assert bad.returncode == 4
        assert (
            "'nosuch' is neither a built-in policy (default, example, strict) nor an existing policy file" in bad.stderr
        )
