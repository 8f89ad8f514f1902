"""Deny-listed files in the git history: the mask covers the working tree, not .git/objects.

A repository that once committed `.env` and later removed it: under the default policy every
historical version is a known secret for the sandbox (git show / git log -p print it redacted,
and the start warns naming the file); under `strict` nothing starts and the error names `.env`;
the positive control shows the content really is in the history and readable inside when the
operator allows it."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from pathlib import Path

import pytest

from sandman.core.session import Sandbox
from sandman.policy import Policy
from sandman.settings import Settings
from tests.conftest import SANDMAN, make_workspace

VALUE = "sk-live-" + secrets.token_hex(12)


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    tmp_path.chmod(0o755)
    root = tmp_path / "ws"
    root.mkdir()

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(root), "-c", "user.email=a@b", "-c", "user.name=a", *args], check=True)

    git("init", "-q")
    (root / ".env").write_text(f"API_KEY={VALUE}\nMODE=production\n")
    (root / "app.py").write_text("print('hi')\n")
    git("add", ".env", "app.py")
    git("commit", "-qm", "first, with the secret")
    git("rm", "-q", "--cached", ".env")
    (root / ".gitignore").write_text(".env\n")
    git("add", ".gitignore")
    git("commit", "-qm", "untrack .env")
    return make_workspace(root)


PROBE = ["sh", "-c", "git show HEAD~1:.env; git log -p --all | grep API_KEY; echo END"]


def test_history_secrets_never_leave_a_run_under_the_default_policy(
    engine: object, agent_image: str, ws: Path, settings: Settings
) -> None:
    env = {**os.environ, "SANDMAN_IN_PROCESS": "1"}
    proc = subprocess.run(
        [*SANDMAN, "run", "-w", str(ws), "--json", "--", *PROBE], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert VALUE not in proc.stdout + proc.stderr
    assert "API_KEY=" in proc.stdout and "END" in proc.stdout  # git did print the file, redacted
    assert ".env" in proc.stderr and "history" in proc.stderr  # the start warns, naming the file
    audit = subprocess.run([*SANDMAN, "audit", "--json"], capture_output=True, text=True, env=env).stdout
    assert "git_history.scrubbed" in audit and VALUE not in audit


def test_history_secrets_never_leave_a_session_exec(
    engine: object, agent_image: str, ws: Path, settings: Settings
) -> None:
    with Sandbox(ws, settings=settings) as sb:
        res = sb.exec(PROBE)
        streamed = b"".join(item.data for item in sb.stream(PROBE) if hasattr(item, "data"))
        events = json.dumps([e.as_json() for e in sb.state.events(session=sb.id)])
    assert VALUE.encode() not in res.stdout + res.stderr + streamed
    assert b"API_KEY=" in res.stdout
    assert VALUE not in events


def test_strict_refuses_to_start_naming_the_file(ws: Path, cli_env: dict[str, str]) -> None:
    proc = subprocess.run(
        [*SANDMAN, "run", "-w", str(ws), "--policy", "strict", "--", "true"],
        capture_output=True,
        text=True,
        env={**cli_env, "SANDMAN_IN_PROCESS": "1"},
        timeout=300,
    )
    assert proc.returncode == 4
    assert "'.env'" in proc.stderr or ".env" in proc.stderr
    assert "git_history" in proc.stderr and VALUE not in proc.stderr


def test_positive_control_allow_shows_the_history_is_really_there(
    engine: object, agent_image: str, ws: Path, settings: Settings
) -> None:
    policy = Policy.model_validate({"filesystem": {"git_history": "allow"}})
    with Sandbox(ws, settings=settings, policy=policy) as sb:
        res = sb.exec(PROBE)
    assert VALUE.encode() in res.stdout  # the operator accepted it: the content is readable inside


def test_a_copy_read_through_the_files_api_is_scrubbed_too(
    engine: object, agent_image: str, ws: Path, settings: Settings
) -> None:
    with Sandbox(ws, settings=settings) as sb:
        sb.exec(["sh", "-c", "git show HEAD~1:.env > copy.txt"])
        data = sb.files.read("copy.txt")
    assert VALUE.encode() not in data and b"REDACTED" in data
    assert VALUE in (ws / "copy.txt").read_text()  # positive control: the copy holds it


def test_a_history_secret_in_an_upcall_argument_is_refused(
    engine: object, agent_image: str, ws: Path, settings: Settings
) -> None:
    policy = Policy.model_validate({"upcalls": {"helpers": {"noop": {}}}})
    with Sandbox(ws, settings=settings, policy=policy) as sb:
        res = sb.exec(["sh", "-c", 'sandman-upcall noop "$(git show HEAD~1:.env | head -1 | cut -d= -f2)"'])
        ok = sb.exec(["sandman-upcall", "noop", "hello"])
    assert res.exit_code != 0 and b"credential" in res.stderr, res.stderr
    assert VALUE.encode() not in res.stdout + res.stderr
    assert ok.stdout == b"hello\n", ok.stderr  # positive control: the helper answers
