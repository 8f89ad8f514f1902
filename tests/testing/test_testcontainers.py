"""The testcontainers module and the pytest plugin, used the way a CI user would."""

from __future__ import annotations

import doctest
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import sandman.testing
from sandman.testing import SandmanContainer
from tests.conftest import workspace_containers

pytestmark = pytest.mark.docker
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_ryuk(monkeypatch: pytest.MonkeyPatch) -> None:
    # No registry here, so no reaper image: SandmanContainer must clean up on its own.
    monkeypatch.setenv("TESTCONTAINERS_RYUK_DISABLED", "true")
    from testcontainers.core.config import testcontainers_config

    monkeypatch.setattr(testcontainers_config, "ryuk_disabled", True)


def containers_with(engine: object, label: str) -> list[dict[str, object]]:
    return engine.containers(all=True, filters={"label": label})  # type: ignore[attr-defined,no-any-return]


def test_docstring_example_runs(engine: object, agent_image: str) -> None:
    failures, tried = doctest.testmod(sandman.testing, verbose=False)
    assert tried >= 2 and failures == 0


def test_builders_labels_exec_and_cleanup(engine: object, agent_image: str, workspace: Path) -> None:
    box = (
        SandmanContainer()
        .with_workspace(workspace)
        .with_policy("strict")
        .with_limits(cpus=0.5, memory="300m", pids=50)
        .with_upcall_helper("noop")
    )
    with box:
        labels = box.get_wrapped_container().labels
        assert labels["org.testcontainers.session-id"] and labels["io.sandman.session"] == box.session_id
        res = box.exec(["sandman-upcall", "noop", "hi"])
        assert (res.exit_code, res.stdout) == (0, b"hi\n")
        assert Path(box.get_upcall_socket_path()).is_socket()
        hc = box.get_wrapped_container().attrs["HostConfig"]
        assert (hc["NanoCpus"], hc["Memory"], hc["PidsLimit"]) == (500_000_000, 300 << 20, 50)
        sid = box.session_id
    assert not containers_with(engine, f"io.sandman.session={sid}")


def _hardening(info: dict[str, object]) -> dict[str, object]:
    hc = info["HostConfig"]
    keys = (
        "NetworkMode",
        "CapDrop",
        "CapAdd",
        "SecurityOpt",
        "ReadonlyRootfs",
        "MaskedPaths",
        "ReadonlyPaths",
        "Ulimits",
        "LogConfig",
        "Tmpfs",
        "Memory",
        "MemorySwap",
        "NanoCpus",
        "PidsLimit",
        "Runtime",
        "IpcMode",
        "Privileged",
    )
    return {k: hc.get(k) for k in keys} | {"User": info["Config"]["User"]}  # type: ignore[attr-defined,index]


def test_hardening_equals_sandman_run(
    engine: object, agent_image: str, workspace: Path, cli_env: dict[str, str]
) -> None:
    import time

    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sandman",
            "run",
            "--workspace",
            str(workspace),
            "--",
            "sh",
            "-c",
            "touch run-ready; sleep 60",
        ],
        env=cli_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not (workspace / "run-ready").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        [live] = workspace_containers(engine, workspace)
        from_run = _hardening(engine.inspect_container(live["Id"]))  # type: ignore[attr-defined]
        with SandmanContainer(workspace) as box:
            from_tc = _hardening(box.get_wrapped_container().attrs)
    finally:
        run.terminate()
        run.wait(30)
    assert from_tc == from_run
    assert from_tc["NetworkMode"] == "none" and from_tc["CapDrop"] == ["ALL"]


INNER = textwrap.dedent("""
    import os, pytest

    def test_fails(sandman_sandbox):
        open(os.environ["SID_FILE"], "a").write(sandman_sandbox.session_id + "\\n")
        assert sandman_sandbox.exec(["false"]).exit_code == 0

    def test_interrupted(sandman_sandbox):
        open(os.environ["SID_FILE"], "a").write(sandman_sandbox.session_id + "\\n")
        raise KeyboardInterrupt
""")


@pytest.mark.parametrize("which", ["test_fails", "test_interrupted"])
def test_cleanup_after_failure_and_keyboard_interrupt(
    engine: object, agent_image: str, tmp_path: Path, which: str
) -> None:
    (tmp_path / "test_inner.py").write_text(INNER)
    sid_file = tmp_path / "sids"
    env = {**os.environ, "SID_FILE": str(sid_file), "TESTCONTAINERS_RYUK_DISABLED": "true"}
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"test_inner.py::{which}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode != 0
    if which == "test_fails":
        assert "sandman audit" in res.stdout  # the failure report carries the sandbox's events
        assert '"event": "exec"' in res.stdout
    [sid] = sid_file.read_text().split()
    assert not containers_with(engine, f"io.sandman.session={sid}")


def test_example_ci_suite_passes_and_leaves_nothing(engine: object, agent_image: str) -> None:
    env = {**os.environ, "TESTCONTAINERS_RYUK_DISABLED": "true"}
    before = {c["Id"] for c in containers_with(engine, "io.sandman.session")}
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "examples" / "ci")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "3 passed" in res.stdout
    after = {c["Id"] for c in containers_with(engine, "io.sandman.session")}
    assert not (after - before)
