"""Scrubbing on the real output path: what a command prints leaves the sandbox redacted."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest

from tests.conftest import sandman

pytestmark = pytest.mark.docker

FAKE_KEY = "ghp_" + "Zx9Yw8Vu7Ts6Rq5Po4Nm3Lk2Ji1Hg0FeDcBa"  # shaped like a GitHub token, not a real one


def test_run_output_shows_only_redactions(
    engine: object, agent_image: str, workspace: Path, cli_env: dict[str, str], tmp_path: Path
) -> None:
    value = "s3cr3t-" + os.urandom(10).hex()
    policy = tmp_path / "p.toml"
    policy.write_text('[secrets]\ninject = ["DEMO_TOKEN"]\n')
    env = {**cli_env, "SANDMAN_SECRETS": json.dumps({"DEMO_TOKEN": value})}
    script = (
        'printf "plain %s\\n" "$DEMO_TOKEN"; printf "%s" "$DEMO_TOKEN" | base64; '
        f'echo "key {FAKE_KEY}"; printf "%s" "$DEMO_TOKEN" | od -An -tx1 | tr -d " \\n"; echo; '
        'printf "%s" "$DEMO_TOKEN" >&2; echo " on stderr" >&2'
    )
    res = sandman("run", "--workspace", str(workspace), "--policy", str(policy), "--", "sh", "-c", script, env=env)
    assert res.returncode == 0, res.stderr
    everything = res.stdout + res.stderr
    assert value not in everything and FAKE_KEY not in everything
    assert base64.b64encode(value.encode()).decode() not in everything
    assert value.encode().hex() not in everything
    lines = res.stdout.splitlines()
    assert lines[0] == "plain [REDACTED:DEMO_TOKEN]"
    assert lines[1] == "[REDACTED:DEMO_TOKEN]"  # base64 of it
    assert lines[2] == "key [REDACTED:github]"
    assert lines[3] == "[REDACTED:DEMO_TOKEN]"  # hex of it
    assert "[REDACTED:DEMO_TOKEN] on stderr" in res.stderr


def test_session_exec_output_and_audit_are_scrubbed(
    engine: object, agent_image: str, workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sandman.core.session import Sandbox
    from sandman.core.state import StateStore
    from sandman.settings import Settings

    monkeypatch.setenv("SANDMAN_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("SANDMAN_RUNTIME_DIR", str(tmp_path / "run"))
    settings = Settings.load()
    with Sandbox(workspace, settings=settings) as sb:
        res = sb.exec(["sh", "-c", f"echo {FAKE_KEY}; echo {FAKE_KEY} | base64"])
        assert FAKE_KEY.encode() not in res.stdout and res.stdout.count(b"[REDACTED:github]") == 2
        sb.exec(["echo", FAKE_KEY])  # on argv: the audit record is scrubbed
    dump = json.dumps([e.as_json() for e in StateStore(settings.state_dir).events()])
    assert FAKE_KEY not in dump and "[REDACTED:github]" in dump
