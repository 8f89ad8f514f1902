"""The crash-recovery demonstration: a process creates a session and runs 100 execs; it is killed
with SIGKILL in the middle of one; `sandman gc` then reconciles. Checks that no sandman container
or runtime dir of the session is left, that the audit log is intact, and that the workspace is
untouched. Exit 0 when all holds.

Usage: .venv/bin/python scripts/crash_demo.py WORKSPACE
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import docker

from sandman.core.state import StateStore
from sandman.settings import Settings

OWNER = textwrap.dedent("""
    import sys
    from sandman.core.session import Sandbox
    sb = Sandbox(sys.argv[1])
    print(sb.id, flush=True)
    for i in range(100):
        if i == 50:
            print("mid-exec", flush=True)
            sb.exec(["sh", "-c", "echo working > /tmp/x; sleep 300"])
        sb.exec(["true"])
""")


def digest(ws: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(ws.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(ws).as_posix().encode() + p.read_bytes())
    return h.hexdigest()


def main() -> int:
    ws = Path(sys.argv[1]).resolve()
    before = digest(ws)
    settings = Settings.load()
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(ws)], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    session_id = owner.stdout.readline().strip()
    print(f"session {session_id} created by pid {owner.pid}; running 100 execs")
    assert owner.stdout.readline().strip() == "mid-exec"
    time.sleep(0.5)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    api = docker.APIClient(version="auto")
    label = {"label": f"io.sandman.session={session_id}"}
    n_left = len(api.containers(all=True, filters=label))
    print(f"killed the owner with SIGKILL mid-exec; containers left: {n_left}")
    gc = subprocess.run([sys.executable, "-m", "sandman", "gc", "--json"], capture_output=True, text=True)
    print(f"sandman gc: {gc.stdout.strip()}")
    left = api.containers(all=True, filters=label)
    dirs = list(settings.runtime_dir.glob(f"{session_id}*"))
    store = StateStore(settings.state_dir)
    rec = store.get_session(session_id)
    events = store.events(session=session_id)
    counts: dict[str, int] = {}
    for e in events:
        counts[e.event] = counts.get(e.event, 0) + 1
    checks = {
        "gc exited 0": gc.returncode == 0,
        "no container left": not left,
        "no runtime dir left": not dirs,
        "session marked stopped (owner died)": rec is not None
        and rec.state == "stopped"
        and "owner process" in (rec.end_reason or ""),
        "audit: create, 50 execs, reconcile": counts.get("session.create") == 1
        and counts.get("exec") == 50
        and counts.get("session.reconcile") == 1,
        "workspace unchanged": digest(ws) == before,
    }
    print(json.dumps({"session": session_id, "audit_events": counts, "end_reason": rec and rec.end_reason}))
    for name, ok in checks.items():
        print(f"[{'pass' if ok else 'FAIL'}] {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
