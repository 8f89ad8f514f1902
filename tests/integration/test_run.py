"""`sandman run` on a real engine with real bubblewrap: what the command sees, and what is left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import SANDMAN, sandman, sandman_containers, workspace_containers

pytestmark = pytest.mark.docker


def run_in(ws: Path, env: dict[str, str], *cmd: str, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return sandman("run", "--workspace", str(ws), *extra, "--", *cmd, env=env)


def test_must_show_identity_capabilities_seccomp_network_and_workspace_write(
    engine: object, agent_image: str, workspace: Path, cli_env: dict[str, str]
) -> None:
    script = 'id -u; grep -E "^Cap(Eff|Bnd)|NoNewPrivs|Seccomp:" /proc/self/status; ls /sys/class/net; echo ok > f'
    res = run_in(workspace, cli_env, "sh", "-c", script)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.split()
    assert lines[0] != "0" and int(lines[0]) == workspace.stat().st_uid
    status = dict(zip(lines[1:9:2], lines[2:9:2], strict=True))
    assert status == {"CapEff:": "0" * 16, "CapBnd:": "0" * 16, "NoNewPrivs:": "1", "Seccomp:": "2"}
    assert lines[9:] == ["lo"]
    assert (workspace / "f").read_text() == "ok\n"


def test_all_capability_sets_are_empty(
    engine: object, agent_image: str, workspace: Path, cli_env: dict[str, str]
) -> None:
    res = run_in(workspace, cli_env, "grep", "-E", "^Cap(Inh|Prm|Eff|Bnd|Amb):", "/proc/self/status")
    assert res.returncode == 0, res.stderr
    values = [line.split()[1] for line in res.stdout.splitlines()]
    assert len(values) == 5 and set(values) == {"0" * 16}


def test_rootfs_is_read_only_but_workspace_and_tmp_are_writable(
    engine: object, agent_image: str, workspace: Path, cli_env: dict[str, str]
) -> None:
    script = (
        "touch /usr/evil 2>/dev/null && echo usr-writable || echo usr-ro;"
        "touch /etc/evil 2>/dev/null && echo etc-writable || echo etc-ro;"
        "touch /workspace/good && echo ws-rw; touch /tmp/t && echo tmp-rw; touch $HOME/h && echo home-rw"
    )
    res = run_in(workspace, cli_env, "sh", "-c", script)
    assert res.stdout.split() == ["usr-ro", "etc-ro", "ws-rw", "tmp-rw", "home-rw"], res.stderr


def test_private_pid_namespace_hides_the_container_init(
    engine: object, agent_image: str, workspace: Path, cli_env: dict[str, str]
) -> None:
    res = run_in(workspace, cli_env, "sh", "-c", "cat /proc/[0-9]*/comm | sort -u; echo pid=$$")
    comms = res.stdout.split()
    assert "tini" not in comms  # the container's PID 1 is outside the agent's view
    assert "bwrap" in comms  # bwrap's own init is PID 1 of the agent's namespace
    assert int(res.stdout.split("pid=")[1]) <= 3


def test_controller_environment_never_reaches_the_sandbox(
    engine: object, agent_image: str, workspace: Path, cli_env: dict[str, str]
) -> None:
    secret = "sandman-test-secret-" + os.urandom(8).hex()
    env = {**cli_env, "SANDMAN_TEST_SECRET": secret, "AWS_SECRET_ACCESS_KEY": secret}
    # Positive control first: the same grep finds a value that IS in the sandbox environment.
    script = (
        f"cat /proc/[0-9]*/environ /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' '\\n' > /tmp/all;"
        f"grep -c 'HOME=/home/agent' /tmp/all; grep -c '{secret[:20]}' /tmp/all; env | grep -c SANDMAN_TEST || true"
    )
    res = run_in(workspace, env, "sh", "-c", script)
    counts = res.stdout.split()
    assert int(counts[0]) >= 1, res.stderr  # the probe can see environments
    # The secret's prefix appears once: in this very script's own cmdline. The full value never does.
    assert secret not in res.stdout
    assert counts[2] == "0"


def test_kernel_settings_cannot_be_opened_for_writing(
    engine: object, agent_image: str, workspace: Path, cli_env: dict[str, str]
) -> None:
    # Open for writing, then close: never write. Control: the same open works on a workspace file.
    probe = (
        "import os,sys\n"
        "for p in sys.argv[1:]:\n"
        "    try:\n"
        "        os.close(os.open(p, os.O_WRONLY)); print(p, 'OPENED')\n"
        "    except OSError as e:\n"
        "        print(p, 'refused', e.errno)\n"
    )
    control = workspace / "control"
    control.write_text("")
    os.chown(control, workspace.stat().st_uid, workspace.stat().st_gid)
    res = run_in(
        workspace,
        cli_env,
        "python3",
        "-c",
        probe,
        "/proc/sys/kernel/core_pattern",
        "/proc/sysrq-trigger",
        "/workspace/control",
    )
    out = dict(line.split(" ", 1) for line in res.stdout.splitlines())
    assert out["/proc/sys/kernel/core_pattern"].startswith("refused"), res.stdout
    assert out["/proc/sysrq-trigger"].startswith("refused"), res.stdout
    assert out["/workspace/control"] == "OPENED"


def test_files_written_appear_on_the_host_owned_by_the_workspace_owner(
    engine: object, agent_image: str, workspace: Path, cli_env: dict[str, str]
) -> None:
    res = run_in(workspace, cli_env, "sh", "-c", "mkdir -p out && echo data > out/result.txt")
    assert res.returncode == 0, res.stderr
    st = (workspace / "out" / "result.txt").stat()
    assert (st.st_uid, st.st_gid) == (workspace.stat().st_uid, workspace.stat().st_gid)
    assert (workspace / "out" / "result.txt").read_text() == "data\n"


@pytest.mark.parametrize(("cmd", "code"), [(["true"], 0), (["false"], 1), (["sh", "-c", "exit 42"], 42)])
def test_exit_codes_propagate(
    engine: object, agent_image: str, workspace: Path, cli_env: dict[str, str], cmd: list[str], code: int
) -> None:
    assert run_in(workspace, cli_env, *cmd).returncode == code


def test_missing_command_exits_127_naming_it(
    engine: object, agent_image: str, workspace: Path, cli_env: dict[str, str]
) -> None:
    res = run_in(workspace, cli_env, "no-such-tool", "--flag")
    assert res.returncode == 127
    assert "command not found in the sandbox: no-such-tool" in res.stderr


def test_stdout_and_stderr_stay_separate(
    engine: object, agent_image: str, workspace: Path, cli_env: dict[str, str]
) -> None:
    res = run_in(workspace, cli_env, "sh", "-c", "echo to-out; echo to-err >&2; echo more-out")
    assert res.stdout == "to-out\nmore-out\n"
    assert "to-err" in res.stderr and "to-out" not in res.stderr


def test_json_result(engine: object, agent_image: str, workspace: Path, cli_env: dict[str, str]) -> None:
    res = run_in(workspace, cli_env, "sh", "-c", "echo hi; exit 3", extra=("--json",))
    assert res.returncode == 3
    out, last = res.stdout.rsplit("\n", 2)[0], res.stdout.strip().splitlines()[-1]
    assert out.startswith("hi")
    data = json.loads(last)
    assert data["exit_code"] == 3 and data["cause"] == "exit" and data["session_id"].startswith("sm-")
    assert data["duration_s"] > 0
    assert not sandman_containers(engine, data["session_id"])


def test_timeout_kills_the_whole_tree_and_leaves_no_container(
    engine: object, agent_image: str, workspace: Path, cli_env: dict[str, str]
) -> None:
    script = "trap '' TERM; (trap '' TERM; sleep 300) & (sleep 300 &) ; sleep 300"
    t0 = time.monotonic()
    res = run_in(workspace, cli_env, "sh", "-c", script, extra=("--timeout", "1", "--json"))
    assert time.monotonic() - t0 < 30
    data = json.loads(res.stdout.strip().splitlines()[-1])
    assert (res.returncode, data["cause"]) == (124, "timeout")
    assert not sandman_containers(engine, data["session_id"])


def mine(engine: object, workspace: Path) -> set[str]:
    return {str(c["Id"]) for c in workspace_containers(engine, workspace)}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_signal_to_sandman_leaves_no_container(
    engine: object, agent_image: str, workspace: Path, cli_env: dict[str, str], unique: str, sig: int
) -> None:
    marker = workspace / f"started-{unique}"
    proc = subprocess.Popen(
        [
            *SANDMAN,
            "run",
            "--workspace",
            str(workspace),
            "--",
            "sh",
            "-c",
            f"trap '' TERM INT; touch {marker.name}; sleep 300",
        ],
        env=cli_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), proc.stderr.read() if proc.stderr else ""  # type: ignore[union-attr]
    before = mine(engine, workspace)
    assert before
    proc.send_signal(sig)
    t0 = time.monotonic()
    code = proc.wait(timeout=30)
    if sig != signal.SIGKILL:
        assert code == 128 + sig
    # Gone within a second even though the command ignores SIGTERM (SIGKILL: the controller notices).
    while time.monotonic() - t0 < 5 and mine(engine, workspace):
        time.sleep(0.05)
    assert not mine(engine, workspace)
    assert time.monotonic() - t0 < (1.0 if sig != signal.SIGKILL else 5.0)


def test_docker_inspect_of_a_live_sandbox_shows_the_hardening(
    engine: object, agent_image: str, workspace: Path, cli_env: dict[str, str]
) -> None:
    from sandman import resources

    proc = subprocess.Popen(
        [
            *SANDMAN,
            "run",
            "--workspace",
            str(workspace),
            "--cpus",
            "1.5",
            "--memory",
            "768m",
            "--pids",
            "200",
            "--",
            "sh",
            "-c",
            "touch ready; sleep 300",
        ],
        env=cli_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while not (workspace / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        [c] = workspace_containers(engine, workspace)
        info = engine.inspect_container(c["Id"])  # type: ignore[attr-defined]
        hc = info["HostConfig"]
        assert hc["NetworkMode"] == "none"
        assert hc["CapDrop"] == ["ALL"] and not hc.get("CapAdd")
        assert hc["ReadonlyRootfs"] is True and hc["Privileged"] is False
        assert (hc["NanoCpus"], hc["Memory"], hc["MemorySwap"], hc["PidsLimit"]) == (
            1_500_000_000,
            768 << 20,
            768 << 20,
            200,
        )
        assert "no-new-privileges" in hc["SecurityOpt"]
        profile = resources.seccomp_profile_path().read_text()
        assert f"seccomp={profile}" in hc["SecurityOpt"]
        assert hc["LogConfig"] == {"Type": "json-file", "Config": {"max-file": "2", "max-size": "10m"}}
        assert info["Config"]["User"] not in ("", "0", "root") and not info["Config"]["User"].startswith("0:")
        assert info["Config"]["Labels"]["io.sandman.session"].startswith("sm-")
        assert "size=" in hc["Tmpfs"]["/tmp"] and "nr_inodes=" in hc["Tmpfs"]["/tmp"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
