"""The workspace: validated once on the host before anything touches it.

A workspace must be an existing directory, not ``/`` nor the user's home itself, and not owned
by root: the sandbox runs as the workspace owner's uid:gid, and never as uid 0 (see README,
"Root-owned workspaces").
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from sandman.errors import WorkspaceError


@dataclass(frozen=True)
class Workspace:
    path: Path  # resolved, real path
    uid: int
    gid: int


def campaign_slug(name: str) -> str:
    slug = "".join(c if c.isalnum() or c in "-_." else "-" for c in name.lower()).strip("-._")
    return slug[:63] or "workspace"


def resolve_workspace(raw: str | os.PathLike[str]) -> Workspace:
    """Validate ``raw`` and return the real workspace, or raise WorkspaceError saying what to do."""
    text = os.fspath(raw)
    if not text or "\x00" in text:
        raise WorkspaceError("workspace path is empty or contains a NUL byte")
    given = Path(text).expanduser()
    if not given.exists():
        raise WorkspaceError(f"workspace {text!r} does not exist: create it or pass an existing directory")
    if not given.is_dir():
        raise WorkspaceError(f"workspace {text!r} is not a directory: pass the project's directory")
    real = given.resolve(strict=True)
    if real == Path("/"):
        raise WorkspaceError("workspace is / : pass a project directory, never the whole filesystem")
    home = Path.home().resolve()
    if real == home:
        raise WorkspaceError(f"workspace {text!r} is your home directory itself: pass a project directory inside it")
    st = real.stat()
    if st.st_uid == 0:
        raise WorkspaceError(
            f"workspace {str(real)!r} is owned by root; the sandbox runs as the workspace owner and "
            "never as uid 0. Give it to an unprivileged user (e.g. `chown -R 1000:1000 "
            f"{real}`), or run from a checkout owned by one"
        )
    return Workspace(path=real, uid=st.st_uid, gid=st.st_gid)
