"""The upcall relay: the host side of the sandbox's only door out.

One module on purpose: the per-session relay process, the bulkheads it enforces (budgets, log gate,
auditor, scan worker) and the host that spawns, feeds and revives it share the context hand-off and
the boot protocol, and the measurements below describe them as one design.

One relay per session listens on ``upcall.sock`` in the session's runtime dir (the directory, not
the socket, is bound into both layers, so a restarted relay is found again). JSON-RPC 2.0, one
object per line, bounded frames, standard error codes, many concurrent connections, a per-call
timeout, a per-session rate limit, and an audit record for every call. Nothing callable here can
change the session's policy, or see, create or stop any session.

Bulkheads: what one session may cost the others
------------------------------------------------
Decision: ONE RELAY PROCESS PER SESSION (setting ``relay_isolation = "process"``, the default).
``RelayHost`` (in the controller, or in the process that owns a library session) only supervises:
it spawns ``python -c ... relay``, hands it the session's context over a pipe (secrets never in
argv or the environment), waits for "ready", keeps the pipe as a lifeline (the relay exits when it
closes), and restarts a relay that died (``revive``, called by the controller's reaper).

What was measured (2 shared cores, load 3-5 from other jobs; tests/security/
test_noisy_neighbour.py: three sessions attacked at once -- descriptor flood, unread 400 KB
replies, refused 1 MB upcalls, blocking helpers, 900 KB slow-to-scan arguments, 200k-deep JSON --
canary = sequential noop upcalls on a fourth session, 400 samples per kind, windows interleaved):

    canary (ms)   p50 quiet/attacked  p99 quiet/attacked  host RSS growth  relay start  RSS/relay
    process       1.2-1.5 / 1.2-1.3   8.0-9.0 / 9.1-10.7  0 MB             0.21-0.27 s  44 MB
    shared        1.2 / 0.9           3.2-9.3 / 4.4-5.7   +54 MB           0.003 s      ~2 MB

So with the in-relay bulkheads below, latency holds in both modes: those bulkheads are what keep
the loop free, not the process boundary. The process is chosen for what budgets cannot enforce:
memory and descriptors the *kernel* counts per session (RLIMIT_DATA ``upcall_memory_bytes``,
RLIMIT_NOFILE ``upcall_max_fds``), so a helper that reads /dev/zero into memory or leaks
descriptors, a C extension that crashes, or a MemoryError ends that session's relay (and it is
revived) instead of the host that serves every session -- in shared mode the attack above already
cost the host 54 MB. Its price: ~0.25 s more per session start and ~44 MB per session (a fork
server sharing the imports would cut both; not done). ``relay_isolation = "shared"`` keeps every
relay on one loop in the hosting process, for hosts that cannot spare a process per session.

In every relay, whatever the mode: helpers run in threads with loops of their own
(``helpers.HelperThreads``; only ``noop``, which cannot block, runs inline); credential checks of
more than 4 KiB run in a worker process (nice 19) killed at ``upcall_scan_timeout_s``; audit
writes and WAL checkpoints happen in a writer thread, off the reply path. Per-session budgets:
connections (``upcall_max_connections``; at the cap a connection silent for 1 s makes room),
new connections per second (4x the rate), upcalls per second (checked before a frame is parsed;
the connection then waits a token's time), helper calls in progress (``upcall_max_pending``,
counted until a stuck thread really ends), bytes in flight (``upcall_max_inflight_bytes``,
requests being handled plus replies not yet read), a write deadline per reply
(``upcall_write_timeout_s``), host log lines (``upcall_log_lines_per_min``; a repeated line once
a minute) and audit records (``audit_records_per_min``). A tripped budget is audited once per
window (``audit_coalesce_s``) with a count, and a relay process whose session trips one lowers
its own CPU priority (nice 10) for a minute. The accept loop backs off on EMFILE/ENFILE (50 ms
doubling to 2 s) and says so once a minute; the hosting process's RLIMIT_NOFILE soft limit is
raised to the hard one.

Memory of one relay is bounded by: connections (32) x reader buffer (2 x MAX_FRAME) + bytes in
flight (32 MiB) + helper calls in progress (8) + one credential check (about 6 x the arguments):
about 150 MiB over the ~45 MiB it starts with, and RLIMIT_DATA (1 GiB) in any case. Measured
peak under the attack above: 45-90 MiB.

Disk a flood can cost, at the defaults: audit records are cut to 4 KiB (long arguments keep a
200-character head, their length and a sha256 prefix; arguments not checked, or holding a
credential, keep only their length), identical refusals are one record plus one count per minute,
and a session writes at most 600 records a minute (2.4 MiB) -- the rest are counted. The store
stays under ``audit_max_bytes`` (64 MiB; oldest first) plus its WAL (at most 16 MiB kept after a
checkpoint), records older than ``audit_retention_days`` go, and the controller's log rotates at
10 MiB with 3 old files kept (40 MiB). Measured: the attack above grew the state dir by < 1.1 MiB;
120 refused upcalls with 1 MB arguments by < 256 KiB (tests/upcall/test_bulkheads.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import json
import os
import queue
import re
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loguru import logger

from sandman.core.state import KEPT_EVENTS, StateStore, cut, digest
from sandman.core.workspace import Workspace
from sandman.errors import SandboxError
from sandman.policy import Policy
from sandman.settings import Settings
from sandman.upcall.helpers import (
    HelperContext,
    HelperError,
    HelperResult,
    HelperThreads,
    available_helpers,
    kill_live_groups,
)

UPCALL_DIR = "upcall"  # in the session's runtime dir; bound (as a directory) into both layers


def upcall_socket(runtime_dir: str | os.PathLike[str]) -> Path:
    """The relay's socket on the host, for a session's runtime dir."""
    return Path(runtime_dir) / UPCALL_DIR / "upcall.sock"


MAX_FRAME = 1 << 20  # one request line
MAX_DEPTH = 32  # nesting of one request
MAX_ARGS = 4096
INLINE_SCAN = 4096  # credential checks of texts up to this size run inline (worst case ~0.1 s)
EVICT_IDLE_S = 1.0  # at the connection budget, one silent this long is closed to make room
SMALL_REPLY = 4096  # replies up to this size are not counted against the bytes in flight
BACKLOG = 128
START_TIMEOUT_S = 15.0
WATCH_S = 5.0  # how often RelayHost looks for relays that died

PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS = -32700, -32600, -32601, -32602
INTERNAL_ERROR = -32603
REFUSED, HELPER_FAILED, RATE_LIMITED, FRAME_TOO_LARGE, BUSY = -32000, -32001, -32002, -32003, -32004

_EMFILE = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class RpcError(Exception):
    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code, self.message, self.data = code, message, data


@dataclass
class RelayContext:
    """What one session's relay knows: its own session and policy, nothing of any other."""

    session_id: str
    campaign: str
    workspace: Workspace
    policy: Policy
    settings: Settings
    socket_path: Path
    created_prs: set[int | tuple[str, int]] = field(default_factory=set)
    # Secrets of this session beyond the settings' (a repository's historical .env versions, host
    # variables the policy refuses): an upcall argument carrying one is refused like any other.
    extra_secrets: dict[str, str] = field(default_factory=dict)


class _Bucket:
    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.last = float(burst), time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False


def raise_nofile_limit() -> int:
    """Raise this process's RLIMIT_NOFILE soft limit to the hard limit; the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return soft


# -- log lines: a budget per session -----------------------------------------------------------


class LogGate:
    """One session's host log lines: at most ``per_min`` a minute, and a line with a ``key`` at
    most once per ``every`` seconds. What is held back is counted and said with the next line."""

    def __init__(self, session_id: str, per_min: int) -> None:
        self.session = session_id
        self.bucket = _Bucket(per_min / 60.0, max(1, min(per_min, 20)))
        self.last: dict[str, float] = {}
        self.held = 0
        self.lock = threading.Lock()

    def __call__(self, level: str, message: str, *, key: str | None = None, every: float = 60.0) -> bool:
        with self.lock:
            now = time.monotonic()
            if key is not None and now - self.last.get(key, -1e18) < every:
                self.held += 1
                return False
            if not self.bucket.take():
                self.held += 1
                return False
            if key is not None:
                self.last[key] = now
            held, self.held = self.held, 0
        suffix = f" ({held} more lines held back by the log budget)" if held else ""
        logger.log(level, "relay {}: {}{}", self.session, message[:2000].replace("\n", "\\n"), suffix)
        return True


# -- the audit trail: bounded, coalesced, off the event loop -----------------------------------


class Auditor:
    """One session's audit records, written by a thread of their own.

    ``key``ed records (refusals, budgets) are coalesced: the first of a window is written, the
    repeats within ``coalesce_s`` are counted and written as one ``<event>.repeated`` record when the
    window ends. Every record spends from a per-session budget (``per_min``); beyond it records are
    counted, one ``audit.throttled`` record says so, and one ``audit.dropped`` gives the count when
    the flood stops. ``essential`` records (a PR this session created) are never dropped."""

    QUEUE_MAX = 512

    def __init__(self, store: StateStore, session_id: str, per_min: int, coalesce_s: float, log: LogGate) -> None:
        self.store, self.session, self.log = store, session_id, log
        self.window = coalesce_s
        self.bucket = _Bucket(per_min / 60.0, max(10, per_min // 6))
        self.lock = threading.Lock()
        self.windows: dict[tuple[str, ...], dict[str, Any]] = {}
        self.dropped = 0
        self.throttled = False
        self.last_drop = 0.0
        self.queue: queue.Queue[tuple[str, str, dict[str, Any], concurrent.futures.Future[None]] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._writer, name=f"audit-{session_id}", daemon=True)
        self.thread.start()

    def record(
        self, event: str, verdict: str, *, key: tuple[str, ...] | None = None, essential: bool = False, **detail: Any
    ) -> concurrent.futures.Future[None] | None:
        """Queue a record; the future is done once it is on disk (None: coalesced or dropped)."""
        now = time.time()
        with self.lock:
            if key is not None and self.window > 0:
                wkey = (event, verdict, *key)
                win = self.windows.get(wkey)
                if win is not None and now < win["until"]:
                    win["count"] += 1
                    win["last"] = now
                    return None
                if win is not None and win["count"]:
                    self._put_locked(*self._summary(wkey, win), force=True)
                self.windows[wkey] = {"count": 0, "first": now, "last": now, "until": now + self.window}
            if not essential and not self.bucket.take():
                self.dropped += 1
                self.last_drop = now
                if not self.throttled:
                    self.throttled = True
                    self._put_locked(
                        "audit.throttled",
                        "throttled",
                        {"reason": "this session's audit budget is spent; further records are counted"},
                        force=True,
                    )
                return None
            return self._put_locked(event, verdict, detail, force=essential)

    def _summary(self, wkey: tuple[str, ...], win: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
        event, verdict, *rest = wkey
        return (
            f"{event}.repeated",
            verdict,
            {"key": list(rest), "repeated": win["count"], "first_ts": win["first"], "last_ts": win["last"]},
        )

    def _put_locked(
        self, event: str, verdict: str, detail: dict[str, Any], force: bool = False
    ) -> concurrent.futures.Future[None] | None:
        # Forced records (summaries, essential ones) are never dropped; there is at most one per
        # record that was not dropped, so the queue stays bounded by QUEUE_MAX twice over.
        if not force and self.queue.qsize() >= self.QUEUE_MAX:
            self.dropped += 1
            self.last_drop = time.time()
            return None
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.queue.put_nowait((event, verdict, detail, fut))
        return fut

    def tick(self, final: bool = False) -> None:
        """Write the summaries of ended windows (all of them when ``final``) and the drop count."""
        now = time.time()
        with self.lock:
            for wkey, win in list(self.windows.items()):
                if final or now >= win["until"]:
                    del self.windows[wkey]
                    if win["count"]:
                        self._put_locked(*self._summary(wkey, win), force=True)
            if self.dropped and (final or now - self.last_drop > 5.0):
                self._put_locked("audit.dropped", "throttled", {"dropped": self.dropped}, force=True)
                self.dropped, self.throttled = 0, False

    def _writer(self) -> None:
        next_tick = time.monotonic() + 1.0
        unsynced = 0
        while True:
            try:
                item = self.queue.get(timeout=1.0)
            except queue.Empty:
                item = ()  # type: ignore[assignment]
            if item is None:
                break
            if item:
                event, verdict, detail, fut = item
                try:
                    self.store.audit(self.session, event, verdict, **detail)
                    unsynced += 1
                    fut.set_result(None)
                except Exception as exc:  # a full disk must not end the relay
                    fut.set_exception(exc)
                    self.log("ERROR", f"audit write failed: {exc!r}", key="audit-write")
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + 1.0
                self.tick()
                # Checkpoints (with their fsync) happen here, after the replies went out.
                if unsynced and self.queue.empty():
                    unsynced = 0
                    with contextlib.suppress(Exception):
                        self.store.checkpoint()
        with contextlib.suppress(Exception):
            self.store.checkpoint()

    def close(self, timeout: float = 5.0) -> None:
        self.tick(final=True)
        self.queue.put(None)
        self.thread.join(timeout)


# -- credential checks of large texts: a process a deadline can kill -----------------------------


_BOOT = "import sys; from sandman.upcall.relay import _main; sys.exit(_main(sys.argv[1]))"
_LEN = struct.Struct(">I")


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("MALLOC_ARENA_MAX", "2")  # threads without an arena each: less memory per relay
    return env


def _secrets(settings: Settings) -> dict[str, str]:
    return {n: v.get_secret_value() for n, v in settings.secrets.items()}


def _make_scrubber(secrets: dict[str, str], key: bytes) -> Any:
    from sandman.secrets.scrub import EXAMPLE_KEYS, Scrubber

    # make_scrubber()'s scrubber, with a key of this relay's: the worker's fingerprints match ours.
    return Scrubber(secrets, patterns=True, allowlist=EXAMPLE_KEYS, fingerprint_key=key)


def _write_frame(fd: int, data: bytes, deadline: float) -> None:
    view = memoryview(_LEN.pack(len(data)) + data)
    while view:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([], [fd], [], left)[1]:
            raise TimeoutError
        view = view[os.write(fd, view[: 1 << 20]) :]


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError("the scan worker closed its pipe")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


class ScanWorker:
    """Scans and scrubs in a child process (nice 19, its own memory limit). A call that takes longer
    than ``timeout`` kills the worker and raises TimeoutError; the next call starts a fresh one."""

    def __init__(self, secrets: dict[str, str], key: bytes, timeout: float) -> None:
        self.config = json.dumps({"secrets": secrets, "key": key.hex()}).encode()
        self.timeout = timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.lock = threading.Lock()
        self.closed = False

    def _spawn(self) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, "scan-worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd="/",
            env=_child_env(),
            close_fds=True,
            start_new_session=True,
        )
        assert proc.stdin is not None
        _write_frame(proc.stdin.fileno(), self.config, time.monotonic() + START_TIMEOUT_S)
        return proc

    def call(self, op: str, text: str) -> Any:
        with self.lock:
            if self.closed:
                raise ConnectionError("the relay is stopping")
            if self.proc is None or self.proc.poll() is not None:
                self.proc = self._spawn()
            proc = self.proc
            assert proc.stdin is not None and proc.stdout is not None
            payload = json.dumps({"op": op, "text": text}).encode()
            deadline = time.monotonic() + self.timeout
            try:
                _write_frame(proc.stdin.fileno(), payload, deadline)
                (n,) = _LEN.unpack(_read_exact(proc.stdout.fileno(), _LEN.size, deadline))
                return json.loads(_read_exact(proc.stdout.fileno(), n, deadline))
            except (TimeoutError, OSError, ConnectionError, ValueError):
                self._kill()
                raise TimeoutError(f"not checked within {self.timeout:g}s") from None

    def _kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(Exception):
                proc.wait(5)
            for pipe in (proc.stdin, proc.stdout):
                with contextlib.suppress(Exception):
                    pipe.close()  # type: ignore[union-attr]

    def close(self) -> None:
        self.closed = True
        if self.lock.acquire(timeout=0.1):
            try:
                self._kill()
            finally:
                self.lock.release()
        elif self.proc is not None:  # a call is running: kill it under its feet
            with contextlib.suppress(Exception):
                self.proc.kill()


def _scan_worker_main() -> int:
    config = json.loads(_read_exact(0, _LEN.unpack(_read_exact(0, _LEN.size, None))[0], None))
    with contextlib.suppress(OSError):
        os.nice(19)  # a slow scan yields the CPU to every other session's relay
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_DATA, (512 << 20, 512 << 20))
    scrubber = _make_scrubber(config["secrets"], bytes.fromhex(config["key"]))
    while True:
        try:
            head = _read_exact(0, _LEN.size, None)
        except ConnectionError:
            return 0
        request = json.loads(_read_exact(0, _LEN.unpack(head)[0], None))
        if request["op"] == "scan":
            result: Any = [[f.kind, f.fingerprint] for f in scrubber.scan_text(request["text"])]
        else:
            result = scrubber.scrub_text(request["text"])[0]
        data = json.dumps(result).encode()
        _write_frame(1, data, time.monotonic() + 60)


# -- what a credential check looks at ----------------------------------------------------------

# Whitespace, controls and characters that render as nothing (zero-width, joiners, bidi marks,
# variation selectors, tags, fillers): removed before the "as it will be read" checks.
_INVISIBLE = re.compile(
    "[\\s\x00-\x1f\x7f-\x9f\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b-\u200f"
    "\u2028-\u202e\u2060-\u206f\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff0-\ufffb\U000e0000-\U000e0fff]"
)
_FLAG = re.compile(r"^(?:--[a-z][a-z0-9-]{0,30}|-[A-Za-z]?)$")  # a flag, or "-" for stdin


# Unicode's Default_Ignorable_Code_Point set is, but for a few Hangul fillers listed above, within
# these categories: format characters (Cf) and the marks that render on nothing here (Mn, Me:
# variation selectors, the combining grapheme joiner, and combining accents a check may drop).
_DROPPED_CATEGORIES = frozenset({"Cf", "Mn", "Me", "Cc", "Zs", "Zl", "Zp", "Co", "Cs", "Cn"})


def _visible(text: str) -> str:
    """The text as a reader (or a program that ignores invisible characters) would take it: every
    whitespace, control, format and combining character removed, compatibility forms folded."""
    # Decomposed first, so a combining mark is dropped rather than composed into its letter.
    text = _INVISIBLE.sub("", unicodedata.normalize("NFKD", text))
    if not text.isascii():
        text = "".join(c for c in text if unicodedata.category(c) not in _DROPPED_CATEGORIES)
    return unicodedata.normalize("NFKC", text)


_JUNCTION = 600  # a token is at most scrub.MAX_TOKEN (512) bytes: this much each side of a join holds it


def _junctions(pieces: list[str]) -> list[str]:
    """The joins of consecutive pieces, two and three at a time, each cut to what a token spanning
    the join can reach: where the whole concatenation would glue a word before a token's start
    (and patterns that need a boundary there would miss it), these start afresh."""
    out = []
    for i in range(len(pieces) - 1):
        left, mid = pieces[i][-_JUNCTION:], pieces[i + 1]
        out.append(left + mid[:_JUNCTION])
        if i + 2 < len(pieces) and len(mid) <= _JUNCTION:
            out.append(left + mid + pieces[i + 2][:_JUNCTION])
    return out


def check_texts(args: list[str], stdin: str | None) -> list[str]:
    """Every form of the arguments a credential is looked for in, as they will be used and read.

    Each argument and stdin; all arguments concatenated without separators; the values alone
    concatenated (flags like ``--body`` dropped, ``--title=x`` kept as ``x``), so a secret split
    between a title and a body is whole again; the joins of consecutive values (see
    ``_junctions``); and all of those again with whitespace, controls and invisible characters
    (zero-width, joiners, bidi marks, variation selectors, tags) removed, after NFKC (full-width
    look-alikes read as what they look like). About six times the arguments' size in all."""
    values = []
    for a in args:
        if _FLAG.match(a):
            continue
        values.append(a.split("=", 1)[1] if a.startswith("--") and "=" in a else a)
    tail = [stdin] if stdin else []
    forms: dict[str, None] = {}
    for view in (lambda t: t, _visible):
        seen_args = [view(a) for a in args]
        seen_values = [view(v) for v in (*values, *tail)]
        seen_tail = [view(t) for t in tail]
        for text in (
            *seen_args,
            *seen_tail,
            "".join(seen_args) + "".join(seen_tail),
            "".join(seen_values),
            *_junctions(seen_values),
        ):
            if text:
                forms.setdefault(text, None)
    return list(forms)


def _too_deep(value: Any, limit: int) -> bool:
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth >= limit:
            return True
        stack.extend((c, depth + 1) for c in children)
    return False


# -- one session's relay -----------------------------------------------------------------------


THROTTLED_NICE = 10  # a relay whose session trips a budget runs at this nice value...
NICE_HOLD_S = 60.0  # ...until this long without another trip


def _renice(value: int) -> bool:
    """Set every thread of this process to ``value`` (Linux nice values are per thread; threads
    started later inherit their creator's). False when not permitted."""
    ok = True
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, value)
        except ProcessLookupError:
            pass
        except OSError:
            ok = False
    return ok


class _InFlight:
    """Bytes of requests being handled and replies not yet taken by their clients."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used = max(0, self.used - n)


class Relay:
    """One session's JSON-RPC server, on whatever event loop runs it (its own process by default)."""

    def __init__(self, ctx: RelayContext) -> None:
        self.ctx = ctx
        s = ctx.settings
        self.settings = s
        self.bucket = _Bucket(s.upcall_rate_per_s, s.upcall_rate_burst)
        # New connections: a few per upcall the rate allows (a client may retry or list first).
        self.accepts = _Bucket(4 * s.upcall_rate_per_s, s.upcall_rate_burst + s.upcall_max_connections)
        self.helpers = available_helpers(ctx.policy, s)
        self.log = LogGate(ctx.session_id, s.upcall_log_lines_per_min)
        key = os.urandom(32)
        secrets = {**ctx.extra_secrets, **_secrets(s)}
        # Upcall arguments are the one channel out of the sandbox: a credential in them blocks the call.
        self.leak_check = _make_scrubber(secrets, key)
        self.worker = ScanWorker(secrets, key, s.upcall_scan_timeout_s)
        self.state = StateStore.for_settings(s, scrub=self.scrub, autocheckpoint=False)  # the Auditor does it
        with contextlib.suppress(Exception):
            self.state.maintain()
        self.audit = Auditor(self.state, ctx.session_id, s.audit_records_per_min, s.audit_coalesce_s, self.log)
        # PRs this session created survive a relay restart: they are in the audit log.
        for event in self.state.events(session=ctx.session_id):
            if event.event == "gh.pr_created":
                ctx.created_prs.add((str(event.detail["repo"]), int(event.detail["number"])))
        self.inflight = _InFlight(s.upcall_max_inflight_bytes)
        self.pending = 0
        self.pending_lock = threading.Lock()
        self.conns: set[asyncio.Task[None]] = set()
        self.idle: dict[asyncio.Task[None], float] = {}  # connections waiting for a request, oldest first
        self.wakeup = False
        self.doomed: set[asyncio.Task[None]] = set()  # cancelled to make room, not yet gone
        self.listener: socket.socket | None = None
        self.sock_ino = -1
        self.loop: asyncio.AbstractEventLoop | None = None
        self.accepting = False
        self.backoff = 0.0
        self.backoff_until = 0.0
        self.closed = False
        self.own_process = False  # set by the relay process: only then may it renice itself
        self.niced = False
        self.last_trip = 0.0
        self.scan_slot: asyncio.Semaphore | None = None
        self.pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix=f"scan-{ctx.session_id}")
        self.threads = HelperThreads(ctx.session_id, self._helper_loop_error)

    def scrub(self, text: str) -> str:
        return str(self.leak_check.scrub_text(text)[0])

    def _helper_loop_error(self, message: str) -> None:
        self.log("WARNING", message, key=message[:60])

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.scan_slot = asyncio.Semaphore(1)
        path = self.ctx.socket_path
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(path))
            self.sock_ino = os.stat(path).st_ino
            os.chmod(path, 0o600)
            if os.geteuid() == 0:
                os.chown(path, self.ctx.workspace.uid, self.ctx.workspace.gid)
            sock.listen(BACKLOG)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self.listener = sock
        self._accept_on()

    async def stop(self) -> None:
        self.closed = True
        self._accept_off()
        if self.listener is not None:
            self.listener.close()
        for task in list(self.conns):
            task.cancel()
        if self.conns:
            await asyncio.wait(list(self.conns), timeout=2)
        with contextlib.suppress(FileNotFoundError):
            if os.stat(self.ctx.socket_path).st_ino == self.sock_ino:  # not a successor's socket
                self.ctx.socket_path.unlink()
        self.worker.close()
        await asyncio.get_running_loop().run_in_executor(None, self.audit.close)
        self.pool.shutdown(wait=False, cancel_futures=True)
        await asyncio.get_running_loop().run_in_executor(None, self.threads.close)
        kill_live_groups()  # a relay that stops leaves no helper process behind
        self.state.close()

    # -- accepting: a connection budget, and no log line per failed attempt --------------------
    def _accept_on(self) -> None:
        if not self.accepting and not self.closed and self.listener is not None and self.loop is not None:
            self.loop.add_reader(self.listener.fileno(), self._on_accept)
            self.accepting = True

    def _accept_off(self) -> None:
        if self.accepting and self.listener is not None and self.loop is not None:
            self.loop.remove_reader(self.listener.fileno())
            self.accepting = False

    def _on_accept(self) -> None:
        assert self.listener is not None and self.loop is not None
        for _ in range(32):
            if len(self.conns) - len(self.doomed) >= self.settings.upcall_max_connections:
                self._budget("connections", f"{self.settings.upcall_max_connections} connections open")
                oldest = next(iter(self.idle), None)
                wait = EVICT_IDLE_S - (time.monotonic() - self.idle[oldest]) if oldest is not None else None
                if oldest is None or wait is None or wait > 0:
                    # All are in calls or just sent one: the rest wait in the backlog until a
                    # connection ends, or has sent nothing for EVICT_IDLE_S.
                    self._accept_off()
                    if not self.wakeup:
                        self.wakeup = True
                        self.loop.call_later(EVICT_IDLE_S if wait is None else wait, self._wake)
                    return
                del self.idle[oldest]  # a connection that sends nothing makes room
                self.doomed.add(oldest)
                oldest.cancel()
            if not self.accepts.take():
                # New connections beyond the session's pace wait in the backlog a token's time:
                # a connect-and-close flood costs its relay little CPU.
                self._budget("connection rate", f"over {self.accepts.rate:g} new connections/s")
                self._accept_off()
                self.backoff_until = time.monotonic() + 1.0 / self.accepts.rate
                self.loop.call_later(1.0 / self.accepts.rate, self._accept_on)
                return
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                self.accepts.tokens += 1  # nobody was waiting: the token goes back
                return
            except OSError as exc:
                self._accept_off()
                if exc.errno in _EMFILE:
                    self.backoff = min(2.0, max(0.05, self.backoff * 2))
                    self._budget("descriptors", f"accept failed: {errno.errorcode.get(exc.errno or 0, exc)}")
                else:
                    self.backoff = 0.05
                self.log("WARNING", f"cannot accept ({exc.strerror}); backing off", key=f"accept-{exc.errno}")
                self.backoff_until = time.monotonic() + self.backoff
                self.loop.call_later(self.backoff, self._accept_on)
                return
            self.backoff = 0.0
            conn.setblocking(False)
            task = self.loop.create_task(self._serve(conn))
            self.conns.add(task)
            task.add_done_callback(self._conn_done)

    def _wake(self) -> None:
        self.wakeup = False
        if time.monotonic() >= self.backoff_until:
            self._accept_on()

    def _conn_done(self, task: asyncio.Task[None]) -> None:
        self.conns.discard(task)
        self.doomed.discard(task)
        self.idle.pop(task, None)
        if time.monotonic() >= self.backoff_until:
            self._accept_on()

    def _budget(self, which: str, detail: str) -> None:
        """A budget tripped: audited once per window, logged once per minute, and (in a relay
        process of its own) the process yields the CPU to every other session's relay."""
        self.audit.record("relay.budget", "throttled", key=(which,), budget=which, detail=detail)
        self.log("WARNING", f"budget '{which}' exceeded: {detail}", key=f"budget-{which}")
        self.last_trip = time.monotonic()
        if self.own_process and not self.niced:
            self.niced = True
            _renice(THROTTLED_NICE)
            assert self.loop is not None
            self.loop.call_later(NICE_HOLD_S, self._maybe_unnice)

    def _maybe_unnice(self) -> None:
        """Back to normal priority after NICE_HOLD_S without a budget tripping (when allowed to:
        lowering a nice value needs CAP_SYS_NICE; without it a throttled relay stays niced)."""
        assert self.loop is not None
        quiet = time.monotonic() - self.last_trip
        if quiet < NICE_HOLD_S:
            self.loop.call_later(NICE_HOLD_S - quiet, self._maybe_unnice)
        elif _renice(0):
            self.niced = False

    # -- one connection ------------------------------------------------------------------------
    async def _serve(self, conn: socket.socket) -> None:
        s = self.settings
        writer: asyncio.StreamWriter | None = None
        try:
            reader, writer = await asyncio.open_unix_connection(sock=conn, limit=MAX_FRAME)
            writer.transport.set_write_buffer_limits(high=1 << 16)
            me = asyncio.current_task()
            assert me is not None
            while True:
                self.idle[me] = time.monotonic()  # waiting for a request: evicted first when the budget is full
                try:
                    line = await asyncio.wait_for(reader.readline(), s.upcall_idle_timeout_s)
                except (asyncio.LimitOverrunError, ValueError):
                    await self._send(writer, _error(None, FRAME_TOO_LARGE, f"frame larger than {MAX_FRAME} bytes"))
                    return
                except TimeoutError:
                    return
                finally:
                    self.idle.pop(me, None)
                if not line:
                    return
                size = len(line)
                if not self.bucket.take():
                    # Refused before it is even parsed, and this connection waits a token's time
                    # before its next line: a flood costs its session's relay little CPU.
                    self._budget("rate", f"over {s.upcall_rate_per_s:g} upcalls/s")
                    limited = _error(None, RATE_LIMITED, "rate limit: too many upcalls; slow down")
                    del line
                    if not await self._send(writer, limited):
                        return
                    await asyncio.sleep(1.0 / s.upcall_rate_per_s)
                    continue
                if not self.inflight.take(size):
                    self._budget("bytes in flight", f"{s.upcall_max_inflight_bytes} bytes buffered")
                    response: dict[str, Any] | None = _error(None, BUSY, "busy: too many bytes in flight; retry")
                else:
                    try:
                        response = await self._handle_line(line)
                    finally:
                        self.inflight.give(size)
                del line
                if response is not None and not await self._send(writer, response):
                    return
        except (ConnectionError, OSError):
            pass
        finally:
            if writer is not None:
                writer.transport.abort()
            else:
                conn.close()

    async def _send(self, writer: asyncio.StreamWriter, message: dict[str, Any]) -> bool:
        """Write one reply; False when the client did not take it within the write deadline."""
        data = json.dumps(message).encode() + b"\n"
        counted = len(data) if len(data) > SMALL_REPLY else 0
        if counted and not self.inflight.take(counted):
            self._budget("bytes in flight", f"a {len(data)}-byte reply over {self.inflight.used} unread")
            data = (
                json.dumps(_error(message.get("id"), BUSY, "reply dropped: too many unread replies")) + "\n"
            ).encode()
            counted = 0
        try:
            writer.write(data)
            del data
            await asyncio.wait_for(writer.drain(), self.settings.upcall_write_timeout_s)
            return True
        except TimeoutError:
            self._budget("write deadline", f"a reply was not read within {self.settings.upcall_write_timeout_s:g}s")
            writer.transport.abort()
            return False
        finally:
            self.inflight.give(counted)

    async def _handle_line(self, line: bytes) -> dict[str, Any] | None:
        try:
            request = json.loads(line)
        except RecursionError:
            return _error(None, PARSE_ERROR, f"parse error: nested deeper than {MAX_DEPTH} levels")
        except (ValueError, UnicodeDecodeError):
            return _error(None, PARSE_ERROR, "parse error: one JSON object per line")
        if _too_deep(request, MAX_DEPTH):
            return _error(None, INVALID_REQUEST, f"invalid request: nested deeper than {MAX_DEPTH} levels")
        if (
            not isinstance(request, dict)
            or request.get("jsonrpc") != "2.0"
            or not isinstance(request.get("method"), str)
        ):
            return _error(
                _id(request.get("id")) if isinstance(request, dict) else None,
                INVALID_REQUEST,
                "invalid request: need jsonrpc '2.0' and a method",
            )
        rid = request.get("id")
        if rid is not None and (not isinstance(rid, str | int) or isinstance(rid, bool) or len(str(rid)) > 128):
            return _error(None, INVALID_REQUEST, "invalid request: id must be a string or a number")
        params = request.get("params", {})
        if not isinstance(params, dict):
            return _error(rid, INVALID_PARAMS, "params must be an object")
        try:
            result = await self._dispatch(request["method"], params)
        except RpcError as exc:
            return None if rid is None else _error(rid, exc.code, exc.message, exc.data)
        except Exception as exc:  # never a dropped connection without an answer
            self.log("ERROR", f"internal error: {exc!r}", key=f"internal-{type(exc).__name__}")
            return None if rid is None else _error(rid, INTERNAL_ERROR, "internal error")
        return None if rid is None else {"jsonrpc": "2.0", "id": rid, "result": result}

    async def _dispatch(self, method: str, params: dict[str, Any]) -> Any:
        ctx = self.ctx
        if method == "upcall.list":
            return [{"name": name, "description": h.description} for name, h in sorted(self.helpers.items())]
        if method == "session.info":
            res = ctx.policy.resources
            return {
                "session_id": ctx.session_id,
                "campaign": ctx.campaign,
                "helpers": sorted(self.helpers),
                "limits": {"cpus": res.cpus, "memory": res.memory, "pids": res.pids},
            }
        if method == "session.report":
            kind, message = params.get("kind"), params.get("message")
            if not isinstance(kind, str) or not isinstance(message, str) or len(kind) > 64 or len(message) > 8192:
                raise RpcError(INVALID_PARAMS, "session.report needs kind (<= 64 chars) and message (<= 8 KiB)")
            if await self._findings([kind, message], None):
                # The audit is a way out too: a report holding a credential is refused like an upcall.
                await self._written(
                    self.audit.record("session.report", "refused", kind_len=len(kind), len=len(message))
                )
                raise RpcError(REFUSED, "session.report refused: it holds what looks like a credential")
            await self._written(self.audit.record("session.report", "ok", kind=kind, message=message))
            return {"ok": True}
        if method == "upcall.exec":
            return await self._exec(params)
        raise RpcError(METHOD_NOT_FOUND, f"method not found: {method[:64]}")

    # -- credential checks ---------------------------------------------------------------------
    async def _worker_call(self, op: str, text: str) -> Any:
        """A large check: one at a time per session, in the worker process, under a deadline."""
        assert self.scan_slot is not None and self.loop is not None
        timeout = self.settings.upcall_scan_timeout_s
        try:
            await asyncio.wait_for(self.scan_slot.acquire(), timeout)
        except TimeoutError:
            self._budget("scans", "a credential check waited for another one too long")
            raise
        try:
            return await self.loop.run_in_executor(self.pool, self.worker.call, op, text)
        finally:
            self.scan_slot.release()

    async def _findings(self, args: list[str], stdin: str | None) -> list[tuple[str, str]]:
        text = "\x00".join(check_texts(args, stdin))  # NUL: no pattern reads across it
        if len(text) <= INLINE_SCAN:
            return [(f.kind, f.fingerprint) for f in self.leak_check.scan_text(text)]
        return [(k, fp) for k, fp in await self._worker_call("scan", text)]

    async def _scrubbed(self, text: str) -> str:
        if len(text) <= INLINE_SCAN:
            return self.scrub(text)
        return str(await self._worker_call("scrub", text))

    # -- upcall.exec ---------------------------------------------------------------------------
    async def _exec(self, params: dict[str, Any]) -> dict[str, Any]:
        s = self.settings
        name, args, stdin = params.get("helper"), params.get("args", []), params.get("stdin")
        if (
            not isinstance(name, str)
            or len(name) > 128
            or not isinstance(args, list)
            or len(args) > MAX_ARGS
            or not all(isinstance(a, str) for a in args)
        ):
            raise RpcError(INVALID_PARAMS, "upcall.exec needs helper (string) and args (list of strings)")
        if stdin is not None and (not isinstance(stdin, str) or len(stdin) > MAX_FRAME // 2):
            raise RpcError(INVALID_PARAMS, "stdin must be a string under 512 KiB")
        if any("\x00" in a for a in args):
            raise RpcError(INVALID_PARAMS, "args contain a NUL byte")
        started = time.monotonic()
        helper = self.helpers.get(name)
        if helper is None:  # refused before any scan: a flood of these costs little
            reason = "helper not allowed by this session's policy"
            await self._record(name, args, "refused", None, started, reason, key=(name[:64], reason), text=False)
            raise RpcError(REFUSED, f"helper {name[:64]!r} is not allowed in this session: see `sandman-upcall list`")
        try:
            findings = await self._findings(args, stdin)
        except TimeoutError:
            reason = f"arguments not checked for credentials within {s.upcall_scan_timeout_s:g}s"
            await self._record(
                name, args, "refused", None, started, reason, key=(name[:64], "scan timeout"), text=False
            )
            raise RpcError(REFUSED, f"upcall refused: {reason}") from None
        if findings:
            what = ", ".join(sorted({f"{kind} ({fp})" for kind, fp in findings}))
            reason = f"credential in the arguments: {what}"
            await self._record(name, args, "refused", None, started, reason, key=(name[:64], reason), text=False)
            raise RpcError(REFUSED, f"upcall refused: its arguments hold what looks like a credential: {what}")
        inline = getattr(helper, "inline", False)  # cannot block (noop): on this loop, not counted
        if not inline:
            with self.pending_lock:
                busy = self.pending >= s.upcall_max_pending
                if not busy:
                    self.pending += 1
            if busy:
                self._budget("pending calls", f"{s.upcall_max_pending} helper calls in progress")
                raise RpcError(BUSY, f"busy: {s.upcall_max_pending} upcalls in progress in this session; retry later")

        def record(event: str, **detail: Any) -> None:
            self.audit.record(event, "ok", essential=event in KEPT_EVENTS, **detail)

        hctx = HelperContext(
            self.ctx.session_id, self.ctx.workspace, s, self.ctx.created_prs, record=record, policy=self.ctx.policy
        )
        timeout = s.upcall_call_timeout_s

        def done(_: Any) -> None:
            with self.pending_lock:  # counted until its thread ends, even after the reply went out
                self.pending -= 1

        running: asyncio.Future[HelperResult]
        if inline:
            running = asyncio.ensure_future(asyncio.wait_for(helper.run(args, stdin, hctx), timeout))
        else:
            future = self.threads.submit(helper, args, stdin, hctx, timeout)
            future.add_done_callback(done)
            running = asyncio.wrap_future(future)
        try:
            result: HelperResult = await asyncio.wait_for(asyncio.shield(running), timeout + 2)
        except HelperError as exc:
            reason = str(exc)
            await self._record(name, args, "refused", None, started, reason, key=(name[:64], digest(reason)[:32]))
            raise RpcError(REFUSED, reason[:4096]) from None
        except TimeoutError:
            reason = f"no answer within {timeout:.0f}s"
            await self._record(name, args, "timeout", None, started, reason, key=(name[:64], "timeout"))
            raise RpcError(HELPER_FAILED, f"helper {name!r} timed out after {timeout:.0f}s") from None
        except Exception as exc:
            reason = f"helper raised {type(exc).__name__}"
            self.log("ERROR", f"helper {name!r} failed: {exc!r}", key=f"helper-{name[:64]}")
            await self._record(name, args, "failed", None, started, reason, key=(name[:64], reason))
            raise RpcError(HELPER_FAILED, f"helper {name!r} failed: {type(exc).__name__}") from None
        try:
            stdout, stderr = await self._scrubbed(result.stdout), await self._scrubbed(result.stderr)
        except TimeoutError:
            stdout, stderr = "", "sandman: output withheld: it was not checked for credentials in time\n"
        await self._record(name, args, "ok" if result.exit_code == 0 else "failed", result.exit_code, started, "")
        return {"exit_code": result.exit_code, "stdout": stdout, "stderr": stderr, "truncated": result.truncated}

    async def _record(
        self,
        helper: str,
        args: list[str],
        verdict: str,
        code: int | None,
        started: float,
        reason: str,
        key: tuple[str, ...] | None = None,
        text: bool = True,
    ) -> None:
        """Audit one upcall: the arguments cut to a head, length and digest when long; lengths only
        (no text) unless they were checked for credentials and held none."""
        shown: list[Any] = []
        for a in args[:32]:
            shown.append(cut(a, 200) if text else {"len": len(a)})
        if len(args) > 32:
            shown.append({"more_args": len(args) - 32, "total_len": sum(map(len, args[32:]))})
        await self._written(
            self.audit.record(
                "upcall",
                verdict,
                key=key,
                helper=cut(helper, 64),
                args=shown,
                args_sha256=digest("\x00".join(args)) if text else None,
                exit_code=code,
                duration_s=round(time.monotonic() - started, 4),
                # A refusal may quote the argument it refused: the same cap as the arguments.
                reason=cut(reason, 200) if len(reason) > 200 else reason,
            )
        )

    async def _written(self, fut: concurrent.futures.Future[None] | None) -> None:
        """Wait (briefly) for a record to be on disk: the reply follows its audit record."""
        if fut is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.wrap_future(fut), 2.0)


def _id(value: Any) -> Any:
    return value if isinstance(value, str | int) and not isinstance(value, bool) and len(str(value)) <= 128 else None


def _error(rid: Any, code: int, message: str, data: Any = None) -> dict[str, Any]:
    err: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        err["data"] = data
    return {"jsonrpc": "2.0", "id": rid, "error": err}


# -- the relay process ---------------------------------------------------------------------------


def _context_payload(ctx: RelayContext) -> dict[str, Any]:
    settings = ctx.settings.model_dump(mode="json")
    settings["secrets"] = _secrets(ctx.settings)
    ws = ctx.workspace
    return {
        "session_id": ctx.session_id,
        "campaign": ctx.campaign,
        "workspace": {"path": str(ws.path), "uid": ws.uid, "gid": ws.gid},
        "policy": ctx.policy.model_dump(mode="json"),
        "settings": settings,
        "socket": str(ctx.socket_path),
        "created_prs": [list(p) if isinstance(p, tuple) else p for p in ctx.created_prs],
        "extra_secrets": ctx.extra_secrets,
    }


def _relay_main() -> int:
    """A session's relay process: context on stdin, "ready" on stdout, logs on stderr; it ends when
    stdin closes (its host is gone or stopped it) or on SIGTERM."""
    payload = json.loads(sys.stdin.buffer.readline())
    settings = Settings(**payload["settings"])
    logger.remove()
    logger.add(sys.stderr, level="INFO", format="{level}|{message}", colorize=False)
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = settings.upcall_max_fds if hard == resource.RLIM_INFINITY else min(hard, settings.upcall_max_fds)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(
            resource.RLIMIT_DATA, (settings.upcall_memory_bytes, resource.getrlimit(resource.RLIMIT_DATA)[1])
        )
    ws = payload["workspace"]
    ctx = RelayContext(
        payload["session_id"],
        payload["campaign"],
        Workspace(Path(ws["path"]), ws["uid"], ws["gid"]),
        Policy.model_validate(payload["policy"]),
        settings,
        Path(payload["socket"]),
        {tuple(p) if isinstance(p, list) else p for p in payload["created_prs"]},
        {str(k): str(v) for k, v in (payload.get("extra_secrets") or {}).items()},
    )
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        relay = Relay(ctx)
        relay.own_process = True
        loop.set_exception_handler(
            lambda _loop, c: relay.log(
                "WARNING",
                f"event loop: {c.get('message')}: {c.get('exception')!r}"[:500],
                key=str(c.get("message"))[:60],
            )
        )
        loop.run_until_complete(relay.start())
    except Exception as exc:
        sys.stdout.write(f"error {type(exc).__name__}: {exc}\n".replace("\n", " ").rstrip() + "\n")
        sys.stdout.flush()
        return 1
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    done = asyncio.Event()

    def lifeline() -> None:
        try:
            data = os.read(0, 4096)
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(0)
            done.set()

    loop.add_reader(0, lifeline)
    loop.add_signal_handler(signal.SIGTERM, done.set)
    loop.run_until_complete(done.wait())
    with contextlib.suppress(Exception):
        loop.run_until_complete(asyncio.wait_for(relay.stop(), 8))
    sys.stderr.flush()
    os._exit(0)  # threads stuck in a helper's blocking call must not keep the process


def _main(role: str) -> int:
    if role == "scan-worker":
        return _scan_worker_main()
    return _relay_main()


# -- hosting relays ----------------------------------------------------------------------------


class _Child:
    """A relay running in a process of its own."""

    def __init__(self, ctx: RelayContext) -> None:
        self.ctx = ctx
        self.started = time.monotonic()
        payload = json.dumps(_context_payload(ctx)).encode() + b"\n"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, "relay"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd="/",
            env=_child_env(),
            close_fds=True,
            start_new_session=True,  # a terminal's ^C reaches the host, which then stops it
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(payload)
            self.proc.stdin.flush()
            line = self._ready_line()
        except BaseException:
            self.kill()
            raise
        if line != b"ready\n":
            self.kill()
            why = line.decode(errors="replace").strip()
            if not why and self.proc.stderr is not None:  # it died first: its last words
                with contextlib.suppress(Exception):
                    tail = self.proc.stderr.read(65536).decode(errors="replace").strip().splitlines()
                    why = tail[-1][:500] if tail else ""
            raise SandboxError(f"the upcall relay of {ctx.session_id} did not start: {why or 'it exited'}")
        self.pid = self.proc.pid
        self.gate = LogGate(ctx.session_id, 2 * ctx.settings.upcall_log_lines_per_min)
        threading.Thread(target=self._logs, name=f"relay-log-{ctx.session_id}", daemon=True).start()

    def _ready_line(self) -> bytes:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + START_TIMEOUT_S
        buf = b""
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise SandboxError(
                    f"the upcall relay of {self.ctx.session_id} did not start within {START_TIMEOUT_S:g}s"
                )
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            buf += chunk
        return buf

    def _logs(self) -> None:
        """The relay's stderr into this process's log, cut and rate-limited once more."""
        assert self.proc.stderr is not None
        while raw := self.proc.stderr.readline(4096):  # a line without an end is cut, never hoarded
            text = raw[:2000].decode(errors="replace").rstrip()
            level, _, message = text.partition("|")
            if level not in ("DEBUG", "INFO", "SUCCESS", "WARNING", "ERROR", "CRITICAL"):
                level, message = "WARNING", text
            self.gate(level, message.removeprefix(f"relay {self.ctx.session_id}: "))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        with contextlib.suppress(Exception):
            self.proc.wait(5)
        self._close_pipes()

    def _close_pipes(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(Exception):
                pipe.close()  # type: ignore[union-attr]

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.stdin.close()  # type: ignore[union-attr]  # the lifeline: the relay stops itself
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.kill()
        self._close_pipes()
        with contextlib.suppress(FileNotFoundError):
            self.ctx.socket_path.unlink()


class _Local:
    """A relay on the host's shared event loop (``relay_isolation = "shared"``)."""

    def __init__(self, relay: Relay, loop: asyncio.AbstractEventLoop) -> None:
        self.relay, self.loop, self.ctx = relay, loop, relay.ctx
        self.pid = os.getpid()

    def alive(self) -> bool:
        return not self.relay.closed

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.relay.stop(), self.loop).result(10)


class RelayHost:
    """Supervises the relays of any number of sessions: each in its own process by default, else on
    one event loop in a daemon thread of this process."""

    _instance: RelayHost | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        raise_nofile_limit()
        self.relays: dict[str, _Child | _Local] = {}
        self.restarts: dict[str, list[float]] = {}
        self.locks: dict[str, threading.Lock] = {}
        self.mutex = threading.Lock()
        self.revive_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        threading.Thread(target=self._watch, name="sandman-relay-watch", daemon=True).start()

    def _watch(self) -> None:
        """Every few seconds, restart relays that died (in whatever process hosts them)."""
        while True:
            time.sleep(WATCH_S)
            with contextlib.suppress(Exception):
                self.revive()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        with self.mutex:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="sandman-relays", daemon=True).start()
            return self._loop

    @classmethod
    def shared(cls) -> RelayHost:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def _session_lock(self, session_id: str) -> threading.Lock:
        with self.mutex:
            return self.locks.setdefault(session_id, threading.Lock())

    def start(self, ctx: RelayContext) -> _Child | _Local:
        available_helpers(ctx.policy, ctx.settings)  # a bad helper config is the caller's ConfigError
        with self._session_lock(ctx.session_id):  # two callers at once never make two relays
            self._stop(ctx.session_id)  # never two relays on one socket
            handle: _Child | _Local
            if ctx.settings.relay_isolation == "process":
                handle = _Child(ctx)
            else:
                relay = Relay(ctx)
                asyncio.run_coroutine_threadsafe(relay.start(), self.loop).result(START_TIMEOUT_S)
                handle = _Local(relay, self.loop)
            with self.mutex:
                self.relays[ctx.session_id] = handle
            return handle

    def stop(self, session_id: str) -> None:
        with self._session_lock(session_id):
            self._stop(session_id)
        with self.mutex:
            if session_id not in self.relays:
                self.locks.pop(session_id, None)

    def _stop(self, session_id: str) -> None:
        with self.mutex:
            handle = self.relays.pop(session_id, None)
        if handle is not None:
            handle.stop()

    def __contains__(self, session_id: str) -> bool:
        return session_id in self.relays

    def ensure(self, ctx: RelayContext) -> bool:
        """Start the relay unless it already serves; True when it had to be (re)started."""
        with self._session_lock(ctx.session_id):
            handle = self.relays.get(ctx.session_id)
            if handle is not None and handle.alive() and ctx.socket_path.exists():
                return False
        self.start(ctx)
        return True

    def revive(self) -> list[str]:
        """Restart relays whose process died (a crash stays in its session, and is mended): at most
        5 restarts per session in 10 minutes. The sessions restarted."""
        with self.revive_lock:
            return self._revive()

    def _revive(self) -> list[str]:
        restarted = []
        for session_id, handle in list(self.relays.items()):
            if handle.alive():
                continue
            now = time.monotonic()
            recent = [t for t in self.restarts.get(session_id, []) if now - t < 600]
            code = handle.proc.returncode if isinstance(handle, _Child) else None
            if len(recent) >= 5:
                logger.error("relay {} keeps dying (exit {}); not restarting it", session_id, code)
                with self.mutex:
                    self.relays.pop(session_id, None)
                continue
            logger.warning("relay {} died (exit {}); restarting it", session_id, code)
            self.restarts[session_id] = [*recent, now]
            try:
                self.start(handle.ctx)
                restarted.append(session_id)
            except Exception as exc:
                logger.error("restarting relay {} failed: {}", session_id, exc)
        return restarted

    @classmethod
    def stop_if_running(cls, session_id: str) -> None:
        if cls._instance is not None:
            cls._instance.stop(session_id)
