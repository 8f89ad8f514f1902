"""Layer 1 and the engine: the Docker connection, and the one pure function that builds the
hardened container's arguments for docker-py.

Everything security-relevant about the container is decided in ``container_kwargs``; the unit
tests pin its exact output and the integration tests check ``docker inspect`` of a live sandbox.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tenacity import retry, retry_if_exception, stop_after_attempt, wait_exponential

from sandman import __version__
from sandman.core.bwrap import HOME, SANDBOX_PATH, WORKSPACE
from sandman.errors import EngineUnavailable
from sandman.policy import Resources, Runtime

if TYPE_CHECKING:
    import docker

LABEL_SESSION = "io.sandman.core.session"
LABEL_CAMPAIGN = "io.sandman.policy.campaign"
LABEL_VERSION = "io.sandman.version"
LABEL_KIND = "io.sandman.kind"
# Which state store owns the container: reconcile only ever reaps its own store's containers.
LABEL_STATE = "io.sandman.core.state"
RUNTIME_DIR_IN_CONTAINER = "/run/sandman"
CONTROL_DIR_IN_CONTAINER = "/run/sandman/control"  # the one runtime subdir the container writes
TRUSTED_DIR_IN_CONTAINER = "/usr/lib/sandman"  # supervisor, launcher, exec shim: sandman's, read-only
LOG_MAX_SIZE = "10m"
LOG_MAX_FILE = "2"


@dataclass(frozen=True)
class ContainerSpec:
    """Everything layer 1 needs to know about one sandbox container."""

    image: str
    command: Sequence[str]
    session_id: str
    campaign: str
    workspace: str  # host path, already validated and resolved
    runtime_dir: str  # host path of this session's runtime dir
    uid: int
    gid: int
    resources: Resources
    seccomp_profile: str  # the JSON text of policies/seccomp/sandman.json
    runtime: Runtime = Runtime.RUNC
    env: Mapping[str, str] = field(default_factory=dict)
    state_id: str = ""
    kind: str = "sandbox"
    extra_mounts: Sequence[tuple[str, str, bool]] = ()  # (host source, target, read-only)
    extra_labels: Mapping[str, str] = field(default_factory=dict)  # e.g. testcontainers' session label
    # Host dir of sandman's in-container programs, bound read-only over the image's copy: what runs
    # in layer 1 and starts layer 2 is never the campaign image's to replace.
    trusted_dir: str | None = None


def state_id_for(state_dir: os.PathLike[str] | str) -> str:
    import hashlib

    return hashlib.sha256(os.path.realpath(state_dir).encode()).hexdigest()[:12]


def labels_for(session_id: str, campaign: str, kind: str = "sandbox", state_id: str = "") -> dict[str, str]:
    return {
        LABEL_SESSION: session_id,
        LABEL_CAMPAIGN: campaign,
        LABEL_VERSION: __version__,
        LABEL_KIND: kind,
        LABEL_STATE: state_id,
    }


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
