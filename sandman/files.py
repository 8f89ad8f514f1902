"""Host-side file access to a session's workspace: read, write, list — every path through
``sandman.paths.validate_path`` (symlinks resolved, the real path under the real workspace root,
the deny list checked), final components opened with O_NOFOLLOW, refusals audited."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sandman.errors import UsageError
from sandman.paths import PathDenied, validate_path
from sandman.policy import Policy
from sandman.workspace import Workspace

MAX_READ = 64 << 20


@dataclass(frozen=True)
class FileInfo:
    path: str  # relative to the workspace
    is_dir: bool
    size: int


class Files:
    """``sb.files``: the workspace as the policy lets the host touch it on the agent's behalf."""

    def __init__(self, workspace: Workspace, policy: Callable[[], Policy], audit: Callable[..., None]) -> None:
        self._ws = workspace
        self._policy = policy
        self._audit = audit

    def _check(self, path: str | os.PathLike[str], must_exist: bool) -> Path:
        fs = self._policy().filesystem
        try:
            return validate_path(self._ws.path, path, deny=fs.deny, allow=fs.allow, must_exist=must_exist)
        except PathDenied as exc:
            self._audit("path.refused", "refused", path=os.fspath(path), reason=str(exc))
            raise

    def read(self, path: str | os.PathLike[str], max_bytes: int = MAX_READ) -> bytes:
        real = self._check(path, must_exist=True)
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise UsageError(f"{os.fspath(path)!r} is not a regular file")
            data = f.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise UsageError(f"{os.fspath(path)!r} is larger than {max_bytes} bytes")
        return data

    def write(self, path: str | os.PathLike[str], data: bytes | str, *, make_dirs: bool = True) -> None:
        real = self._check(path, must_exist=False)
        payload = data.encode() if isinstance(data, str) else data
        if make_dirs:
            self._make_parents(real.parent)
        fd = os.open(real, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            if os.geteuid() == 0:  # the file belongs to the workspace owner, like the sandbox's own
                os.fchown(f.fileno(), self._ws.uid, self._ws.gid)
        self._audit("file.write", "ok", path=os.fspath(path), bytes=len(payload))

    def _make_parents(self, directory: Path) -> None:
        missing = []
        while not directory.exists():
            missing.append(directory)
            directory = directory.parent
        for d in reversed(missing):
            d.mkdir()
            if os.geteuid() == 0:
                os.chown(d, self._ws.uid, self._ws.gid)

    def list(self, path: str | os.PathLike[str] = ".") -> list[FileInfo]:
        """Entries of a directory, denied ones left out (as the sandbox cannot see them either)."""
        real = self._check(path, must_exist=True)
        if not real.is_dir():
            raise UsageError(f"{os.fspath(path)!r} is not a directory")
        fs = self._policy().filesystem
        entries = []
        for entry in sorted(os.scandir(real), key=lambda e: e.name):
            rel = Path(entry.path).relative_to(self._ws.path).as_posix()
            try:
                validate_path(self._ws.path, rel, deny=fs.deny, allow=fs.allow)
            except PathDenied:
                continue
            st = entry.stat(follow_symlinks=False)
            entries.append(FileInfo(rel, entry.is_dir(follow_symlinks=False), st.st_size))
        return entries
