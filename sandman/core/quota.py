"""The host's disk: a workspace quota and a host reserve, enforced while a command runs.

The workspace is the host's disk, and a sandbox can fill it at hundreds of MB/s. The strongest
mechanism is a filesystem project quota (the kernel refuses the write); where the workspace's
filesystem has none, a watchdog samples the filesystem's free space (``statvfs``: one syscall,
cheap enough every 100 ms; ext4 and xfs count delayed-allocation reservations as used) and stops
the command with cause ``disk-quota`` when the space used since the command started passes the
quota, or the free space falls under the reserve. The overshoot is bounded by the write rate
times the sampling interval (at 400 MB/s and 100 ms: about 40 MB). It counts every writer on that
filesystem, so a busy host shortens the budget, never lengthens it. Files already in the workspace
are never touched: the command is stopped, nothing is deleted.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SAMPLE_S = 0.1
_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


def parse_reserve(value: str | int) -> tuple[int, float]:
    """(bytes, fraction) of a reserve written as a size ("2g") or a share of the filesystem ("5%")."""
    from sandman.policy import parse_size

    if isinstance(value, str) and (m := _PERCENT.match(value)):
        share = float(m.group(1))
        if not 0 <= share < 100:
            raise ValueError("a percentage reserve must be between 0 and 100")
        return 0, share / 100
    return parse_size(value), 0.0


def parse_inode_reserve(value: str | int) -> tuple[int, float]:
    """(inodes, fraction) of an inode reserve written as a count ("100000") or a share ("5%")."""
    text = str(value).strip()
    if m := _PERCENT.match(text):
        share = float(m.group(1))
        if not 0 <= share < 100:
            raise ValueError("a percentage reserve must be between 0 and 100")
        return 0, share / 100
    if not text.isdigit():
        raise ValueError(f"expected a number of inodes or a share such as 5%, not {text!r}")
    return int(text), 0.0


@dataclass(frozen=True)
class Mechanism:
    name: str  # "project-quota" or "watchdog"
    detail: str
    stronger: str | None = None  # how to get the stronger mechanism, when not active


def mechanism(path: Path) -> Mechanism:
    """Which enforcement the workspace's filesystem allows (for doctor and the audit)."""
    opts, fstype = _mount_of(path)
    if "prjquota" in opts or "pquota" in opts:
        return Mechanism(
            "watchdog",
            f"{fstype} is mounted with project quotas, but sandman does not yet assign project ids: "
            "the statvfs watchdog is what enforces workspace_quota",
        )
    return Mechanism(
        "watchdog",
        f"{fstype} without project quotas: a statvfs watchdog samples free space every "
        f"{SAMPLE_S * 1000:.0f} ms and stops the command (bounded overshoot)",
        stronger=(
            "project quotas make the kernel refuse the write itself: ext4 `tune2fs -O project,quota DEV` "
            "and mount with `prjquota`, or xfs with `pquota`"
            if fstype in ("ext4", "xfs")
            else f"{fstype} has no project quotas: put workspaces on ext4 or xfs mounted with prjquota"
        ),
    )


def _mount_of(path: Path) -> tuple[set[str], str]:
    best, fstype = "", "unknown"
    opts: set[str] = set()
    real = os.path.realpath(path)
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return opts, fstype
    for line in lines:
        fields = line.split()
        if len(fields) < 4:
            continue
        point = fields[1].replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, fstype, opts = point, fields[2], set(fields[3].split(","))
    return opts, fstype


class DiskWatch:
    """Samples the workspace's filesystem while a command runs; calls ``on_exceed`` once."""

    def __init__(
        self,
        path: Path,
        quota: int | None,
        reserve: str | int | None,
        on_exceed: Callable[[str], None],
        interval: float = SAMPLE_S,
        inode_quota: int | None = None,
        inode_reserve: str | int | None = None,
    ) -> None:
        self.path = str(path)
        self.quota = quota
        st = os.statvfs(self.path)
        self.total = st.f_blocks * st.f_frsize
        self.free0 = st.f_bavail * st.f_frsize
        reserve_bytes, share = parse_reserve(reserve) if reserve not in (None, "", 0) else (0, 0.0)
        self.reserve = max(reserve_bytes, int(self.total * share))
        # Inodes too: empty files use no blocks, and a filesystem out of inodes fails every
        # program that creates a file on it (sandman, the engine, other sessions).
        self.inode_quota = inode_quota if st.f_files else None  # 0 files: no inode accounting (btrfs)
        self.ifree0 = st.f_favail
        inodes, ishare = parse_inode_reserve(inode_reserve) if inode_reserve not in (None, "", 0) else (0, 0.0)
        self.inode_reserve = max(inodes, int(st.f_files * ishare)) if st.f_files else 0
        self.on_exceed = on_exceed
        self.interval = interval
        self.reason: str | None = None
        self.peak_growth = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sandman-diskwatch", daemon=True)

    @property
    def exceeded(self) -> bool:
        return self.reason is not None

    def start(self) -> DiskWatch:
        if self.quota is not None or self.reserve or self.inode_quota is not None or self.inode_reserve:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2)

    def check(self) -> str | None:
        """One sample: the reason to stop, or None."""
        st = os.statvfs(self.path)
        free = st.f_bavail * st.f_frsize
        growth = self.free0 - free
        self.peak_growth = max(self.peak_growth, growth)
        if self.quota is not None and growth > self.quota:
            return f"the workspace grew by {growth >> 20} MiB, over resources.workspace_quota ({self.quota >> 20} MiB)"
        if self.reserve and free < self.reserve:
            return (
                f"the workspace's filesystem has {free >> 20} MiB free, under the host reserve "
                f"(resources.host_reserve, {self.reserve >> 20} MiB)"
            )
        created = self.ifree0 - st.f_favail
        if self.inode_quota is not None and created > self.inode_quota:
            return (
                f"{created} files were created on the workspace's filesystem, over "
                f"resources.workspace_inode_quota ({self.inode_quota})"
            )
        if self.inode_reserve and st.f_favail < self.inode_reserve:
            return (
                f"the workspace's filesystem has {st.f_favail} free inodes, under the host reserve "
                f"(resources.host_inode_reserve, {self.inode_reserve})"
            )
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                reason = self.check()
            except OSError:
                continue
            if reason is not None:
                self.reason = reason
                self.on_exceed(reason)
                return

    def __enter__(self) -> DiskWatch:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
