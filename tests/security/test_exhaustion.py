"""Exhaustion: each attack ends with its cause named, the host survives (the engine answers and
another session keeps working), nothing in the workspace is lost, nothing is left behind, and an
immediate re-run works."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandman.core.runner import ExitCause
from sandman.core.session import Sandbox
from sandman.policy import load_policy
from sandman.settings import Settings
from tests.conftest import workspace_containers

pytestmark = pytest.mark.docker

POLICY = load_policy().with_resources(
    memory="512m", pids=128, tmpfs_size="64m", tmpfs_inodes=2000, max_output="8m", exec_timeout_s=12
)


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("SANDMAN_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("SANDMAN_RUNTIME_DIR", str(tmp_path / "run"))
    return Settings.load()


def checksums(ws: Path) -> dict[str, str]:
    return {
        p.relative_to(ws).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(ws.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def canary(engine: object, agent_image: str, tmp_path: Path, settings: Settings) -> Iterator[list[float]]:
    """Another session exec'ing every 200 ms during the attack; the latencies it saw."""
    from tests.conftest import make_workspace

    ws = make_workspace(tmp_path / "canary")
    seen: list[float] = []
    stop = threading.Event()
    with Sandbox(ws, settings=settings) as other:

        def loop() -> None:
            while not stop.is_set():
                t0 = time.monotonic()
                assert other.exec(["true"], timeout=30).exit_code == 0
                seen.append(time.monotonic() - t0)
                stop.wait(0.2)

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        yield seen
        stop.set()
        thread.join(60)


ATTACKS = {
    "fork bomb": (["sh", "-c", "f(){ f | f & }; f; sleep 60"], {ExitCause.PIDS_LIMIT}),
    "thread bomb": (
        [
            "python3",
            "-c",
            "import threading, time\nwhile True:\n"
            "    try: threading.Thread(target=time.sleep, args=(60,)).start()\n"
            "    except RuntimeError: pass",
        ],
        {ExitCause.PIDS_LIMIT},
    ),
    "memory bomb": (["python3", "-c", "a = []\nwhile True: a.append(bytearray(32 << 20))"], {ExitCause.OOM}),
    "/tmp fill": (["sh", "-c", "dd if=/dev/zero of=/tmp/fill bs=1M count=1000"], {ExitCause.DISK_FULL}),
    "HOME fill": (["sh", "-c", "dd if=/dev/zero of=$HOME/fill bs=1M count=1000"], {ExitCause.DISK_FULL}),
    "inode exhaustion": (
        ["sh", "-c", "mkdir -p /tmp/i && cd /tmp/i && i=0; while touch f$i; do i=$((i+1)); done; exit 1"],
        {ExitCause.DISK_FULL},
    ),
    "SIGTERM ignored past the timeout": (["sh", "-c", "trap '' TERM; sleep 600"], {ExitCause.TIMEOUT}),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_attack_is_contained(
    engine: object, agent_image: str, workspace: Path, settings: Settings, canary: list[float], attack: str
) -> None:
    argv, causes = ATTACKS[attack]
    (workspace / "precious.txt").write_text("do not lose me\n" * 1000)
    before = checksums(workspace)
    with Sandbox(workspace, settings=settings, policy=POLICY) as sb:
        runtime_dir = Path(sb.record.runtime_dir)
        t0 = time.monotonic()
        result = sb.exec(argv)
        assert result.cause in causes, (attack, result.cause, result.exit_code, result.stderr[-300:])
        assert time.monotonic() - t0 < 60
        assert engine.ping()  # type: ignore[attr-defined]
        assert sb.exec(["sh", "-c", "rm -rf /tmp/* $HOME/* 2>/dev/null; echo again"]).stdout == b"again\n"
        container_id = sb.record.container_id
    assert checksums(workspace) == before
    assert not engine.containers(all=True, filters={"id": container_id})  # type: ignore[attr-defined]
    assert not runtime_dir.exists()  # its sockets went with it
    assert str(runtime_dir) not in Path("/proc/self/mounts").read_text()
    assert canary and max(canary) < 10.0, canary  # the other session kept answering throughout


def test_gigabytes_on_stdout_are_truncated_and_logs_stay_bounded(
    engine: object, agent_image: str, workspace: Path, cli_env: dict[str, str], tmp_path: Path
) -> None:
    policy = tmp_path / "p.toml"
    policy.write_text('[resources]\nmax_output = "16m"\n')
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sandman",
            "run",
            "--workspace",
            str(workspace),
            "--policy",
            str(policy),
            "--json",
            "--",
            "sh",
            "-c",
            "head -c 1G /dev/zero | tr '\\0' x; echo done >&2",
        ],
        env=cli_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    chunks: dict[str, list[bytes]] = {"out": [], "err": []}

    def drain(name: str, stream: object) -> None:
        chunks[name].extend(iter(lambda: stream.read(1 << 16), b""))  # type: ignore[attr-defined]

    readers = [
        threading.Thread(target=drain, args=(n, s), daemon=True)
        for n, s in (("out", proc.stdout), ("err", proc.stderr))
    ]
    for reader in readers:
        reader.start()
    biggest_log = 0
    while proc.poll() is None:
        for c in workspace_containers(engine, workspace, all_=False):
            log = Path(engine.inspect_container(c["Id"])["LogPath"])  # type: ignore[attr-defined]
            logs = [p.stat().st_size for p in log.parent.glob(log.name + "*") if p.exists()]
            biggest_log = max(biggest_log, sum(logs))
        time.sleep(0.2)
    for reader in readers:
        reader.join(60)
    out, err = b"".join(chunks["out"]), b"".join(chunks["err"])
    result = json.loads(out.rsplit(b"\n", 2)[-2])
    assert result["exit_code"] == 0 and result["cause"] == "exit"
    assert len(out) < (16 << 20) + 4096  # what reached the user is bounded
    assert b"output truncated after 16777216 bytes" in err
    assert biggest_log <= 2 * 10 * (1 << 20) + (1 << 20)  # json-file: max-size 10m, max-file 2
    rerun = subprocess.run(
        [sys.executable, "-m", "sandman", "run", "--workspace", str(workspace), "--", "true"],
        env=cli_env,
        timeout=60,
    )
    assert rerun.returncode == 0


def test_sigterm_to_sandman_with_a_blocked_stdout_still_cleans_up(
    engine: object, agent_image: str, workspace: Path, cli_env: dict[str, str]
) -> None:
    """Nobody reads sandman's stdout (a stuck pipeline) and the command floods it: a SIGTERM must
    still end sandman and remove the sandbox, not wait forever on the full pipe."""
    import os
    import signal

    read_end, write_end = os.pipe()  # never read
    proc = subprocess.Popen(
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
            "touch started; head -c 1G /dev/zero | tr '\\0' x",
        ],
        env=cli_env,
        stdout=write_end,
        stderr=subprocess.DEVNULL,
    )
    os.close(write_end)
    try:
        deadline = time.monotonic() + 60
        while not (workspace / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # let every buffer between the sandbox and the pipe fill up
        mine = [c["Id"] for c in workspace_containers(engine, workspace, all_=False)]
        assert mine
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 128 + signal.SIGTERM
        while time.monotonic() - t0 < 20 and engine.containers(all=True, filters={"id": mine[0]}):  # type: ignore[attr-defined]
            time.sleep(0.1)
        assert not engine.containers(all=True, filters={"id": mine[0]})  # type: ignore[attr-defined]
    finally:
        os.close(read_end)
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize(
    ("args", "script", "cause"),
    [
        (["--pids", "64", "--timeout", "5"], "f(){ f | f & }; f; sleep 60", "pids-limit"),
        (["--memory", "256m"], "python3 -c 'a = []\nwhile True: a.append(bytearray(32 << 20))'", "oom"),
        ([], "dd if=/dev/zero of=/tmp/fill bs=1M count=1000", "disk-full"),
    ],
)
def test_sandman_run_names_the_cause(
    engine: object, agent_image: str, workspace: Path, cli_env: dict[str, str], args: list[str], script: str, cause: str
) -> None:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "sandman",
            "run",
            "--workspace",
            str(workspace),
            "--json",
            *args,
            "--",
            "sh",
            "-c",
            script,
        ],
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert json.loads(res.stdout.strip().splitlines()[-1])["cause"] == cause, res.stdout[-300:]
