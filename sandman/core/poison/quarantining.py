"""Quarantine: flagged files moved out of the workspace into a host directory, with a manifest,
and the audit record of a scan."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import stat
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sandman.core.poison.model import _O_DIR, _O_FILE, Finding, QuarantinedFile, QuarantineReport, _parts_of


def quarantine_dir(state_dir: Path, label: str) -> Path:
    """Where a session's quarantined files go: ``<state_dir>/quarantine/<label>``."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", label)[:100].lstrip(".") or "quarantine"
    return Path(state_dir) / "quarantine" / safe


_NOT_FILES = frozenset({"missing", "truncated", "error", "nested-repo", "lookalike"})


def quarantine(workspace: Path, findings: Iterable[Finding], dest_dir: Path) -> QuarantineReport:
    """Move every flagged file (whole config files, hooks, ``.git`` files and symlinks, commondir,
    gitdir and alternates files, flagged editor files) out of ``workspace`` into
    ``dest_dir/files/<same path>``, and write ``dest_dir/manifest.json``.

    Every step works from directory descriptors with ``O_NOFOLLOW``: a symlink is moved as the
    link, never followed; directories are never moved. A rename is used where the destination is
    on the same filesystem, else the file is copied, synced and unlinked. Never raises for one
    file: its entry says what failed.
    """
    by_path: dict[str, list[str]] = {}
    for f in findings:
        if f.kind in _NOT_FILES or f.path in ("", "."):
            continue
        by_path.setdefault(f.path, [])
        if f.key not in by_path[f.path]:
            by_path[f.path].append(f.key)
    dest_dir = Path(dest_dir)
    report = QuarantineReport(dest_dir=str(dest_dir))
    if not by_path:
        return report
    os.makedirs(dest_dir, mode=0o700, exist_ok=True)
    dest_fd = os.open(dest_dir, _O_DIR)
    root_fd = os.open(os.path.realpath(os.fspath(workspace)), _O_DIR)
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir("files", 0o700, dir_fd=dest_fd)
        files_fd = os.open("files", _O_DIR, dir_fd=dest_fd)
        try:
            for path, keys in by_path.items():
                report.files.append(_quarantine_one(root_fd, files_fd, dest_dir / "files", path, keys))
        finally:
            os.close(files_fd)
        report.manifest = _write_manifest(dest_fd, dest_dir, workspace, report)
    finally:
        os.close(root_fd)
        os.close(dest_fd)
    return report


def _open_parts(root_fd: int, parts: Iterable[str], create: bool = False) -> int:
    fd = os.dup(root_fd)
    try:
        for name in parts:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o700, dir_fd=fd)
            nfd = os.open(name, _O_DIR, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def _quarantine_one(root_fd: int, files_fd: int, files_dir: Path, path: str, keys: list[str]) -> QuarantinedFile:
    entry = QuarantinedFile(path=path, keys=keys, method="failed")
    try:
        parts = _parts_of(path)
        if not parts:
            raise ValueError("the workspace itself")
        name = parts[-1]
        pfd = _open_parts(root_fd, parts[:-1])
    except (OSError, ValueError) as exc:
        entry.error = f"cannot reach it without following a symlink: {exc}"
        return entry
    try:
        try:
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            entry.method, entry.error = "skipped", "already gone"
            return entry
        if stat.S_ISDIR(st.st_mode):
            entry.method, entry.error = "skipped", "a directory (only its flagged files are moved)"
            return entry
        dfd = _open_parts(files_fd, parts[:-1], create=True)
        try:
            dname = name
            for i in range(1, 1000):
                try:
                    os.stat(dname, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    break
                dname = f"{name}.{i}"
            entry.dest = str(files_dir.joinpath(*parts[:-1], dname))
            if stat.S_ISREG(st.st_mode):
                entry.size = st.st_size
                entry.sha256 = _digest_at(pfd, name)
            try:
                os.rename(name, dname, src_dir_fd=pfd, dst_dir_fd=dfd)
                entry.method = "rename"
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
                _copy_then_unlink(pfd, name, dfd, dname, st)
                entry.method = "copy"
            with contextlib.suppress(FileNotFoundError):
                os.stat(name, dir_fd=pfd, follow_symlinks=False)
                entry.error = "something was written at the same path again after the move"
        finally:
            os.close(dfd)
    except OSError as exc:
        entry.method, entry.error = "failed", f"{exc.strerror or exc}"
    finally:
        os.close(pfd)
    return entry


def _digest_at(dfd: int, name: str) -> str | None:
    try:
        fd = os.open(name, _O_FILE, dir_fd=dfd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        h = hashlib.sha256()
        while b := os.read(fd, 1 << 20):
            h.update(b)
        return h.hexdigest()
    finally:
        os.close(fd)


def _copy_then_unlink(sfd: int, name: str, dfd: int, dname: str, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(name, dir_fd=sfd), dname, dir_fd=dfd)
    elif stat.S_ISREG(st.st_mode):
        src = os.open(name, _O_FILE, dir_fd=sfd)
        try:
            now = os.fstat(src)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(now.st_mode):
                raise OSError(errno.EAGAIN, "the file was replaced while being quarantined")
            dst = os.open(dname, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            try:
                while b := os.read(src, 1 << 20):
                    os.write(dst, b)
                os.fsync(dst)
            finally:
                os.close(dst)
        finally:
            os.close(src)
    else:
        raise OSError(errno.EXDEV, "a FIFO, socket or device on another filesystem: not copied")
    os.unlink(name, dir_fd=sfd)


def _write_manifest(dest_fd: int, dest_dir: Path, workspace: Path, report: QuarantineReport) -> str:
    data = {
        "workspace": os.path.realpath(os.fspath(workspace)),
        "time": time.time(),
        "note": report.note,
        "files": [f.model_dump() for f in report.files],
    }
    name = "manifest.json"
    for i in range(2, 1000):
        try:
            fd = os.open(
                name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dest_fd
            )
            break
        except FileExistsError:
            name = f"manifest-{i}.json"
    else:
        raise OSError(errno.EEXIST, "too many manifests")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
        fh.write("\n")
    return str(dest_dir / name)


def audit(store: Any, session: str | None, findings: list[Finding], report: QuarantineReport | None = None) -> None:
    """Record a scan in the audit log (``sandman.core.state.StateStore``); never raises."""
    with contextlib.suppress(Exception):
        store.audit(
            session,
            "workspace.poison",
            verdict=("quarantined" if report and report.moved else "found") if findings else "clean",
            findings=[f.model_dump() for f in findings[:200]],
            quarantine=report.model_dump() if report else None,
        )
