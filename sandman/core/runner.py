"""``sandman run``: one command in a fresh two-layer sandbox, streamed live, then torn down.

One module on purpose: ``Runner`` (about 400 lines) and the pieces of its run path (exit
classification, cancellation, the idle-tick pump, the runtime dir) are read together when following
a run from start to teardown.

The container's main process is tini -> bwrap -> the command, so the container lives exactly as
long as the command; teardown is a forced remove (SIGKILL to every process in it), which is fast
even when the command ignores SIGTERM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import secrets
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from sandman import backends, resources
from sandman.backends.base import Backend, ContainerSpec, state_id_for
from sandman.backends.causes import ENOSPC_TEXT, Counters, OutputCap
from sandman.backends.image import ImageManager, Progress, load_campaign
from sandman.core import bwrap
from sandman.core.quota import DiskWatch
from sandman.core.state import SessionRecord, SessionState, StateStore
from sandman.core.workspace import Workspace, resolve_workspace
from sandman.errors import SandboxError, SandmanError, UsageError, WorkspaceError
from sandman.policy import Policy, effective_policy, enforce, seccomp
from sandman.settings import Settings
from sandman.upcall.relay import UPCALL_DIR, RelayContext, RelayHost, upcall_socket

if TYPE_CHECKING:
    import docker

TINI = "/usr/bin/tini"
SUPERVISOR = "/usr/lib/sandman/supervisor.py"
CONTROL_DIR = "control"  # the supervisor's socket dir: the one runtime subdir the container writes
Sink = Callable[[bytes], None]


class ExitCause(StrEnum):
    EXIT = "exit"
    TIMEOUT = "timeout"
    OOM = "oom"
    PIDS_LIMIT = "pids-limit"
    DISK_FULL = "disk-full"
    DISK_QUOTA = "disk-quota"  # resources.workspace_quota or host_reserve (sandman.core.quota)
    KILLED = "killed"
    ERROR = "error"


def classify_end(
    exit_code: int, before: Counters, after: Counters, stderr_tail: bytes, *, killed_by_us: bool
) -> ExitCause:
    """The cause of a command's end, from its exit code and the kernel's counters."""
    if killed_by_us:
        return ExitCause.KILLED
    if after.oom_kills > before.oom_kills and exit_code != 0:
        return ExitCause.OOM
    if after.pids_max_hits > before.pids_max_hits and exit_code != 0:
        return ExitCause.PIDS_LIMIT
    if exit_code != 0 and ENOSPC_TEXT in stderr_tail:
        return ExitCause.DISK_FULL
    if exit_code in (128 + signal.SIGKILL, 128 + signal.SIGTERM):
        return ExitCause.KILLED
    return ExitCause.EXIT


@dataclass(frozen=True)
class RunResult:
    exit_code: int
    cause: ExitCause
    duration_s: float
    session_id: str
    poison: tuple[str, ...] = ()  # what the sandbox left that would make the host's git run code

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["cause"] = self.cause.value
        data["duration_s"] = round(self.duration_s, 3)
        data["poison"] = list(self.poison)
        if not self.poison:
            del data["poison"]
        return data


class Cancel:
    """Ends a running sandbox from another thread or a signal handler: the controller fires it
    when its client goes away, the in-process CLI when SIGINT/SIGTERM arrives."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._kill: Callable[[], None] | None = None
        self.signum: int | None = None

    @property
    def fired(self) -> bool:
        return self._event.is_set()

    def fire(self, signum: int | None = None) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self.signum = signum
            self._event.set()
            kill = self._kill
        if kill is not None:
            threading.Thread(target=kill, daemon=True).start()

    def arm(self, kill: Callable[[], None]) -> None:
        """Register how to kill the container; kills at once if already fired."""
        with self._lock:
            self._kill = kill
            fired = self._event.is_set()
        if fired:
            kill()


def process_start(pid: int) -> float | None:
    """The start time (clock ticks since boot) of ``pid``: tells a live owner from a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return float(stat.rsplit(")", 1)[1].split()[19])


def new_session_id() -> str:
    return "sm-" + secrets.token_hex(6)


def _discard(_: bytes) -> None:
    pass


def _quiet(_: str) -> None:
    pass


@contextlib.contextmanager
def signals_cancel(cancel: Cancel) -> Iterator[None]:
    """In the main thread, let SIGINT/SIGTERM fire ``cancel`` so teardown always runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: FrameType | None) -> None:
        cancel.fire(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def make_runtime_dir(settings: Settings, session_id: str, ws: Workspace) -> Path:
    """A per-session dir the container sees read-only at /run/sandman.

    The host never creates, chowns or writes anything in a directory the container can write:
    the session dir, ``env`` (private env files) and ``upcall`` (the relay's socket) belong to
    the host and are bound read-only; only ``control`` (the supervisor's socket, which the
    container must create) is bound read-write, and the host only ever connects to it, opening
    the socket without following symlinks."""
    if os.geteuid() not in (0, ws.uid):
        raise WorkspaceError(
            f"workspace {ws.path} belongs to uid {ws.uid} but sandman runs as uid {os.geteuid()}: "
            "run sandman as the workspace owner (or as root)"
        )
    root = settings.runtime_dir
    root.mkdir(parents=True, exist_ok=True, mode=0o711)
    path = root / session_id
    path.mkdir(mode=0o711)
    # Created inside a fresh directory only this process can write: no path here can be swapped.
    for name in (UPCALL_DIR, enforce.ENV_DIR):
        (path / name).mkdir(mode=0o711)
    (path / CONTROL_DIR).mkdir(mode=0o700)
    fd = os.open(path / "empty", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o444)
    os.close(fd)  # what denied files read as inside layer 2
    if os.geteuid() == 0:
        os.chown(path / CONTROL_DIR, ws.uid, ws.gid, follow_symlinks=False)
    return path


TRUSTED_FILES = {"supervisor.py": 0o644, "sandbox-exec": 0o755}


def trusted_dir(settings: Settings) -> Path:
    """A host copy of sandman's in-container programs (supervisor, launcher, exec shim), made
    once per content and bound read-only into every sandbox over the image's copy: a campaign
    image cannot replace what runs in layer 1 and starts layer 2."""
    source = resources.images_dir() / "base"
    blobs = {name: (source / name).read_bytes() for name in TRUSTED_FILES}
    digest = hashlib.sha256(b"".join(n.encode() + b"\0" + b + b"\0" for n, b in sorted(blobs.items()))).hexdigest()
    root = settings.runtime_dir
    path = root / f"lib-{digest[:16]}"
    if path.is_dir() and not path.is_symlink():
        return path
    root.mkdir(parents=True, exist_ok=True, mode=0o711)
    tmp = root / f".lib-{secrets.token_hex(6)}"
    tmp.mkdir(mode=0o755)
    for name, mode in TRUSTED_FILES.items():
        fd = os.open(tmp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(blobs[name])
        os.chmod(tmp / name, mode)  # whatever the umask said
    os.chmod(tmp, 0o755)
    try:
        os.rename(tmp, path)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return path


class Runner:
    """Runs commands in one-shot sandboxes on one engine (the library face of ``sandman run``)."""

    def __init__(
        self,
        settings: Settings | None = None,
        progress: Progress = _quiet,
        api: docker.APIClient | None = None,
        backend: Backend | str | None = None,
    ) -> None:
        self.settings = settings or Settings.load()
        self.progress = progress
        if isinstance(backend, str) or backend is None:
            backends.backend_class(backend or self.settings.backend)  # an unknown name fails here
        self._backend_arg = backend
        self._backend: Backend | None = backend if not isinstance(backend, str | None) else None
        self._api = api
        self._state: StateStore | None = None

    @property
    def state(self) -> StateStore:
        if self._state is None:
            self._state = StateStore(self.settings.state_dir, scrub=enforce.text_scrubber(self.settings))
        return self._state

    @property
    def backend_name(self) -> str:
        if isinstance(self._backend_arg, str):
            return self._backend_arg
        if self._backend is not None:
            return self._backend.name
        return self.settings.backend

    @property
    def backend(self) -> Backend:
        """What runs layer 1 (``--backend``, else the ``backend`` setting), connected lazily."""
        if self._backend is None:
            name = self._backend_arg if isinstance(self._backend_arg, str) else None
            extra = {"api": self._api} if self._api is not None else {}
            self._backend = backends.get(name, self.settings, **extra)
        return self._backend

    @property
    def api(self) -> docker.APIClient:
        """The Docker-API client of an engine backend (docker, gvisor, podman)."""
        api = getattr(self.backend, "api", None)
        if api is None:
            raise UsageError(f"the {self.backend.name} backend has no engine API")
        return api

    def images(self) -> ImageManager:
        images: ImageManager = self.backend.images()  # type: ignore[assignment]
        return images

    def policy(self, path: Path | None, workspace: Path | None = None) -> Policy:
        """The effective policy: the operator's (``path``, else settings, else sandman's default)
        with the workspace's campaign policy merged on top."""
        return effective_policy(path or self.settings.default_policy, workspace).policy

    def check_campaign(self, workspace: Path, accept: bool = False) -> None:
        """Refuse a campaign (``.sandman/``) the operator has not accepted; record first use."""
        from sandman.policy import campaign

        verdict, snap = campaign.check(self.settings.state_dir, workspace, accept=accept)
        if verdict != "same":
            self.state.audit(
                None, f"campaign.{verdict}", workspace=str(workspace), digest=snap.digest[:16], files=sorted(snap.files)
            )

    def refuse(self, session_id: str | None, exc: SandmanError, argv: Sequence[str]) -> None:
        """Audit a refusal before it reaches the caller."""
        self.state.audit(session_id, "command.refused", "refused", argv=list(argv), reason=str(exc))

    def run(
        self,
        command: Sequence[str],
        workspace: str | os.PathLike[str],
        *,
        policy: Policy | None = None,
        campaign: str | None = None,
        timeout: float | None = None,
        stdout: Sink = _discard,
        stderr: Sink = _discard,
        cancel: Cancel | None = None,
        host_env: Mapping[str, str] | None = None,
        accept_campaign: bool = False,
    ) -> RunResult:
        """Run ``command`` in a fresh sandbox on ``workspace``; stream its output to the sinks.

        ``host_env`` is where the policy's passthrough variables are read (default: os.environ);
        ``accept_campaign`` accepts a changed ``.sandman/`` (else CampaignChanged, with the diff)."""
        if not command:
            raise UsageError("no command given: put it after --, e.g. sandman run --workspace . -- make test")
        if any("\x00" in arg for arg in command):
            raise UsageError("the command contains a NUL byte, which no program can receive")
        ws = resolve_workspace(workspace)
        self.check_campaign(ws.path, accept_campaign)
        policy = policy or self.policy(None, ws.path)
        camp = load_campaign(ws.path, campaign)
        session_id = new_session_id()
        try:
            enforce.check_argv(command, policy, ws)
        except enforce.CommandRefused as exc:
            self.refuse(session_id, exc, command)
            raise
        try:
            env = enforce.sandbox_env(
                policy,
                self.settings,
                host_env=os.environ if host_env is None else host_env,
                controller_env={"SANDMAN_SESSION": session_id, "SANDMAN_CAMPAIGN": camp.name},
                extra=camp.spec.env,
            )
        except enforce.EnvRefused as exc:
            self.refuse(session_id, exc, command)
            raise
        masks = enforce.scan_masks(ws, policy)
        landlock = self.backend.layer2_mode != "gvisor"
        for warning in [*masks.warnings, *enforce.advisory_warnings(policy, landlock=landlock)]:
            self.progress(warning)
        env.known_secrets.update(
            enforce.history_secrets(
                ws,
                policy,
                self.settings,
                progress=self.progress,
                audit=lambda event, verdict, **d: self.state.audit(session_id, event, verdict, **d),
            )
        )
        layer2 = enforce.Layer2(env, masks, writable=tuple(policy.filesystem.writable))
        image = self.images().ensure(camp, self.progress)
        self.ensure_probe(image, ws, policy)
        if timeout is None:
            timeout = policy.resources.exec_timeout_s
        from sandman.core import poison

        baseline = poison.take_baseline(ws.path)
        enforce.poison_gate(self.settings, ws, baseline)
        result = self._run_container(
            command,
            ws,
            camp.name,
            image,
            policy,
            timeout,
            stdout,
            stderr,
            cancel=cancel,
            layer2=layer2,
            session_id=session_id,
        )
        found = enforce.poison_check(ws, baseline, policy, self.settings, session_id, self.state, self.progress)
        return dataclasses.replace(result, poison=tuple(found)) if found else result

    # -- the probe -------------------------------------------------------------------------
    def ensure_probe(self, image: str, ws: Workspace, policy: Policy) -> None:
        """Run the real layer-2 argv with ``true`` once per image/profile/engine; fail closed."""
        backend = self.backend
        memo = (image, policy.runtime.value + backend.name, self.settings.state_dir)
        if _PROBED.get(memo, 0.0) > time.monotonic():
            return
        profile = resources.seccomp_profile_path().read_bytes()
        image_id = backend.image_id(image)
        engine = json.dumps(backend.versions(), sort_keys=True).encode()
        key = hashlib.sha256(image_id.encode() + profile + engine + policy.runtime.value.encode()).hexdigest()[:24]
        marker = self.settings.state_dir / "probes" / key
        if marker.exists():
            _PROBED[memo] = time.monotonic() + 60.0
            return
        err = bytearray()
        result = self._run_container(["true"], ws, "probe", image, policy, 60.0, _discard, err.extend, kind="probe")
        if result.exit_code != 0:
            failure = bwrap.classify_probe(result.exit_code, err.decode(errors="replace"))
            detail = err.decode(errors="replace").strip().splitlines()
            raise SandboxError(
                f"the bubblewrap probe failed ({failure.value if failure else 'unknown'}): "
                f"{detail[-1] if detail else 'exit ' + str(result.exit_code)}. "
                f"{bwrap.probe_fix(failure) if failure else ''}"
            )
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()

    # -- one container -----------------------------------------------------------------------
    def container_spec(
        self,
        command: Sequence[str],
        ws: Workspace,
        campaign: str,
        image: str,
        policy: Policy,
        session_id: str,
        runtime_dir: Path,
        kind: str = "sandbox",
    ) -> ContainerSpec:
        return ContainerSpec(
            image=image,
            command=list(command),
            session_id=session_id,
            campaign=campaign,
            workspace=str(ws.path),
            runtime_dir=str(runtime_dir),
            uid=ws.uid,
            gid=ws.gid,
            resources=policy.resources,
            seccomp_profile=seccomp.profile_for(policy.commands.allow is not None),
            runtime=policy.runtime,
            state_id=state_id_for(self.settings.state_dir),
            kind=kind,
            extra_mounts=enforce.extra_mounts(policy),
            trusted_dir=str(trusted_dir(self.settings)),
        )

    def _run_container(
        self,
        command: Sequence[str],
        ws: Workspace,
        campaign: str,
        image: str,
        policy: Policy,
        timeout: float | None,
        stdout: Sink,
        stderr: Sink,
        kind: str = "sandbox",
        cancel: Cancel | None = None,
        layer2: enforce.Layer2 | None = None,
        session_id: str | None = None,
    ) -> RunResult:
        backend = self.backend
        cancel = cancel or Cancel()
        session_id = session_id or new_session_id()
        layer2 = layer2 or enforce.plain_layer2()
        started = time.monotonic()
        runtime_dir = make_runtime_dir(self.settings, session_id, ws)
        relay = (
            self._start_relay(session_id, campaign, ws, policy, runtime_dir, layer2.env.known_secrets)
            if kind == "sandbox"
            else None
        )
        env_file = None
        if layer2.env.private:
            env_file = enforce.write_env_file(runtime_dir, ws, layer2.env.private)[1]
        argv = launcher_argv(layer2.spec(command, env_file), ws, backend.layer2_mode)
        spec = self.container_spec(argv, ws, campaign, image, policy, session_id, runtime_dir, kind)
        res = policy.resources
        self.state.add_session(
            SessionRecord(
                id=session_id,
                kind=kind,
                campaign=campaign,
                workspace=str(ws.path),
                image=image,
                policy_hash=policy.digest(),
                container_id=None,
                runtime_dir=str(runtime_dir),
                state=SessionState.STARTING.value,
                owner_pid=os.getpid(),
                owner_start=process_start(os.getpid()),
                pool=None,
                uid=ws.uid,
                gid=ws.gid,
                limits=json.dumps({"cpus": res.cpus, "memory": res.memory, "pids": res.pids}),
                created=time.time(),
                last_used=time.time(),
                backend=backend.name,
            )
        )
        container_id: str | None = None
        timed_out = threading.Event()
        timer: threading.Timer | None = None
        disk: DiskWatch | None = None
        cause, exit_code = ExitCause.EXIT, 0
        try:
            with signals_cancel(cancel):
                try:
                    container_id = backend.create(spec)
                    self.state.update_session(session_id, container_id=container_id, state="running")
                    cancel.arm(functools.partial(backend.kill, container_id))
                    stream = backend.attach(container_id)
                    if not cancel.fired:
                        backend.start(container_id)
                except SandboxError:
                    if cancel.fired:
                        raise _Cancelled from None
                    raise
                if timeout:
                    timer = threading.Timer(timeout, _expire, (timed_out, cancel))
                    timer.daemon = True
                    timer.start()
                if kind == "sandbox":
                    disk = DiskWatch(
                        ws.path,
                        policy.resources.workspace_quota,
                        policy.resources.host_reserve,
                        lambda _r: cancel.fire(),
                        inode_quota=policy.resources.workspace_inode_quota,
                        inode_reserve=policy.resources.host_inode_reserve,
                    ).start()
                watch = backend.counters(container_id)
                cap = OutputCap(policy.resources.max_output, stderr)
                # Every byte that leaves the sandbox passes the scrubber (secrets split across
                # chunks included), then the output cap.
                scrubber = enforce.make_scrubber(layer2.env.known_secrets)
                scrub_out, scrub_err = scrubber.stream(), scrubber.stream()
                seen = Counters()
                for out, err in _with_idle_ticks(stream, IDLE_RELEASE_S):
                    if cancel.fired or timed_out.is_set():
                        continue  # keep draining: the engine only finishes a kill once it is read
                    if out is None and err is None:  # idle: release what the scrubbers hold back
                        seen = watch.read()  # the cgroup goes with the container: read it while it lives
                        if held := cap.take(scrub_out.release()):
                            stdout(held)
                        if held := cap.take(scrub_err.release()):
                            stderr(held)
                        continue
                    if out and (out := cap.take(scrub_out.feed(out))):
                        stdout(out)
                    if err:
                        cap.note_stderr(err)
                        if err := cap.take(scrub_err.feed(err)):
                            stderr(err)
                if tail := cap.take(scrub_out.flush()):
                    stdout(tail)
                if tail := cap.take(scrub_err.flush()):
                    stderr(tail)
                exit_code = backend.wait(container_id)
                if disk is not None and disk.exceeded:
                    stderr(f"sandman: stopped: {disk.reason}\n".encode())
                    raise _DiskQuota
                if cancel.fired and not timed_out.is_set():
                    raise _Cancelled
                now = watch.read()
                counters = Counters(max(now.pids_max_hits, seen.pids_max_hits), max(now.oom_kills, seen.oom_kills))
                if exit_code == 128 + signal.SIGKILL and not timed_out.is_set() and not counters.oom_kills:
                    # A run's container is its own: the engine's OOM flag is exact for it.
                    oom = backend.status(container_id).oom_killed
                    counters = Counters(counters.pids_max_hits, 1 if oom else 0)
                if timed_out.is_set():
                    # A fork or thread bomb ends by the timeout; the pids limit is what it ran into.
                    cause = ExitCause.PIDS_LIMIT if counters.pids_max_hits else ExitCause.TIMEOUT
                    exit_code = 124
                else:
                    cause = classify_end(exit_code, Counters(), counters, cap.tail, killed_by_us=False)
        except _Cancelled:
            cause, exit_code = ExitCause.KILLED, 128 + (cancel.signum or signal.SIGKILL)
        except _DiskQuota:
            cause, exit_code = ExitCause.DISK_QUOTA, 128 + signal.SIGKILL
        finally:
            if timer is not None:
                timer.cancel()
            if disk is not None:
                disk.stop()
            if container_id is not None:
                backend.remove(container_id)
            if relay is not None:
                relay.stop(session_id)
            shutil.rmtree(runtime_dir, ignore_errors=True)
            shutil.rmtree(self.settings.state_dir / "git" / f"{session_id}.git", ignore_errors=True)
            self.state.end_session(session_id, SessionState.STOPPED, cause.value)
        duration = time.monotonic() - started
        if kind != "probe":
            self.state.audit(
                session_id,
                "run",
                "ok",
                argv=list(command),
                campaign=campaign,
                exit_code=exit_code,
                cause=cause.value,
                duration_s=round(duration, 4),
            )
        return RunResult(exit_code, cause, duration, session_id)

    def _start_relay(
        self,
        session_id: str,
        campaign: str,
        ws: Workspace,
        policy: Policy,
        runtime_dir: Path,
        known: Mapping[str, str] | None = None,
    ) -> RelayHost | None:
        """An upcall relay for the run's lifetime, when the policy names any helper."""
        if not policy.upcalls.helpers:
            return None
        host = RelayHost.shared()
        host.start(
            RelayContext(
                session_id,
                campaign,
                ws,
                policy,
                self.settings,
                upcall_socket(runtime_dir),
                extra_secrets=dict(known or {}),
            )
        )
        return host


class _Cancelled(Exception):
    pass


class _DiskQuota(Exception):
    pass


def launcher_argv(spec: bwrap.BwrapSpec, ws: Workspace | None = None, mode: str = "bwrap") -> list[str]:
    """A one-shot container's command: tini, then sandman's launcher, which opens the guarded
    workspace paths without following symlinks and becomes bwrap (in gVisor mode: builds the
    namespaces itself and waits for the command)."""
    if mode == "gvisor":
        if ws is None:
            raise ValueError("gVisor mode needs the workspace's uid and gid")
        plan = json.dumps(layer2_request(spec, ws, mode))
        return [TINI, "--", "python3", "-I", "-S", SUPERVISOR, "--gvisor", "--launch", plan]
    request = {"argv": bwrap.bwrap_argv(spec), "guard": bwrap.guard_request(spec), "env": {}}
    return [TINI, "--", "python3", "-I", "-S", SUPERVISOR, "--launch", json.dumps(request)]


def layer2_request(spec: bwrap.BwrapSpec, ws: Workspace, mode: str) -> dict[str, Any]:
    """What the supervisor needs to start one command: bubblewrap's argv and the guard, or (a
    backend whose ``layer2_mode`` is "gvisor") the namespace plan."""
    if mode == "gvisor":
        bpf = exec_filter("SANDMAN_EXEC_ALLOW" in spec.env)
        return bwrap.supervisor_plan(spec, ws.uid, ws.gid, seccomp_bpf=bpf, root_tag=secrets.token_hex(8))
    return {"argv": bwrap.bwrap_argv(spec), "guard": bwrap.guard_request(spec)}


@functools.lru_cache(maxsize=2)
def exec_filter(exec_allowlist: bool) -> bytes:
    """The compiled (classic BPF) layer-2 seccomp filter of gVisor mode (``seccomp.exec_profile``),
    compiled with libseccomp like the local backend's; an error here refuses the start."""
    from sandman.backends import local_seccomp

    try:
        return local_seccomp.compile_profile(seccomp.exec_profile(exec_allowlist))
    except (ImportError, ValueError, OSError) as exc:
        raise SandboxError(f"cannot compile the gVisor exec filter with libseccomp: {exc}") from None


IDLE_RELEASE_S = 0.05
_PROBED: dict[tuple[str, str, Path], float] = {}  # probe results remembered for a minute


def _with_idle_ticks(
    stream: Iterator[tuple[bytes | None, bytes | None]], idle_s: float
) -> Iterator[tuple[bytes | None, bytes | None]]:
    """The engine's (stdout, stderr) frames, read in a thread, with (None, None) whenever the
    stream has been quiet for ``idle_s``; the thread keeps draining whatever the consumer does."""
    import queue

    frames: queue.Queue[tuple[bytes | None, bytes | None] | None] = queue.Queue(maxsize=1024)

    def pump() -> None:
        try:
            for frame in stream:
                frames.put(frame)
        except Exception:
            pass
        finally:
            frames.put(None)

    threading.Thread(target=pump, name="sandman-attach", daemon=True).start()
    while True:
        try:
            frame = frames.get(timeout=idle_s)
        except queue.Empty:
            yield None, None
            continue
        if frame is None:
            return
        yield frame


def _expire(timed_out: threading.Event, cancel: Cancel) -> None:
    """The timeout: mark it, then end the sandbox the way a cancel does (kill, stop forwarding)."""
    timed_out.set()
    cancel.fire()
