"""Reconcile state with the engine, by labels: the crash-recovery half of sessions.

A container with no live session is removed; a live session whose container is gone is marked
lost; a session whose owning process died is stopped; a session whose supervisor exited on its
idle or lifetime limit is marked expired; runtime dirs nobody owns are removed. The workspace is
never touched. Runs at the start of session commands and on ``sandman gc``.
"""

from __future__ import annotations

import contextlib
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandman.backends.docker import LABEL_SESSION, LABEL_STATE, state_id_for
from sandman.core.state import SessionState, StateStore

if TYPE_CHECKING:
    import docker

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


def reconcile(api: docker.APIClient, store: StateStore, runtime_root: Path) -> ReconcileReport:
    from sandman.core.session import owner_alive

    report = ReconcileReport()
    mine = f"{LABEL_STATE}={state_id_for(store.path.parent)}"
    containers = {
        c["Labels"][LABEL_SESSION]: c for c in api.containers(all=True, filters={"label": [LABEL_SESSION, mine]})
    }
    records = {r.id: r for r in store.sessions(live_only=True)}

    def remove(container: dict[str, Any]) -> None:
        import docker.errors

        with contextlib.suppress(docker.errors.NotFound):
            api.remove_container(container["Id"], force=True, v=True)
        report.removed_containers.append(container["Id"][:12])

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
        if container["State"] != "running":
            code = api.inspect_container(container["Id"])["State"].get("ExitCode")
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
