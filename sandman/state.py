"""Embedded state: sessions and the audit log, in SQLite under the XDG state dir.

WAL mode, so many processes (CLI calls, controllers, library users) read and write at once. The
audit log records events, verdicts and causes; callers pass nothing secret, and the writer scrubs
what it is given once more before it lands on disk.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from enum import StrEnum
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    campaign TEXT NOT NULL,
    workspace TEXT NOT NULL,
    image TEXT NOT NULL,
    policy_hash TEXT NOT NULL,
    container_id TEXT,
    runtime_dir TEXT NOT NULL,
    state TEXT NOT NULL,
    owner_pid INTEGER,
    owner_start REAL,
    pool TEXT,
    uid INTEGER NOT NULL,
    gid INTEGER NOT NULL,
    limits TEXT NOT NULL,
    created REAL NOT NULL,
    last_used REAL NOT NULL,
    ended REAL,
    end_reason TEXT,
    policy TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS sessions_state ON sessions(state);
CREATE TABLE IF NOT EXISTS audit (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ts REAL NOT NULL,
    session TEXT,
    event TEXT NOT NULL,
    verdict TEXT NOT NULL,
    detail TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS audit_session ON audit(session, ts);
CREATE INDEX IF NOT EXISTS audit_ts ON audit(ts);
"""


class SessionState(StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    POOLED = "pooled"
    STOPPED = "stopped"
    EXPIRED = "expired"
    LOST = "lost"

    @property
    def live(self) -> bool:
        return self in (SessionState.STARTING, SessionState.RUNNING, SessionState.POOLED)


@dataclass
class SessionRecord:
    id: str
    kind: str
    campaign: str
    workspace: str
    image: str
    policy_hash: str
    container_id: str | None
    runtime_dir: str
    state: str
    owner_pid: int | None
    owner_start: float | None
    pool: str | None
    uid: int
    gid: int
    limits: str
    created: float
    last_used: float
    ended: float | None = None
    end_reason: str | None = None
    policy: str = "{}"  # the effective policy the session was created with (JSON)

    def as_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["limits"] = json.loads(self.limits)
        data["policy"] = json.loads(self.policy)
        return data


@dataclass(frozen=True)
class AuditEvent:
    id: int
    ts: float
    session: str | None
    event: str
    verdict: str
    detail: dict[str, Any]

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "ts": self.ts,
            "session": self.session,
            "event": self.event,
            "verdict": self.verdict,
            "detail": self.detail,
        }


class StateStore:
    """Sessions and audit events. Cheap to open; every call is its own short transaction."""

    def __init__(self, state_dir: Path, scrub: Callable[[str], str] | None = None) -> None:
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = state_dir / "sandman.db"
        self._scrub = scrub
        self._db = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA busy_timeout = 30000")
        # Many processes open the store at once (parallel sessions, CLI calls): switching to WAL and
        # creating the schema can meet a lock that busy_timeout does not cover, so retry briefly.
        for attempt in range(50):
            try:
                if self._db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                    self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=NORMAL")
                self._db.executescript(SCHEMA)
                columns = {row[1] for row in self._db.execute("PRAGMA table_info(sessions)")}
                if "policy" not in columns:  # a state dir from before policies were recorded
                    self._db.execute("ALTER TABLE sessions ADD COLUMN policy TEXT NOT NULL DEFAULT '{}'")
                break
            except sqlite3.OperationalError as exc:
                if ("locked" not in str(exc) and "busy" not in str(exc)) or attempt == 49:
                    raise
                time.sleep(0.05 + 0.01 * attempt)
        with contextlib.suppress(OSError):
            self.path.chmod(0o600)

    def close(self) -> None:
        self._db.close()

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    # sessions -------------------------------------------------------------------------------
    def add_session(self, rec: SessionRecord) -> None:
        cols = [f.name for f in fields(SessionRecord)]
        with self._tx() as db:
            db.execute(
                f"INSERT INTO sessions ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
                [getattr(rec, c) for c in cols],
            )

    def update_session(self, session_id: str, **values: Any) -> None:
        if not values:
            return
        assigns = ", ".join(f"{k} = ?" for k in values)
        with self._tx() as db:
            db.execute(f"UPDATE sessions SET {assigns} WHERE id = ?", [*values.values(), session_id])

    def end_session(self, session_id: str, state: SessionState, reason: str) -> bool:
        """Mark a live session ended; False when it had already ended (first writer wins)."""
        with self._tx() as db:
            cur = db.execute(
                "UPDATE sessions SET state = ?, ended = ?, end_reason = ? WHERE id = ? AND ended IS NULL",
                (state.value, time.time(), reason, session_id),
            )
            return cur.rowcount == 1

    def claim_pooled(self, pool: str, owner_pid: int | None, owner_start: float | None) -> SessionRecord | None:
        """Atomically take the oldest ready sandbox of ``pool`` out of it (None when empty)."""
        with self._tx() as db:
            row = db.execute(
                "SELECT id FROM sessions WHERE state = ? AND pool = ? AND ended IS NULL ORDER BY created LIMIT 1",
                (SessionState.POOLED.value, pool),
            ).fetchone()
            if row is None:
                return None
            db.execute(
                "UPDATE sessions SET state = ?, owner_pid = ?, owner_start = ?, last_used = ? WHERE id = ?",
                (SessionState.RUNNING.value, owner_pid, owner_start, time.time(), row[0]),
            )
        return self.get_session(row[0])

    def touch(self, session_id: str) -> None:
        self._db.execute("UPDATE sessions SET last_used = ? WHERE id = ?", (time.time(), session_id))

    def get_session(self, session_id: str) -> SessionRecord | None:
        row = self._db.execute(
            f"SELECT {', '.join(f.name for f in fields(SessionRecord))} FROM sessions WHERE id = ?",
            (session_id,),
        ).fetchone()
        return SessionRecord(*row) if row else None

    def sessions(self, live_only: bool = False, kind: str | None = None) -> list[SessionRecord]:
        query = f"SELECT {', '.join(f.name for f in fields(SessionRecord))} FROM sessions"
        where, args = [], []
        if live_only:
            where.append("ended IS NULL")
        if kind:
            where.append("kind = ?")
            args.append(kind)
        if where:
            query += " WHERE " + " AND ".join(where)
        return [SessionRecord(*row) for row in self._db.execute(query + " ORDER BY created", args)]

    # audit ----------------------------------------------------------------------------------
    def audit(self, session: str | None, event: str, verdict: str = "ok", **detail: Any) -> None:
        text = json.dumps(detail, default=str, sort_keys=True)
        if self._scrub is not None:
            text = self._scrub(text)
        self._db.execute(
            "INSERT INTO audit (ts, session, event, verdict, detail) VALUES (?, ?, ?, ?, ?)",
            (time.time(), session, event, verdict, text),
        )

    def events(self, session: str | None = None, since: float | None = None, limit: int = 10000) -> list[AuditEvent]:
        query = "SELECT id, ts, session, event, verdict, detail FROM audit"
        args: list[Any] = []
        where = []
        if session:
            where.append("session = ?")
            args.append(session)
        if since is not None:
            where.append("ts >= ?")
            args.append(since)
        if where:
            query += " WHERE " + " AND ".join(where)
        query += " ORDER BY id LIMIT ?"
        args.append(limit)
        return [AuditEvent(r[0], r[1], r[2], r[3], r[4], json.loads(r[5])) for r in self._db.execute(query, args)]
