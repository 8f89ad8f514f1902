"""The local backend's limits, for real on this host: a fork bomb stopped by pids, an allocation
over the memory cap OOM-killed while one under it succeeds, and a CPU quota one can measure.

Each limit test has its control in the same test (the same workload without that limit).
The cgroup tests need root and a writable cgroup hierarchy (skipped elsewhere, failing in CI).
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator

import pytest

from sandman.backends.local_limits import HostLimits, LimitError, LimitHandle
from tests.conftest import skip_unless

MiB = 1 << 20
SUPPORT = HostLimits().probe()
CGROUPS = SUPPORT.mode != "rlimit"
needs_cgroups = skip_unless(CGROUPS and os.geteuid() == 0, f"no writable cgroups here: {SUPPORT.summary()}")


@pytest.fixture
def limits() -> Iterator[HostLimits]:
    yield HostLimits()


@pytest.fixture
def session(limits: HostLimits) -> Iterator[list[LimitHandle]]:
    """Handles made by a test; all removed (and their processes killed) afterwards."""
    made: list[LimitHandle] = []
    yield made
    for h in made:
        h.remove()


def _sid() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def _run(code: str, handle: LimitHandle | None, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-I", "-c", textwrap.dedent(code)],
        preexec_fn=handle.preexec if handle else None,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# --- cgroups -----------------------------------------------------------------------------


@needs_cgroups
def test_probe_reports_every_resource_enforced_by_cgroups() -> None:
    for name in ("cpu", "memory", "pids"):
        e = SUPPORT.get(name)
        assert e.enforced and e.exact, SUPPORT.summary()
        assert e.how.startswith("cgroup"), e


# Bounded on purpose (depth 10, two children each: at most 2047 processes, for 3 s), so a
# broken limit cannot take the machine down; with the limit it stops far below that.
BOMB = """
    import os, time
    end = time.monotonic() + 3
    depth = 0
    while depth < 10:
        kids = 0
        for _ in range(2):
            try:
                if os.fork() == 0:
                    depth += 1
                    break
                kids += 1
            except BlockingIOError:   # EAGAIN: pids.max reached
                pass
        else:
            break
    while time.monotonic() < end:
        time.sleep(0.05)
"""


@needs_cgroups
def test_fork_bomb_is_stopped_by_pids(limits: HostLimits, session: list[LimitHandle]) -> None:
    h = limits.apply(_sid(), pids=24)
    session.append(h)
    proc = subprocess.Popen([sys.executable, "-I", "-c", textwrap.dedent(BOMB)], preexec_fn=h.preexec)
    try:
        # Let the bomb saturate, then look: capped, and the kernel refused forks.
        deadline = 50
        while h.stats().get("pids_refused", 0) == 0 and deadline:
            subprocess.run(["sleep", "0.05"], check=True)
            deadline -= 1
        st = h.stats()
        assert st["pids_refused"] > 0, st
        assert 1 < st["pids_current"] <= 24, st
        assert len(h.pids()) <= 24
    finally:
        assert h.kill_all(timeout=5), h.pids()
        proc.wait(timeout=5)
    assert h.pids() == []


@needs_cgroups
def test_memory_cap_kills_above_and_allows_below(limits: HostLimits, session: list[LimitHandle]) -> None:
    h = limits.apply(_sid(), memory=128 * MiB)
    session.append(h)
    under = _run("b = b'x' * (48 << 20); print(len(b) >> 20)", h)
    assert under.returncode == 0 and under.stdout.strip() == "48", under
    over = _run("b = b'x' * (256 << 20); print('survived')", h)
    assert over.returncode == -signal.SIGKILL, over  # the OOM killer, not a MemoryError
    assert "survived" not in over.stdout
    assert h.stats()["oom_kills"] >= 1, h.stats()
    control = _run("b = b'x' * (256 << 20); print('survived')", None)  # same allocation, no cap
    assert control.returncode == 0 and "survived" in control.stdout


BUSY = """
    import time
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:
        pass
    print(time.process_time())
"""


@needs_cgroups
def test_cpu_quota_is_measurable(limits: HostLimits, session: list[LimitHandle]) -> None:
    h = limits.apply(_sid(), cpus=0.25)
    session.append(h)
    limited = float(_run(BUSY, h).stdout)
    free = float(_run(BUSY, None).stdout)
    assert 0.1 < limited < 0.45, limited  # ~0.25 s of CPU in 1 s of wall time
    assert free > 0.6, free  # control: the same loop unlimited gets (nearly) a whole CPU
    assert h.stats()["nr_throttled"] > 0


@needs_cgroups
def test_kill_all_reaches_a_tree_that_left_its_parent(limits: HostLimits, session: list[LimitHandle]) -> None:
    h = limits.apply(_sid(), pids=50)
    session.append(h)
    # A daemonised grandchild (setsid, parent gone): out of reach of process-group kills.
    proc = subprocess.Popen(
        ["sh", "-c", "setsid sh -c 'sleep 60 & sleep 60 & wait' & sleep 60"],
        preexec_fn=h.preexec,
        start_new_session=True,
    )
    for _ in range(100):
        if len(h.pids()) >= 5:
            break
        subprocess.run(["sleep", "0.02"], check=True)
    assert len(h.pids()) >= 5, h.pids()
    assert h.kill_all(timeout=5)
    proc.wait(timeout=5)
    assert h.pids() == []


@needs_cgroups
def test_update_and_remove(limits: HostLimits) -> None:
    h = limits.apply(_sid(), cpus=1.0, memory=256 * MiB, pids=100)
    try:
        h.update(cpus=0.5, memory=64 * MiB, pids=10)
        with open(f"{h.dirs['pids']}/pids.max") as f:
            assert f.read().strip() == "10"
        if SUPPORT.mode == "cgroup-v1":
            with open(f"{h.dirs['cpu']}/cpu.cfs_quota_us") as f:
                assert f.read().strip() == "50000"
            with open(f"{h.dirs['memory']}/memory.limit_in_bytes") as f:
                assert int(f.read()) == 64 * MiB
        h.update(memory=512 * MiB)  # growing past the old memsw value must work too
        sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)
        h.add(sleeper.pid)
        assert h.pids() == [sleeper.pid]
    finally:
        h.remove()
    sleeper.wait(timeout=5)
    assert all(not os.path.exists(d) for d in h.dirs.values())
    h.remove()  # idempotent


@needs_cgroups
def test_duplicate_and_invalid_session_ids_are_refused(limits: HostLimits, session: list[LimitHandle]) -> None:
    sid = _sid()
    session.append(limits.apply(sid, pids=10))
    with pytest.raises(LimitError, match="already exists"):
        limits.apply(sid, pids=10)
    for bad in ("", "../x", "a/b", ".hidden", "x" * 200):
        with pytest.raises(LimitError, match="invalid session id"):
            limits.apply(bad, pids=10)


# --- the rlimit fallback -----------------------------------------------------------------


def test_rlimit_fallback_says_what_it_does_not_enforce() -> None:
    s = HostLimits(force_rlimits=True).probe()
    assert s.mode == "rlimit"
    assert not s.cpu.enforced and "RLIMIT_CPU" in s.cpu.reason
    assert s.memory.enforced and not s.memory.exact and "virtual address space" in s.memory.reason
    assert s.pids.enforced and not s.pids.exact and "real uid" in s.pids.reason


def test_rlimit_fallback_sets_the_child_limits() -> None:
    h = HostLimits(force_rlimits=True).apply(_sid(), cpus=1, memory=512 * MiB, pids=77)
    out = _run(
        "import resource; print(resource.getrlimit(resource.RLIMIT_AS)[0], resource.getrlimit(resource.RLIMIT_NPROC)[0])",
        h,
    )
    assert out.stdout.split() == [str(512 * MiB), "77"], out
    over = _run("b = b'x' * (1024 << 20)", h)  # over RLIMIT_AS: a MemoryError, not the OOM killer
    assert over.returncode == 1 and "MemoryError" in over.stderr
    assert resource.getrlimit(resource.RLIMIT_AS)[0] != 512 * MiB  # the parent is untouched
