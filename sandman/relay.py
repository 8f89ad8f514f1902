"""The upcall relay: the host side of the sandbox's only door out.

One relay per session listens on ``upcall.sock`` in the session's runtime dir (the directory, not
the socket, is bound into both layers, so a restarted relay is found again). JSON-RPC 2.0, one
object per line, bounded frames, standard error codes, many concurrent connections, a per-call
timeout, a per-session rate limit, and an audit record for every call. Nothing callable here can
change the session's policy, or see, create or stop any session.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loguru import logger

from sandman.helpers import HelperContext, HelperError, HelperResult, available_helpers
from sandman.policy import Policy
from sandman.settings import Settings
from sandman.state import StateStore
from sandman.workspace import Workspace

UPCALL_DIR = "upcall"  # in the session's runtime dir; bound (as a directory) into both layers


def upcall_socket(runtime_dir: str | os.PathLike[str]) -> Path:
    """The relay's socket on the host, for a session's runtime dir."""
    return Path(runtime_dir) / UPCALL_DIR / "upcall.sock"


MAX_FRAME = 1 << 20  # one request line
IDLE_READ_S = 60.0  # a connection that sends nothing for this long is closed
CALL_TIMEOUT_S = 120.0
RATE_PER_S, RATE_BURST = 20.0, 50

PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS = -32700, -32600, -32601, -32602
REFUSED, HELPER_FAILED, RATE_LIMITED, FRAME_TOO_LARGE = -32000, -32001, -32002, -32003


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


class Relay:
    """One session's JSON-RPC server (runs on a RelayHost's event loop)."""

    def __init__(self, ctx: RelayContext) -> None:
        self.ctx = ctx
        self.bucket = _Bucket(RATE_PER_S, RATE_BURST)
        self.server: asyncio.AbstractServer | None = None
        self.helpers = available_helpers(ctx.policy, ctx.settings)
        from sandman.enforce import make_scrubber

        # Upcall arguments are the one channel out of the sandbox: a credential in them blocks the call.
        self.leak_check = make_scrubber({n: v.get_secret_value() for n, v in ctx.settings.secrets.items()})
        self.state = StateStore(ctx.settings.state_dir, scrub=self.scrub)
        # PRs this session created survive a relay restart: they are in the audit log.
        for event in self.state.events(session=ctx.session_id):
            if event.event == "gh.pr_created":
                ctx.created_prs.add((str(event.detail["repo"]), int(event.detail["number"])))

    def scrub(self, text: str) -> str:
        return self.leak_check.scrub_text(text)[0]

    async def start(self) -> None:
        path = self.ctx.socket_path
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self.server = await asyncio.start_unix_server(self._serve, path=str(path), limit=MAX_FRAME)
        os.chmod(path, 0o600)
        if os.geteuid() == 0:
            os.chown(path, self.ctx.workspace.uid, self.ctx.workspace.gid)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 2)
        with contextlib.suppress(FileNotFoundError):
            self.ctx.socket_path.unlink()
        self.state.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    line = await asyncio.wait_for(reader.readline(), IDLE_READ_S)
                except (asyncio.LimitOverrunError, ValueError):
                    await self._send(writer, _error(None, FRAME_TOO_LARGE, f"frame larger than {MAX_FRAME} bytes"))
                    return
                except TimeoutError:
                    return
                if not line:
                    return
                response = await self._handle_line(line)
                if response is not None:
                    await self._send(writer, response)
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _send(self, writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
        writer.write(json.dumps(message).encode() + b"\n")
        await writer.drain()

    async def _handle_line(self, line: bytes) -> dict[str, Any] | None:
        try:
            request = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            return _error(None, PARSE_ERROR, "parse error: one JSON object per line")
        if (
            not isinstance(request, dict)
            or request.get("jsonrpc") != "2.0"
            or not isinstance(request.get("method"), str)
        ):
            return _error(
                request.get("id") if isinstance(request, dict) else None,
                INVALID_REQUEST,
                "invalid request: need jsonrpc '2.0' and a method",
            )
        rid = request.get("id")
        if rid is not None and not isinstance(rid, str | int):
            return _error(None, INVALID_REQUEST, "invalid request: id must be a string or a number")
        params = request.get("params", {})
        if not isinstance(params, dict):
            return _error(rid, INVALID_PARAMS, "params must be an object")
        try:
            if not self.bucket.take():
                raise RpcError(RATE_LIMITED, "rate limit: too many upcalls; slow down")
            result = await self._dispatch(request["method"], params)
        except RpcError as exc:
            return None if rid is None else _error(rid, exc.code, exc.message, exc.data)
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
            self.state.audit(ctx.session_id, "session.report", "ok", kind=kind, message=message)
            return {"ok": True}
        if method == "upcall.exec":
            return await self._exec(params)
        raise RpcError(METHOD_NOT_FOUND, f"method not found: {method}")

    async def _exec(self, params: dict[str, Any]) -> dict[str, Any]:
        name, args, stdin = params.get("helper"), params.get("args", []), params.get("stdin")
        if not isinstance(name, str) or not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise RpcError(INVALID_PARAMS, "upcall.exec needs helper (string) and args (list of strings)")
        if stdin is not None and (not isinstance(stdin, str) or len(stdin) > MAX_FRAME // 2):
            raise RpcError(INVALID_PARAMS, "stdin must be a string under 512 KiB")
        if any("\x00" in a for a in args):
            raise RpcError(INVALID_PARAMS, "args contain a NUL byte")
        started = time.monotonic()
        findings = self.leak_check.scan_text("\n".join([*args, stdin or ""]))
        if findings:
            what = ", ".join(sorted({f"{f.kind} ({f.fingerprint})" for f in findings}))
            self._audit(name, args, "refused", None, started, f"credential in the arguments: {what}")
            raise RpcError(REFUSED, f"upcall refused: its arguments hold what looks like a credential: {what}")
        helper = self.helpers.get(name)
        if helper is None:
            self._audit(name, args, "refused", None, started, "helper not allowed by this session's policy")
            raise RpcError(REFUSED, f"helper {name!r} is not allowed in this session: see `sandman-upcall list`")
        hctx = HelperContext(
            self.ctx.session_id,
            self.ctx.workspace,
            self.ctx.settings,
            self.ctx.created_prs,
            record=lambda event, **detail: self.state.audit(self.ctx.session_id, event, "ok", **detail),
        )
        try:
            result: HelperResult = await asyncio.wait_for(helper.run(args, stdin, hctx), CALL_TIMEOUT_S)
        except HelperError as exc:
            self._audit(name, args, "refused", None, started, str(exc))
            raise RpcError(REFUSED, str(exc)) from None
        except TimeoutError:
            self._audit(name, args, "timeout", None, started, f"no answer within {CALL_TIMEOUT_S:.0f}s")
            raise RpcError(HELPER_FAILED, f"helper {name!r} timed out after {CALL_TIMEOUT_S:.0f}s") from None
        self._audit(name, args, "ok" if result.exit_code == 0 else "failed", result.exit_code, started, "")
        return {
            "exit_code": result.exit_code,
            "stdout": self.scrub(result.stdout),
            "stderr": self.scrub(result.stderr),
            "truncated": result.truncated,
        }

    def _audit(self, helper: str, args: list[str], verdict: str, code: int | None, started: float, reason: str) -> None:
        self.state.audit(
            self.ctx.session_id,
            "upcall",
            verdict,
            helper=helper,
            args=args,
            exit_code=code,
            duration_s=round(time.monotonic() - started, 4),
            reason=reason,
        )


def _error(rid: Any, code: int, message: str, data: Any = None) -> dict[str, Any]:
    err: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        err["data"] = data
    return {"jsonrpc": "2.0", "id": rid, "error": err}


class RelayHost:
    """An event loop in a daemon thread that serves the relays of any number of sessions."""

    _instance: RelayHost | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.relays: dict[str, Relay] = {}
        self.thread = threading.Thread(target=self.loop.run_forever, name="sandman-relays", daemon=True)
        self.thread.start()

    @classmethod
    def shared(cls) -> RelayHost:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def start(self, ctx: RelayContext) -> Relay:
        relay = Relay(ctx)
        asyncio.run_coroutine_threadsafe(relay.start(), self.loop).result(10)
        old = self.relays.pop(ctx.session_id, None)
        self.relays[ctx.session_id] = relay
        if old is not None:
            logger.debug("replaced the relay of {}", ctx.session_id)
        return relay

    def stop(self, session_id: str) -> None:
        relay = self.relays.pop(session_id, None)
        if relay is not None:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(relay.stop(), self.loop).result(5)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self.relays

    def ensure(self, ctx: RelayContext) -> bool:
        """Start the relay unless it already serves; True when it had to be (re)started."""
        relay = self.relays.get(ctx.session_id)
        if relay is not None and ctx.socket_path.exists():
            return False
        self.start(ctx)
        return True

    @classmethod
    def stop_if_running(cls, session_id: str) -> None:
        if cls._instance is not None:
            cls._instance.stop(session_id)
