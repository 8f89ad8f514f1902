"""Shared fixtures. Docker-backed tests run for real: with no engine they FAIL with how to start
one (never a silent skip), in CI and on a developer's machine alike."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def skip_unless(condition: bool, reason: str) -> pytest.MarkDecorator:
    """Skip where ``condition`` fails on a developer's machine; in CI the test runs (and fails
    if the precondition is missing): a security test that skips proves nothing."""
    return pytest.mark.skipif(not condition and not IN_CI, reason=reason)


SANDMAN = [sys.executable, "-m", "sandman"]
SANDBOX_UID = 1000


def _engine_error() -> str | None:
    from sandman.backends.docker import connect
    from sandman.errors import EngineUnavailable
    from sandman.settings import Settings

    try:
        connect(Settings.load().docker_base_url(), 10).close()
    except EngineUnavailable as exc:
        return str(exc)
    return None


@pytest.fixture(scope="session")
def engine() -> Iterator[object]:
    """A live engine's low-level client, or a failure that says how to start one."""
    err = _engine_error()
    if err:
        pytest.fail(f"{err}. These tests need a real Docker engine: run scripts/setup first.", pytrace=False)
    from sandman.backends.docker import connect
    from sandman.settings import Settings

    api = connect(Settings.load().docker_base_url())
    yield api
    api.close()


@pytest.fixture(scope="session")
def agent_image(engine: object) -> str:
    """sandman's agent image, built (or found cached) once per test session."""
    from sandman.backends.image import Campaign, CampaignImage
    from sandman.core.runner import Runner

    return Runner().images().ensure(Campaign("base", CampaignImage(), None))


def make_workspace(path: Path) -> Path:
    """A workspace owned by an unprivileged user, as sandman requires (tests often run as root)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        for p in [path, *path.rglob("*")]:
            os.lchown(p, SANDBOX_UID, SANDBOX_UID)
    return path


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = make_workspace(tmp_path / "ws")
    (tmp_path).chmod(0o755)
    return ws


@pytest.fixture(scope="session")
def cli_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Environment for CLI calls: private state and runtime dirs, so the tests get their own
    controller, which is shut down at the end of the session."""
    base = tmp_path_factory.mktemp("sandman-cli")
    env = dict(os.environ)
    env["SANDMAN_STATE_DIR"] = str(base / "state")
    env["SANDMAN_RUNTIME_DIR"] = str(base / "run")
    env["SANDMAN_CONTROLLER_IDLE_S"] = "120"
    env.pop("SANDMAN_IN_PROCESS", None)
    yield env
    stop_controllers(base / "run")


def stop_controllers(run_dir: Path) -> None:
    import json
    import socket

    for sock_path in run_dir.glob("controller-*.sock"):
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(str(sock_path))
                s.sendall(json.dumps({"op": "shutdown"}).encode() + b"\n")
                s.recv(64)
            except OSError:
                pass


def sandman(
    *args: str, env: dict[str, str] | None = None, timeout: float = 300, input: bytes | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*SANDMAN, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        input=input and input.decode(),
        cwd=ROOT,
    )


def sandman_containers(engine: object, session: str | None = None) -> list[dict[str, object]]:
    label = "io.sandman.session" + (f"={session}" if session else "")
    return engine.containers(all=True, filters={"label": label})  # type: ignore[attr-defined,no-any-return]


def workspace_containers(engine: object, workspace: Path, *, all_: bool = True) -> list[dict[str, Any]]:
    """Sandman containers whose workspace mount is ``workspace``: the ones a test started, even
    when other tests run sandboxes at the same time."""
    return [
        c
        for c in engine.containers(all=all_, filters={"label": "io.sandman.session"})  # type: ignore[attr-defined]
        if any(m.get("Source") == str(workspace) for m in c.get("Mounts") or [])
    ]


@pytest.fixture
def unique() -> str:
    return uuid.uuid4().hex[:8]
