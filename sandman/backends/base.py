"""The backend seam: what sandman asks of whatever runs layer 1.

A backend creates a sandbox from a backend-neutral ``SandboxSpec`` (image, workspace, runtime
dir, limits, labels, and the command that starts layer 2: sandman's launcher or supervisor),
starts it, streams its output, waits, kills and removes it, updates its limits, lists its own
sandboxes by label (reconcile and ``gc``), resolves or builds images, and says which walls it
gives and what it cannot do. Policy, layer 2 (bubblewrap and the supervisor), the relay,
scrubbing, state and audit are the core's and are never copied per backend.

Handles are strings the backend chose (a container id, or the local backend's own id); the core
stores them in the session record and hands them back.
"""

from __future__ import annotations

import hashlib
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from sandman import __version__
from sandman.policy import Resources, Runtime

if TYPE_CHECKING:
    from sandman.backends.causes import CgroupWatch
    from sandman.backends.image import Campaign
    from sandman.settings import Settings

LABEL_SESSION = "io.sandman.session"
LABEL_CAMPAIGN = "io.sandman.campaign"
LABEL_VERSION = "io.sandman.version"
LABEL_KIND = "io.sandman.kind"
# Which state store owns the sandbox: reconcile only ever reaps its own store's sandboxes.
LABEL_STATE = "io.sandman.state"
LABEL_BACKEND = "io.sandman.backend"
RUNTIME_DIR_IN_CONTAINER = "/run/sandman"
CONTROL_DIR_IN_CONTAINER = "/run/sandman/control"  # the one runtime subdir the sandbox writes
TRUSTED_DIR_IN_CONTAINER = "/usr/lib/sandman"  # supervisor, launcher, exec shim: sandman's, read-only

# The walls a backend can give, by name (``sandman backends`` prints them).
WALL_CONTAINER = "container"  # namespaces + cgroups + seccomp + no capabilities, from an engine
WALL_GVISOR = "gvisor"  # a user-space kernel between the agent and the host's
WALL_BUBBLEWRAP = "bubblewrap"  # sandman's layer 2: per-command namespaces, masks, Landlock


@dataclass(frozen=True)
class ContainerSpec:
    """Everything layer 1 needs to know about one sandbox, whatever runs it."""

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


SandboxSpec = ContainerSpec  # the backend-neutral name


def state_id_for(state_dir: os.PathLike[str] | str) -> str:
    return hashlib.sha256(os.path.realpath(state_dir).encode()).hexdigest()[:12]


def labels_for(session_id: str, campaign: str, kind: str = "sandbox", state_id: str = "") -> dict[str, str]:
    return {
        LABEL_SESSION: session_id,
        LABEL_CAMPAIGN: campaign,
        LABEL_VERSION: __version__,
        LABEL_KIND: kind,
        LABEL_STATE: state_id,
    }


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run here; when not, the exact reason and the fix."""

    available: bool
    reason: str = ""
    fix: str = ""
    detail: str = ""  # e.g. the engine's version, when available


@dataclass(frozen=True)
class Capabilities:
    """What a backend gives and what it cannot do (``sandman backends``, ``doctor``, README)."""

    walls: tuple[str, ...]
    layer2: bool = True  # bubblewrap runs inside (else the supervisor builds each exec's namespaces)
    limits: tuple[str, ...] = ("cpus", "memory", "pids")  # the limits it enforces
    live_update: bool = True  # limits can change on a running sandbox
    notes: tuple[str, ...] = ()  # what it cannot do, each a sentence

    def as_json(self) -> dict[str, Any]:
        return {
            "walls": list(self.walls),
            "layer2": self.layer2,
            "limits": list(self.limits),
            "live_update": self.live_update,
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class Status:
    running: bool
    exit_code: int | None = None
    oom_killed: bool = False
    pid: int = 0  # the sandbox's init on the host (0: unknown or gone)


@dataclass(frozen=True)
class Listed:
    """One of the backend's sandboxes, as ``list`` found it."""

    id: str
    labels: Mapping[str, str]
    running: bool


Frames = Iterator[tuple[bytes | None, bytes | None]]  # (stdout, stderr) chunks, one side each


class Images(Protocol):
    """Resolves (or builds) the image a campaign runs in; lists and prunes sandman's images."""

    def ensure(self, campaign: Campaign, progress: Any = ..., rebuild: bool = False) -> str: ...

    def list_images(self) -> list[dict[str, Any]]: ...

    def prune(self, everything: bool = False) -> list[str]: ...


class Backend(ABC):
    """One way to run layer 1. Subclasses register in ``sandman.backends.REGISTRY``."""

    name: ClassVar[str]
    summary: ClassVar[str]
    # How layer 2 is made: "bwrap" (bubblewrap, argv from sandman.core.bwrap.bwrap_argv) or
    # "gvisor" (the supervisor builds the namespaces itself: supervisor.py --gvisor, from
    # sandman.core.bwrap.supervisor_plan), for a runtime where bubblewrap cannot run.
    layer2_mode: ClassVar[str] = "bwrap"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    # -- what it is ------------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def availability(cls, settings: Settings) -> Availability:
        """Can it run here? Never raises; says why not and how to fix it."""

    @abstractmethod
    def capabilities(self) -> Capabilities: ...

    @classmethod
    def workspace_owner(cls, settings: Settings) -> tuple[int, int] | None:
        """The (uid, gid) a workspace must belong to on this backend; None: any non-root owner."""
        return None

    @abstractmethod
    def versions(self) -> dict[str, Any]:
        """What runs layer 1, for doctor, verify and the probe's cache key."""

    def host_addresses(self) -> list[str]:
        """Host addresses a sandbox could try to reach (the escape battery probes them)."""
        return []

    # -- images ----------------------------------------------------------------------------
    @abstractmethod
    def images(self) -> Images: ...

    @abstractmethod
    def image_id(self, image: str) -> str: ...

    # -- one sandbox -----------------------------------------------------------------------
    @abstractmethod
    def create(self, spec: ContainerSpec) -> str:
        """Create (not start) the sandbox; its handle. SandboxError when refused."""

    @abstractmethod
    def attach(self, handle: str) -> Frames:
        """The sandbox's output from its start (call before ``start``), until it exits."""

    @abstractmethod
    def start(self, handle: str) -> None: ...

    @abstractmethod
    def wait(self, handle: str) -> int:
        """Its exit code, once it has exited."""

    @abstractmethod
    def status(self, handle: str) -> Status: ...

    @abstractmethod
    def logs(self, handle: str, tail: int = 20) -> str: ...

    @abstractmethod
    def kill(self, handle: str) -> None:
        """SIGKILL every process in it; a gone sandbox is not an error."""

    @abstractmethod
    def remove(self, handle: str) -> None:
        """Kill and remove it, with everything the backend made for it; idempotent."""

    @abstractmethod
    def update_limits(
        self, handle: str, *, cpus: float | None = None, memory: int | None = None, pids: int | None = None
    ) -> None:
        """New caps on a running sandbox; UsageError when the backend cannot."""

    @abstractmethod
    def list(self, state_id: str) -> list[Listed]:
        """This state store's sandboxes on this backend, running or not."""

    @abstractmethod
    def counters(self, handle: str) -> CgroupWatch:
        """The sandbox's cgroup counters (pids-limit hits, OOM kills)."""

    def close(self) -> None:  # noqa: B027 - most backends hold nothing
        """Release connections."""


def describe(backend: type[Backend], settings: Settings) -> dict[str, Any]:
    """``sandman backends --json``: one object per backend."""
    avail = backend.availability(settings)
    caps = backend(settings).capabilities() if avail.available else None
    return {
        "name": backend.name,
        "summary": backend.summary,
        "available": avail.available,
        "walls": list(caps.walls) if caps else list(getattr(backend, "WALLS", ())),
        "reason": avail.reason,
        "fix": avail.fix,
        "detail": avail.detail,
        **({"capabilities": caps.as_json()} if caps else {}),
    }
