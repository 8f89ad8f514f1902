"""Layer 1 and the engine: the Docker connection, and the one pure function that builds the
hardened container's arguments for docker-py.

Everything security-relevant about the container is decided in ``container_kwargs``; the unit
tests pin its exact output and the integration tests check ``docker inspect`` of a live sandbox.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any

from tenacity import retry, retry_if_exception, stop_after_attempt, wait_exponential

from sandman.backends.base import (
    CONTROL_DIR_IN_CONTAINER,
    LABEL_BACKEND,
    LABEL_SESSION,
    LABEL_STATE,
    RUNTIME_DIR_IN_CONTAINER,
    TRUSTED_DIR_IN_CONTAINER,
    WALL_BUBBLEWRAP,
    WALL_CONTAINER,
    Availability,
    Backend,
    Capabilities,
    ContainerSpec,
    Frames,
    Listed,
    Status,
    labels_for,
)
from sandman.core.bwrap import HOME, SANDBOX_PATH, WORKSPACE
from sandman.errors import EngineUnavailable, SandboxError, UsageError

if TYPE_CHECKING:
    import docker

LOG_MAX_SIZE = "10m"
LOG_MAX_FILE = "2"


def container_kwargs(spec: ContainerSpec) -> dict[str, Any]:
    """Arguments for ``docker.APIClient.create_container`` (host config included), pure."""
    if spec.uid == 0:
        # Unmasked /proc and uid 0 together let a process write the host's kernel settings.
        raise ValueError("the sandbox container never runs as uid 0")
    res = spec.resources
    # A file may pass the workspace quota by half of it at most (the watchdog stops the command
    # first at the disk's pace; this bounds what one file reaches by any faster route).
    fsize = min(res.max_file_size, res.workspace_quota * 3 // 2) if res.workspace_quota else res.max_file_size
    env = {"PATH": SANDBOX_PATH, "HOME": HOME, "LANG": "C.UTF-8", **spec.env}
    # The engine's own HostConfig form, so this is exactly what `docker inspect` shows back.
    host_config: dict[str, Any] = {
        "NetworkMode": "none",
        "NanoCpus": int(res.cpus * 1e9),
        "Memory": res.memory,
        "MemorySwap": res.memory,  # no swap on top of the memory cap
        "PidsLimit": res.pids,
        "ReadonlyRootfs": True,
        # /tmp and HOME are the only writable places besides the workspace; both capped in size
        # and inodes, and layer 2 binds them (bwrap's own tmpfs could not cap inodes).
        "Tmpfs": {
            "/tmp": f"rw,nosuid,nodev,size={res.tmpfs_size},nr_inodes={res.tmpfs_inodes},mode=1777",
            HOME: f"rw,nosuid,nodev,size={res.tmpfs_size},nr_inodes={res.tmpfs_inodes},mode=1777",
        },
        "CapDrop": ["ALL"],
        "SecurityOpt": ["no-new-privileges", f"seccomp={spec.seccomp_profile}"],
        # An unmasked /proc (what `--security-opt systempaths=unconfined` sends): bwrap needs a
        # /proc without overmounts to mount a fresh one. Safe only because the container's uid is
        # never 0 and every capability is dropped (see DESIGN.md, layer 1).
        "MaskedPaths": [],
        "ReadonlyPaths": [],
        "Ulimits": [
            # No single file may outgrow the workspace quota, whatever the disk watchdog samples.
            {"Name": "fsize", "Soft": fsize, "Hard": fsize},
            {"Name": "nofile", "Soft": res.open_files, "Hard": res.open_files},
            {"Name": "core", "Soft": 0, "Hard": 0},
            # POSIX message queues are counted per host uid: none, so one sandbox cannot use up
            # the budget of the user's other sandboxes and processes.
            {"Name": "msgqueue", "Soft": 0, "Hard": 0},
        ],
        "LogConfig": {"Type": "json-file", "Config": {"max-size": LOG_MAX_SIZE, "max-file": LOG_MAX_FILE}},
        "Mounts": [
            {"Target": WORKSPACE, "Source": spec.workspace, "Type": "bind", "ReadOnly": False},
            # The runtime dir is the host's: read-only inside, except the supervisor's socket dir.
            {
                "Target": RUNTIME_DIR_IN_CONTAINER,
                "Source": spec.runtime_dir,
                "Type": "bind",
                "ReadOnly": True,
            },
            {
                "Target": CONTROL_DIR_IN_CONTAINER,
                "Source": os.path.join(spec.runtime_dir, "control"),
                "Type": "bind",
                "ReadOnly": False,
            },
            *(
                [{"Target": TRUSTED_DIR_IN_CONTAINER, "Source": spec.trusted_dir, "Type": "bind", "ReadOnly": True}]
                if spec.trusted_dir
                else []
            ),
        ],
        "IpcMode": "private",
        "Runtime": spec.runtime.value,
    }
    return {
        "image": spec.image,
        "command": list(spec.command),
        "user": f"{spec.uid}:{spec.gid}",
        "environment": env,
        "working_dir": WORKSPACE,
        # sandman's own labels win: reconcile and gc find sandboxes by them.
        "labels": {**spec.extra_labels, **labels_for(spec.session_id, spec.campaign, spec.kind, spec.state_id)},
        "hostname": "sandman",
        "stdin_open": False,
        "tty": False,
        "host_config": host_config,
    }


def _is_transient(exc: BaseException) -> bool:
    import docker.errors
    import requests

    if isinstance(exc, docker.errors.APIError):
        return exc.status_code is not None and exc.status_code >= 500 and exc.status_code != 501
    return isinstance(exc, requests.exceptions.ConnectionError | requests.exceptions.Timeout)


engine_retry = retry(
    retry=retry_if_exception(_is_transient),
    stop=stop_after_attempt(4),
    wait=wait_exponential(multiplier=0.2, max=2),
    reraise=True,
)


def start_hint(base_url: str) -> str:
    if os.geteuid() == 0:
        how = "run scripts/setup (installs and starts dockerd)"
    else:
        how = "start it (e.g. `sudo systemctl start docker`) or run scripts/setup as root"
    return f"docker engine not reachable at {base_url}: {how}, or set DOCKER_HOST / SANDMAN_DOCKER_HOST"


def connect(base_url: str, timeout_s: float = 60.0) -> docker.APIClient:
    """A low-level client for a live engine; EngineUnavailable (with how to start one) otherwise."""
    import docker
    import docker.errors
    import requests

    try:
        client = docker.APIClient(base_url=base_url, version="auto", timeout=int(timeout_s))
        engine_retry(client.ping)()
    except (docker.errors.DockerException, requests.exceptions.RequestException, OSError) as exc:
        raise EngineUnavailable(start_hint(base_url)) from exc
    return client


def _refused(exc: Exception) -> SandboxError:
    explanation = getattr(exc, "explanation", None)
    return SandboxError(f"the engine refused the sandbox container: {explanation or exc}")


class DockerBackend(Backend):
    """Docker with its default runtime (runc): a hardened container, bubblewrap inside."""

    name = "docker"
    summary = "Docker engine, runc: hardened container + bubblewrap inside"
    WALLS: tuple[str, ...] = (WALL_CONTAINER, WALL_BUBBLEWRAP)

    def __init__(self, settings: Any, api: docker.APIClient | None = None) -> None:
        super().__init__(settings)
        self._api = api

    # -- connection --------------------------------------------------------------------------
    def base_url(self) -> str:
        url: str = self.settings.docker_base_url()
        return url

    @property
    def api(self) -> docker.APIClient:
        if self._api is None:
            self._api = connect(self.base_url(), self.settings.engine_timeout_s)
        return self._api

    @classmethod
    def availability(cls, settings: Any) -> Availability:
        backend = cls(settings)
        try:
            version = backend.api.version()
        except EngineUnavailable as exc:
            return Availability(False, str(exc).split(":", 1)[0], str(exc).split(": ", 1)[-1])
        return backend._check(version)

    def _check(self, version: dict[str, Any]) -> Availability:
        return Availability(True, detail=f"Docker {version.get('Version')} at {self.base_url()}")

    def capabilities(self) -> Capabilities:
        return Capabilities(walls=self.WALLS)

    def versions(self) -> dict[str, Any]:
        info = self.api.info()
        version = self.api.version()
        return {
            "backend": self.name,
            "engine": version.get("Version"),
            "api": getattr(self.api, "api_version", None),
            "runtime": self.runtime_name(),
            "runtimes": sorted((info.get("Runtimes") or {}).keys()),
            "kernel": info.get("KernelVersion"),
            "cgroup": info.get("CgroupVersion"),
        }

    def runtime_name(self) -> str:
        return "runc"

    def host_addresses(self) -> list[str]:
        import docker.errors

        try:
            net = self.api.inspect_network("bridge")
        except docker.errors.APIError:
            return []
        return [c["Gateway"] for c in (net.get("IPAM") or {}).get("Config") or [] if c.get("Gateway")]

    # -- images ------------------------------------------------------------------------------
    def images(self) -> Any:
        from sandman.backends.image import ImageManager

        s = self.settings
        return ImageManager(self.api, s.base_image, s.offline_base_image, s.state_dir)

    def image_id(self, image: str) -> str:
        image_id: str = engine_retry(self.api.inspect_image)(image)["Id"]
        return image_id

    # -- one sandbox -------------------------------------------------------------------------
    def kwargs(self, spec: ContainerSpec) -> dict[str, Any]:
        """The engine's create arguments: ``container_kwargs`` plus this backend's label."""
        kwargs = container_kwargs(spec)
        kwargs["labels"][LABEL_BACKEND] = self.name
        return kwargs

    def create(self, spec: ContainerSpec) -> str:
        import docker.errors

        try:
            cid: str = engine_retry(self.api.create_container)(**self.kwargs(spec))["Id"]
        except docker.errors.APIError as exc:
            raise _refused(exc) from None
        return cid

    def attach(self, handle: str) -> Frames:
        stream: Frames = self.api.attach(handle, stdout=True, stderr=True, stream=True, logs=True, demux=True)
        return stream

    def start(self, handle: str) -> None:
        import docker.errors

        try:
            engine_retry(self.api.start)(handle)
        except docker.errors.APIError as exc:
            raise _refused(exc) from None

    def wait(self, handle: str) -> int:
        return int(self.api.wait(handle)["StatusCode"])

    def status(self, handle: str) -> Status:
        import docker.errors

        try:
            state = self.api.inspect_container(handle)["State"]
        except docker.errors.NotFound:
            return Status(running=False)
        return Status(
            running=bool(state.get("Running")),
            exit_code=state.get("ExitCode"),
            oom_killed=bool(state.get("OOMKilled")),
            pid=int(state.get("Pid") or 0),
        )

    def logs(self, handle: str, tail: int = 20) -> str:
        data: bytes = self.api.logs(handle, stdout=True, stderr=True, tail=tail)
        return data.decode(errors="replace")

    def kill(self, handle: str) -> None:
        import docker.errors

        with contextlib.suppress(docker.errors.APIError):
            self.api.kill(handle)

    def remove(self, handle: str) -> None:
        import docker.errors

        with contextlib.suppress(docker.errors.NotFound):
            engine_retry(self.api.remove_container)(handle, force=True, v=True)

    def update_limits(
        self, handle: str, *, cpus: float | None = None, memory: int | None = None, pids: int | None = None
    ) -> None:
        import docker.errors

        body: dict[str, Any] = {}
        if cpus is not None:
            body["NanoCpus"] = int(cpus * 1e9)
        if memory is not None:
            body["Memory"] = body["MemorySwap"] = memory
        if pids is not None:
            body["PidsLimit"] = pids
        if not body:
            return
        api = self.api
        try:
            res = api._post_json(api._url("/containers/{0}/update", handle), data=body)
            api._raise_for_status(res)
        except docker.errors.APIError as exc:
            raise UsageError(f"the engine refused the update: {exc.explanation or exc}") from None

    def list(self, state_id: str) -> list[Listed]:
        mine = f"{LABEL_STATE}={state_id}"
        return [
            Listed(c["Id"], c.get("Labels") or {}, c.get("State") == "running")
            for c in self.api.containers(all=True, filters={"label": [LABEL_SESSION, mine]})
            if (c.get("Labels") or {}).get(LABEL_BACKEND, "docker") == self.name
        ]

    def counters(self, handle: str) -> Any:
        from sandman.backends.causes import CgroupWatch

        return CgroupWatch.for_container(handle, lambda: self.status(handle).pid)

    def close(self) -> None:
        if self._api is not None:
            self._api.close()
            self._api = None
