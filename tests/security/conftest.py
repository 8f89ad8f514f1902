"""Fixtures for the escape battery: one real session per module, in a private state store and
runtime root, created while the host environment holds unique secrets; a host-loopback listener
the sandbox must not reach."""

from __future__ import annotations

import contextlib
import secrets
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandman.core.session import Sandbox
from sandman.settings import Settings
from tests.conftest import make_workspace

# Host variables holding secrets while the session is created: nothing of them may reach it.
SECRET_VARS = ("ESCAPE_TEST_API_TOKEN", "AWS_SECRET_ACCESS_KEY")


@pytest.fixture(scope="module")
def host_secrets() -> dict[str, str]:
    return {name: f"sm-secret-{secrets.token_hex(16)}" for name in SECRET_VARS}


@pytest.fixture(scope="module")
def isolated_settings(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """A private state store and runtime root (the `settings` pattern of test_session, module-wide)."""
    base = tmp_path_factory.mktemp("security")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SANDMAN_STATE_DIR", str(base / "state"))
        mp.setenv("SANDMAN_RUNTIME_DIR", str(base / "run"))
        yield Settings.load()


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """A private state store and runtime root for one test (the CLI and the library alike)."""
    monkeypatch.setenv("SANDMAN_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("SANDMAN_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.delenv("SANDMAN_IN_PROCESS", raising=False)
    return Settings.load()


@pytest.fixture(scope="module")
def security_workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    parent = tmp_path_factory.mktemp("security-ws")
    parent.chmod(0o755)
    ws = make_workspace(parent / "ws")
    (ws / "README").write_text("escape battery workspace\n")
    make_workspace(ws)
    return ws


@pytest.fixture(scope="module")
def session(
    engine: object,
    agent_image: str,
    isolated_settings: Settings,
    security_workspace: Path,
    host_secrets: dict[str, str],
) -> Iterator[Sandbox]:
    """One live session for the whole module, created with the host secrets in the environment."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in host_secrets.items():
            mp.setenv(name, value)
        with Sandbox(security_workspace, settings=isolated_settings) as sb:
            yield sb


@pytest.fixture(scope="module")
def host_listener() -> Iterator[int]:
    """A TCP listener on the host's 127.0.0.1 that accepts and closes; yields its port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    accepted: list[object] = []

    def serve() -> None:
        while True:
            try:
                conn, peer = sock.accept()
            except OSError:
                return
            accepted.append(peer)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield int(sock.getsockname()[1])
    finally:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        sock.close()
        thread.join(2)
