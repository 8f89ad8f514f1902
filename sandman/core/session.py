"""Sessions: long-lived sandboxes you create once and exec in many times.

One module on purpose: it is mostly the ``Sandbox`` class (create, attach, exec streaming, update,
teardown), whose methods share the session record, the control socket and the relay; the functions
after it are its small helpers.

The session container's main process is sandman's supervisor (images/base/supervisor.py), which
listens on a control socket in the session's runtime dir. An exec is one Unix-socket round trip
to it plus bubblewrap's start, not a ``docker exec``. The socket's directory is bound into the
container but never into the bubblewrap layer, so the agent cannot reach it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets as _secrets
import select
import shutil
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandman import backends
from sandman.backends.base import Backend, ContainerSpec, state_id_for
from sandman.backends.causes import CgroupWatch, OutputCap
from sandman.core.files import Files
from sandman.core.protocol import HEADER, recv_exact
from sandman.core.quota import DiskWatch
from sandman.core.runner import (
    CONTROL_DIR,
    SUPERVISOR,
    TINI,
    ExitCause,
    Runner,
    classify_end,
    layer2_request,
    make_runtime_dir,
    new_session_id,
    process_start,
    trusted_dir,
)
from sandman.core.state import SessionRecord, SessionState, StateStore
from sandman.core.workspace import Workspace, resolve_workspace
from sandman.errors import SandboxError, SandmanError, UsageError
from sandman.policy import Policy, enforce, seccomp
from sandman.policy.paths import WorkspaceScanner
from sandman.secrets.scrub import Scrubber
from sandman.settings import Settings
from sandman.upcall.helpers import bare_repository
from sandman.upcall.relay import RelayContext, RelayHost, upcall_socket

if TYPE_CHECKING:
    import docker

CONTROL_SOCK = "ctl.sock"
PRIVATE_DIRS = ("/tmp", "/home/agent")  # the container tmpfs each exec gets its own directory in
READY_TIMEOUT_S = 30.0
IDLE_RELEASE_S = 0.05  # a stream quiet this long has its scrubber's held-back tail released
EXIT_IDLE, EXIT_LIFETIME = 3, 4


class SessionNotFound(UsageError):
    exit_code = 6


class SessionGone(SandmanError):
    """The session exists in state but its sandbox is no longer running."""

    exit_code = 6


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: bytes
    stderr: bytes
    cause: ExitCause
    duration_s: float
    truncated: bool = False  # output beyond resources.max_output was dropped

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def as_json(self) -> dict[str, Any]:
        return {
            "exit_code": self.exit_code,
            "cause": self.cause.value,
            "duration_s": round(self.duration_s, 4),
        }


@dataclass(frozen=True)
class Output:
    """One chunk of a streaming exec: ``stream`` is "stdout" or "stderr"."""

    stream: str
    data: bytes


def owner_alive(pid: int | None, start: float | None) -> bool:
    if pid is None:
        return True  # not owned by a process: lives until stopped or expired
    return process_start(pid) == start


class Sandbox:
    """A session: ``with Sandbox(workspace=...) as sb: sb.exec([...])``.

    >>> with Sandbox(workspace=ws) as sb:                      # doctest: +SKIP
    ...     sb.exec(["sh", "-c", "echo hi"]).stdout
    b'hi\\n'
    """

    def __init__(
        self,
        workspace: str | os.PathLike[str] | None = None,
        *,
        policy: Policy | str | os.PathLike[str] | None = None,
        campaign: str | None = None,
        settings: Settings | None = None,
        progress: Callable[[str], None] | None = None,
        owned: bool = True,
        kind: str = "session",
        labels: Mapping[str, str] | None = None,
        accept_campaign: bool = False,
        backend: str | None = None,
        _record: SessionRecord | None = None,
        _runner: Runner | None = None,
    ) -> None:
        self.settings = settings or Settings.load()
        name = _record.backend if _record is not None else backend
        if name is not None:
            backends.backend_class(name)  # an unknown name is a usage error, before anything starts
        if _runner is None or (name is not None and _runner.backend_name != name):
            _runner = Runner(
                self.settings, progress or (_runner.progress if _runner else (lambda _m: None)), backend=name
            )
        self._runner = _runner
        # Known secrets found in the repository's history: scrubbed from output and the audit.
        self._history: dict[str, str] | None = None
        self._history_values: dict[str, str] = {}
        self._scrub_text = enforce.text_scrubber(self.settings, self._history_values)
        self.state = StateStore(self.settings.state_dir, scrub=self._scrub_text)
        self._scrubbers: dict[frozenset[tuple[str, str]], Scrubber] = {}
        self._scanner: WorkspaceScanner | None = None
        self.poison: list[str] = []  # after close: what the session left for the host's own tools
        self._watch: CgroupWatch | None = None
        if _record is not None:  # attach: the policy the session was created with
            self.record = _record
            self.workspace = Workspace(Path(_record.workspace), _record.uid, _record.gid)
            self.policy = (
                Policy.model_validate_json(_record.policy)
                if _record.policy != "{}"
                else (self._runner.policy(None, self.workspace.path))
            )
            return
        if workspace is None:
            raise UsageError("a workspace is required to create a session")
        self.workspace = resolve_workspace(workspace)
        self._runner.check_campaign(self.workspace.path, accept_campaign)
        self.policy = (
            self._runner.policy(None, self.workspace.path)
            if policy is None
            else _as_policy(self._runner, policy, self.workspace.path)
        )
        self.record = self._create(campaign, owned, kind, dict(labels or {}))

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def files(self) -> Files:
        """Host-side, path-validated access to the workspace: ``read``, ``write``, ``list``."""
        return Files(
            self.workspace,
            lambda: self.policy,
            lambda event, verdict, **detail: self.state.audit(self.id, event, verdict, **detail),
            scrub=self._scrub_file,
        )

    def _scrub_file(self, data: bytes) -> bytes:
        """A file read through the files API carries none of the session's known secrets."""
        known = {
            **{n: v.get_secret_value() for n, v in self.settings.secrets.items()},
            **self._history_values,
        }
        if not known:
            return data
        return self._scrubber(known).scrub_bytes(data)[0]

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def api(self) -> docker.APIClient:
        return self._runner.api

    @property
    def backend(self) -> Backend:
        return self._runner.backend

    def _create(self, campaign_name: str | None, owned: bool, kind: str, labels: dict[str, str]) -> SessionRecord:
        from sandman.backends.image import load_campaign

        camp = load_campaign(self.workspace.path, campaign_name)
        image = self._runner.images().ensure(camp, self._runner.progress)
        self._runner.ensure_probe(image, self.workspace, self.policy)
        self._campaign_env = dict(camp.spec.env)
        session_id = new_session_id()
        runtime_dir = make_runtime_dir(self.settings, session_id, self.workspace)
        res = self.policy.resources
        command = [
            TINI,
            "--",
            "python3",
            "-I",
            "-S",
            SUPERVISOR,
            "--socket",
            f"/run/sandman/{CONTROL_DIR}/{CONTROL_SOCK}",
        ]
        if self.backend.layer2_mode == "gvisor":
            command += ["--gvisor", f"{self.workspace.uid}:{self.workspace.gid}"]
        if res.idle_timeout_s:
            command += ["--idle", str(res.idle_timeout_s)]
        if res.session_timeout_s:
            command += ["--lifetime", str(res.session_timeout_s)]
        spec = ContainerSpec(
            image=image,
            command=command,
            session_id=session_id,
            campaign=camp.name,
            workspace=str(self.workspace.path),
            runtime_dir=str(runtime_dir),
            uid=self.workspace.uid,
            gid=self.workspace.gid,
            resources=res,
            seccomp_profile=seccomp.profile_for(self.policy.commands.allow is not None),
            runtime=self.policy.runtime,
            state_id=state_id_for(self.settings.state_dir),
            kind=kind,
            extra_mounts=enforce.extra_mounts(self.policy),
            extra_labels=labels,
            trusted_dir=str(trusted_dir(self.settings)),
        )
        now = time.time()
        rec = SessionRecord(
            id=session_id,
            kind=kind,
            campaign=camp.name,
            workspace=str(self.workspace.path),
            image=image,
            policy_hash=self.policy.digest(),
            container_id=None,
            runtime_dir=str(runtime_dir),
            state=SessionState.STARTING.value,
            owner_pid=os.getpid() if owned else None,
            owner_start=process_start(os.getpid()) if owned else None,
            pool=None,
            uid=self.workspace.uid,
            gid=self.workspace.gid,
            limits=json.dumps(
                {"cpus": res.cpus, "memory": res.memory, "pids": res.pids, "campaign_env": self._campaign_env}
            ),
            created=now,
            last_used=now,
            policy=self.policy.model_dump_json(),
            backend=self._runner.backend_name,
        )
        self.state.add_session(rec)
        try:
            self._history_secrets(session_id)  # `refuse` stops here, before any container exists
            self._save_baseline(session_id)
        except BaseException:
            self.state.end_session(session_id, SessionState.STOPPED, "refused at start")
            shutil.rmtree(runtime_dir, ignore_errors=True)
            raise
        try:
            container_id = self.backend.create(spec)
            rec.container_id = container_id
            self.state.update_session(session_id, container_id=container_id)
            self.backend.start(container_id)
            self._wait_ready(container_id, runtime_dir / CONTROL_DIR / CONTROL_SOCK)
            self._start_relay(rec, owned)
        except BaseException as exc:
            self._teardown(rec, SessionState.STOPPED, f"failed to start: {exc!r}"[:200])
            raise
        rec.state = SessionState.RUNNING.value
        self.state.update_session(session_id, state=rec.state)
        for warning in enforce.advisory_warnings(self.policy, landlock=self.backend.layer2_mode != "gvisor"):
            self._runner.progress(warning)
            self.state.audit(session_id, "policy.advisory", "warning", reason=warning)
        self.state.audit(
            session_id,
            "session.create",
            campaign=camp.name,
            image=image,
            kind=kind,
            workspace=str(self.workspace.path),
            policy=self.policy.name,
        )
        return rec

    def _wait_ready(self, container_id: str, sock_path: Path) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if os.path.lexists(sock_path):
                with contextlib.suppress(OSError, ConnectionError, ValueError):
                    self._control({"op": "ping"}, sock_path)
                    return
            if not self.backend.status(container_id).running:
                logs = self.backend.logs(container_id, tail=20)
                raise SandboxError(f"the session supervisor exited during start: {logs.strip()[-400:]}")
            time.sleep(0.01)
        raise SandboxError(f"the session supervisor did not answer within {READY_TIMEOUT_S:.0f}s")

    @property
    def _sock_path(self) -> Path:
        return Path(self.record.runtime_dir) / CONTROL_DIR / CONTROL_SOCK

    def _connect(self) -> socket.socket:
        try:
            return connect_control(self._sock_path)
        except OSError:
            raise SessionGone(f"session {self.id} is not running (its supervisor does not answer)") from None

    def _control(self, request: dict[str, Any], path: Path | None = None) -> dict[str, Any]:
        sock = connect_control(path or self._sock_path)
        with sock:
            sock.settimeout(10)
            sock.sendall(json.dumps(request).encode() + b"\n")
            _kind, length = HEADER.unpack(recv_exact(sock, HEADER.size))
            result: dict[str, Any] = json.loads(recv_exact(sock, length))
            return result

    def close(self) -> None:
        """Stop the session: kill every process (no SIGTERM grace), remove the container."""
        self._teardown(self.record, SessionState.STOPPED, "closed")

    def _upcall_sock(self, rec: SessionRecord) -> Path:
        return upcall_socket(rec.runtime_dir)

    def _relay_context(self, rec: SessionRecord) -> RelayContext:
        return RelayContext(
            rec.id,
            rec.campaign,
            self.workspace,
            self.policy,
            self.settings,
            self._upcall_sock(rec),
            extra_secrets={
                **enforce.known_secrets(self.settings, self.policy, os.environ),
                **self._history_secrets(rec.id),
            },
        )

    def _history_secrets(self, session_id: str) -> dict[str, str]:
        """The repository's historical deny-listed file versions (``filesystem.git_history``),
        found once per handle: scrubbed from output, the audit, files API reads and upcalls."""
        if self._history is None:
            self._history = enforce.history_secrets(
                self.workspace,
                self.policy,
                self.settings,
                progress=self._runner.progress,
                audit=lambda event, verdict, **d: self.state.audit(session_id, event, verdict, **d),
            )
            self._history_values.update(self._history)
        return self._history

    def _start_relay(self, rec: SessionRecord, owned: bool) -> None:
        """The session's upcall relay: in this process when it owns the session, else in the
        controller (which outlives this CLI call and restarts relays after a crash)."""
        if not self.policy.upcalls.helpers:
            return
        if owned:
            RelayHost.shared().start(self._relay_context(rec))
        else:
            from sandman.core import client

            client.request({"op": "relay.start", "session_id": rec.id})

    def _baseline_path(self, session_id: str) -> Path:
        return self.settings.state_dir / "baselines" / f"{session_id}.json"

    def _save_baseline(self, session_id: str) -> None:
        """What the workspace held for the host's tools before the agent ran (sandman.core.poison)."""
        from sandman.core import poison

        path = self._baseline_path(session_id)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        baseline = poison.take_baseline(self.workspace.path)
        enforce.poison_gate(self.settings, self.workspace, baseline)
        path.write_text(baseline.model_dump_json())

    def _teardown(self, rec: SessionRecord, state: SessionState, reason: str) -> None:
        RelayHost.stop_if_running(rec.id)

        if rec.container_id:
            self.backend.remove(rec.container_id)
        shutil.rmtree(rec.runtime_dir, ignore_errors=True)
        shutil.rmtree(bare_repository(self.settings.state_dir, rec.id), ignore_errors=True)
        ended = self.state.end_session(rec.id, state, reason)
        if ended:
            self.state.audit(rec.id, "session.stop", state=state.value, reason=reason)
        rec.state = state.value
        self.poison = self._poison_check(rec) if ended else []

    def _poison_check(self, rec: SessionRecord) -> list[str]:
        """The session is over: report (or quarantine) what it left for the host's own tools."""
        from sandman.core import poison

        path = self._baseline_path(rec.id)
        try:
            baseline = poison.Baseline.model_validate_json(path.read_text())
        except (OSError, ValueError):
            baseline = None
        try:
            return enforce.poison_check(
                self.workspace, baseline, self.policy, self.settings, rec.id, self.state, self._runner.progress
            )
        finally:
            path.unlink(missing_ok=True)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def attach(cls, session_id: str, settings: Settings | None = None) -> Sandbox:
        """A handle on a running session, from any process."""
        settings = settings or Settings.load()
        store = StateStore(settings.state_dir)
        rec = store.get_session(session_id)
        store.close()
        if rec is None:
            raise SessionNotFound(f"no session {session_id!r}: see `sandman session ls`")
        if not SessionState(rec.state).live:
            raise SessionGone(f"session {session_id} has ended ({rec.state}: {rec.end_reason})")
        sb = cls(settings=settings, _record=rec)
        if rec.owner_pid is None and sb.policy.upcalls.helpers and not _answers(sb._upcall_sock(rec)):
            # Its relay lived in a controller that is gone: start it again; the sandbox finds the
            # new socket in the same (bound) directory.
            sb._start_relay(rec, owned=False)
        return sb

    # -- exec ---------------------------------------------------------------------------------
    def masks(self) -> enforce.Masks:
        """Denied, protected and pinned paths as they are now: every exec rescans (incrementally,
        so an unchanged tree costs a few milliseconds)."""
        if self._scanner is None:
            self._scanner = enforce.workspace_scanner(self.workspace, self.policy)
        masks = enforce.scan_masks(self.workspace, self.policy, self._scanner)
        for warning in masks.warnings:
            self._runner.progress(warning)
        return masks

    def _layer2(
        self,
        argv: Sequence[str],
        cwd: str | os.PathLike[str] | None,
        env: Mapping[str, str] | None,
        host_env: Mapping[str, str] | None,
    ) -> enforce.Layer2:
        try:
            enforce.check_argv(argv, self.policy, self.workspace)
        except enforce.CommandRefused as exc:
            self._runner.refuse(self.id, exc, argv)
            raise
        self._history_secrets(self.id)
        limits = json.loads(self.record.limits)
        extra = {**(limits.get("campaign_env") or {}), **(env or {})}
        try:
            sandbox_env = enforce.sandbox_env(
                self.policy,
                self.settings,
                host_env=os.environ if host_env is None else host_env,
                controller_env={"SANDMAN_SESSION": self.id, "SANDMAN_CAMPAIGN": self.record.campaign},
                extra=extra,
            )
        except enforce.EnvRefused as exc:
            self._runner.refuse(self.id, exc, argv)
            raise
        sandbox_env.known_secrets.update(self._history_secrets(self.id))
        return enforce.Layer2(
            sandbox_env,
            self.masks(),
            enforce.container_cwd(cwd, self.workspace, self.policy),
            tuple(self.policy.filesystem.writable),
        )

    def stream(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = None,
        cwd: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | Iterator[bytes] | None = None,
        tty: tuple[int, int] | None = None,
        host_env: Mapping[str, str] | None = None,
    ) -> Iterator[Output | ExecResult]:
        """Run ``argv``; yield Output chunks as they come, then the ExecResult.

        ``stdin`` is bytes or an iterator of chunks (an interactive terminal); ``tty`` = (rows,
        cols) runs the command on a pseudo-terminal, stdout and stderr merged."""
        if not argv or not all(isinstance(a, str) for a in argv):
            raise UsageError("argv must be a non-empty list of strings")
        if any("\x00" in a for a in argv):
            raise UsageError("argv contains a NUL byte")
        if timeout is None:
            timeout = self.policy.resources.exec_timeout_s
        plan = self._layer2(argv, cwd, env, host_env)
        env_file: Path | None = None
        env_file_in_container = None
        if plan.env.private:
            env_file, env_file_in_container = enforce.write_env_file(
                Path(self.record.runtime_dir), self.workspace, plan.env.private
            )
        private = None
        if not self.policy.filesystem.share_tmp_home:
            tag = f".sandman-exec-{_secrets.token_hex(8)}"
            private = (f"{PRIVATE_DIRS[0]}/{tag}", f"{PRIVATE_DIRS[1]}/{tag}")
        spec = plan.spec(argv, env_file_in_container, private)
        request: dict[str, Any] = {
            "op": "exec",
            **layer2_request(spec, self.workspace, self.backend.layer2_mode),
            "mkdirs": list(private or ()),
            "env": {},
            "timeout": timeout,
            "stdin": stdin is not None,
            "tty": tty is not None,
            "winsize": list(tty) if tty else None,
        }
        started = time.monotonic()
        out, err = bytearray(), bytearray()
        notices: list[bytes] = []
        cap = OutputCap(self.policy.resources.max_output, notices.append)
        scrubber = self._scrubber(plan.env.known_secrets)
        scrub_out, scrub_err = scrubber.stream(), scrubber.stream()
        watch = self._cgroup_watch()
        before = watch.read()
        sock = self._connect()
        res = self.policy.resources
        disk = DiskWatch(
            self.workspace.path,
            res.workspace_quota,
            res.host_reserve,
            lambda _r: _send_kill(sock),
            inode_quota=res.workspace_inode_quota,
            inode_reserve=res.host_inode_reserve,
        )
        with sock, _removed_after(env_file), disk:
            sock.sendall(json.dumps(request).encode() + b"\n")
            if stdin is not None:
                threading.Thread(target=_feed_stdin, args=(sock, stdin), daemon=True).start()
            while True:
                if not select.select([sock], [], [], IDLE_RELEASE_S)[0]:
                    # Idle: let what the scrubbers hold back go out now rather than at the end.
                    for name, scrub in (("stdout", scrub_out), ("stderr", scrub_err)):
                        if held := cap.take(scrub.release()):
                            (out if name == "stdout" else err).extend(held)
                            yield Output(name, held)
                    continue
                try:
                    kind, length = HEADER.unpack(recv_exact(sock, HEADER.size))
                    payload = recv_exact(sock, length)
                except ConnectionError:
                    raise SessionGone(f"session {self.id} stopped during the exec") from None
                if kind == b"r":  # the scrubbers hold back what could start a secret: flush them
                    if tail := cap.take(scrub_out.flush()):
                        out += tail
                        yield Output("stdout", tail)
                    if tail := cap.take(scrub_err.flush()):
                        err += tail
                        yield Output("stderr", tail)
                elif kind == b"o":
                    if payload := cap.take(scrub_out.feed(payload)):
                        out += payload
                        yield Output("stdout", payload)
                elif kind == b"e":
                    cap.note_stderr(payload)
                    if payload := cap.take(scrub_err.feed(payload)):
                        err += payload
                        yield Output("stderr", payload)
                while notices:  # the truncation notice, once, on stderr
                    note = notices.pop()
                    err += note
                    yield Output("stderr", note)
                if kind == b"r":
                    result = json.loads(payload)
                    break
        if "error" in result:
            raise SandboxError(f"the session supervisor refused the exec: {result['error']}")
        code = int(result["exit_code"])
        after = watch.read()
        if disk.exceeded:
            note = f"sandman: stopped: {disk.reason}\n".encode()
            err += note
            yield Output("stderr", note)
            cause, code = ExitCause.DISK_QUOTA, 137
        elif result.get("timed_out"):
            # A fork or thread bomb ends by the timeout; the pids limit is what it ran into.
            cause = ExitCause.PIDS_LIMIT if after.pids_max_hits > before.pids_max_hits else ExitCause.TIMEOUT
            code = 124
        else:
            cause = classify_end(code, before, after, cap.tail, killed_by_us=bool(result.get("killed")))
        duration = time.monotonic() - started
        self.state.touch(self.id)
        self.state.audit(
            self.id,
            "exec",
            "ok",
            argv=list(argv),
            exit_code=code,
            cause=cause.value,
            duration_s=round(duration, 4),
        )
        yield ExecResult(code, bytes(out), bytes(err), cause, duration, cap.truncated)

    def exec(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = None,
        cwd: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | Iterator[bytes] | None = None,
        on_output: Callable[[Output], None] | None = None,
    ) -> ExecResult:
        """Run ``argv`` to completion inside both layers and return its result."""
        for item in self.stream(argv, timeout=timeout, cwd=cwd, env=env, stdin=stdin):
            if isinstance(item, ExecResult):
                return item
            if on_output is not None:
                on_output(item)
        raise SandboxError("the exec ended without a result")  # pragma: no cover

    def _scrubber(self, secrets: Mapping[str, str]) -> Scrubber:
        """One scrubber per set of known secrets (building one costs a few ms; an exec ~10 ms)."""
        key = frozenset(secrets.items())
        if key not in self._scrubbers:
            self._scrubbers = {key: enforce.make_scrubber(secrets)}
        return self._scrubbers[key]

    def _cgroup_watch(self) -> CgroupWatch:
        """The session container's cgroup counters (located once per handle)."""
        if self._watch is None:
            self._watch = CgroupWatch(0)
            if self.record.container_id:
                with contextlib.suppress(Exception):
                    self._watch = self.backend.counters(self.record.container_id)
        return self._watch

    # -- live changes -------------------------------------------------------------------------
    def update_policy(self, policy: Policy | str | os.PathLike[str]) -> dict[str, list[str]]:
        """Switch the session to a new policy without a restart where possible.

        Commands, environment, secrets and the deny list apply from the next exec; CPU, memory
        and pids caps are applied to the running container; anything else (network, runtime,
        mounts, tmpfs, ulimits, session timeouts) needs a new session and is refused, by key."""
        new = _as_policy(self._runner, policy, self.workspace.path)
        next_exec, live, rebuild = classify_policy_change(self.policy, new)
        if rebuild:
            raise UsageError(
                f"these policy changes need a new container, so a new session: {', '.join(rebuild)}; "
                "nothing was changed"
            )
        if live:
            res = new.resources
            self.update(cpus=res.cpus, memory=res.memory, pids=res.pids)
        self.policy = new
        self._scanner = None
        self.record.policy = new.model_dump_json()
        self.state.update_session(self.id, policy=self.record.policy, policy_hash=new.digest())
        self.state.audit(self.id, "session.policy", next_exec=next_exec, live=live)
        return {"next_exec": next_exec, "live": live}

    def update(self, *, cpus: float | None = None, memory: int | None = None, pids: int | None = None) -> None:
        """Apply new CPU, memory (= memory+swap) or pids caps to the running container."""
        if (cpus is None and memory is None and pids is None) or not self.record.container_id:
            return
        self.backend.update_limits(self.record.container_id, cpus=cpus, memory=memory, pids=pids)
        limits = json.loads(self.record.limits)
        limits.update({k: v for k, v in {"cpus": cpus, "memory": memory, "pids": pids}.items() if v is not None})
        self.record.limits = json.dumps(limits)
        self.state.update_session(self.id, limits=self.record.limits)
        self.state.audit(self.id, "session.update", cpus=cpus, memory=memory, pids=pids)


def connect_control(path: Path) -> socket.socket:
    """Connect to a supervisor's socket without following a symlink the container may have put
    in its place (the control dir is the one runtime dir the container writes): the socket is
    opened O_PATH|O_NOFOLLOW, checked to be a socket, and connected to through its descriptor."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise ConnectionRefusedError(f"{path} is not a socket")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(f"/proc/self/fd/{fd}")
        except OSError:
            sock.close()
            raise
        return sock
    finally:
        os.close(fd)


def _answers(path: Path) -> bool:
    """Whether something accepts connections on the Unix socket at ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(1)
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def _removed_after(path: Path | None) -> Iterator[None]:
    """The private env file lives exactly as long as its exec."""
    try:
        yield
    finally:
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


# What a running session can take from a new policy, and how.
_NEXT_EXEC = (
    "commands",
    "environment",
    "secrets",
    "filesystem.deny",
    "filesystem.allow",
    "filesystem.protected",
    "resources.exec_timeout_s",
    "name",
    "upcalls",
    "campaign",
)
_LIVE_UPDATE = ("resources.cpus", "resources.memory", "resources.pids")


def classify_policy_change(old: Policy, new: Policy) -> tuple[list[str], list[str], list[str]]:
    """Changed keys: (apply at the next exec, apply with docker update, need a new container)."""
    from sandman.policy import flatten

    before, after = flatten(old.model_dump(mode="json")), flatten(new.model_dump(mode="json"))
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    next_exec = [k for k in changed if k.startswith(_NEXT_EXEC)]
    live = [k for k in changed if k in _LIVE_UPDATE]
    rebuild = [k for k in changed if k not in next_exec and k not in live]
    return next_exec, live, rebuild


def _send_kill(sock: socket.socket) -> None:
    """Ask the supervisor to kill the exec on this connection (from the disk watchdog's thread)."""
    with contextlib.suppress(OSError):
        sock.sendall(HEADER.pack(b"k", 0))


def _feed_stdin(sock: socket.socket, data: bytes | Iterator[bytes]) -> None:
    chunks = (data[i : i + (1 << 16)] for i in range(0, len(data), 1 << 16)) if isinstance(data, bytes) else data
    with contextlib.suppress(OSError):
        for chunk in chunks:
            sock.sendall(HEADER.pack(b"i", len(chunk)) + chunk)
        sock.sendall(HEADER.pack(b"I", 0))


def _as_policy(runner: Runner, policy: Policy | str | os.PathLike[str], workspace: Path | None = None) -> Policy:
    """A Policy as given, or a shipped policy name / policy file with the campaign's on top."""
    if isinstance(policy, Policy):
        return policy
    from sandman.policy import effective_policy, named_policy_path

    return effective_policy(named_policy_path(policy), workspace).policy
