"""sandman's in-container supervisor: the main process of a session container (under tini).

Single-threaded on purpose: it forks bubblewrap for each exec and waits for it itself, so bwrap's
--die-with-parent follows a parent that cannot lose a thread. It listens on a control socket in a
runtime-dir subdirectory that is never bound into the bubblewrap layer, so the agent cannot reach
it. Stdlib only; the host builds every argv (this process runs what it is given, as its own uid).

Wire format: a request is one JSON line; then frames of (type byte, 4-byte big-endian length,
payload) both ways. Host -> here: b"i" stdin data, b"I" stdin EOF, b"k" kill. Here -> host:
b"o" stdout, b"e" stderr, b"r" the JSON result. A host that disconnects kills its exec.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import selectors
import signal
import socket
import struct
import sys
import termios
import time

HEADER = struct.Struct(">cI")
MAX_REQUEST = 1 << 20
READ_CHUNK = 1 << 16
EXIT_IDLE, EXIT_LIFETIME = 3, 4


class Exec:
    """One running command and the host connection that asked for it."""

    def __init__(self, sup: Supervisor, conn: socket.socket, request: dict) -> None:
        self.sup = sup
        self.conn = conn
        self.started = time.monotonic()
        timeout = request.get("timeout")
        self.deadline = self.started + float(timeout) if timeout else None
        self.timed_out = False
        self.killed = False
        self.inbuf = b""
        self.outq: list[bytes] = []
        self.status: int | None = None
        self.open_streams = 0
        want_stdin = bool(request.get("stdin"))
        tty = bool(request.get("tty"))
        if tty:
            # One pty for all three streams: an interactive shell (`sandman session shell`).
            master, slave = os.openpty()
            rows, cols = (request.get("winsize") or [24, 80])[:2]
            fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", int(rows), int(cols), 0, 0))
            out_r, out_w = master, slave
            err_r, err_w = -1, os.dup(slave)
            in_r, in_w = os.dup(slave), os.dup(master)
        else:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            in_r, in_w = os.pipe() if want_stdin else (os.open(os.devnull, os.O_RDONLY), -1)
        env = {str(k): str(v) for k, v in (request.get("env") or {}).items()}
        argv = [str(a) for a in request["argv"]]
        pid = os.fork()
        if pid == 0:  # child: become the command (bwrap), with clean stdio
            try:
                os.setpgid(0, 0)
                os.dup2(in_r, 0)
                os.dup2(out_w, 1)
                os.dup2(err_w, 2)
                os.closerange(3, 65536)
                signal.signal(signal.SIGPIPE, signal.SIG_DFL)
                os.execve(argv[0], argv, env)
            except BaseException as exc:  # noqa: BLE001 - report and die, never return to the loop
                os.write(2, f"sandman: cannot start {argv[0]}: {exc}\n".encode())
            finally:
                os._exit(127)
        self.pid = pid
        for fd in (in_r, out_w, err_w):
            os.close(fd)
        self.stdin_fd = in_w
        self.stdin_buf = b""
        self.stdin_eof = False
        if in_w >= 0:
            os.set_blocking(in_w, False)
        for fd, kind in ((out_r, b"o"), (err_r, b"e")):
            if fd < 0:
                continue
            os.set_blocking(fd, False)
            sup.sel.register(fd, selectors.EVENT_READ, ("pipe", self, kind))
            self.open_streams += 1

    # host -> command ----------------------------------------------------------------------
    def on_host_data(self, data: bytes) -> None:
        self.inbuf += data
        while len(self.inbuf) >= HEADER.size:
            kind, length = HEADER.unpack_from(self.inbuf)
            if len(self.inbuf) < HEADER.size + length:
                return
            payload = self.inbuf[HEADER.size : HEADER.size + length]
            self.inbuf = self.inbuf[HEADER.size + length :]
            if kind == b"i" and self.stdin_fd >= 0:
                self.stdin_buf += payload
                self.flush_stdin()
            elif kind == b"I":
                self.stdin_eof = True
                self.flush_stdin()
            elif kind == b"k":
                self.kill()

    def flush_stdin(self) -> None:
        """Write what the command will take now; the rest waits for the pipe to drain."""
        if self.stdin_fd < 0:
            return
        try:
            while self.stdin_buf:
                n = os.write(self.stdin_fd, self.stdin_buf[:READ_CHUNK])
                self.stdin_buf = self.stdin_buf[n:]
        except BlockingIOError:
            pass
        except OSError:
            self.stdin_buf = b""
            self.close_stdin()
            return
        registered = self.stdin_fd in self.sup.sel.get_map()
        if self.stdin_buf and not registered:
            self.sup.sel.register(self.stdin_fd, selectors.EVENT_WRITE, ("stdin", self, None))
        elif not self.stdin_buf:
            if registered:
                self.sup.sel.unregister(self.stdin_fd)
            if self.stdin_eof:
                self.close_stdin()

    def close_stdin(self) -> None:
        if self.stdin_fd >= 0:
            if self.stdin_fd in self.sup.sel.get_map():
                self.sup.sel.unregister(self.stdin_fd)
            os.close(self.stdin_fd)
            self.stdin_fd = -1

    def kill(self) -> None:
        # SIGKILL to bwrap: its child (PID 1 of the agent's namespace) has PDEATHSIG, and when
        # that init dies the kernel kills every process in the namespace.
        if self.status is None and not self.killed:
            self.killed = True
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except OSError:
                pass

    # command -> host ----------------------------------------------------------------------
    def send(self, kind: bytes, payload: bytes) -> None:
        try:
            self.conn.sendall(HEADER.pack(kind, len(payload)) + payload)
        except OSError:
            self.kill()  # the host is gone: nobody wants this command any more

    def on_pipe(self, fd: int, kind: bytes) -> None:
        try:
            data = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:  # EIO: the pty's last user is gone
            data = b""
        if data:
            self.send(kind, data)
            return
        self.sup.sel.unregister(fd)
        os.close(fd)
        self.open_streams -= 1
        self.maybe_finish()

    def maybe_finish(self) -> None:
        if self.status is None or self.open_streams:
            return
        code = os.waitstatus_to_exitcode(self.status)
        result = {
            "exit_code": code if code >= 0 else 128 - code,
            "signal": -code if code < 0 else None,
            "timed_out": self.timed_out,
            "killed": self.killed,
            "duration_s": round(time.monotonic() - self.started, 6),
        }
        self.send(b"r", json.dumps(result).encode())
        self.sup.finish(self)


class Supervisor:
    def __init__(self, path: str, idle_s: float | None, lifetime_s: float | None) -> None:
        self.sel = selectors.DefaultSelector()
        self.execs: dict[int, Exec] = {}
        self.by_conn: dict[int, Exec] = {}
        self.pending: dict[int, tuple[socket.socket, bytes]] = {}
        self.idle_s = idle_s
        self.started = self.last_active = time.monotonic()
        self.lifetime_s = lifetime_s
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        os.chmod(path, 0o600)
        self.listener.listen(128)
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, ("accept", None, None))
        rfd, wfd = os.pipe()
        os.set_blocking(rfd, False)
        os.set_blocking(wfd, False)
        signal.set_wakeup_fd(wfd)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: None)
        self.wakeup = rfd
        self.sel.register(rfd, selectors.EVENT_READ, ("signal", None, None))
        self.stop_code: int | None = None

    def finish(self, ex: Exec) -> None:
        self.execs.pop(ex.pid, None)
        self.by_conn.pop(ex.conn.fileno(), None)
        ex.close_stdin()
        try:
            self.sel.unregister(ex.conn)
        except (KeyError, ValueError):
            pass
        ex.conn.close()
        self.last_active = time.monotonic()

    def on_accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except BlockingIOError:
            return
        conn.setblocking(True)
        self.pending[conn.fileno()] = (conn, b"")
        self.sel.register(conn, selectors.EVENT_READ, ("request", None, None))
        self.last_active = time.monotonic()

    def on_request_data(self, conn: socket.socket) -> None:
        fd = conn.fileno()
        conn_, buf = self.pending[fd]
        try:
            data = conn.recv(READ_CHUNK)
        except OSError:
            data = b""
        if not data:
            self.sel.unregister(conn)
            del self.pending[fd]
            conn.close()
            return
        buf += data
        if b"\n" not in buf:
            if len(buf) > MAX_REQUEST:
                self._reply_close(conn, {"error": "request too large"})
            else:
                self.pending[fd] = (conn, buf)
            return
        line, rest = buf.split(b"\n", 1)
        del self.pending[fd]
        self.sel.unregister(conn)
        try:
            request = json.loads(line)
            op = request["op"]
        except (ValueError, KeyError, TypeError):
            self._reply_close(conn, {"error": "malformed request"})
            return
        if op == "ping":
            self._reply_close(conn, {"pid": os.getpid(), "execs": len(self.execs),
                                     "uptime_s": round(time.monotonic() - self.started, 3)})
        elif op == "exec":
            try:
                ex = Exec(self, conn, request)
            except (KeyError, TypeError, ValueError, OSError) as exc:
                self._reply_close(conn, {"error": f"cannot exec: {exc}"})
                return
            self.execs[ex.pid] = ex
            self.by_conn[conn.fileno()] = ex
            self.sel.register(conn, selectors.EVENT_READ, ("host", ex, None))
            if rest:
                ex.on_host_data(rest)
        elif op == "shutdown":
            self._reply_close(conn, {"ok": True})
            self.stop_code = 0
        else:
            self._reply_close(conn, {"error": f"unknown op {op!r}"})

    def _reply_close(self, conn: socket.socket, data: dict) -> None:
        payload = json.dumps(data).encode()
        try:
            conn.sendall(HEADER.pack(b"r", len(payload)) + payload)
        except OSError:
            pass
        conn.close()

    def on_host(self, ex: Exec) -> None:
        try:
            data = ex.conn.recv(READ_CHUNK)
        except OSError:
            data = b""
        if not data:
            self.sel.unregister(ex.conn)
            ex.kill()
            ex.close_stdin()
            return
        ex.on_host_data(data)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            ex = self.execs.get(pid)
            if ex is not None:
                ex.status = status
                ex.maybe_finish()

    def check_timers(self) -> float | None:
        now = time.monotonic()
        waits = []
        for ex in list(self.execs.values()):
            if ex.deadline is not None and ex.status is None:
                if now >= ex.deadline and not ex.timed_out:
                    ex.timed_out = True
                    ex.kill()
                else:
                    waits.append(ex.deadline - now)
        if self.lifetime_s is not None:
            left = self.started + self.lifetime_s - now
            if left <= 0:
                self.stop_code = EXIT_LIFETIME
            waits.append(max(left, 0))
        if self.idle_s is not None and not self.execs:
            left = self.last_active + self.idle_s - now
            if left <= 0:
                self.stop_code = EXIT_IDLE
            waits.append(max(left, 0))
        return max(min(waits), 0.01) if waits else None

    def serve(self) -> int:
        while self.stop_code is None:
            timeout = self.check_timers()
            if self.stop_code is not None:
                break
            for key, _ in self.sel.select(timeout):
                what, ex, kind = key.data
                if what == "accept":
                    self.on_accept()
                elif what == "signal":
                    try:
                        os.read(self.wakeup, 512)
                    except BlockingIOError:
                        pass
                    self.reap()
                elif what == "request":
                    self.on_request_data(key.fileobj)  # type: ignore[arg-type]
                elif what == "host":
                    self.on_host(ex)
                elif what == "pipe":
                    ex.on_pipe(key.fd, kind)
                elif what == "stdin":
                    ex.flush_stdin()
        for ex in list(self.execs.values()):
            ex.kill()
        return self.stop_code


def main() -> int:
    parser = argparse.ArgumentParser(description="sandman session supervisor")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--idle", type=float, default=None)
    parser.add_argument("--lifetime", type=float, default=None)
    ns = parser.parse_args()
    sup = Supervisor(ns.socket, ns.idle, ns.lifetime)
    print(f"supervisor {os.getpid()} ready on {ns.socket}", file=sys.stderr, flush=True)
    return sup.serve()


if __name__ == "__main__":
    sys.exit(main())
