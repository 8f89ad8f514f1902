"""Why a command ended: the kernel's own counters for the container's cgroup (pids limit hits,
OOM kills), ENOSPC on the capped tmpfs, and the output cap that truncates a flood.

Counters are read on the host from the container's cgroup, found through /proc/<pid>/cgroup of
its init process, so this works on cgroup v1 and v2 and with either cgroup driver.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
ENOSPC_TEXT = b"No space left on device"


@dataclass(frozen=True)
class Counters:
    pids_max_hits: int = 0
    oom_kills: int = 0


def _read_key(path: Path, key: str) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return 0


class CgroupWatch:
    """The cgroup files of one container, located once while its init process lives."""

    @classmethod
    def for_container(cls, container_id: str, pid: Callable[[], int]) -> CgroupWatch:
        """Docker's usual cgroup paths first (no engine call); else through the init's pid."""
        v1 = CGROUP_ROOT / "pids" / "docker" / container_id
        if v1.is_dir():
            watch = cls(0)
            watch.pids_events = v1 / "pids.events"
            watch.memory_files = [(CGROUP_ROOT / "memory" / "docker" / container_id / "memory.oom_control", "oom_kill")]
            return watch
        for v2 in (
            CGROUP_ROOT / "system.slice" / f"docker-{container_id}.scope",
            CGROUP_ROOT / "docker" / container_id,
        ):
            if (v2 / "pids.events").exists():
                watch = cls(0)
                watch.pids_events = v2 / "pids.events"
                watch.memory_files = [(v2 / "memory.events", "oom_kill")]
                return watch
        return cls(pid())

    def __init__(self, pid: int) -> None:
        self.pids_events: Path | None = None
        self.memory_files: list[tuple[Path, str]] = []
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
                _, controllers, rel = line.split(":", 2)
                rel = rel.lstrip("/")
                if controllers == "":  # cgroup v2: one unified hierarchy
                    base = CGROUP_ROOT / rel
                    if not base.is_dir():
                        base = CGROUP_ROOT / "unified" / rel
                    if (base / "pids.events").exists():
                        self.pids_events = base / "pids.events"
                    if (base / "memory.events").exists():
                        self.memory_files.append((base / "memory.events", "oom_kill"))
                elif "pids" in controllers.split(","):
                    self.pids_events = CGROUP_ROOT / "pids" / rel / "pids.events"
                elif "memory" in controllers.split(","):
                    self.memory_files.append((CGROUP_ROOT / "memory" / rel / "memory.oom_control", "oom_kill"))

    def read(self) -> Counters:
        pids = _read_key(self.pids_events, "max") if self.pids_events else 0
        ooms = sum(_read_key(path, key) for path, key in self.memory_files)
        return Counters(pids, ooms)


class OutputCap:
    """Pass output on until ``limit`` bytes, then a one-line notice, then nothing."""

    def __init__(self, limit: int, notice_sink: Callable[[bytes], None]) -> None:
        self.limit, self.seen, self.truncated = limit, 0, False
        self._notice = notice_sink
        self.tail = b""  # the last bytes of stderr, to recognise ENOSPC

    def take(self, data: bytes) -> bytes:
        room = self.limit - self.seen
        self.seen += len(data)
        if room >= len(data):
            return data
        if not self.truncated:
            self.truncated = True
            self._notice(
                f"\nsandman: output truncated after {self.limit} bytes (resources.max_output); "
                "the command keeps running\n".encode()
            )
        return data[: max(room, 0)]

    def note_stderr(self, data: bytes) -> None:
        self.tail = (self.tail + data)[-4096:]
