"""Reconcile state with the engine, by labels: the crash-recovery half of sessions.

A container with no live session is removed; a live session whose container is gone is marked
lost; a session whose owning process died is stopped; a session whose supervisor exited on its
idle or lifetime limit is marked expired; runtime dirs nobody owns are removed. The workspace is
never touched. Runs at the start of session commands and on ``sandman gc``.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandman.backends.base import LABEL_SESSION, Listed, state_id_for
from sandman.core.state import SessionState, StateStore

if TYPE_CHECKING:
    from sandman.backends.base import Backend

EXIT_IDLE, EXIT_LIFETIME = 3, 4


@dataclass
class ReconcileReport:
    removed_containers: list[str] = field(default_factory=list)
    marked: dict[str, str] = field(default_factory=dict)  # session id -> new state
    removed_runtime_dirs: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "removed_containers": self.removed_containers,
            "marked": self.marked,
            "removed_runtime_dirs": self.removed_runtime_dirs,
        }


def backends_in_use(store: StateStore, default: Backend) -> list[Backend]:
    """The default backend, and every other one a live session was created on (when it is
    available here: a session on a backend that cannot be reached is left alone)."""
    from sandman import backends

    found = [default]
    for name in sorted({r.backend for r in store.sessions(live_only=True)} - {default.name}):
        if name not in backends.REGISTRY:  # a record from another sandman version: leave it be
            continue
        cls = backends.backend_class(name)
        if cls.availability(default.settings).available:
            found.append(cls(default.settings))
    return found


def reconcile(backend: Backend | list[Backend], store: StateStore, runtime_root: Path) -> ReconcileReport:
    """Make the state store and the backends agree, for every backend given."""
    report = ReconcileReport()
    for one in backend if isinstance(backend, list) else [backend]:
        _reconcile(one, store, report)
    live = {r.id for r in store.sessions(live_only=True)}
    if runtime_root.is_dir():
        for path in runtime_root.glob("sm-*"):
            if path.is_dir() and path.name not in live:
                shutil.rmtree(path, ignore_errors=True)
                report.removed_runtime_dirs.append(path.name)
    # git-push's bare repositories of sessions that ended (a crash skipped their teardown).
    git_root = store.path.parent / "git"
    if git_root.is_dir():
        for path in git_root.glob("sm-*.git"):
            if path.name.removesuffix(".git") not in live:
                shutil.rmtree(path, ignore_errors=True)
    return report


def _reconcile(backend: Backend, store: StateStore, report: ReconcileReport) -> None:
    from sandman.core.session import owner_alive

    containers = {c.labels[LABEL_SESSION]: c for c in backend.list(state_id_for(store.path.parent))}
    records = {r.id: r for r in store.sessions(live_only=True) if r.backend == backend.name}

    def remove(container: Listed) -> None:
        backend.remove(container.id)
        report.removed_containers.append(container.id[:12])

    def end(session_id: str, state: SessionState, reason: str) -> None:
        if store.end_session(session_id, state, reason):
            store.audit(session_id, "session.reconcile", state=state.value, reason=reason)
            report.marked[session_id] = state.value

    for session_id, container in containers.items():
        rec = records.get(session_id)
        if rec is None:
            remove(container)  # an orphan: no live session claims it
            if store.get_session(session_id) is not None:
                store.audit(session_id, "session.reconcile", reason="orphan container removed")
            continue
        if not container.running:
            code = backend.status(container.id).exit_code
            remove(container)
            if code == EXIT_IDLE:
                end(session_id, SessionState.EXPIRED, "idle timeout")
            elif code == EXIT_LIFETIME:
                end(session_id, SessionState.EXPIRED, "session lifetime reached")
            else:
                end(session_id, SessionState.LOST, f"container exited with {code}")
            continue
        if not owner_alive(rec.owner_pid, rec.owner_start):
            remove(container)
            end(session_id, SessionState.STOPPED, f"owner process {rec.owner_pid} died")
    for session_id, rec in records.items():
        if session_id in containers or (
            rec.state == SessionState.STARTING and owner_alive(rec.owner_pid, rec.owner_start)
        ):
            continue
        end(session_id, SessionState.LOST, "container gone")
