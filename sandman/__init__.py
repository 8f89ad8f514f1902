"""sandman: run untrusted commands (AI coding agents) in a hardened container with a bubblewrap
layer inside, with narrow audited upcalls to the host.

The public API is imported lazily, so ``import sandman`` stays cheap for the CLI's fast path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Sandbox": "sandman.core.session",
    "ExecResult": "sandman.core.session",
    "Output": "sandman.core.session",
    "Pool": "sandman.core.pool",
    "Runner": "sandman.core.runner",
    "RunResult": "sandman.core.runner",
    "ExitCause": "sandman.core.runner",
    "Policy": "sandman.policy",
    "load_policy": "sandman.policy",
    "Settings": "sandman.settings",
    "SandmanError": "sandman.errors",
    "UsageError": "sandman.errors",
    "WorkspaceError": "sandman.errors",
    "ConfigError": "sandman.errors",
    "EngineUnavailable": "sandman.errors",
    "ImageError": "sandman.errors",
    "SandboxError": "sandman.errors",
}
__all__ = [  # noqa: RUF022 - grouped as _EXPORTS
    "__version__",
    "Sandbox",
    "ExecResult",
    "Output",
    "Pool",
    "Runner",
    "RunResult",
    "ExitCause",
    "Policy",
    "load_policy",
    "Settings",
    "SandmanError",
    "UsageError",
    "WorkspaceError",
    "ConfigError",
    "EngineUnavailable",
    "ImageError",
    "SandboxError",
]

if TYPE_CHECKING:
    from sandman.core.pool import Pool
    from sandman.core.runner import ExitCause, Runner, RunResult
    from sandman.core.session import ExecResult, Output, Sandbox
    from sandman.errors import (
        ConfigError,
        EngineUnavailable,
        ImageError,
        SandboxError,
        SandmanError,
        UsageError,
        WorkspaceError,
    )
    from sandman.policy import Policy, load_policy
    from sandman.settings import Settings


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sandman' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
