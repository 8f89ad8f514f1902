"""The CLI's side of ``sandman run``: stdlib only, so a call costs milliseconds before the
sandbox starts. It finds (or starts) the controller, streams the command's output to this
process's stdout/stderr, forwards Ctrl-C/SIGTERM as a cancel, and returns the exit code.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from sandman.core import protocol

START_TIMEOUT_S = 30.0
CANCEL_GRACE_S = 10.0


class ControllerUnavailable(Exception):
    pass


def _connect(path: Path) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except OSError:
        sock.close()
        return None
    return sock


def _start_controller(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o711)
    fd = os.open(path.with_suffix(".log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    log = os.fdopen(fd, "ab")  # handed to the child
    with log:
        subprocess.Popen(
            [sys.executable, "-m", "sandman.core.controller", "--socket", str(path)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,  # Ctrl-C in the terminal must not reach it
            close_fds=True,
        )


def connect() -> socket.socket:
    """A connection to a live controller, starting one when none answers."""
    path = protocol.socket_path()
    sock = _connect(path)
    if sock is not None:
        return sock
    _start_controller(path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        sock = _connect(path)
        if sock is not None:
            return sock
        time.sleep(0.02)
    raise ControllerUnavailable(
        f"the sandman controller did not start within {START_TIMEOUT_S:.0f}s; see {path.with_suffix('.log')}"
    )


def request(message: dict[str, Any]) -> dict[str, Any]:
    """One request to the controller (starting it if needed) and its one-frame answer."""
    from sandman.errors import SandboxError

    try:
        sock = connect()
    except ControllerUnavailable as exc:
        raise SandboxError(str(exc)) from None
    try:
        with sock:
            sock.sendall(json.dumps(message).encode() + b"\n")
            kind, payload = protocol.recv_frame(sock)
    except OSError as exc:  # ConnectionError included
        raise SandboxError(f"the sandman controller did not answer: {exc}") from None
    data: dict[str, Any] = json.loads(payload)
    if kind == protocol.ERROR:
        raise SandboxError(f"controller: {data.get('message')}")
    return data


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


# The last byte written to stdout, so `--json` can start its line on a line of its own.
last_stdout: bytes = b"\n"


class _Interrupted(Exception):
    """Raised from the signal handler so a write blocked on a full stdout cannot hold us."""


def run(
    args: dict[str, Any], progress: bool = True, raw: bool = False
) -> tuple[int, dict[str, Any] | None, str | None]:
    """Run through the controller. Returns (exit code, result object, error message).

    Output bound for a terminal is neutralized (``sandman.cli.terminal``) unless ``raw``; pipes and
    files get the bytes unchanged."""
    try:
        sock = connect()
    except ControllerUnavailable as exc:
        return 71, None, str(exc)
    from sandman.cli import terminal

    tty_out, tty_err = terminal.for_fd(1, raw), terminal.for_fd(2, raw)
    cancelled: list[int] = []

    def cancel(signum: int) -> None:
        if not cancelled:
            cancelled.append(signum)
            with contextlib.suppress(OSError):
                sock.sendall(f"cancel {signum}\n".encode())
            sock.settimeout(CANCEL_GRACE_S)

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        cancel(signum)
        raise _Interrupted

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        sock.sendall(json.dumps({"op": "run", "args": args}).encode() + b"\n")
        while True:
            try:
                kind, payload = protocol.recv_frame(sock)
                if cancelled and kind in (protocol.STDOUT, protocol.STDERR, protocol.PROGRESS):
                    continue  # cancelled: wait for the controller's word that the sandbox is gone
                if kind == protocol.STDOUT:
                    try:
                        global last_stdout
                        if tty_out is not None:
                            payload = tty_out.feed(payload)
                        write_all(1, payload)
                        last_stdout = payload[-1:] or last_stdout
                    except BrokenPipeError:
                        # The reader is gone (`| head`): stop the command as a shell pipeline would.
                        cancel(signal.SIGPIPE)
                elif kind == protocol.STDERR:
                    with contextlib.suppress(BrokenPipeError):
                        write_all(2, tty_err.feed(payload) if tty_err is not None else payload)
                elif kind == protocol.PROGRESS:
                    if progress:
                        if tty_err is not None:  # may quote a campaign's build output
                            payload = terminal.neutralize(payload)
                        with contextlib.suppress(OSError):
                            write_all(2, b"\xe2\x80\xba " + payload + b"\n")
                elif kind == protocol.RESULT:
                    result = json.loads(payload)
                    if cancelled:
                        return 128 + cancelled[0], result, None
                    return int(result["exit_code"]), result, None
                elif kind == protocol.ERROR:
                    err = json.loads(payload)
                    return int(err.get("exit_code", 1)), None, str(err.get("message"))
            except _Interrupted:
                continue  # a signal arrived (maybe mid-write): keep reading until the sandbox is gone
            except (ConnectionError, TimeoutError, OSError) as exc:
                if cancelled:
                    return 128 + cancelled[0], None, None
                return 71, None, f"lost the controller: {exc}"
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        sock.close()
        # What a neutralizer still holds (an unfinished escape or UTF-8 character), made inert.
        for fd, held in ((1, tty_out), (2, tty_err)):
            if held is not None and not cancelled:
                with contextlib.suppress(OSError):
                    write_all(fd, held.flush())
