"""The relay's bulkheads, one at a time: credentials split across arguments, deep JSON, bounded and
coalesced audit records, the store's size cap and retention, descriptor exhaustion, write deadlines
and bytes in flight, slow credential checks, helpers that block, crashes, and the rotating log.
(tests/security/test_noisy_neighbour.py has them all at once against a canary.)"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from loguru import logger

from sandman.core.state import StateStore, cut, fit_detail
from sandman.core.workspace import Workspace
from sandman.policy import Policy
from sandman.policy.enforce import make_scrubber
from sandman.settings import Settings
from sandman.upcall import helpers as helpers_mod
from sandman.upcall.helpers import Helper, HelperContext, HelperResult
from sandman.upcall.relay import Auditor, LogGate, RelayContext, RelayHost, check_texts, raise_nofile_limit

ROOT = Path(__file__).resolve().parents[2]
GHP = "ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"
OPENAI = "sk-proj-" + "Ab3dEf6hIj9lMn2pQr5tUv8xYz1BcD4fGh7j"
SLOW_TO_SCAN = "%3Dsk-" * 150_000


class Relays:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.started: list[str] = []

    def start(self, name: str = "t", helpers: dict[str, Any] | None = None, **overrides: Any) -> RelayContext:
        values: dict[str, Any] = {"state_dir": self.base / "state", "runtime_dir": self.base / "run"}
        values.update(overrides)
        ws = self.base / f"ws-{name}"
        ws.mkdir(exist_ok=True)
        sock = self.base / "run" / name / "upcall.sock"
        sock.parent.mkdir(parents=True, exist_ok=True)
        policy = Policy.model_validate({"upcalls": {"helpers": helpers or {"noop": {}}}})
        ctx = RelayContext(
            f"sm-{name}", "camp", Workspace(ws, os.getuid(), os.getgid()), policy, Settings(**values), sock
        )
        RelayHost.shared().start(ctx)
        self.started.append(ctx.session_id)
        return ctx

    def events(self, ctx: RelayContext) -> list[Any]:
        store = StateStore(ctx.settings.state_dir)
        try:
            return store.events(session=ctx.session_id, limit=10**6)
        finally:
            store.close()


@pytest.fixture
def relays(tmp_path: Path) -> Iterator[Relays]:
    r = Relays(tmp_path)
    yield r
    for sid in r.started:
        RelayHost.stop_if_running(sid)


def rpc(path: Path, payload: bytes | dict[str, Any], timeout: float = 30) -> dict[str, Any]:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode() + b"\n"
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(data)
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(1 << 20)
            if not chunk:
                break
            buf += chunk
    return json.loads(buf)  # type: ignore[no-any-return]


def exec_(ctx: RelayContext, helper: str, args: list[str], stdin: str | None = None, **kw: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"helper": helper, "args": args}
    if stdin is not None:
        params["stdin"] = stdin
    return rpc(ctx.socket_path, {"jsonrpc": "2.0", "id": 1, "method": "upcall.exec", "params": params}, **kw)


# -- credentials split across arguments --------------------------------------------------------

SPLITS = {
    "title and body halves": (["pr", "create", "--title", f"Fix {GHP[:20]}", "--body", f"{GHP[20:]} thanks"], None),
    "title= and body= halves": (["pr", "create", f"--title={GHP[:20]}", f"--body={GHP[20:]}"], None),
    "halves of a key that needs a word boundary": (
        ["pr", "create", "--repo", "acme/app", "--title", OPENAI[:19], "--body", OPENAI[19:]],
        None,
    ),
    "three pieces": (["comment", "--body", GHP[:10], GHP[10:25], GHP[25:]], None),
    "a newline inside": (["--body", f"here: {GHP[:16]}\n{GHP[16:]}"], None),
    "a CRLF and tabs inside": (["--body", f"{GHP[:16]}\r\n\t{GHP[16:]}"], None),
    "zero-width characters inside": (["--body", "\u200b".join(GHP)], None),
    "a soft hyphen and a BOM inside": (["--body", GHP[:9] + "\u00ad" + GHP[9:30] + "\ufeff" + GHP[30:]], None),
    "spaces between every character": (["--body", " ".join(GHP)], None),
    "full-width look-alikes": (["--body", "".join(chr(ord(c) + 0xFEE0) if c.isalnum() else c for c in GHP)], None),
    "title in args, the rest on stdin": (["pr", "create", "--title", GHP[:20], "--body-file", "-"], GHP[20:]),
}


@pytest.mark.parametrize("case", sorted(SPLITS))
def test_a_split_credential_is_found_in_some_checked_form(case: str) -> None:
    args, stdin = SPLITS[case]
    scrubber = make_scrubber({})
    assert not any(scrubber.scan_text(a) for a in args), "each piece alone must look harmless"
    assert any(scrubber.scan_text(text) for text in check_texts(args, stdin)), case


def test_a_split_known_secret_is_found() -> None:
    secret = "correct-horse-battery-staple-42"
    scrubber = make_scrubber({"DB_PASSWORD": secret})
    args = ["issue", "comment", "--title", secret[:12], "--body", secret[12:]]
    assert any(scrubber.scan_text(text) for text in check_texts(args, None))


def test_ordinary_arguments_raise_nothing() -> None:
    scrubber = make_scrubber({})
    args = ["pr", "create", "--draft", "--title", "Fix the widget", "--body", "Made in a sandbox.\nTests pass."]
    assert not any(scrubber.scan_text(text) for text in check_texts(args, "more text\n"))
    assert check_texts(["x"], None) == ["x"]


def test_the_relay_refuses_split_credentials_and_keeps_them_out_of_the_audit(relays: Relays) -> None:
    ctx = relays.start()
    for case in ("title and body halves", "zero-width characters inside", "title in args, the rest on stdin"):
        args, stdin = SPLITS[case]
        err = exec_(ctx, "noop", args, stdin)["error"]
        assert err["code"] == -32000 and "credential" in err["message"], case
    assert exec_(ctx, "noop", ["harmless"])["result"]["stdout"] == "harmless\n"
    stored = json.dumps([e.as_json() for e in relays.events(ctx)])
    for piece in (GHP[:20], GHP[20:], GHP[:16]):
        assert piece not in stored


# -- malformed and deep JSON ---------------------------------------------------------------------


def test_deep_json_gets_an_error_never_a_dropped_connection(relays: Relays) -> None:
    ctx = relays.start()
    assert rpc(ctx.socket_path, b"[" * 200_000 + b"\n")["error"]["code"] == -32700
    assert rpc(ctx.socket_path, b"{" * 200_000 + b"\n")["error"]["code"] == -32700
    nested = '{"a":' * 100 + "1" + "}" * 100
    frame = f'{{"jsonrpc": "2.0", "id": 3, "method": "upcall.list", "params": {nested}}}\n'.encode()
    assert rpc(ctx.socket_path, frame)["error"]["code"] == -32600
    assert rpc(ctx.socket_path, b"\xff\xfe{\n")["error"]["code"] == -32700
    assert rpc(ctx.socket_path, {"jsonrpc": "2.0", "id": 4, "method": "upcall.list"})["result"]


# -- bounded audit ---------------------------------------------------------------------------------


def test_cut_keeps_a_head_a_length_and_a_digest_and_never_half_a_token() -> None:
    assert cut("short", 10) == "short"
    long = "word " * 30 + GHP + " tail" * 100
    c = cut(long, 160)
    assert isinstance(c, dict) and c["len"] == len(long) and len(c["sha256"]) == 16
    assert c["head"].endswith(" ") and "ghp_" not in c["head"]  # the token-like run at the cut is dropped
    assert len(fit_detail({"args": ["x" * 1_000_000] * 3, "reason": "r"}, 4096)) <= 4096
    assert len(fit_detail({f"k{i}": "v" * 300 for i in range(1000)}, 4096)) <= 4096


def test_an_oversized_record_is_cut_to_the_cap(relays: Relays) -> None:
    ctx = relays.start(audit_record_max_bytes=2048)
    big = "A" * 900_000
    assert exec_(ctx, "noop", ["--body", big])["result"]["exit_code"] == 0
    assert rpc(
        ctx.socket_path,
        {"jsonrpc": "2.0", "id": 2, "method": "session.report", "params": {"kind": "k", "message": "m" * 8000}},
    )["result"]
    store = StateStore(ctx.settings.state_dir)
    rows = store._db.execute("SELECT event, length(detail) FROM audit WHERE session = ?", (ctx.session_id,)).fetchall()
    assert rows and all(n <= 2048 for _, n in rows), rows
    upcall = next(e for e in store.events(session=ctx.session_id) if e.event == "upcall")
    arg = upcall.detail["args"][1]
    assert arg["len"] == 900_000 and len(arg["sha256"]) == 16 and len(arg["head"]) <= 200
    assert len(upcall.detail["args_sha256"]) == 16


def test_repeated_refusals_are_coalesced_with_a_count(relays: Relays) -> None:
    ctx = relays.start(upcall_rate_per_s=1e6, upcall_rate_burst=10**6)
    before = sum(p.stat().st_size for p in (relays.base / "state").iterdir())
    big = "B" * 999_800  # a 1 MB frame
    for _ in range(120):
        assert exec_(ctx, "not-allowed", [big])["error"]["code"] == -32000
    RelayHost.stop_if_running(ctx.session_id)  # the open window's count is written at the latest now
    events = [e for e in relays.events(ctx) if e.event.startswith("upcall")]
    assert [(e.event, e.verdict) for e in events] == [("upcall", "refused"), ("upcall.repeated", "refused")]
    assert events[1].detail["repeated"] == 119
    assert events[0].detail["args"] == [{"len": 999_800}]  # never checked for credentials: no text
    growth = sum(p.stat().st_size for p in (relays.base / "state").iterdir()) - before
    print(f"state dir growth for 120 refused 1 MB upcalls: {growth} bytes")
    assert growth < 256 << 10, growth  # was 1 MB per refusal


def test_the_audit_budget_drops_and_counts(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    auditor = Auditor(store, "sm-a", per_min=60, coalesce_s=60, log=LogGate("sm-a", 60))
    futures = [auditor.record("upcall", "ok", n=i) for i in range(200)]
    essential = auditor.record("gh.pr_created", "ok", essential=True, repo="a/b", number=1)
    assert essential is not None
    auditor.close()
    events = store.events(session="sm-a")
    kinds = [e.event for e in events]
    assert kinds.count("audit.throttled") == 1 and kinds.count("audit.dropped") == 1
    written = kinds.count("upcall")
    assert written == sum(f is not None for f in futures) and written <= 15
    dropped = next(e for e in events if e.event == "audit.dropped").detail["dropped"]
    assert written + dropped == 200
    assert "gh.pr_created" in kinds


def test_the_store_has_a_size_cap_and_retention(tmp_path: Path) -> None:
    store = StateStore(tmp_path, max_bytes=2 << 20, max_record_bytes=4096, retention_s=3600)
    store.audit("sm-x", "gh.pr_created", repo="a/b", number=7)
    for i in range(3000):  # ~10 MB offered
        store.audit("sm-x", "upcall", "refused", i=i, args=[f"{i:04d}" + "z" * 3400])
    store.maintain()
    assert store.used_bytes() <= 2 << 20
    events = store.events(session="sm-x", limit=10**6)
    assert events[0].event == "gh.pr_created"  # what a restarted relay needs is kept
    assert events[-1].detail["i"] == 2999 and len(events) < 3000  # the newest stay, the oldest went
    wal = tmp_path / "sandman.db-wal"
    store.checkpoint()
    assert not wal.exists() or wal.stat().st_size <= 16 << 20
    store._db.execute("UPDATE audit SET ts = ts - 7200 WHERE event = 'upcall'")
    store.maintain()
    assert [e.event for e in store.events(session="sm-x", limit=10**6)] == ["gh.pr_created"]


# -- descriptors, connections, bytes in flight --------------------------------------------------


def test_descriptor_exhaustion_backs_off_and_logs_once(relays: Relays) -> None:
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="DEBUG")
    ctx = relays.start(upcall_max_fds=64, upcall_max_connections=1000, upcall_rate_per_s=1e6, upcall_rate_burst=10**6)
    held = []
    try:
        for _ in range(300):
            s = socket.socket(socket.AF_UNIX)
            s.setblocking(False)
            try:
                s.connect(str(ctx.socket_path))
            except BlockingIOError:
                s.close()
                break
            held.append(s)
        time.sleep(3)  # the relay meets EMFILE over and over meanwhile
    finally:
        for s in held:
            s.close()
        time.sleep(0.5)
        logger.remove(sink)
    assert len(held) >= 100
    assert rpc(ctx.socket_path, {"jsonrpc": "2.0", "id": 1, "method": "upcall.list"}, timeout=10)["result"]
    accept_lines = [line for line in lines if "cannot accept" in line]
    print(f"EMFILE for 3 s: {len(accept_lines)} log line(s), {len(lines)} in all")
    assert 1 <= len(accept_lines) <= 2, lines
    budget = [e for e in relays.events(ctx) if e.event == "relay.budget" and e.detail["budget"] == "descriptors"]
    assert len(budget) == 1


def test_process_limits(relays: Relays) -> None:
    import resource

    assert raise_nofile_limit() == resource.getrlimit(resource.RLIMIT_NOFILE)[1]  # the host: soft = hard
    ctx = relays.start(upcall_max_fds=100)
    handle = RelayHost.shared().relays[ctx.session_id]
    limits = Path(f"/proc/{handle.pid}/limits").read_text()
    row = next(line for line in limits.splitlines() if line.startswith("Max open files"))
    assert row.split()[3] == "100"
    row = next(line for line in limits.splitlines() if line.startswith("Max data size"))
    assert row.split()[3] == str(1 << 30)  # upcall_memory_bytes: a leak ends in its own session


def test_unread_replies_meet_a_deadline_and_a_bytes_budget(relays: Relays) -> None:
    ctx = relays.start(upcall_write_timeout_s=1.0, upcall_max_inflight_bytes=1 << 20)
    frame = (
        json.dumps(
            {"jsonrpc": "2.0", "id": 9, "method": "upcall.exec", "params": {"helper": "noop", "args": ["x" * 600_000]}}
        ).encode()
        + b"\n"
    )
    unread = []
    for _ in range(3):
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(ctx.socket_path))
        s.sendall(frame)
        unread.append(s)
        time.sleep(0.3)
    time.sleep(2.0)  # past the write deadline: the relay dropped them
    got = []
    for s in unread:
        s.settimeout(2)
        buf = b""
        try:
            while chunk := s.recv(1 << 20):
                buf += chunk
        except OSError:
            pass
        got.append(buf)
        s.close()
    # The first reply was cut off at the deadline; the others met the bytes budget (-32004).
    assert got[0].startswith(b'{"jsonrpc": "2.0", "id": 9, "result"') and not got[0].endswith(b"\n")
    assert all(json.loads(g)["error"]["code"] == -32004 for g in got[1:]), [g[:100] for g in got]
    assert exec_(ctx, "noop", ["ok"])["result"]["stdout"] == "ok\n"
    budgets = {e.detail["budget"] for e in relays.events(ctx) if e.event == "relay.budget"}
    assert {"write deadline", "bytes in flight"} <= budgets


# -- slow credential checks, blocking helpers, crashes -------------------------------------------


def test_a_slow_to_scan_argument_is_refused_at_the_deadline(relays: Relays) -> None:
    ctx = relays.start(upcall_scan_timeout_s=1.0)
    t0 = time.monotonic()
    err = exec_(ctx, "noop", [SLOW_TO_SCAN])["error"]
    assert err["code"] == -32000 and "not checked for credentials" in err["message"]
    assert time.monotonic() - t0 < 5
    # The killed worker is replaced: a large, ordinary argument is checked (and passes) again.
    assert exec_(ctx, "noop", ["y" * 50_000])["result"]["exit_code"] == 0


class BlockingHelper(Helper):
    """Does what no helper should: a synchronous read of a FIFO, inside its async run()."""

    name: ClassVar[str] = "blocking"
    description: ClassVar[str] = "test only"
    fifo: ClassVar[Path]

    async def run(self, args: list[str], stdin: str | None, ctx: HelperContext) -> HelperResult:
        with open(self.fifo) as f:
            return HelperResult(0, f.read(), "")


def test_a_helper_that_blocks_blocks_nobody_else(
    relays: Relays, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shared mode (every relay on one loop, in this process, where a test helper can be added):
    the helper's synchronous read stalls only its own thread."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    monkeypatch.setattr(BlockingHelper, "fifo", fifo, raising=False)
    monkeypatch.setitem(helpers_mod.BUILTINS, "blocking", BlockingHelper)
    monkeypatch.setattr(helpers_mod, "_register_gh", lambda: None)
    shared = {"relay_isolation": "shared", "upcall_call_timeout_s": 1.0, "upcall_max_pending": 3}
    victim = relays.start("victim", {"noop": {}, "blocking": {}}, **shared)
    other = relays.start("other", {"noop": {}}, **shared)
    results: list[dict[str, Any]] = []
    callers = [threading.Thread(target=lambda: results.append(exec_(victim, "blocking", []))) for _ in range(2)]
    for t in callers:
        t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    assert exec_(other, "noop", ["x"])["result"]["stdout"] == "x\n"
    assert exec_(victim, "noop", ["y"])["result"]["stdout"] == "y\n"
    assert time.monotonic() - t0 < 0.5
    callers.append(threading.Thread(target=lambda: results.append(exec_(victim, "blocking", []))))
    callers[-1].start()
    time.sleep(0.3)
    busy = exec_(victim, "blocking", [])["error"]
    assert busy["code"] == -32004  # three stuck calls are this session's budget
    assert exec_(victim, "noop", ["z"])["result"]["stdout"] == "z\n"  # noop runs inline: never stuck
    assert exec_(other, "noop", ["x"])["result"]["stdout"] == "x\n"  # not the other session's
    for t in callers:
        t.join(10)
    # Answered at the deadline; the threads stay stuck (and counted) until the read returns.
    assert [r["error"]["code"] for r in results] == [-32001] * 3
    with open(fifo, "w") as w:  # release the stuck threads
        w.write("done")
    time.sleep(0.3)


def test_a_crashed_relay_stays_in_its_session_and_is_revived(relays: Relays) -> None:
    a, b = relays.start("a"), relays.start("b")
    host = RelayHost.shared()
    pid = host.relays[a.session_id].pid
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.3)
    assert exec_(b, "noop", ["fine"])["result"]["stdout"] == "fine\n"
    revived = host.revive()  # the host's watchdog would do it within 5 s
    assert revived == [a.session_id] or host.relays[a.session_id].pid != pid
    assert host.relays[a.session_id].pid != pid
    assert exec_(a, "noop", ["back"])["result"]["stdout"] == "back\n"
    assert host.ensure(a) is False


# -- logs ------------------------------------------------------------------------------------------


def test_the_log_gate_says_a_line_once_and_counts_the_rest() -> None:
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="DEBUG")
    try:
        gate = LogGate("sm-g", per_min=60)
        for _ in range(10_000):
            gate("WARNING", "cannot accept (Too many open files)", key="accept-24")
        for i in range(100):
            gate("WARNING", f"distinct {i}")
    finally:
        logger.remove(sink)
    assert sum("cannot accept" in line for line in lines) == 1
    assert len(lines) <= 21  # the burst; the rest held back and counted in the next line


def test_the_controller_log_rotates(tmp_path: Path) -> None:
    log = tmp_path / "controller-x.log"
    code = (
        "from pathlib import Path; from loguru import logger; from sandman.core import controller\n"
        f"controller._log_to_rotating_file(Path({str(log)!r}))\n"
        "for i in range(20000): logger.info('line {} {}', i, 'x' * 100)\n"
        "print('through stdout too')\n"
    )
    env = {**os.environ, "SANDMAN_LOG_ROTATION_BYTES": str(256 << 10), "SANDMAN_LOG_RETENTION_FILES": "2"}
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=120)
    files = sorted(tmp_path.glob("controller-x*.log"))
    assert 2 <= len(files) <= 3, files  # the current file and at most 2 rotated ones
    assert all(f.stat().st_size <= (256 << 10) + 4096 for f in files)
    assert "through stdout too" in log.read_text()


def test_invisible_characters_never_hide_a_secret_in_upcall_arguments() -> None:
    """Red-team round 4: characters Unicode renders as nothing (musical beams, shorthand format
    controls) interleaved in a token slipped past a hand-written list of invisible characters."""
    from sandman.upcall.relay import _visible, check_texts

    token = "ghp_" + "A" * 36
    for joiner in ("\u200b", "\U0001d173", "\U0001bca0", "\u2060", "\ufe0f", "\u0301"):
        hidden = joiner.join(token)
        assert _visible(hidden) == token, repr(joiner)
        assert any(token in text for text in check_texts([hidden], None)), repr(joiner)
    assert _visible("plain words stay") == "plainwordsstay"  # whitespace goes too, nothing else
