"""Poison: what an agent can leave in a workspace that makes the host user's own tools run its code.

The sandbox lets the agent write the workspace, and the host user's git obeys what it finds there:
``core.fsmonitor`` in a config runs a command on the next ``git status``; so do hooks, aliases
starting with ``!``, filters, pagers, editors... and git can be pointed at an agent-made config in
many ways besides ``.git/config`` (a ``.git`` *file* saying ``gitdir: .g``, ``.git`` renamed away and
replaced, ``commondir``, ``.git/modules/*``, linked worktrees, nested repositories, ``include.path``).
Protection inside the sandbox (read-only ``.git`` config and hooks) narrows this; this module is
the independent check afterwards, on the host, and catches what protection cannot.

:func:`scan_workspace` reads the workspace the way an attacker cannot steer: from directory
descriptors, one name at a time, with ``O_NOFOLLOW|O_NONBLOCK``; it never follows a symlink, never
opens anything but a regular file (never a FIFO or device), reads at most :data:`MAX_FILE_BYTES` of
a file and never runs git. It parses git's config syntax itself, like git's own parser
(``config.c``), and in doubt reports more, not less: lines git would refuse are skipped and
parsing goes on, and a sweep for dangerous key names catches what the parser did not read as a key.

:func:`take_baseline` before a session and ``scan_workspace(ws, baseline)`` after it report only
what is new or changed, i.e. the agent's. Both are cheap and never raise: a scan that fails or stops
early says so in a finding (kinds ``error`` and ``truncated``) that no baseline suppresses.

:func:`quarantine` moves flagged files (whole config files, hooks, pointer files) out of the
workspace into a host directory, with a manifest.

The package: the findings and limits (``model``), git's config syntax and which keys matter
(``gitconfig``), the walk (``scanner``), quarantine and audit (``quarantining``); the names below
are its API.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from sandman.core.poison.gitconfig import NOT_FLAGGED, ConfigEntry, ParsedConfig, parse_git_config
from sandman.core.poison.model import (
    _ALWAYS,
    EXIT_FOUND,
    MAX_DEPTH,
    MAX_ENTRIES,
    MAX_FILE_BYTES,
    MAX_FINDINGS,
    MAX_INCLUDE_DEPTH,
    MAX_SECONDS,
    MAX_TOTAL_BYTES,
    Baseline,
    Finding,
    Kind,
    QuarantinedFile,
    QuarantineReport,
    Status,
)
from sandman.core.poison.quarantining import audit, quarantine, quarantine_dir
from sandman.core.poison.scanner import _error, _scan

__all__ = [
    "EXIT_FOUND",
    "MAX_DEPTH",
    "MAX_ENTRIES",
    "MAX_FILE_BYTES",
    "MAX_FINDINGS",
    "MAX_INCLUDE_DEPTH",
    "MAX_SECONDS",
    "MAX_TOTAL_BYTES",
    "NOT_FLAGGED",
    "Baseline",
    "ConfigEntry",
    "Finding",
    "Kind",
    "ParsedConfig",
    "QuarantineReport",
    "QuarantinedFile",
    "Status",
    "audit",
    "parse_git_config",
    "quarantine",
    "quarantine_dir",
    "scan_workspace",
    "take_baseline",
]


def take_baseline(workspace: Path, *, limit: int = MAX_ENTRIES, max_seconds: float = MAX_SECONDS) -> Baseline:
    """What a later :func:`scan_workspace` compares with. Never raises: a failure is recorded in
    ``error`` and the later scan then reports everything."""
    try:
        r = _scan(workspace, limit, max_seconds)
        return Baseline(
            workspace=os.path.realpath(os.fspath(workspace)),
            taken=time.time(),
            findings=r.findings,
            digests=r.digests,
            gitdirs=r.gitdirs,
            truncated=r.truncated,
        )
    except Exception as exc:
        return Baseline(workspace=os.fspath(workspace), taken=time.time(), error=f"{type(exc).__name__}: {exc}")


def scan_workspace(
    workspace: Path, baseline: Baseline | None = None, *, limit: int = MAX_ENTRIES, max_seconds: float = MAX_SECONDS
) -> list[Finding]:
    """Everything in ``workspace`` that can make the host user's git (or editor, or shell) run or
    read what the agent chose; with a ``baseline``, only what is new or changed since it.

    Never raises and never runs git; a failed or truncated scan is itself a finding.
    """
    try:
        r = _scan(workspace, limit, max_seconds)
    except Exception as exc:
        return [_error(exc)]
    if baseline is None or baseline.error:
        return r.findings
    old = {f.fingerprint() for f in baseline.findings}
    old_keys = {(f.path, f.key) for f in baseline.findings}
    out: list[Finding] = []
    for f in r.findings:
        if f.kind in _ALWAYS:
            out.append(f)
        elif f.fingerprint() not in old:
            changed = (f.path, f.key) in old_keys or f.path in baseline.digests
            out.append(f.model_copy(update={"status": "changed" if changed else "new"}))
    for path, typ in baseline.gitdirs.items():
        if path not in r.gitdirs:
            out.append(
                Finding(
                    path=path,
                    key="gitdir",
                    kind="missing",
                    value=typ,
                    status="changed",
                    detail="a repository that was here before the session is gone: renamed or removed "
                    "(a directory holding HEAD, objects and refs under another name is reported separately)",
                )
            )
    return out
