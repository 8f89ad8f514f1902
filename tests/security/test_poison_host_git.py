"""What an agent leaves in the workspace must not make the HOST user's git run its code.

Each test builds one verified attack in a real repository owned by an unprivileged user (as
sandman's workspaces are), then proves three things with this host's git, run as that user with
no system or global config and no sandman protection at all:

1. the attack is real: the user's ordinary git command runs the planted command (positive control);
2. ``sandman.core.poison.scan_workspace`` reports it, by path and key;
3. after ``quarantine``, the same git command runs nothing.

No Docker needed: this is the host side, after the sandbox is gone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandman.core.poison import Finding, quarantine, quarantine_dir, scan_workspace, take_baseline
from tests.conftest import SANDBOX_UID, make_workspace

OWNER = SANDBOX_UID if os.geteuid() == 0 else os.geteuid()
SETUP_ENV = {
    **os.environ,
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_TERMINAL_PROMPT": "0",
}
IDENTITY = ("-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main", "-c", "safe.directory=*")


def setup_git(*args: str, cwd: Path) -> None:
    """git as the test (root), before the workspace is handed to its owner: building the attack."""
    subprocess.run(["git", *IDENTITY, *args], cwd=cwd, env=SETUP_ENV, check=True, capture_output=True)


class Host:
    """The host user who owns the workspace and runs git in it after the session."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.markers = base / "markers"
        self.home = base / "home"

    def repo(self, name: str = "ws") -> Path:
        ws = self.base / name
        ws.mkdir()
        setup_git("init", "-q", cwd=ws)
        (ws / "README").write_text("hello\n")
        setup_git("add", "README", cwd=ws)
        setup_git("commit", "-qm", "init", cwd=ws)
        return ws

    def script(self, path: Path, marker: str) -> str:
        """An agent-written script that leaves a marker when something runs it."""
        path.write_text(f"#!/bin/sh\ntouch {self.markers / marker}\n")
        path.chmod(0o755)
        return str(path)

    def hand_over(self, ws: Path) -> None:
        make_workspace(ws)  # chown -R to the unprivileged owner, as sandman requires

    def git(self, cwd: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.home),
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": "/dev/null",
            "GIT_TERMINAL_PROMPT": "0",
            "LANG": "C",
        }
        as_owner = {"user": OWNER, "group": OWNER, "extra_groups": []} if os.geteuid() == 0 else {}
        result: subprocess.CompletedProcess[bytes] = subprocess.run(
            ["git", "-c", "user.name=host", "-c", "user.email=h@h", *args],
            cwd=cwd,
            env=env,
            capture_output=True,
            timeout=60,
            **as_owner,  # type: ignore[call-overload]
        )
        return result

    def runs(self, marker: str, cwd: Path, *args: str) -> bool:
        """Whether the host user's `git ARGS` in ``cwd`` runs the planted command."""
        (self.markers / marker).unlink(missing_ok=True)
        self.git(cwd, *args)
        return (self.markers / marker).exists()

    def quarantine(self, ws: Path, findings: list[Finding]) -> None:
        report = quarantine(ws, findings, quarantine_dir(self.base / "state", f"sm-{ws.name}"))
        assert report.moved and not [f for f in report.files if f.method == "failed"], report


@pytest.fixture
def host() -> Iterator[Host]:
    base = Path(tempfile.mkdtemp(prefix="sandman-poison-"))
    base.chmod(0o755)  # the owner must reach it (pytest's own tmp dirs are private to root)
    h = Host(base)
    h.markers.mkdir()
    h.markers.chmod(0o777)
    h.home.mkdir()
    os.chown(h.home, OWNER, OWNER)
    yield h
    shutil.rmtree(base, ignore_errors=True)


def found(findings: list[Finding], path: str, key: str) -> Finding:
    for f in findings:
        if (f.path, f.key) == (path, key):
            return f
    raise AssertionError(f"{path}: {key} not reported; got {[f.line() for f in findings]}")


# -- negative control -----------------------------------------------------------------------------


def test_clean_repository_and_ordinary_work_report_nothing(host: Host) -> None:
    ws = host.repo()
    host.hand_over(ws)
    assert scan_workspace(ws) == []
    base = take_baseline(ws)
    # what an agent ordinarily does: edit, branch, commit
    (ws / "README").write_text("changed\n")
    (ws / "new.py").write_text("print(1)\n")
    host.hand_over(ws)
    host.git(ws, "checkout", "-q", "-b", "work")
    host.git(ws, "add", "-A")
    assert host.git(ws, "commit", "-qm", "work").returncode == 0
    assert scan_workspace(ws, base) == []


# -- the attacks ----------------------------------------------------------------------------------


def test_gitdir_file_points_git_at_an_agent_config(host: Host) -> None:
    ws = host.repo()
    os.rename(ws / ".git", ws / ".g")
    (ws / ".git").write_text("gitdir: .g\n")
    setup_git("config", "-f", ".g/config", "core.fsmonitor", host.script(ws / ".fsm", "gitdir"), cwd=ws)
    host.hand_over(ws)

    assert host.runs("gitdir", ws, "status")  # positive control: the attack works on this git

    findings = scan_workspace(ws)
    assert found(findings, ".g/config", "core.fsmonitor").kind == "exec"
    assert found(findings, ".git", "gitdir").value == ".g"

    host.quarantine(ws, findings)
    assert not host.runs("gitdir", ws, "status")


def test_git_renamed_away_and_replaced(host: Host) -> None:
    ws = host.repo()
    host.hand_over(ws)
    base = take_baseline(ws)
    # the agent: mv .git .git2, then a fresh .git with its own config
    os.rename(ws / ".git", ws / ".git2")
    setup_git("init", "-q", cwd=ws)
    setup_git("config", "core.fsmonitor", host.script(ws / ".fsm", "renamed"), cwd=ws)
    host.hand_over(ws)

    assert host.runs("renamed", ws, "status")

    findings = scan_workspace(ws, base)
    assert found(findings, ".git/config", "core.fsmonitor").status == "changed"
    assert found(findings, ".git2", "gitdir").kind == "lookalike"

    host.quarantine(ws, findings)
    assert not host.runs("renamed", ws, "status")


def test_commondir_points_at_an_agent_config(host: Host) -> None:
    ws = host.repo()
    evil = ws / "evil"
    shutil.copytree(ws / ".git", evil)  # config, objects and refs where commondir sends git
    setup_git("config", "-f", "evil/config", "core.fsmonitor", host.script(ws / ".fsm", "commondir"), cwd=ws)
    (ws / ".git" / "commondir").write_text("../evil\n")
    host.hand_over(ws)

    assert host.runs("commondir", ws, "status")

    findings = scan_workspace(ws)
    assert found(findings, ".git/commondir", "commondir").value == "../evil"
    assert found(findings, "evil/config", "core.fsmonitor").kind == "exec"

    host.quarantine(ws, findings)
    assert not host.runs("commondir", ws, "status")


def test_submodule_config_and_hook_under_git_modules(host: Host) -> None:
    upstream = host.repo("upstream")
    ws = host.repo()
    setup_git("-c", "protocol.file.allow=always", "submodule", "add", "-q", str(upstream), "sub", cwd=ws)
    setup_git("commit", "-qm", "add sub", cwd=ws)
    modules = ws / ".git" / "modules" / "sub"
    setup_git("config", "-f", str(modules / "config"), "core.fsmonitor", host.script(ws / ".fsm", "module"), cwd=ws)
    host.script(modules / "hooks" / "pre-commit", "module-hook")
    host.hand_over(ws)

    assert host.runs("module", ws, "status")  # status in the superproject recurses into sub
    assert host.runs("module-hook", ws / "sub", "commit", "-q", "--allow-empty", "-m", "x")

    findings = scan_workspace(ws)
    assert found(findings, ".git/modules/sub/config", "core.fsmonitor").kind == "exec"
    assert found(findings, ".git/modules/sub/hooks/pre-commit", "hook:pre-commit").kind == "hook"

    host.quarantine(ws, findings)
    assert not host.runs("module", ws, "status")
    assert not host.runs("module-hook", ws / "sub", "commit", "-q", "--allow-empty", "-m", "y")


def test_nested_repository(host: Host) -> None:
    ws = host.repo()
    (ws / "sub").mkdir()
    setup_git("init", "-q", cwd=ws / "sub")
    setup_git("config", "core.fsmonitor", host.script(ws / ".fsm", "nested"), cwd=ws / "sub")
    host.hand_over(ws)

    assert host.runs("nested", ws / "sub", "status")

    findings = scan_workspace(ws)
    assert found(findings, "sub/.git", "gitdir").kind == "nested-repo"
    assert found(findings, "sub/.git/config", "core.fsmonitor").kind == "exec"

    host.quarantine(ws, findings)
    assert not host.runs("nested", ws / "sub", "status")


def test_alias_running_a_shell_command(host: Host) -> None:
    ws = host.repo()
    setup_git("config", "alias.st", f"!touch {host.markers / 'alias'}", cwd=ws)
    host.hand_over(ws)

    assert host.runs("alias", ws, "st")

    findings = scan_workspace(ws)
    assert found(findings, ".git/config", "alias.st").value == f"!touch {host.markers / 'alias'}"

    host.quarantine(ws, findings)
    assert not host.runs("alias", ws, "st")


def test_hook_added_during_the_session(host: Host) -> None:
    ws = host.repo()
    host.script(ws / ".git" / "hooks" / "post-commit", "users-own-hook")  # the user's, before
    host.hand_over(ws)
    base = take_baseline(ws)
    host.script(ws / ".git" / "hooks" / "pre-commit", "hook")  # the agent's
    host.hand_over(ws)

    assert host.runs("hook", ws, "commit", "-q", "--allow-empty", "-m", "x")

    findings = scan_workspace(ws, base)
    assert [(f.path, f.key, f.status) for f in findings] == [(".git/hooks/pre-commit", "hook:pre-commit", "new")]

    host.quarantine(ws, findings)
    assert not host.runs("hook", ws, "commit", "-q", "--allow-empty", "-m", "y")
    assert host.runs("users-own-hook", ws, "commit", "-q", "--allow-empty", "-m", "z")  # left alone


def test_rewritten_linked_worktree(host: Host) -> None:
    ws = host.repo()
    setup_git("worktree", "add", "-q", "wt", cwd=ws)
    host.hand_over(ws)
    base = take_baseline(ws)
    # the agent: a copy of the repository with its own config, and the worktree pointed at it
    shutil.copytree(ws / ".git", ws / ".g2", ignore=shutil.ignore_patterns("worktrees"))
    setup_git("config", "-f", ".g2/config", "core.fsmonitor", host.script(ws / ".fsm", "worktree"), cwd=ws)
    (ws / "wt" / ".git").write_text("gitdir: ../.g2\n")
    host.hand_over(ws)

    assert host.runs("worktree", ws / "wt", "status")

    findings = scan_workspace(ws, base)
    assert found(findings, "wt/.git", "gitdir").status == "changed"
    assert found(findings, ".g2/config", "core.fsmonitor").kind == "exec"

    host.quarantine(ws, findings)
    assert not host.runs("worktree", ws / "wt", "status")
