"""Embedded state: sessions and the audit log, in SQLite under the XDG state dir.

WAL mode, so many processes (CLI calls, controllers, library users) read and write at once. The
audit log records events, verdicts and causes; callers pass nothing secret, and the writer scrubs
what it is given once more before it lands on disk.

The audit log is bounded, because what lands in it is partly chosen by the agent: a record is cut
to ``max_record_bytes`` (a long value keeps a head, its length and a sha256 prefix), the database
to ``max_bytes`` (the oldest audit records are deleted first; ``KEPT_EVENTS``, which helpers read
back to decide, are kept), records older than ``retention_s`` go, and the WAL file is
truncated to ``WAL_LIMIT`` after checkpoints. Disk used by the state dir is thus at most about
``max_bytes`` + ``WAL_LIMIT`` + one checkpoint's worth (4 MiB), whatever an agent sends.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import sqlite3
import threading
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
    policy TEXT NOT NULL DEFAULT '{}',
    backend TEXT NOT NULL DEFAULT 'docker'
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


DEFAULT_MAX_RECORD_BYTES = 4096
DEFAULT_MAX_BYTES = 64 << 20
DEFAULT_RETENTION_S = 90 * 86400.0
WAL_LIMIT = 16 << 20
# Records helpers read back to decide (the PRs and branches a session made): never evicted by the
# size cap, never dropped by a session's audit budget (retention still applies).
KEPT_EVENTS = ("gh.pr_created", "git.pushed")
_MAINTAIN_EVERY = 200  # inserts between two size checks
_TOKENISH_TAIL = re.compile(r"[A-Za-z0-9_\-+/=%.:]+$")


def digest(text: str) -> str:
    """A sha256 prefix: tells two long values apart without keeping them."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def cut(text: str, keep: int) -> str | dict[str, Any]:
    """``text`` when short; else its head, length and digest. A head never ends inside a token-like
    run (which could be half a credential the scrubber no longer recognises)."""
    if len(text) <= keep:
        return text
    head = _TOKENISH_TAIL.sub("", text[:keep]) if keep else ""
    return {"head": head, "len": len(text), "sha256": digest(text)}


def _shrink(value: Any, keep: int, depth: int = 0) -> Any:
    if isinstance(value, str):
        return cut(value, keep)
    if depth > 6:
        return "(nested too deeply)"
    if isinstance(value, dict):
        items = list(value.items())
        out: dict[str, Any] = {str(k)[:64]: _shrink(v, keep, depth + 1) for k, v in items[:32]}
        if len(items) > 32:
            out["(more keys)"] = len(items) - 32
        return out
    if isinstance(value, list | tuple):
        shown = [_shrink(v, keep, depth + 1) for v in list(value)[:32]]
        if len(value) > 32:
            shown.append({"more_items": len(value) - 32})
        return shown
    return value


def fit_detail(detail: dict[str, Any], max_bytes: int) -> str:
    """The record's JSON text, cut until it fits ``max_bytes`` (long strings first, then all of it)."""
    text = json.dumps(detail, default=str, sort_keys=True)
    if len(text) <= max_bytes:
        return text
    for keep in (256, 64, 0):
        text = json.dumps(_shrink(detail, keep), default=str, sort_keys=True)
        if len(text) <= max_bytes:
            return text
    return json.dumps({"truncated": True, "len": len(text), "sha256": digest(text), "keys": sorted(detail)[:16]})


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
    backend: str = "docker"  # what runs its layer 1 (sandman.backends)

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

    def __init__(
        self,
        state_dir: Path,
        scrub: Callable[[str], str] | None = None,
        *,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        retention_s: float = DEFAULT_RETENTION_S,
        autocheckpoint: bool = True,
    ) -> None:
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = state_dir / "sandman.db"
        self._scrub = scrub
        self.max_record_bytes, self.max_bytes, self.retention_s = max_record_bytes, max_bytes, retention_s
        self._inserts = 0
        self._lock = threading.Lock()  # one connection, shared by a relay's writer and its readers
        self._db = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA busy_timeout = 30000")
        # Many processes open the store at once (parallel sessions, CLI calls): switching to WAL and
        # creating the schema can meet a lock that busy_timeout does not cover, so retry briefly.
        for attempt in range(50):
            try:
                if self._db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                    self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=NORMAL")
                self._db.execute(f"PRAGMA journal_size_limit = {WAL_LIMIT}")
                if not autocheckpoint:  # the owner calls checkpoint() off its latency path
                    self._db.execute("PRAGMA wal_autocheckpoint = 0")
                self._db.executescript(SCHEMA)
                columns = {row[1] for row in self._db.execute("PRAGMA table_info(sessions)")}
                if "policy" not in columns:  # a state dir from before policies were recorded
                    self._db.execute("ALTER TABLE sessions ADD COLUMN policy TEXT NOT NULL DEFAULT '{}'")
                if "backend" not in columns:  # a state dir from before backends
                    self._db.execute("ALTER TABLE sessions ADD COLUMN backend TEXT NOT NULL DEFAULT 'docker'")
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

    @classmethod
    def for_settings(
        cls, settings: Any, scrub: Callable[[str], str] | None = None, autocheckpoint: bool = True
    ) -> StateStore:
        """The store with the settings' audit bounds."""
        return cls(
            settings.state_dir,
            scrub,
            max_record_bytes=settings.audit_record_max_bytes,
            max_bytes=settings.audit_max_bytes,
            retention_s=settings.audit_retention_days * 86400.0,
            autocheckpoint=autocheckpoint,
        )

    # audit ----------------------------------------------------------------------------------
    def audit(self, session: str | None, event: str, verdict: str = "ok", **detail: Any) -> None:
        # Cut first, then scrub: scrubbing cost grows with the text, and the text is the agent's.
        text = fit_detail(detail, self.max_record_bytes)
        if self._scrub is not None:
            text = self._scrub(text)
            if len(text) > self.max_record_bytes + 1024:  # redaction markers made it longer: cut again
                text = json.dumps({"truncated": True, "len": len(text)})
        with self._lock:
            self._db.execute(
                "INSERT INTO audit (ts, session, event, verdict, detail) VALUES (?, ?, ?, ?, ?)",
                (time.time(), session, event[:64], verdict[:32], text),
            )
            self._inserts += 1
            due = self._inserts % _MAINTAIN_EVERY == 0
        if due:
            self.maintain()

    def checkpoint(self) -> None:
        """Copy the WAL into the database where no reader needs it (never waits for one)."""
        with self._lock:
            self._db.execute("PRAGMA wal_checkpoint(PASSIVE)")

    def used_bytes(self) -> int:
        """Bytes of the database file in use (free pages left by deletions are reused)."""
        with self._lock:
            pages = self._db.execute("PRAGMA page_count").fetchone()[0]
            free = self._db.execute("PRAGMA freelist_count").fetchone()[0]
            size = self._db.execute("PRAGMA page_size").fetchone()[0]
        return int((pages - free) * size)

    def maintain(self) -> int:
        """Apply retention and the size cap; the number of audit records deleted."""
        deleted = 0
        with self._lock:
            cur = self._db.execute("DELETE FROM audit WHERE ts < ?", (time.time() - self.retention_s,))
            deleted += max(cur.rowcount, 0)
        kept = ", ".join("?" * len(KEPT_EVENTS))
        for _ in range(100):
            if self.used_bytes() <= self.max_bytes * 0.9:
                break
            with self._lock:
                total = self._db.execute("SELECT COUNT(*) FROM audit").fetchone()[0]
                batch = max(100, total // 10)
                cur = self._db.execute(
                    f"DELETE FROM audit WHERE id IN (SELECT id FROM audit WHERE event NOT IN ({kept}) "
                    "ORDER BY id LIMIT ?)",
                    (*KEPT_EVENTS, batch),
                )
            if cur.rowcount <= 0:
                break
            deleted += cur.rowcount
        return deleted

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
        with self._lock:
            rows = self._db.execute(query, args).fetchall()
        return [AuditEvent(r[0], r[1], r[2], r[3], r[4], json.loads(r[5])) for r in rows]
