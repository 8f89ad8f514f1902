"""Sessions on a real engine: exec through both layers via the supervisor, timeouts, concurrency,
live updates, attach from another process, crash recovery and the warm pool."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sandman.backends.docker import DockerBackend
from sandman.core.runner import ExitCause
from sandman.core.session import ExecResult, Output, Sandbox, SessionGone
from sandman.core.state import StateStore
from sandman.settings import Settings
from tests.conftest import SANDMAN

pytestmark = pytest.mark.docker


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """A private state store and runtime root: reconcile here touches only this test's sandboxes."""
    monkeypatch.setenv("SANDMAN_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("SANDMAN_RUNTIME_DIR", str(tmp_path / "run"))
    return Settings.load()


@pytest.fixture
def sb(engine: object, agent_image: str, workspace: Path, settings: Settings) -> Iterator[Sandbox]:
    with Sandbox(workspace, settings=settings) as box:
        yield box


def containers_of(engine: object, session_id: str) -> list[dict[str, object]]:
    return engine.containers(all=True, filters={"label": f"io.sandman.session={session_id}"})  # type: ignore[attr-defined,no-any-return]


def test_exec_runs_in_both_layers_with_streams_and_exit_codes(sb: Sandbox, workspace: Path) -> None:
    res = sb.exec(["sh", "-c", "echo out; echo err >&2; grep -E '^(NoNewPrivs|Seccomp):' /proc/self/status; exit 5"])
    assert res.exit_code == 5 and res.cause is ExitCause.EXIT
    assert res.stdout.decode().split() == ["out", "NoNewPrivs:", "1", "Seccomp:", "2"]
    assert res.stderr == b"err\n"
    comms = sb.exec(["sh", "-c", "cat /proc/[0-9]*/comm"]).stdout.decode().split()
    assert "supervisor.py" not in comms and "python3" not in comms and "tini" not in comms
    assert sb.exec(["cat"], stdin=b"round trip").stdout == b"round trip"
    assert sb.exec(["sh", "-c", "echo $SANDMAN_SESSION"]).stdout.decode().strip() == sb.id


def test_streaming_yields_output_before_the_end(sb: Sandbox) -> None:
    seen: list[tuple[float, bytes]] = []
    t0 = time.monotonic()
    for item in sb.stream(["sh", "-c", "echo first; sleep 1; echo second"]):
        if isinstance(item, Output):
            seen.append((time.monotonic() - t0, item.data))
        else:
            assert isinstance(item, ExecResult) and item.exit_code == 0
    assert seen[0][1] == b"first\n" and seen[0][0] < 0.8
    assert seen[-1][1].endswith(b"second\n")


def test_agent_cannot_reach_the_control_socket(sb: Sandbox) -> None:
    res = sb.exec(["sh", "-c", "ls -la /run/sandman/ 2>&1; ls /run/sandman/control 2>&1; echo done"])
    assert "ctl.sock" not in res.stdout.decode()
    # Control: the socket exists, outside the agent's layer.
    assert (Path(sb.record.runtime_dir) / "control" / "ctl.sock").exists()


def test_exec_timeout_kills_the_tree_and_the_session_keeps_working(sb: Sandbox) -> None:
    t0 = time.monotonic()
    res = sb.exec(["sh", "-c", "trap '' TERM; (sleep 300 &); sleep 300"], timeout=1)
    assert res.cause is ExitCause.TIMEOUT and res.exit_code == 124
    assert time.monotonic() - t0 < 10
    leftovers = sb.exec(["sh", "-c", "cat /proc/[0-9]*/comm"]).stdout.decode().split()
    assert "sleep" not in leftovers
    assert sb.exec(["echo", "alive"]).stdout == b"alive\n"


def test_parallel_execs_in_one_session(sb: Sandbox) -> None:
    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: sb.exec(["sh", "-c", f"sleep 1; echo {i}"]), range(8)))
    assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(8)]
    assert time.monotonic() - t0 < 6  # concurrent, not 8 s in a row


def test_many_sessions_in_parallel(engine: object, agent_image: str, workspace: Path, settings: Settings) -> None:
    def one(i: int) -> bytes:
        with Sandbox(workspace, settings=settings) as box:
            return box.exec(["sh", "-c", f"echo {i}"]).stdout

    with ThreadPoolExecutor(3) as pool:
        assert sorted(pool.map(one, range(3))) == [b"0\n", b"1\n", b"2\n"]


def test_cwd_env_and_reserved_names(sb: Sandbox, workspace: Path) -> None:
    (workspace / "sub").mkdir()
    os.chown(workspace / "sub", workspace.stat().st_uid, workspace.stat().st_gid)
    assert sb.exec(["pwd"], cwd="sub").stdout == b"/workspace/sub\n"
    assert sb.exec(["sh", "-c", "echo $X"], env={"X": "y"}).stdout == b"y\n"
    from sandman.errors import UsageError

    with pytest.raises(UsageError, match="escapes the workspace"):
        sb.exec(["pwd"], cwd="../..")
    with pytest.raises(UsageError, match="reserved"):
        sb.exec(["true"], env={"SANDMAN_SESSION": "forged"})


def test_live_update_changes_the_running_container(sb: Sandbox, engine: object) -> None:
    sb.update(cpus=0.5, memory=768 << 20, pids=99)
    hc = engine.inspect_container(sb.record.container_id)["HostConfig"]  # type: ignore[attr-defined]
    assert (hc["NanoCpus"], hc["Memory"], hc["MemorySwap"], hc["PidsLimit"]) == (
        500_000_000,
        768 << 20,
        768 << 20,
        99,
    )
    assert sb.exec(["true"]).exit_code == 0


def test_attach_from_a_second_process_and_stop_is_fast(
    engine: object, agent_image: str, workspace: Path, settings: Settings, tmp_path: Path
) -> None:
    box = Sandbox(workspace, settings=settings, owned=False)
    env = {**os.environ}
    res = subprocess.run(
        [*SANDMAN, "session", "exec", box.id, "--", "sh", "-c", "echo from-cli"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert res.stdout == "from-cli\n", res.stderr
    box.exec(["sh", "-c", "trap '' TERM; sleep 300 & echo started"])
    t0 = time.monotonic()
    stop = subprocess.run([*SANDMAN, "session", "stop", box.id], capture_output=True, text=True, env=env)
    assert stop.returncode == 0, stop.stderr
    assert time.monotonic() - t0 < 5
    assert not containers_of(engine, box.id)
    with pytest.raises(SessionGone):
        Sandbox.attach(box.id, settings=settings)


def test_idle_timeout_ends_the_session(engine: object, agent_image: str, workspace: Path, settings: Settings) -> None:
    from sandman.core.reaper import reconcile
    from sandman.policy import load_policy

    policy = load_policy().with_resources(idle_timeout_s=1.5)
    box = Sandbox(workspace, settings=settings, policy=policy, owned=False)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state = engine.inspect_container(box.record.container_id)["State"]  # type: ignore[attr-defined]
        if not state["Running"]:
            break
        time.sleep(0.2)
    report = reconcile(DockerBackend(settings, api=engine), StateStore(settings.state_dir), settings.runtime_dir)
    assert report.marked == {box.id: "expired"}
    rec = StateStore(settings.state_dir).get_session(box.id)
    assert rec is not None and rec.end_reason == "idle timeout"
    assert not containers_of(engine, box.id)


def test_kill_9_of_the_owning_process_mid_exec_then_gc_leaves_nothing(
    engine: object, agent_image: str, workspace: Path, settings: Settings
) -> None:
    """The issue's must-show, as a script users can run: scripts/crash_demo.py."""
    (workspace / "keep.txt").write_text("precious")
    script = Path(__file__).resolve().parents[2] / "scripts" / "crash_demo.py"
    res = subprocess.run(
        [sys.executable, str(script), str(workspace)],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "[FAIL]" not in res.stdout and res.stdout.count("[pass]") == 6
    assert (workspace / "keep.txt").read_text() == "precious"


def test_reconcile_marks_a_session_whose_container_vanished_as_lost(
    engine: object, agent_image: str, workspace: Path, settings: Settings
) -> None:
    from sandman.core.reaper import reconcile

    box = Sandbox(workspace, settings=settings, owned=False)
    engine.remove_container(box.record.container_id, force=True)  # type: ignore[attr-defined]
    report = reconcile(DockerBackend(settings, api=engine), StateStore(settings.state_dir), settings.runtime_dir)
    assert report.marked == {box.id: "lost"}


def test_pool_acquire_release_and_replace(
    engine: object, agent_image: str, workspace: Path, settings: Settings
) -> None:
    from sandman.core.pool import Pool

    with Pool(workspace, size=2, settings=settings) as pool:
        assert pool.ready() == 2
        first = pool.acquire()
        assert first.exec(["echo", "fresh"]).stdout == b"fresh\n"
        deadline = time.monotonic() + 30
        while pool.ready() < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool.ready() == 2  # replaced in the background
        pool.release(first)
        assert not containers_of(engine, first.id)  # destroyed, never reused
        ids = {r.id for r in StateStore(settings.state_dir).sessions(live_only=True, kind="pool")}
        assert first.id not in ids
    assert not StateStore(settings.state_dir).sessions(live_only=True, kind="pool")


def test_policy_changes_apply_live_or_say_they_need_a_new_session(
    engine: object, agent_image: str, workspace: Path, settings: Settings, tmp_path: Path
) -> None:
    from sandman.errors import UsageError
    from sandman.policy.enforce import CommandRefused

    with Sandbox(workspace, settings=settings) as box:
        assert box.exec(["sh", "-c", "echo ${MODE:-unset}"]).stdout == b"unset\n"
        newer = tmp_path / "newer.toml"
        newer.write_text(
            '[environment]\nallow = { MODE = "strict" }\n[commands]\nallow = ["sh"]\n[resources]\npids = 100\n'
        )
        applied = box.update_policy(newer)
        assert "environment.allow.MODE" in applied["next_exec"] and applied["live"] == ["resources.pids"]
        assert box.exec(["sh", "-c", "echo $MODE"]).stdout == b"strict\n"  # no restart
        with pytest.raises(CommandRefused, match="not in the allowlist"):
            box.exec(["ls"])
        hc = engine.inspect_container(box.record.container_id)["HostConfig"]  # type: ignore[attr-defined]
        assert hc["PidsLimit"] == 100
        rebuild = tmp_path / "rebuild.toml"
        rebuild.write_text('runtime = "runsc"\n[resources]\ntmpfs_size = "32m"\n')
        with pytest.raises(UsageError, match="need a new container.*resources.tmpfs_size.*runtime"):
            box.update_policy(rebuild)
        events = [e.event for e in StateStore(settings.state_dir).events(session=box.id)]
        assert "command.refused" in events and "session.policy" in events


def test_files_api_is_path_validated(sb: Sandbox, workspace: Path, settings: Settings) -> None:
    from sandman.policy.paths import PathDenied

    sb.files.write("src/app.py", "print('hi')\n")
    assert sb.exec(["python3", "src/app.py"]).stdout == b"hi\n"  # the sandbox sees it
    assert (workspace / "src" / "app.py").stat().st_uid == workspace.stat().st_uid
    assert sb.files.read("src/app.py") == b"print('hi')\n"
    (workspace / ".env").write_text("SECRET=1\n")
    (workspace / "out").symlink_to("/etc")
    for bad in (".env", "../outside", "/etc/passwd", "out/passwd"):
        with pytest.raises(PathDenied):
            sb.files.read(bad)
    with pytest.raises(PathDenied):
        sb.files.write("out/evil", "x")
    assert not Path("/etc/evil").exists()
    names = [f.path for f in sb.files.list(".")]
    assert "src" in names and ".env" not in names
    events = StateStore(settings.state_dir).events(session=sb.id)
    assert sum(1 for e in events if e.event == "path.refused") == 5


def test_a_cli_sessions_relay_survives_its_controller(
    engine: object, agent_image: str, workspace: Path, tmp_path: Path, cli_env: dict[str, str]
) -> None:
    import signal as _signal

    policy = tmp_path / "upcalls.toml"
    policy.write_text("[upcalls.helpers.noop]\n")
    env = dict(cli_env)
    created = subprocess.run(
        [*SANDMAN, "session", "create", "-w", str(workspace), "--policy", str(policy)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    sid = created.stdout.strip()
    assert created.returncode == 0 and sid.startswith("sm-"), created.stderr
    try:

        def upcall() -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [*SANDMAN, "session", "exec", sid, "--", "sandman-upcall", "noop", "alive"],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )

        assert upcall().stdout == "alive\n"
        # Kill the controller that hosts the relay (SIGKILL: no goodbye); the sandbox stays up.
        run_dir = Path(env["SANDMAN_RUNTIME_DIR"])
        for sock in run_dir.glob("controller-*.sock"):
            import socket as _socket

            with _socket.socket(_socket.AF_UNIX) as s:
                s.connect(str(sock))
                s.sendall(b'{"op": "ping"}\n')
                pid = json.loads(s.recv(4096)[5:])["pid"]
            os.kill(pid, _signal.SIGKILL)
        time.sleep(0.5)
        again = upcall()  # attach notices the dead relay and a new controller serves it
        assert again.returncode == 0 and again.stdout == "alive\n", again.stderr
    finally:
        subprocess.run([*SANDMAN, "session", "stop", sid], env=env, capture_output=True, timeout=60)
