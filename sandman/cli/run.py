"""``sandman run``: one command in a fresh sandbox.

``run`` goes through the controller (see ``sandman.core.controller``) so that the CLI itself imports
almost nothing; set SANDMAN_IN_PROCESS=1 to run everything in this process instead.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from sandman.cli.common import (
    _emit,
    _fail,
    _flush_held,
    _progress,
    _say,
    accept_campaign_option,
    backend_option,
    json_option,
    raw_option,
    workspace_option,
)
from sandman.errors import SandmanError


@click.command(context_settings={"allow_interspersed_args": False})
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
@workspace_option("Project directory, mounted read-write at /workspace.")
@click.option("--campaign", help="Campaign name (.sandman/campaigns/NAME.toml); default: .sandman/image.toml.")
@click.option("--policy", help="Policy name (default, strict) or file (default: the operator's, else sandman's).")
@click.option("--cpus", type=click.FloatRange(min=0.01), help="CPU cap, e.g. 1.5.")
@click.option("--memory", help="Memory cap (memory+swap), e.g. 512m or 2g.")
@click.option("--pids", type=click.IntRange(min=16), help="Maximum number of processes.")
@click.option("--timeout", type=click.FloatRange(min=0.001), help="Seconds before the whole process tree is killed.")
@backend_option
@accept_campaign_option
@raw_option
@json_option
def run(
    command: tuple[str, ...],
    workspace: Path,
    campaign: str | None,
    policy: str | None,
    cpus: float | None,
    memory: str | None,
    pids: int | None,
    timeout: float | None,
    backend: str | None,
    accept_campaign: bool,
    raw: bool,
    json_out: bool,
) -> None:
    """Run COMMAND in a fresh sandbox on WORKSPACE and exit with its exit code.

    Put the command after --, e.g.  sandman run -w . -- make test

    stdout and stderr stream live and separately. With --json, one line of JSON follows the
    output: exit_code, cause (exit, timeout, oom, pids-limit, disk-full, killed, error), duration_s,
    session_id.

    Output written to a terminal has its control sequences made inert (clipboard, title, screen
    and cursor control are the operator's, not the command's); --raw turns that off.
    """
    raw = raw or json_out  # --json output is for programs: the bytes as the command wrote them
    if backend is not None:
        from sandman import backends

        try:
            backends.backend_class(backend)
        except SandmanError as exc:
            _fail(exc)
    args = {
        "backend": backend,
        "command": list(command),
        "workspace": os.path.abspath(workspace),
        "campaign": campaign,
        "policy": policy,  # a name or a path: resolved (against cwd) where the policy is read
        "cwd": os.getcwd(),
        "cpus": cpus,
        "memory": memory,
        "pids": pids,
        "timeout": timeout,
        "accept_campaign": accept_campaign,
        # The policy's passthrough variables come from the caller's environment, not the controller's.
        "env": dict(os.environ),
    }
    if os.environ.get("SANDMAN_IN_PROCESS") == "1":
        code, result, error = _run_in_process(args, raw)
    else:
        from sandman.core import client

        code, result, error = client.run(args, raw=raw)
    if error is not None:
        _say(f"error: {error}")
        result = {"exit_code": code, "cause": "error", "error": error, "duration_s": 0.0, "session_id": None}
    elif result and result.get("cause") in ("timeout", "oom") and not json_out:
        _say(f"command ended by {result['cause']} after {result['duration_s']:.1f}s (exit {code})")
    if json_out and result is not None:
        from sandman.core import client

        if client.last_stdout != b"\n":  # the command's output did not end its line
            sys.stdout.write("\n")
        _emit(result, compact=True)
    sys.exit(code)


def _run_in_process(args: dict[str, Any], raw: bool = False) -> tuple[int, dict[str, Any] | None, str | None]:
    from sandman.cli.terminal import for_fd, neutralize
    from sandman.core.client import write_all

    held = {fd: for_fd(fd, raw) for fd in (1, 2)}

    def sink(fd: int) -> Callable[[bytes], None]:
        tty = held[fd]
        if tty is None:
            return lambda data: write_all(fd, data)
        return lambda data: write_all(fd, tty.feed(data))

    def progress(message: str) -> None:
        if held[2] is not None:  # build output quoted in progress lines is the campaign's
            message = neutralize(message.encode()).decode()
        _progress(message)

    try:
        return _run_in_process_with(args, sink, progress)
    finally:
        _flush_held(held)


def _run_in_process_with(
    args: dict[str, Any], sink: Callable[[int], Callable[[bytes], None]], progress: Callable[[str], None]
) -> tuple[int, dict[str, Any] | None, str | None]:
    from sandman.core.runner import Runner
    from sandman.core.workspace import resolve_workspace
    from sandman.policy import cli_size

    try:
        runner = Runner(progress=progress, backend=args.get("backend"))
        ws = resolve_workspace(args["workspace"])
        runner.check_campaign(ws.path, bool(args.get("accept_campaign")))
        from sandman.policy import named_policy_path

        operator = named_policy_path(args["policy"], args.get("cwd")) if args["policy"] else None
        pol = runner.policy(operator, ws.path)
        mem = cli_size(args["memory"], "--memory") if args["memory"] else None
        pol = pol.with_resources(cpus=args["cpus"], memory=mem, pids=args["pids"])
        res = runner.run(
            args["command"],
            args["workspace"],
            policy=pol,
            campaign=args["campaign"],
            timeout=args["timeout"],
            stdout=sink(1),
            stderr=sink(2),
        )
    except SandmanError as exc:
        return exc.exit_code, None, str(exc)
    return res.exit_code, res.as_json(), None
