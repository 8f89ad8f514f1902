"""Policy enforcement through `sandman run` on a real engine: denied files, symlinks, protected
paths, environment passthrough and refusals, secret injection, campaign tightening, audit."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import SANDMAN, make_workspace, sandman, workspace_containers

pytestmark = pytest.mark.docker


@pytest.fixture
def secrets_ws(tmp_path: Path) -> Path:
    ws = tmp_path / "proj"
    (ws / "config").mkdir(parents=True)
    (ws / ".git" / "hooks").mkdir(parents=True)
    (ws / ".env").write_text("DB_PASSWORD=hunter2\n")
    (ws / ".env.example").write_text("DB_PASSWORD=changeme\n")
    (ws / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nnope\n")
    (ws / "config" / "credentials.json").write_text('{"token": "abc"}\n')
    (ws / ".git" / "config").write_text('[remote "origin"]\n\turl = https://user:pw@example.invalid/x\n')
    (ws / ".git" / "hooks" / "pre-commit").write_text("#!/bin/sh\nexit 0\n")
    (ws / "link").symlink_to("/etc/passwd")
    (ws / "notes.txt").write_text("public\n")
    return make_workspace(ws)


def run(ws: Path, env: dict[str, str], *cmd: str, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return sandman("run", "--workspace", str(ws), *extra, "--", *cmd, env=env)


def test_must_show_denied_files_are_unreadable_and_the_example_is_fine(
    engine: object, agent_image: str, secrets_ws: Path, cli_env: dict[str, str]
) -> None:
    res = run(secrets_ws, cli_env, "sh", "-c", "cat .env; cat id_rsa; cat .env.example")
    assert res.stdout == "DB_PASSWORD=changeme\n", res.stderr
    assert "hunter2" not in res.stdout + res.stderr and "OPENSSH" not in res.stdout + res.stderr


def test_denied_paths_stay_hidden_by_every_route(
    engine: object, agent_image: str, secrets_ws: Path, cli_env: dict[str, str]
) -> None:
    script = (
        "cat config/credentials.json .git/config 2>/dev/null;"
        "cat ./sub/../.env 2>/dev/null; cat /workspace/.env 2>/dev/null;"
        "ln -s .env alias 2>/dev/null; cat alias 2>/dev/null;"
        "ln .env hard 2>/dev/null; cat hard 2>/dev/null;"
        "cat /proc/self/root/workspace/.env 2>/dev/null; cat /proc/self/cwd/id_rsa 2>/dev/null;"
        "echo overwrite > .env 2>/dev/null; cat notes.txt"
    )
    res = run(secrets_ws, cli_env, "sh", "-c", script)
    assert res.stdout == "public\n", res.stdout  # the control: an allowed file reads fine
    assert (secrets_ws / ".env").read_text() == "DB_PASSWORD=hunter2\n"  # nothing lost or changed


def test_symlink_out_of_the_workspace_shows_the_containers_file_not_the_hosts(
    engine: object, agent_image: str, secrets_ws: Path, cli_env: dict[str, str]
) -> None:
    res = run(secrets_ws, cli_env, "sh", "-c", "cat < link")
    inside = res.stdout
    assert "agent:x:1000:1000" in inside  # the image's own user
    host = Path("/etc/passwd").read_text()
    assert inside != host


def test_protected_git_hooks_are_read_only(
    engine: object, agent_image: str, secrets_ws: Path, cli_env: dict[str, str]
) -> None:
    res = run(
        secrets_ws,
        cli_env,
        "sh",
        "-c",
        "echo evil > .git/hooks/pre-commit 2>/dev/null && echo hook-written || echo hook-ro;"
        "echo ok > .git/description && echo git-dir-writable",
    )
    assert res.stdout.split() == ["hook-ro", "git-dir-writable"], res.stderr
    assert "evil" not in (secrets_ws / ".git" / "hooks" / "pre-commit").read_text()


def test_host_side_argument_check_refuses_denied_paths_and_escapes(
    engine: object, agent_image: str, secrets_ws: Path, cli_env: dict[str, str]
) -> None:
    for args, needle in (
        (["cat", ".env"], "denied by rule '.env'"),
        (["cat", "../../etc/shadow"], "escapes the workspace"),
        (["git", "-C", ".", "push", "--force"], "commands.rules.git.blocked"),
    ):
        res = run(secrets_ws, cli_env, *args)
        assert res.returncode == 126 and needle in res.stderr, (args, res.stderr)
    audit = sandman("audit", "--json", env=cli_env)
    refused = [e for e in json.loads(audit.stdout) if e["event"] == "command.refused"]
    assert any(e["detail"]["argv"] == ["git", "-C", ".", "push", "--force"] for e in refused)


def test_environment_is_exactly_policy_passthrough_and_controller_values(
    engine: object, agent_image: str, secrets_ws: Path, cli_env: dict[str, str], tmp_path: Path
) -> None:
    policy = tmp_path / "op.toml"
    policy.write_text('[environment]\nallow = { CI = "true" }\npassthrough = ["MY_TOOL_MODE"]\n')
    env = {**cli_env, "MY_TOOL_MODE": "fast", "UNLISTED": "x", "AWS_SECRET_ACCESS_KEY": "aws-host-value"}
    res = run(secrets_ws, env, "sh", "-c", "env | sort", extra=("--policy", str(policy)))
    names = {line.split("=", 1)[0] for line in res.stdout.splitlines()}
    assert res.returncode == 0, res.stderr
    assert "MY_TOOL_MODE=fast" in res.stdout and "CI=true" in res.stdout
    assert "UNLISTED" not in names and "AWS_SECRET_ACCESS_KEY" not in names and "aws-host-value" not in res.stdout
    assert names <= {
        "CI",
        "MY_TOOL_MODE",
        "PATH",
        "HOME",
        "LANG",
        "TERM",
        "PWD",
        "SHLVL",
        "_",
        "SANDMAN_SESSION",
        "SANDMAN_CAMPAIGN",
    }
    bad = tmp_path / "bad.toml"
    bad.write_text('[environment]\npassthrough = ["AWS_SECRET_ACCESS_KEY"]\n')
    refused = run(secrets_ws, env, "true", extra=("--policy", str(bad)))
    assert refused.returncode == 4 and "AWS_*" in refused.stderr and str(bad) in refused.stderr


def test_injected_secret_reaches_the_command_and_nowhere_else(
    engine: object, agent_image: str, secrets_ws: Path, cli_env: dict[str, str], tmp_path: Path
) -> None:
    value = "sk-test-" + os.urandom(12).hex()
    policy = tmp_path / "secret.toml"
    policy.write_text('[secrets]\ninject = ["DEMO_API_KEY"]\n')
    env = {**cli_env, "SANDMAN_SECRETS": json.dumps({"DEMO_API_KEY": value})}
    # The command proves it holds the value by its hash; then it captures every argv it can see
    # and counts the value there (grep's own argv is not in the capture).
    script = (
        'printf %s "$DEMO_API_KEY" | sha256sum | cut -c1-16; touch ready; sleep 2;'
        "cat /proc/[0-9]*/cmdline | tr '\\0' ' ' > /tmp/argv; grep -c -- \"$DEMO_API_KEY\" /tmp/argv || true"
    )
    proc = subprocess.Popen(
        [*SANDMAN, "run", "--workspace", str(secrets_ws), "--policy", str(policy), "--", "sh", "-c", script],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    deadline = time.monotonic() + 60
    while not (secrets_ws / "ready").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    live = workspace_containers(engine, secrets_ws, all_=False)
    assert live
    inspect = json.dumps(engine.inspect_container(live[0]["Id"]))  # type: ignore[attr-defined]
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    digest = hashlib.sha256(value.encode()).hexdigest()[:16]
    assert out.split() == [digest, "0"]  # visible to the command; not on any argv inside
    assert value not in inspect  # not in the container's config, command or env
    assert value not in out + err
    for path in secrets_ws.rglob("*"):
        if path.is_file() and not path.is_symlink():
            assert value not in path.read_text(errors="replace"), path
    state = Path(env["SANDMAN_STATE_DIR"])
    for path in [*state.rglob("*"), *Path(env["SANDMAN_RUNTIME_DIR"]).rglob("*")]:
        if path.is_file():
            assert value.encode() not in path.read_bytes(), path  # audit db, controller logs, env files


def test_campaign_policy_may_tighten_but_not_loosen(
    engine: object, agent_image: str, tmp_path: Path, cli_env: dict[str, str]
) -> None:
    ws = tmp_path / "camp"
    (ws / ".sandman").mkdir(parents=True)
    (ws / ".sandman" / "policy.toml").write_text('[resources]\npids = 64\n[commands]\nallow = ["sh", "true", "cat"]\n')
    make_workspace(ws)
    ok = run(ws, cli_env, "sh", "-c", "cat /sys/fs/cgroup/pids/pids.max 2>/dev/null || cat /sys/fs/cgroup/pids.max")
    assert ok.returncode == 0 and ok.stdout.strip() == "64", ok.stderr
    refused = run(ws, cli_env, "ls")
    assert refused.returncode == 126 and "'ls' is not in the allowlist" in refused.stderr
    (ws / ".sandman" / "policy.toml").write_text('[resources]\nmemory = "64g"\n')
    changed = run(ws, cli_env, "true")  # a changed campaign needs the operator's acceptance first
    assert changed.returncode == 4 and "changed since they were last accepted" in changed.stderr
    assert '+memory = "64g"' in changed.stderr
    accepted = sandman("campaign", "accept", "-w", str(ws), env=cli_env)
    assert accepted.returncode == 0 and "accepted the campaign files" in accepted.stdout, accepted.stderr
    looser = run(ws, cli_env, "true")
    assert looser.returncode == 4
    assert "policy.toml: key 'resources.memory': a campaign may only tighten" in looser.stderr


def test_policy_cli_explain_show_and_check(secrets_ws: Path, cli_env: dict[str, str], tmp_path: Path) -> None:
    res = sandman("policy", "explain", "--workspace", str(secrets_ws), "--", "git", "push", "--force", env=cli_env)
    assert (
        res.returncode == 126 and "refused" in res.stdout and "commands.rules.git.blocked: 'push --force'" in res.stdout
    )
    ok = sandman("policy", "explain", "--workspace", str(secrets_ws), "--", "git", "push", env=cli_env)
    assert ok.returncode == 0 and ok.stdout.startswith("allowed")
    bad = tmp_path / "bad.toml"
    bad.write_text("[resources]\ncpus = -1\n")
    check = sandman("policy", "check", str(bad), env=cli_env)
    lines = [line for line in check.stderr.splitlines() if line.strip()]
    assert check.returncode == 4 and len(lines) == 1 and str(bad) in lines[0] and "resources.cpus" in lines[0]
    shown = json.loads(sandman("policy", "show", "--workspace", str(secrets_ws), "--json", env=cli_env).stdout)
    assert shown["sources"]["resources.memory"].startswith("sandman default")
