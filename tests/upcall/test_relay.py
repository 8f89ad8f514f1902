"""The upcall relay on its own socket: JSON-RPC errors, bounds, concurrency, slow and flooding
helpers, rate limits and audit — it answers every client and keeps serving the others."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandman.core.state import StateStore
from sandman.core.workspace import Workspace
from sandman.policy import Policy
from sandman.settings import Settings
from sandman.upcall.relay import RelayContext, RelayHost


@pytest.fixture
def helpers_dir(tmp_path: Path) -> Path:
    d = tmp_path / "helpers"
    d.mkdir()
    for name, body in {
        "hang": "#!/bin/sh\nsleep 300\n",
        "flood": "#!/bin/sh\nhead -c 50000000 /dev/zero | tr '\\0' x\necho err >&2\n",
        "envdump": "#!/bin/sh\nenv | sort\npwd\n",
        "fail": "#!/bin/sh\necho out; echo bad >&2; exit 3\n",
    }.items():
        (d / name).write_text(body)
        (d / name).chmod(0o755)
    return d


def start_relay(tmp_path: Path, helpers_dir: Path, **overrides: object) -> RelayContext:
    # Limits are settings: the relay runs in a process of its own, out of monkeypatch's reach.
    settings = Settings(
        state_dir=tmp_path / "state",
        runtime_dir=tmp_path / "run",
        helpers_dir=helpers_dir,
        upcall_call_timeout_s=2.0,
        **overrides,  # type: ignore[arg-type]
    )
    policy = Policy.model_validate(
        {"upcalls": {"helpers": {"noop": {}, "hang": {}, "flood": {}, "envdump": {"mode": "x"}, "fail": {}}}}
    )
    ws_path = tmp_path / "ws"
    ws_path.mkdir(exist_ok=True)
    sock = tmp_path / "run" / "upcall.sock"
    sock.parent.mkdir(parents=True, exist_ok=True)
    ctx = RelayContext("sm-test", "camp", Workspace(ws_path, os.getuid(), os.getgid()), policy, settings, sock)
    RelayHost.shared().start(ctx)
    return ctx


@pytest.fixture
def relay(tmp_path: Path, helpers_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[RelayContext]:
    monkeypatch.setenv("SANDMAN_TOKEN_LIKE", "should-not-reach-helpers")
    yield start_relay(tmp_path, helpers_dir)
    RelayHost.shared().stop("sm-test")


@pytest.fixture
def unlimited_relay(tmp_path: Path, helpers_dir: Path) -> Iterator[RelayContext]:
    yield start_relay(tmp_path, helpers_dir, upcall_rate_per_s=1e9, upcall_rate_burst=10**9)
    RelayHost.shared().stop("sm-test")


def rpc(path: Path, payload: bytes | dict, timeout: float = 10) -> dict:  # type: ignore[type-arg]
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode() + b"\n"
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        # The relay may answer an oversized frame and close before we finish sending.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(data)
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(1 << 20)
            if not chunk:
                break
            buf += chunk
    return json.loads(buf)  # type: ignore[no-any-return]


def call(ctx: RelayContext, method: str, params: dict | None = None, rid: int = 1) -> dict:  # type: ignore[type-arg]
    return rpc(ctx.socket_path, {"jsonrpc": "2.0", "id": rid, "method": method, "params": params or {}})


def test_socket_is_private(relay: RelayContext) -> None:
    assert stat.S_IMODE(relay.socket_path.stat().st_mode) == 0o600


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (b"{not json\n", -32700),
        (b"[1, 2]\n", -32600),
        (b'{"jsonrpc": "1.0", "id": 1, "method": "upcall.list"}\n', -32600),
        (b'{"jsonrpc": "2.0", "id": {"x": 1}, "method": "upcall.list"}\n', -32600),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "nope"}\n', -32601),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "upcall.list", "params": [1]}\n', -32602),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "upcall.exec", "params": {"helper": 5}}\n', -32602),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "upcall.exec", "params": {"helper": "noop", "args": [1]}}\n', -32602),
    ],
)
def test_standard_error_codes(relay: RelayContext, payload: bytes, code: int) -> None:
    assert rpc(relay.socket_path, payload)["error"]["code"] == code


@pytest.mark.parametrize("method", ["policy.set", "session.stop", "session.create", "session.list", "upcall.add"])
def test_nothing_over_the_socket_can_change_policy_or_touch_sessions(relay: RelayContext, method: str) -> None:
    assert call(relay, method, {"session_id": "sm-other"})["error"]["code"] == -32601


def test_methods(relay: RelayContext) -> None:
    names = [h["name"] for h in call(relay, "upcall.list")["result"]]
    assert names == ["envdump", "fail", "flood", "hang", "noop"]
    info = call(relay, "session.info")["result"]
    assert info["session_id"] == "sm-test" and info["campaign"] == "camp"
    assert call(relay, "upcall.exec", {"helper": "noop", "args": ["a", "b"]})["result"]["stdout"] == "a b\n"
    res = call(relay, "upcall.exec", {"helper": "fail"})["result"]
    assert (res["exit_code"], res["stdout"], res["stderr"]) == (3, "out\n", "bad\n")  # streams kept apart
    assert call(relay, "session.report", {"kind": "progress", "message": "halfway"})["result"] == {"ok": True}
    refused = call(relay, "upcall.exec", {"helper": "rm", "args": ["-rf", "/"]})
    assert refused["error"]["code"] == -32000 and "not allowed" in refused["error"]["message"]
    events = StateStore(relay.settings.state_dir).events(session="sm-test")
    verdicts = [(e.event, e.verdict, e.detail.get("helper")) for e in events]
    assert ("upcall", "ok", "noop") in verdicts and ("upcall", "failed", "fail") in verdicts
    assert ("upcall", "refused", "rm") in verdicts and ("session.report", "ok", None) in verdicts
    assert all("duration_s" in e.detail for e in events if e.event == "upcall")


def test_helpers_get_a_sanitized_environment_and_their_config(relay: RelayContext) -> None:
    out = call(relay, "upcall.exec", {"helper": "envdump"})["result"]["stdout"]
    assert "SANDMAN_HELPER_MODE=x" in out and "SANDMAN_SESSION=sm-test" in out
    assert "should-not-reach-helpers" not in out and "HOME=" not in out
    assert str(relay.workspace.path) not in out  # the cwd is never the agent's


def test_a_frame_too_large_is_refused_and_others_keep_being_served(relay: RelayContext) -> None:
    huge = b'{"jsonrpc": "2.0", "id": 1, "method": "upcall.list", "x": "' + b"a" * (2 << 20) + b'"}\n'
    assert rpc(relay.socket_path, huge)["error"]["code"] == -32003
    assert "result" in call(relay, "upcall.list")


def test_a_hanging_helper_times_out_without_blocking_anyone(relay: RelayContext) -> None:
    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(call, relay, "upcall.exec", {"helper": "hang"})
        time.sleep(0.2)
        t0 = time.monotonic()
        assert call(relay, "upcall.exec", {"helper": "noop", "args": ["x"]})["result"]["stdout"] == "x\n"
        assert time.monotonic() - t0 < 1.0
        err = slow.result(timeout=15)["error"]
    assert err["code"] == -32001 and "timed out" in err["message"]


def test_a_flooding_helper_is_truncated(relay: RelayContext) -> None:
    res = call(relay, "upcall.exec", {"helper": "flood"}, rid=7)["result"]
    assert res["truncated"] is True and len(res["stdout"]) == 1 << 20 and res["stderr"] == "err\n"


def test_a_silent_connection_blocks_nobody(relay: RelayContext) -> None:
    silent = [socket.socket(socket.AF_UNIX) for _ in range(50)]
    try:
        for s in silent:
            s.connect(str(relay.socket_path))
            s.sendall(b'{"jsonrpc": "2.0", "id": 1, "meth')  # and never finishes
        assert "result" in call(relay, "upcall.list")
    finally:
        for s in silent:
            s.close()


def test_thousands_of_concurrent_connections(unlimited_relay: RelayContext) -> None:
    relay = unlimited_relay
    n = 2000
    with ThreadPoolExecutor(64) as pool:
        results = list(
            pool.map(lambda i: call(relay, "upcall.exec", {"helper": "noop", "args": [str(i)]}, rid=i), range(n))
        )
    assert sorted(int(r["result"]["stdout"]) for r in results) == list(range(n))


def test_rate_limit_per_session(relay: RelayContext) -> None:
    codes = [call(relay, "upcall.list").get("error", {}).get("code") for _ in range(120)]
    assert -32002 in codes and codes[0] is None


def test_relay_restart_keeps_the_socket_path(relay: RelayContext) -> None:
    RelayHost.shared().stop("sm-test")
    assert not relay.socket_path.exists()
    RelayHost.shared().start(relay)
    assert "result" in call(relay, "upcall.list")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.one_of(
        st.binary(max_size=300).map(lambda b: b.replace(b"\n", b" ") + b"\n"),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=20),
            lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
            max_leaves=12,
        ).map(lambda v: json.dumps(v).encode() + b"\n"),
        st.fixed_dictionaries(
            {
                "jsonrpc": st.sampled_from(["2.0", "1.0", 2]),
                "id": st.integers() | st.text(max_size=5),
                "method": st.sampled_from(["upcall.list", "upcall.exec", "session.info", "session.report", "x"]),
                "params": st.dictionaries(
                    st.sampled_from(["helper", "args", "stdin", "kind", "message"]),
                    st.text(max_size=10) | st.lists(st.text(max_size=5)) | st.integers(),
                    max_size=3,
                ),
            }
        ).map(lambda d: json.dumps(d).encode() + b"\n"),
    )
)
def test_fuzzed_input_always_gets_an_answer_and_the_relay_survives(
    unlimited_relay: RelayContext, payload: bytes
) -> None:
    reply = rpc(unlimited_relay.socket_path, payload)
    assert reply.get("jsonrpc") == "2.0" and ("error" in reply or "result" in reply)
    if "error" in reply:
        assert isinstance(reply["error"]["code"], int) and reply["error"]["message"]


def test_relay_threads_do_not_leak(relay: RelayContext) -> None:
    before = threading.active_count()
    for _ in range(50):
        call(relay, "upcall.list")
    assert threading.active_count() <= before + 1


def test_a_credential_in_upcall_arguments_blocks_the_call(relay: RelayContext) -> None:
    key = "ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"
    res = call(relay, "upcall.exec", {"helper": "noop", "args": ["--body", f"here is {key}"]})
    assert res["error"]["code"] == -32000 and "credential" in res["error"]["message"]
    assert key not in json.dumps(res)
    events = StateStore(relay.settings.state_dir).events(session="sm-test")
    assert key not in json.dumps([e.as_json() for e in events])  # the audit writer scrubs, too
    assert call(relay, "upcall.exec", {"helper": "noop", "args": ["harmless"]})["result"]["exit_code"] == 0
