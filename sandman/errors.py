"""The exception hierarchy: every error a user can act on is a SandmanError with a fix in its text.

Each class carries the CLI exit code it maps to, so scripts can tell bad input from a missing
engine from a sandbox that could not start.
"""

from __future__ import annotations


class SandmanError(Exception):
    """Base of every error sandman raises on purpose. ``str(err)`` is one actionable line."""

    exit_code = 1


class UsageError(SandmanError):
    """The caller asked for something malformed (bad flag value, bad size, ...)."""

    exit_code = 2


class WorkspaceError(UsageError):
    """The workspace is missing, not a directory, too broad (/ or $HOME) or owned by root."""

    exit_code = 3


class ConfigError(UsageError):
    """A settings, policy or image.toml file is invalid; the message names file, key and reason."""

    exit_code = 4


class CampaignError(UsageError):
    """An unknown or malformed campaign name."""

    exit_code = 4


class EngineUnavailable(SandmanError):
    """No Docker engine answers; the message says how to start one."""

    exit_code = 69  # EX_UNAVAILABLE


class ImageError(SandmanError):
    """The base or campaign image could not be found, pulled or built."""

    exit_code = 70


class SandboxError(SandmanError):
    """The sandbox could not be started (bubblewrap probe failed, container refused, ...)."""

    exit_code = 71
