"""The controller: a per-user background process that keeps the engine connection, settings and
image cache warm, so a CLI call costs one container's life and not Python's imports.

Started on demand by the CLI (``python -m sandman.core.controller``), one per code version and
environment, listening on a Unix socket in the runtime dir (0700). It exits after an idle period.
Every request runs in its own thread; a client that disconnects cancels its sandbox.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import select
import socket
import socketserver
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from loguru import logger

from sandman.core import protocol
from sandman.core.runner import Cancel, Runner
from sandman.core.workspace import resolve_workspace
from sandman.errors import SandmanError, UsageError
from sandman.policy import cli_size, enforce
from sandman.settings import Settings

DEFAULT_IDLE_S = 900.0


class _State:
    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self.active = 0
        self.last = time.monotonic()
        self.lock = threading.Lock()
        self.backends: dict[tuple[str, str], Any] = {}  # (name, settings) -> a connected backend

    def enter(self) -> None:
        with self.lock:
            self.active += 1
            self.last = time.monotonic()

    def leave(self) -> None:
        with self.lock:
            self.active -= 1
            self.last = time.monotonic()

    def idle_for(self) -> float:
        from sandman.upcall.relay import RelayHost

        host = RelayHost._instance
        with self.lock:
            if self.active or (host is not None and host.relays):
                return 0.0  # a session's relay keeps its controller alive
            return time.monotonic() - self.last


class Handler(socketserver.StreamRequestHandler):
    server: Server

    def handle(self) -> None:
        state = self.server.state
        state.enter()
        try:
            line = self.rfile.readline(protocol.MAX_REQUEST)
            if not line:
                return
            try:
                request = json.loads(line)
                op = request["op"]
            except (ValueError, KeyError, TypeError):
                protocol.send_json(self.request, protocol.ERROR, {"message": "malformed request", "exit_code": 2})
                return
            if op == "ping":
                protocol.send_json(self.request, protocol.RESULT, {"pid": os.getpid()})
            elif op == "shutdown":
                protocol.send_json(self.request, protocol.RESULT, {"pid": os.getpid()})
                threading.Thread(target=self.server.shutdown, daemon=True).start()
            elif op in ("relay.start", "relay.stop"):
                self._relay(op, request)
            elif op == "run":
                self._run(request.get("args") or {})
            else:
                protocol.send_json(self.request, protocol.ERROR, {"message": f"unknown op {op!r}", "exit_code": 2})
        except (BrokenPipeError, ConnectionError):
            pass
        finally:
            state.leave()

    def _relay(self, op: str, request: dict[str, Any]) -> None:
        """Host a CLI-created session's upcall relay (the CLI process is gone long before it ends)."""
        from sandman.core.session import Sandbox
        from sandman.upcall.relay import RelayHost

        session_id = str(request.get("session_id"))
        try:
            if op == "relay.stop":
                RelayHost.stop_if_running(session_id)
                protocol.send_json(self.request, protocol.RESULT, {"stopped": session_id})
                return
            from sandman.core.session import SessionGone
            from sandman.core.state import SessionState, StateStore

            settings = Settings.load()
            store = StateStore(settings.state_dir)
            rec = store.get_session(session_id)
            store.close()
            if rec is None or not SessionState(rec.state).live:
                raise SessionGone(f"session {session_id} is not live")
            sb = Sandbox(settings=settings, _record=rec)  # not attach(): that would ask us again
            started = RelayHost.shared().ensure(sb._relay_context(rec))
            protocol.send_json(self.request, protocol.RESULT, {"session_id": session_id, "started": started})
        except SandmanError as exc:
            protocol.send_json(self.request, protocol.ERROR, {"message": str(exc), "exit_code": exc.exit_code})

    def _runner(self, settings: Settings, progress: Any, name: str | None = None) -> Runner:
        """A runner on a backend kept connected across runs (one per backend and settings)."""
        from sandman import backends

        state = self.server.state
        key = (name or settings.backend, settings.model_dump_json())
        with state.lock:
            if key not in state.backends:
                state.backends[key] = backends.get(key[0], settings)
            backend = state.backends[key]
        return Runner(settings, progress, backend=backend)

    def _run(self, args: dict[str, Any]) -> None:
        sock: socket.socket = self.request
        send_lock = threading.Lock()
        cancel = Cancel()
        gone = threading.Event()

        def send(kind: bytes, data: bytes) -> None:
            """Backpressure while the client reads; once cancelled (or the client is gone), output
            is dropped so the engine's stream keeps draining and the sandbox can be removed."""
            view = memoryview(protocol.HEADER.pack(kind, len(data)) + data)
            with send_lock:
                while view and not gone.is_set():
                    try:
                        view = view[sock.send(view, socket.MSG_DONTWAIT) :]
                    except BlockingIOError:
                        if cancel.fired and kind != protocol.RESULT:
                            return
                        select.select([], [sock], [], 0.2)
                    except OSError:
                        gone.set()
                        cancel.fire()

        watcher = threading.Thread(target=self._watch, args=(cancel,), daemon=True)
        watcher.start()
        try:
            settings = Settings.load()
            name = args.get("backend")
            if name is not None and not isinstance(name, str):
                raise UsageError("backend must be a name")
            runner = self._runner(settings, lambda msg: send(protocol.PROGRESS, msg.encode()), name)
            ws = resolve_workspace(args.get("workspace") or ".")
            runner.check_campaign(ws.path, bool(args.get("accept_campaign")))
            from sandman.policy import named_policy_path

            operator = named_policy_path(str(args["policy"]), args.get("cwd")) if args.get("policy") else None
            policy = runner.policy(operator, ws.path)
            memory = args.get("memory")
            policy = policy.with_resources(
                cpus=args.get("cpus"),
                memory=cli_size(memory, "--memory") if memory else None,
                pids=args.get("pids"),
            )
            command = args.get("command")
            if not isinstance(command, list) or not all(isinstance(a, str) for a in command):
                raise UsageError("command must be a list of strings")
            host_env = args.get("env")
            if not isinstance(host_env, dict):
                host_env = {}
            result = runner.run(
                command,
                ws.path,
                host_env={str(k): str(v) for k, v in host_env.items()},
                policy=policy,
                campaign=args.get("campaign"),
                timeout=args.get("timeout"),
                stdout=lambda b: send(protocol.STDOUT, b),
                stderr=lambda b: send(protocol.STDERR, b),
                cancel=cancel,
            )
            send(protocol.RESULT, json.dumps(result.as_json()).encode())
        except SandmanError as exc:
            message = enforce.text_scrubber(Settings.load())(str(exc))
            send(protocol.ERROR, json.dumps({"message": message, "exit_code": exc.exit_code}).encode())
        except (BrokenPipeError, ConnectionError):
            cancel.fire()
        except Exception as exc:  # the client must get an answer, never a hang
            logger.error("run failed: {}", traceback.format_exc())
            with contextlib.suppress(OSError):
                send(
                    protocol.ERROR,
                    json.dumps({"message": f"internal error: {exc!r}", "exit_code": 1}).encode(),
                )

    def _watch(self, cancel: Cancel) -> None:
        """Cancel the sandbox when the client asks, or when it goes away."""
        try:
            while True:
                line = self.rfile.readline(256)
                if not line:
                    break
                if line.startswith(b"cancel"):
                    parts = line.split()
                    cancel.fire(int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None)
        except (OSError, ValueError):
            pass
        cancel.fire()


class Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    state: _State


def _stop_ended_relays() -> None:
    """Relays outlive nothing: a relay whose session has ended is stopped."""
    from sandman.core.state import SessionState, StateStore
    from sandman.upcall.relay import RelayHost

    host = RelayHost._instance
    if host is None or not host.relays:
        return
    try:
        store = StateStore(Settings.load().state_dir)
        for session_id in list(host.relays):
            rec = store.get_session(session_id)
            if rec is None or not SessionState(rec.state).live:
                host.stop(session_id)
        store.close()
        host.revive()  # a relay that died (crash, memory limit) is restarted; its session lives on
    except Exception:
        logger.exception("checking relays failed")


def serve(path: Path, idle_s: float) -> int:
    # 0711: a local-backend sandbox (run as the workspace owner) must search its way to its own
    # runtime dir; the socket itself is never more than 0600, from its first moment.
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o711)
    os.chmod(path.parent, 0o711)
    lock_file = open(f"{path}.lock", "w")  # noqa: SIM115 - held for the process's life
    try:
        fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # another controller already serves this socket
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    old_umask = os.umask(0o177)
    try:
        server = Server(str(path), Handler)
    finally:
        os.umask(old_umask)
    server.state = _State(idle_s)
    os.chmod(path, 0o600)
    logger.info("controller {} serving on {}", os.getpid(), path)

    def reaper() -> None:
        while server.state.idle_for() < idle_s:
            time.sleep(min(5.0, idle_s / 4))
            _stop_ended_relays()
        logger.info("idle for {:.0f}s: exiting", idle_s)
        server.shutdown()

    threading.Thread(target=reaper, daemon=True).start()
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        server.server_close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sandman-controller", description=__doc__)
    parser.add_argument("--socket", type=Path, default=None)
    parser.add_argument(
        "--idle", type=float, default=float(os.environ.get("SANDMAN_CONTROLLER_IDLE_S", DEFAULT_IDLE_S))
    )
    ns = parser.parse_args(argv)
    path = ns.socket or protocol.socket_path()
    _log_to_rotating_file(path.with_suffix(".log"))
    from sandman.upcall.relay import raise_nofile_limit

    raise_nofile_limit()  # a session's flood is its relay's problem; this process keeps descriptors
    return serve(path, ns.idle)


class _ToLog:
    """sys.stdout/sys.stderr of the controller: lines into the rotating log."""

    def __init__(self, level: str) -> None:
        self.level, self.buf = level, ""
        self.busy = threading.local()

    def write(self, text: str) -> int:
        if getattr(self.busy, "on", False):  # the log itself failed and says so: drop, never loop
            return len(text)
        self.busy.on = True
        try:
            return self._write(text)
        finally:
            self.busy.on = False

    def _write(self, text: str) -> int:
        self.buf += text
        *lines, self.buf = self.buf.split("\n")
        for line in lines:
            logger.log(self.level, "{}", line[:4000])
        if len(self.buf) > 4000:
            logger.log(self.level, "{}", self.buf[:4000])
            self.buf = ""
        return len(text)

    def flush(self) -> None:
        pass


def _log_to_rotating_file(path: Path) -> None:
    """Everything this process logs goes to ``path``, rotated at ``log_rotation_bytes`` with
    ``log_retention_files`` old files kept: a flood costs at most their product in disk. The
    descriptors the client gave us for stdout and stderr (the same file, never rotated) get
    nothing more after this."""
    try:
        settings = Settings.load()
        rotation, retention = settings.log_rotation_bytes, settings.log_retention_files
    except SandmanError:
        rotation, retention = 10 << 20, 3
    logger.remove()
    logger.add(path, level="INFO", rotation=rotation, retention=retention, encoding="utf-8")
    sys.stdout, sys.stderr = _ToLog("INFO"), _ToLog("ERROR")
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            os.dup2(devnull, fd)
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
