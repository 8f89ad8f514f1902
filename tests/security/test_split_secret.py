"""A secret written in two parts with a pause between them -- longer than the 50 ms after which an
idle stream's scrubber releases what it holds -- must still leave the sandbox redacted: on every
output path (one-shot run, session exec, session stream) and in the audit.

Each command writes a known secret (injected from the settings) on one stream and a GitHub-shaped
token (from a workspace file, so no argv holds it) on the other, each cut in two by the same
pause: 0.1 s, 1 s and 5 s (the 5 s once per path). Ordinary output written before the pause must
still come out during it: the scrubber holds back only what could begin a secret.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandman.core.runner import Runner
from sandman.core.session import ExecResult, Output, Sandbox
from sandman.core.state import StateStore
from sandman.policy import Policy, SecretsPolicy
from sandman.secrets.scrub import _b64_cores
from sandman.settings import Settings
from tests.conftest import SANDBOX_UID, make_workspace

pytestmark = pytest.mark.docker

TOKEN = "ghp_" + "Zx9Yw8Vu7Ts6Rq5Po4Nm3Lk2Ji1Hg0FeDcBa"  # shaped like a GitHub token, not a real one
PAUSES = [0.1, 1.0, 5.0]


@pytest.fixture(scope="module")
def secret_value() -> str:
    return "s3cr3t-" + secrets.token_hex(12)


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory, secret_value: str) -> Iterator[Settings]:
    base = tmp_path_factory.mktemp("split-secret")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SANDMAN_STATE_DIR", str(base / "state"))
        mp.setenv("SANDMAN_RUNTIME_DIR", str(base / "run"))
        mp.setenv("SANDMAN_SECRETS", json.dumps({"SPLIT_SECRET": secret_value}))
        yield Settings.load()


@pytest.fixture(scope="module")
def split_workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    parent = tmp_path_factory.mktemp("split-ws")
    parent.chmod(0o755)
    ws = make_workspace(parent / "ws")
    tok = ws / "tok"
    tok.write_text(TOKEN)
    if os.geteuid() == 0:
        os.chown(tok, SANDBOX_UID, SANDBOX_UID)
    return ws


@pytest.fixture(scope="module")
def policy(engine: object, settings: Settings, split_workspace: Path) -> Policy:
    base = Runner(settings).policy(None, split_workspace)
    return base.model_copy(update={"secrets": SecretsPolicy(inject=["SPLIT_SECRET"])})


@pytest.fixture(scope="module")
def session(agent_image: str, settings: Settings, split_workspace: Path, policy: Policy) -> Iterator[Sandbox]:
    with Sandbox(split_workspace, settings=settings, policy=policy) as sb:
        yield sb


def split_script(pause: float, secret_on: str = "out") -> str:
    """Print a marker line, then the secret's first half on one stream and the token's on the
    other, pause, then both second halves."""
    sec, tok = ("", ">&2") if secret_on == "out" else (">&2", "")
    return (
        'n=${#SPLIT_SECRET}; h=$((n / 2)); echo "working on it"; '
        f'printf %s "$SPLIT_SECRET" | head -c "$h" {sec}; head -c 17 tok {tok}; '
        f"sleep {pause}; "
        f'printf %s "$SPLIT_SECRET" | tail -c +"$((h + 1))" {sec}; echo " done" {sec}; '
        f"tail -c +18 tok {tok}; echo {tok}"
    )


def assert_clean(text: bytes, secret_value: str) -> None:
    assert secret_value.encode() not in text, text
    assert TOKEN.encode() not in text, text
    # no half of either survived next to the redaction either: both were held, then redacted whole
    assert secret_value[len(secret_value) // 2 :].encode() not in text, text
    assert TOKEN[17:].encode() not in text, text


def assert_audit_clean(settings: Settings, secret_value: str) -> None:
    dump = json.dumps([e.as_json() for e in StateStore(settings.state_dir).events()]).encode()
    assert secret_value.encode() not in dump and TOKEN.encode() not in dump


def first_line_was_live(chunks: list[tuple[float, bytes]], t0: float, pause: float) -> None:
    """The marker line came out before the pause ended: ordinary output is not held back."""
    seen = b""
    for at, data in chunks:
        seen += data
        if b"working on it\n" in seen:
            assert at - t0 < pause + 0.5 if pause >= 1 else True, (at - t0, pause)
            return
    raise AssertionError(f"marker line never came out: {seen!r}")


@pytest.mark.parametrize("pause", PAUSES)
def test_run_output(
    agent_image: str, settings: Settings, split_workspace: Path, policy: Policy, secret_value: str, pause: float
) -> None:
    t0 = time.monotonic()
    out: list[tuple[float, bytes]] = []
    err: list[tuple[float, bytes]] = []
    secret_on = "err" if pause == 1.0 else "out"  # both streams carry each kind once
    res = Runner(settings).run(
        ["sh", "-c", split_script(pause, secret_on)],
        split_workspace,
        policy=policy,
        stdout=lambda b: out.append((time.monotonic(), b)),
        stderr=lambda b: err.append((time.monotonic(), b)),
    )
    assert res.exit_code == 0 and res.duration_s >= pause
    stdout, stderr = b"".join(b for _, b in out), b"".join(b for _, b in err)
    assert_clean(stdout + stderr, secret_value)
    secret_stream, token_stream = (stdout, stderr) if secret_on == "out" else (stderr, stdout)
    assert b"[REDACTED:SPLIT_SECRET] done" in secret_stream, (stdout, stderr)
    assert token_stream.replace(b"working on it\n", b"").strip() == b"[REDACTED:github]", (stdout, stderr)
    first_line_was_live(out, t0, pause)
    assert_audit_clean(settings, secret_value)


@pytest.mark.parametrize("pause", PAUSES)
def test_session_exec_output(session: Sandbox, settings: Settings, secret_value: str, pause: float) -> None:
    res = session.exec(["sh", "-c", split_script(pause, "err" if pause == 1.0 else "out")])
    assert res.exit_code == 0 and res.duration_s >= pause
    assert_clean(res.stdout + res.stderr, secret_value)
    assert b"[REDACTED:SPLIT_SECRET] done" in res.stdout + res.stderr
    assert b"[REDACTED:github]" in res.stdout + res.stderr
    assert_audit_clean(settings, secret_value)


@pytest.mark.parametrize("pause", PAUSES)
def test_session_streamed_output(session: Sandbox, settings: Settings, secret_value: str, pause: float) -> None:
    t0 = time.monotonic()
    chunks: list[tuple[float, bytes]] = []
    result = None
    for item in session.stream(["sh", "-c", split_script(pause)]):
        if isinstance(item, Output):
            assert_clean(item.data, secret_value)
            chunks.append((time.monotonic(), item.data))
        else:
            assert isinstance(item, ExecResult)
            result = item
    assert result is not None and result.exit_code == 0
    streamed = b"".join(b for _, b in chunks)
    assert_clean(streamed, secret_value)
    assert b"[REDACTED:SPLIT_SECRET] done" in streamed and b"[REDACTED:github]" in streamed
    first_line_was_live(chunks, t0, pause)
    assert_audit_clean(settings, secret_value)


def test_session_split_escaped_coloured_and_wrapped_forms(
    session: Sandbox, split_workspace: Path, secret_value: str
) -> None:
    """The cheap disguises, each cut by a 1 s pause: the secret JSON-escaped character by
    character, the token with a colour code before every character, and the secret's base64
    wrapped at 76 columns with the line break inside it (cut right after the break)."""
    value = secret_value.encode()
    escaped = b'{"v": "' + b"".join(b"\\u%04x" % c for c in value) + b'"}\n'
    coloured = b"".join(b"\x1b[3%dm%c" % (i % 8, c) for i, c in enumerate(TOKEN.encode())) + b"\x1b[0m\n"
    wrapped = base64.encodebytes(b"x" * 50 + value)  # 76 columns: the break falls inside the secret's
    assert wrapped.index(b"\n") < (50 + len(value)) * 4 // 3
    files = {
        "escaped": (escaped, len(escaped) // 2),
        "coloured": (coloured, len(coloured) // 2),
        "wrapped": (wrapped, 77),
    }
    for name, (data, _) in files.items():
        (split_workspace / name).write_bytes(data)
        if os.geteuid() == 0:
            os.chown(split_workspace / name, SANDBOX_UID, SANDBOX_UID)
    script = "; ".join(f"head -c {cut} {name}; sleep 1; tail -c +{cut + 1} {name}" for name, (_, cut) in files.items())
    res = session.exec(["sh", "-c", script])
    assert res.exit_code == 0, res.stderr
    out = res.stdout
    assert out.count(b"[REDACTED:SPLIT_SECRET]") == 2 and out.count(b"[REDACTED:github]") == 1, out
    assert out.startswith(b'{"v": "[REDACTED:SPLIT_SECRET]"}\n'), out
    assert_clean(out, secret_value)
    for _, core in _b64_cores(value):
        assert core not in out.replace(b"\n", b""), out
