"""Workspace validation: clear refusals for every path sandman must not mount."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sandman.core.workspace import resolve_workspace
from sandman.errors import WorkspaceError


def test_missing_file_root_and_home_are_refused(tmp_path: Path) -> None:
    with pytest.raises(WorkspaceError, match="does not exist"):
        resolve_workspace(tmp_path / "nope")
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(WorkspaceError, match="not a directory"):
        resolve_workspace(f)
    with pytest.raises(WorkspaceError, match="never the whole filesystem"):
        resolve_workspace("/")
    with pytest.raises(WorkspaceError, match="home directory itself"):
        resolve_workspace(Path.home())
    with pytest.raises(WorkspaceError, match="NUL"):
        resolve_workspace("a\x00b")


def test_root_owned_workspace_is_refused_with_the_fix() -> None:
    # /usr/share is root-owned on every Linux host, whoever runs the test.
    with pytest.raises(WorkspaceError, match="owned by root.*chown"):
        resolve_workspace("/usr/share")


def test_symlinked_workspace_resolves_to_its_target(tmp_path: Path) -> None:
    real = tmp_path / "real dir ✓"
    real.mkdir()
    if os.geteuid() == 0:
        os.chown(real, 1000, 1000)
    link = tmp_path / "link"
    link.symlink_to(real)
    ws = resolve_workspace(link)
    assert ws.path == real.resolve()
    assert ws.uid == real.stat().st_uid
