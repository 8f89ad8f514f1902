"""The operator's terminal is not the sandbox's to control: `sandman run` and `sandman session exec`
writing to a real pseudo-terminal deliver a clipboard write (OSC 52), a screen erase, a title and
C1 controls inert; --raw delivers them as written (the positive control); pipes get the bytes
unchanged."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import select
import subprocess
import time
import tty
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandman.cli.terminal import neutralize
from tests.conftest import ROOT, SANDMAN

pytestmark = pytest.mark.docker

# printf(1) format: OSC 52 clipboard write, erase display, SGR red, OSC 0 title, a C1 CSI byte and
# a C1 CSI as UTF-8, cursor home, a BEL.
STDOUT_FMT = r"\033]52;c;aGk=\a\033[2J\033[31mred\033[0m \033]0;pwned\a\233\302\2332J\033[H\a done\n"
STDERR_FMT = r"\033]52;c;ZXJy\a\033[3J\033[1mwarn\033[0m\n"
STDOUT_BYTES = b"\x1b]52;c;aGk=\x07\x1b[2J\x1b[31mred\x1b[0m \x1b]0;pwned\x07\x9b\xc2\x9b2J\x1b[H\x07 done\n"
STDERR_BYTES = b"\x1b]52;c;ZXJy\x07\x1b[3J\x1b[1mwarn\x1b[0m\n"
SGR = re.compile(rb"\x1b\[[0-9;:]*m")


def command() -> list[str]:
    return ["sh", "-c", f"printf '{STDOUT_FMT}'; printf '{STDERR_FMT}' >&2"]


def on_ptys(args: list[str], env: dict[str, str], timeout: float = 180) -> tuple[int, bytes, bytes]:
    """Run the CLI with stdout and stderr each on its own pseudo-terminal (raw mode, so the bytes
    read from the master are the bytes the CLI wrote); return (exit code, stdout, stderr)."""
    masters, slaves = [], []
    for _ in range(2):
        m, s = pty.openpty()
        tty.setraw(s)
        masters.append(m)
        slaves.append(s)
    try:
        proc = subprocess.Popen(
            [*SANDMAN, *args], stdin=subprocess.DEVNULL, stdout=slaves[0], stderr=slaves[1], env=env, cwd=ROOT
        )
    finally:
        for s in slaves:
            os.close(s)
    got = {m: bytearray() for m in masters}
    open_ = set(masters)
    deadline = time.monotonic() + timeout
    try:
        while open_:
            if time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"sandman {args} did not finish in {timeout}s: {dict(got)}")
            ready, _, _ = select.select(list(open_), [], [], 0.2)
            for m in ready:
                try:
                    chunk = os.read(m, 65536)
                except OSError:  # EIO: every slave end is closed
                    chunk = b""
                if chunk:
                    got[m] += chunk
                else:
                    open_.discard(m)
            if not ready and proc.poll() is not None:
                break  # exited and nothing more to read
        code = proc.wait(timeout=30)
    finally:
        for m in masters:
            os.close(m)
    return code, bytes(got[masters[0]]), bytes(got[masters[1]])


def on_pipes(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([*SANDMAN, *args], capture_output=True, env=env, cwd=ROOT, timeout=180)


def assert_inert(out: bytes) -> None:
    text = SGR.sub(b"", out)
    assert b"\x1b" not in text and b"\x07" not in text, out
    out.decode("utf-8")  # no stray C1 bytes
    assert not any(0x80 <= ord(c) <= 0x9F for c in out.decode()), out


def test_run_on_a_terminal_neutralizes_control_sequences(
    engine: object, agent_image: str, workspace: Path, cli_env: dict[str, str]
) -> None:
    code, out, err = on_ptys(["run", "--workspace", str(workspace), "--", *command()], cli_env)
    assert code == 0, err
    assert out == neutralize(STDOUT_BYTES)
    assert out == (
        b"\\x1b]52;c;aGk=\\x07\\x1b[2J\x1b[31mred\x1b[0m \\x1b]0;pwned\\x07\\x9b\\u009b2J\\x1b[H\\x07 done\n"
    )
    assert b"\x1b]52" not in out and b"\x1b[2J" not in out and b"\x1b]0;" not in out
    assert_inert(out)
    assert neutralize(STDERR_BYTES) in err and b"\x1b]52" not in err and b"\x1b[3J" not in err
    assert_inert(err)


def test_run_raw_on_a_terminal_writes_the_bytes_unchanged(
    engine: object, agent_image: str, workspace: Path, cli_env: dict[str, str]
) -> None:
    """The positive control: the same command does reach the terminal raw when asked to."""
    code, out, err = on_ptys(["run", "--workspace", str(workspace), "--raw", "--", *command()], cli_env)
    assert code == 0, err
    assert out == STDOUT_BYTES
    assert STDERR_BYTES in err


def test_run_json_on_a_terminal_writes_the_bytes_unchanged(
    engine: object, agent_image: str, workspace: Path, cli_env: dict[str, str]
) -> None:
    code, out, err = on_ptys(["run", "--workspace", str(workspace), "--json", "--", *command()], cli_env)
    assert code == 0, err
    assert out.startswith(STDOUT_BYTES)
    assert json.loads(out[len(STDOUT_BYTES) :])["exit_code"] == 0


def test_run_into_pipes_writes_the_bytes_unchanged(
    engine: object, agent_image: str, workspace: Path, cli_env: dict[str, str]
) -> None:
    res = on_pipes(["run", "--workspace", str(workspace), "--", *command()], cli_env)
    assert res.returncode == 0, res.stderr
    assert res.stdout == STDOUT_BYTES
    assert STDERR_BYTES in res.stderr


def test_run_in_process_on_a_terminal_neutralizes_too(
    engine: object, agent_image: str, workspace: Path, cli_env: dict[str, str]
) -> None:
    env = {**cli_env, "SANDMAN_IN_PROCESS": "1"}
    code, out, err = on_ptys(["run", "--workspace", str(workspace), "--", *command()], env)
    assert code == 0, err
    assert out == neutralize(STDOUT_BYTES)
    assert neutralize(STDERR_BYTES) in err


@pytest.fixture
def session_id(engine: object, agent_image: str, workspace: Path, cli_env: dict[str, str]) -> Iterator[str]:
    res = on_pipes(["session", "create", "-w", str(workspace), "--json"], cli_env)
    assert res.returncode == 0, res.stderr
    sid = json.loads(res.stdout)["session_id"]
    try:
        yield sid
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired):
            on_pipes(["session", "stop", sid], cli_env)


def test_session_exec_on_a_terminal_neutralizes_raw_does_not_pipes_unchanged(
    session_id: str, cli_env: dict[str, str]
) -> None:
    code, out, err = on_ptys(["session", "exec", session_id, "--", *command()], cli_env)
    assert code == 0, err
    assert out == neutralize(STDOUT_BYTES)
    assert neutralize(STDERR_BYTES) in err
    assert_inert(out)
    assert_inert(err)

    code, out, err = on_ptys(["session", "exec", session_id, "--raw", "--", *command()], cli_env)
    assert code == 0, err
    assert out == STDOUT_BYTES and STDERR_BYTES in err

    res = on_pipes(["session", "exec", session_id, "--", *command()], cli_env)
    assert res.returncode == 0, res.stderr
    assert res.stdout == STDOUT_BYTES and STDERR_BYTES in res.stderr
