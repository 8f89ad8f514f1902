"""What every command shares: how the CLI speaks (errors on one scrubbed line, progress, JSON), its
common options, and the few helpers more than one command group uses.

Heavy imports stay inside the functions: importing the CLI must stay cheap.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

from sandman.errors import SandmanError, UsageError

F = TypeVar("F", bound=Callable[..., Any])


def _say(message: str) -> None:
    sys.stderr.write(f"sandman: {_scrubbed(message)}\n")
    sys.stderr.flush()


def _scrubbed(message: str) -> str:
    """Error messages leave through the scrubber too (only loaded when a message names something
    that could be a secret: most do not, and the fast path stays fast)."""
    if len(message) < 16:
        return message
    try:
        from sandman.policy.enforce import text_scrubber
        from sandman.settings import Settings

        return text_scrubber(Settings.load())(message)
    except Exception:
        return message


def _progress(message: str) -> None:
    sys.stderr.write(f"\u203a {message}\n")
    sys.stderr.flush()


def _emit(data: Any, compact: bool = False) -> None:
    sys.stdout.write(json.dumps(data, default=str, indent=None if compact else 2) + "\n")
    sys.stdout.flush()


def _fail(exc: SandmanError) -> NoReturn:
    _say(f"error: {exc}")
    sys.exit(exc.exit_code)


def workspace_option(help_text: str = "Workspace (project directory).") -> Callable[[F], F]:
    return click.option(
        "-w", "--workspace", type=click.Path(path_type=Path), default=Path("."), show_default=True, help=help_text
    )


def json_option(f: F) -> F:
    return click.option("--json", "json_out", is_flag=True, help="Print JSON instead of text.")(f)


def accept_campaign_option(f: F) -> F:
    return click.option(
        "--accept-campaign",
        is_flag=True,
        help="Accept a changed .sandman/ (image.toml, policy.toml) of the workspace; review it first "
        "with `sandman campaign accept --dry-run`.",
    )(f)


def backend_option(f: F) -> F:
    return click.option(
        "--backend",
        metavar="NAME",
        help="What runs layer 1: docker, gvisor, podman, podman-rootless or local "
        "(default: the `backend` setting, docker); `sandman backends` lists them.",
    )(f)


def raw_option(f: F) -> F:
    return click.option(
        "--raw",
        is_flag=True,
        help="Write the command's output to a terminal unchanged, escape sequences included "
        "(default: only text, \\n \\r \\t \\b and SGR colours pass; other control sequences are "
        "printed inert, e.g. \\x1b[2J). Pipes, files and --json always get the bytes unchanged.",
    )(f)


def _flush_held(held: dict[int, Any]) -> None:
    """Write what the terminal neutralizers still hold (an unfinished sequence), made inert."""
    import contextlib

    from sandman.core.client import write_all

    for fd, tty in held.items():
        if tty is not None:
            with contextlib.suppress(OSError):
                write_all(fd, tty.flush())


def _since(text: str | None) -> float | None:
    """'90s', '10m', '2h', '1d' ago, or an ISO timestamp, as epoch seconds."""
    import re
    import time
    from datetime import datetime

    if text is None:
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    if m:
        return time.time() - float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise UsageError(f"--since {text!r}: use a duration such as 10m, 2h, 1d or an ISO time") from None


def _reconcile_quietly() -> None:
    """Crash recovery on every session command: reap what a dead controller left behind."""
    from sandman.core.reaper import backends_in_use, reconcile
    from sandman.core.runner import Runner

    runner = Runner()
    reconcile(backends_in_use(runner.state, runner.backend), runner.state, runner.settings.runtime_dir)


def _print_events(events: list[Any], json_out: bool) -> None:
    from datetime import datetime

    if json_out:
        _emit([e.as_json() for e in events])
        return
    for e in events:
        when = datetime.fromtimestamp(e.ts).strftime("%Y-%m-%d %H:%M:%S")
        detail = " ".join(f"{k}={json.dumps(v)}" for k, v in e.detail.items())
        click.echo(f"{when}  {e.session or '-':<16} {e.event:<16} {e.verdict:<8} {detail}")
