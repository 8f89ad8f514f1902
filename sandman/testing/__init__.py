"""sandman for CI jobs written with pytest and testcontainers.

``SandmanContainer`` is a testcontainers ``DockerContainer`` that *is* a sandman session: the same
hardened container and bubblewrap layer as ``sandman run``, built by the same code, carrying
testcontainers' session label (for its reaper) and sandman's own labels (for ``sandman gc``).

>>> from sandman.testing import SandmanContainer
>>> with SandmanContainer().with_limits(cpus=1, memory="512m") as box:
...     result = box.exec("test $(id -u) -ne 0 && echo not root; ls /sys/class/net; echo built > out.txt")
...     print(result.exit_code, result.stdout.decode().split(), (box.workspace / "out.txt").read_text())
0 ['not', 'root', 'lo'] built
<BLANKLINE>

Requires the ``sandman[testcontainers]`` extra. Where testcontainers' reaper image cannot be
pulled, set ``TESTCONTAINERS_RYUK_DISABLED=true``: the container removes itself on ``stop()``,
at interpreter exit, and through ``sandman gc`` if the test process is killed.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
import tempfile
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from testcontainers.core.config import testcontainers_config
from testcontainers.core.container import DockerContainer
from testcontainers.core.labels import create_labels
from testcontainers.core.waiting_utils import WaitStrategy

from sandman.errors import UsageError
from sandman.policy import Policy, parse_size

if TYPE_CHECKING:
    from sandman.core.session import ExecResult, Sandbox
    from sandman.settings import Settings

__all__ = ["SandboxReady", "SandmanContainer"]

SANDBOX_UID = 1000


class SandboxReady(WaitStrategy):
    """Ready when the session's supervisor answers a ping and, if the policy names helpers, the
    upcall relay answers ``session.info`` on its socket (connecting, not checking that a file
    exists: a socket file can exist with nobody listening)."""

    def wait_until_ready(self, container: Any) -> None:
        box: SandmanContainer = container
        deadline = time.monotonic() + self._startup_timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                box.sandbox._control({"op": "ping"})
                if box.sandbox.policy.upcalls.helpers:
                    _relay_info(box.get_upcall_socket_path())
                return
            except (OSError, ValueError, KeyError) as exc:
                last = exc
                time.sleep(self._poll_interval)
        out, err = box.get_logs()
        raise TimeoutError(
            f"sandman sandbox {box.session_id} not ready after {self._startup_timeout:.0f}s ({last!r}); "
            f"logs:\n{out.decode(errors='replace')}{err.decode(errors='replace')}"
        )


def _relay_info(path: str) -> dict[str, Any]:
    import json

    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(2)
        s.connect(path)
        s.sendall(b'{"jsonrpc": "2.0", "id": 1, "method": "session.info"}\n')
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                raise OSError("relay closed the connection")
            buf += chunk
    reply: dict[str, Any] = json.loads(buf)
    if "result" not in reply:
        raise OSError(f"relay answered {reply}")
    return reply


def _owned_temp_workspace(backend: str | None = None, settings: Settings | None = None) -> Path:
    path = Path(tempfile.mkdtemp(prefix="sandman-tc-"))
    if os.geteuid() == 0:  # the sandbox never runs as root: hand the scratch workspace to a user
        from sandman import backends
        from sandman.settings import Settings

        settings = settings or Settings.load()
        owner = backends.backend_class(backend or settings.backend).workspace_owner(settings)
        os.chown(path, *(owner or (SANDBOX_UID, SANDBOX_UID)))
    return path


class SandmanContainer(DockerContainer):
    """A sandman sandbox as a testcontainers container; builders return ``Self``."""

    def __init__(
        self,
        workspace: str | os.PathLike[str] | None = None,
        *,
        policy: str | os.PathLike[str] | Policy | None = None,
        campaign: str | None = None,
        settings: Settings | None = None,
        backend: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(image="sandman/sandbox", **kwargs)
        self._backend = backend
        self._workspace = Path(workspace) if workspace is not None else None
        self._policy_ref = policy
        self._campaign = campaign
        self._settings = settings
        self._limits: dict[str, Any] = {}
        self._helpers: dict[str, dict[str, Any]] = {}
        self._secrets: list[str] = []
        self._sandbox: Sandbox | None = None
        self._scratch: Path | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self.waiting_for(SandboxReady())

    # -- builders ---------------------------------------------------------------------------
    def with_workspace(self, path: str | os.PathLike[str]) -> Self:
        self._workspace = Path(path)
        return self

    def with_backend(self, name: str) -> Self:
        """What runs layer 1: docker (default), gvisor, podman, podman-rootless or local."""
        self._backend = name
        return self

    def with_policy(self, name_or_path: str | os.PathLike[str] | Policy) -> Self:
        self._policy_ref = name_or_path
        return self

    def with_limits(
        self, *, cpus: float | None = None, memory: int | str | None = None, pids: int | None = None
    ) -> Self:
        if memory is not None:
            memory = parse_size(memory)
        self._limits.update({k: v for k, v in {"cpus": cpus, "memory": memory, "pids": pids}.items() if v is not None})
        return self

    def with_upcall_helper(self, name: str, **config: Any) -> Self:
        self._helpers[name] = config
        return self

    def with_secret(self, name: str) -> Self:
        self._secrets.append(name)
        return self

    # -- lifecycle --------------------------------------------------------------------------
    def _effective_policy(self, workspace: Path) -> Policy:
        from sandman.policy import effective_policy, named_policy_path
        from sandman.settings import Settings

        settings = self._settings or Settings.load()
        if isinstance(self._policy_ref, Policy):
            policy = self._policy_ref
        else:
            operator = named_policy_path(self._policy_ref) if self._policy_ref else settings.default_policy
            policy = effective_policy(operator, workspace).policy
        if self._limits:
            policy = policy.with_resources(**self._limits)
        if self._helpers:
            helpers = {**policy.upcalls.helpers, **self._helpers}
            policy = policy.model_copy(update={"upcalls": policy.upcalls.model_copy(update={"helpers": helpers})})
        if self._secrets:
            inject = list(dict.fromkeys([*policy.secrets.inject, *self._secrets]))
            policy = policy.model_copy(update={"secrets": policy.secrets.model_copy(update={"inject": inject})})
        return Policy.model_validate(policy.model_dump())

    def start(self) -> Self:
        from sandman.core.session import Sandbox

        if not testcontainers_config.ryuk_disabled:
            from testcontainers.core.container import Reaper

            Reaper.get_instance()
        if self._workspace is None:
            self._scratch = self._workspace = _owned_temp_workspace(self._backend, self._settings)
        workspace = self._workspace.resolve()
        policy = self._effective_policy(workspace)
        labels = create_labels("sandman/sandbox", None)  # testcontainers' session label, for its reaper
        self._sandbox = Sandbox(
            workspace,
            policy=policy,
            campaign=self._campaign,
            settings=self._settings,
            labels=labels,
            backend=self._backend,
        )
        self._finalizer = weakref.finalize(self, _close_quietly, self._sandbox, self._scratch)
        atexit.register(self._finalizer)
        self.image = self._sandbox.record.image
        self._container = _engine_container(self._sandbox, self.get_docker_client)
        if self._wait_strategy is not None:
            self._wait_strategy.wait_until_ready(self)
        return self

    def stop(self, force: bool = True, delete_volume: bool = True) -> None:
        if self._finalizer is not None:
            self._finalizer()  # closes the session, removes the scratch workspace; runs once
        self._container = None
        with contextlib.suppress(Exception):
            self.get_docker_client().client.close()

    # -- accessors --------------------------------------------------------------------------
    @property
    def sandbox(self) -> Sandbox:
        if self._sandbox is None:
            raise UsageError("the SandmanContainer is not started")
        return self._sandbox

    @property
    def session_id(self) -> str:
        return self.sandbox.id

    @property
    def workspace(self) -> Path:
        return self.sandbox.workspace.path

    def exec(self, command: str | list[str], **kwargs: Any) -> ExecResult:  # type: ignore[override]
        """Run through sandman's two layers (not ``docker exec``): an ExecResult with stdout,
        stderr, exit_code and cause."""
        argv = ["sh", "-c", command] if isinstance(command, str) else list(command)
        return self.sandbox.exec(argv, **kwargs)

    def get_upcall_socket_path(self) -> str:
        """The relay's socket on the host (inside the sandbox: /run/sandman/upcall/upcall.sock)."""
        from sandman.upcall.relay import upcall_socket

        return str(upcall_socket(self.sandbox.record.runtime_dir))


def _engine_container(sandbox: Sandbox, default_client: Any) -> Any:
    """The docker-py Container of the sandbox on its engine (Docker's, or podman's compat API);
    None on the local backend, which has no engine (exec and the workspace work the same)."""
    base_url = getattr(sandbox.backend, "base_url", None)
    if base_url is None or not sandbox.record.container_id:
        return None
    if sandbox.backend.name in ("docker", "gvisor"):
        return default_client().client.containers.get(sandbox.record.container_id)
    import docker

    return docker.DockerClient(base_url=base_url(), version="auto").containers.get(sandbox.record.container_id)


def _close_quietly(sandbox: Sandbox, scratch: Path | None) -> None:
    with contextlib.suppress(Exception):
        sandbox.close()
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)
