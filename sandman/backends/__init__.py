"""Backends: what runs layer 1. The seam is ``sandman.backends.base.Backend``.

Adding a backend: write ``sandman/backends/<name>.py`` with a ``Backend`` subclass and add one
line to ``REGISTRY`` below (module and class, imported only when that backend is used).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from sandman.errors import UsageError

if TYPE_CHECKING:
    from sandman.backends.base import Backend
    from sandman.settings import Settings

DEFAULT = "docker"
REGISTRY: dict[str, str] = {
    "docker": "sandman.backends.docker:DockerBackend",
    "gvisor": "sandman.backends.gvisor:GVisorBackend",
    "podman": "sandman.backends.podman:PodmanBackend",
    "podman-rootless": "sandman.backends.podman:PodmanRootlessBackend",
    "local": "sandman.backends.local:LocalBackend",
}


def names() -> list[str]:
    return list(REGISTRY)


def backend_class(name: str) -> type[Backend]:
    try:
        target = REGISTRY[name]
    except KeyError:
        raise UsageError(f"unknown backend {name!r}: choose one of {', '.join(REGISTRY)}") from None
    module, _, attr = target.partition(":")
    cls: type[Backend] = getattr(importlib.import_module(module), attr)
    return cls


def get(name: str | None, settings: Settings, **kwargs: Any) -> Backend:
    """The backend called ``name`` (else the ``backend`` setting), for these settings."""
    return backend_class(name or settings.backend)(settings, **kwargs)


def describe_all(settings: Settings) -> list[dict[str, Any]]:
    from sandman.backends.base import describe

    return [describe(backend_class(name), settings) for name in REGISTRY]
