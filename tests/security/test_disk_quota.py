"""The host's disk: a command that writes without end is stopped with cause disk-quota, its file
stays under the quota plus a bounded overshoot, every other workspace file is byte-identical, and
another session keeps working. The quota comes from the campaign's policy (it may only tighten)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import threading
from pathlib import Path

import pytest

from sandman.core.runner import ExitCause
from sandman.core.session import Sandbox
from sandman.settings import Settings
from tests.conftest import SANDMAN, make_workspace

QUOTA = 512 << 20
# The watchdog samples every 100 ms; at the few hundred MB/s a VM disk takes, plus what the
# kernel has accepted but not yet allocated, the file may pass the quota by this much at most.
OVERSHOOT = 384 << 20


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    tmp_path.chmod(0o755)
    root = tmp_path / "ws"
    (root / ".sandman").mkdir(parents=True)
    (root / ".sandman" / "policy.toml").write_text('[resources]\nworkspace_quota = "512m"\n')
    (root / "keep").mkdir()
    for i in range(5):
        (root / "keep" / f"f{i}.bin").write_bytes(os.urandom(4096))
    return make_workspace(root)


def digests(ws: Path) -> dict[str, str]:
    return {
        p.relative_to(ws).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(ws.rglob("*"))
        if p.is_file() and p.name != "big"
    }


DD = ["dd", "if=/dev/zero", "of=big", "bs=1M", "count=2000"]


def test_a_one_shot_run_that_fills_the_disk_ends_with_disk_quota(
    engine: object, agent_image: str, ws: Path, settings: Settings
) -> None:
    before = digests(ws)
    env = {**os.environ, "SANDMAN_IN_PROCESS": "1"}
    proc = subprocess.run(
        [*SANDMAN, "run", "-w", str(ws), "--json", "--", *DD],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    size = (ws / "big").stat().st_size
    print(f"one-shot: big = {size >> 20} MiB (quota {QUOTA >> 20} MiB)")
    assert result["cause"] == "disk-quota", proc.stderr
    assert "workspace_quota" in proc.stderr
    assert size < QUOTA + OVERSHOOT
    assert digests(ws) == before  # nothing else touched
    # Positive control: the same command under the quota completes normally.
    small = subprocess.run(
        [*SANDMAN, "run", "-w", str(ws), "--json", "--", "dd", "if=/dev/zero", "of=big", "bs=1M", "count=64"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert json.loads(small.stdout.strip().splitlines()[-1])["cause"] == "exit", small.stderr
    events = subprocess.run([*SANDMAN, "audit", "--json"], capture_output=True, text=True, env=env).stdout
    assert '"disk-quota"' in events


def test_a_session_exec_that_fills_the_disk_is_stopped_and_a_canary_keeps_working(
    engine: object, agent_image: str, ws: Path, settings: Settings, tmp_path: Path
) -> None:
    canary_ws = make_workspace(tmp_path / "canary")
    before = digests(ws)
    with Sandbox(ws, settings=settings) as sb, Sandbox(canary_ws, settings=settings) as canary:
        canary_out: list[bytes] = []

        def canary_loop() -> None:
            for _ in range(10):
                canary_out.append(canary.exec(["echo", "alive"]).stdout)

        t = threading.Thread(target=canary_loop)
        t.start()
        res = sb.exec(DD)
        t.join(120)
        assert res.cause == ExitCause.DISK_QUOTA, res.stderr
        assert b"workspace_quota" in res.stderr
        size = (ws / "big").stat().st_size
        print(f"session: big = {size >> 20} MiB (quota {QUOTA >> 20} MiB)")
        assert size < QUOTA + OVERSHOOT
        assert canary_out == [b"alive\n"] * 10
        # The session itself goes on; a small write works (positive control).
        (ws / "big").unlink()
        assert sb.exec(["sh", "-c", "head -c 1048576 /dev/zero > small && echo ok"]).stdout == b"ok\n"
    assert {k: v for k, v in digests(ws).items() if k != "small"} == before


def test_fallocate_cannot_reserve_past_the_quota_between_two_samples(
    engine: object, agent_image: str, ws: Path, settings: Settings
) -> None:
    # The red team's route: posix_fallocate reserved 4 GiB in 5 ms, between two samples. fallocate
    # answers EOPNOTSUPP (the C library then writes the blocks, at the disk's pace) and no file may
    # outgrow the quota (RLIMIT_FSIZE).
    script = (
        "import os\n"
        "for i in range(4):\n"
        "    fd = os.open(f'fa{i}', os.O_WRONLY | os.O_CREAT, 0o644)\n"
        "    os.posix_fallocate(fd, 0, 1 << 30)\n"
        "    os.close(fd)\n"
    )
    with Sandbox(ws, settings=settings) as sb:
        res = sb.exec(["python3", "-c", script])
    total = sum((ws / f"fa{i}").stat().st_blocks * 512 for i in range(4) if (ws / f"fa{i}").exists())
    print(f"fallocate: {total >> 20} MiB allocated (quota {QUOTA >> 20} MiB), cause {res.cause}")
    assert total < QUOTA + OVERSHOOT
    assert res.cause == ExitCause.DISK_QUOTA


MAKE_FILES = "import os\nfor i in range({n}): open(f'e{{i}}', 'w').close()\nprint('made', {n})"


@pytest.fixture
def inode_ws(tmp_path: Path) -> Path:
    tmp_path.chmod(0o755)
    root = tmp_path / "iws"
    (root / ".sandman").mkdir(parents=True)
    (root / ".sandman" / "policy.toml").write_text("[resources]\nworkspace_inode_quota = 3000\n")
    return make_workspace(root)


def test_empty_files_cannot_exhaust_the_inodes_past_the_quota(
    engine: object, agent_image: str, inode_ws: Path, settings: Settings
) -> None:
    """Empty files use inodes, not blocks: the watchdog counts both (a red-team round filled a
    filesystem's inodes with 0.4 MB of blocks). The positive control: fewer files than the quota
    are made in full, with cause exit."""
    env = {**os.environ, "SANDMAN_IN_PROCESS": "1"}

    def run(n: int) -> dict[str, object]:
        proc = subprocess.run(
            [*SANDMAN, "run", "-w", str(inode_ws), "--json", "--", "python3", "-c", MAKE_FILES.format(n=n)],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
        return result

    control = run(500)
    assert control["cause"] == "exit" and control["exit_code"] == 0
    assert len(list(inode_ws.glob("e*"))) == 500
    for p in inode_ws.glob("e*"):
        p.unlink()
    attack = run(2_000_000)
    assert attack["cause"] == "disk-quota", attack
    made = len(list(inode_ws.glob("e*")))
    assert 3000 <= made < 200_000  # stopped soon after the quota (100 ms at ~30k files/s, plus slack)


def test_the_inode_reserve_is_checked_on_every_sample(tmp_path: Path) -> None:
    """The host inode reserve alone stops a command: a reserve above what is free trips at once."""
    from sandman.core.quota import DiskWatch

    free = os.statvfs(tmp_path).f_favail
    tripped = DiskWatch(tmp_path, None, None, lambda _r: None, inode_reserve=str(free + 10**6)).check()
    assert tripped is not None and "free inodes" in tripped
    assert DiskWatch(tmp_path, None, None, lambda _r: None, inode_reserve="0").check() is None  # control
