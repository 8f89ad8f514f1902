"""``sandman session`` (long-lived sandboxes: create, exec, shell, ls, logs, stop, update) and
``sandman pool`` (warm pools of fresh sandboxes, acquired as sessions)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import click

from sandman.cli.common import (
    _emit,
    _fail,
    _flush_held,
    _print_events,
    _progress,
    _reconcile_quietly,
    _say,
    accept_campaign_option,
    backend_option,
    json_option,
    raw_option,
    workspace_option,
)
from sandman.errors import SandmanError, UsageError


@click.group()
def session() -> None:
    """Long-lived sandboxes: create once, exec many times."""


@session.command("create")
@workspace_option()
@click.option("--campaign", help="Campaign name.")
@click.option("--policy", help="Policy name (default, strict) or file.")
@backend_option
@accept_campaign_option
@json_option
def session_create(
    workspace: Path,
    campaign: str | None,
    policy: str | None,
    backend: str | None,
    accept_campaign: bool,
    json_out: bool,
) -> None:
    """Start a session; print its id. It lives until stopped or its idle/lifetime limit."""
    from sandman.core.session import Sandbox

    try:
        _reconcile_quietly()
        sb = Sandbox(
            workspace,
            policy=policy,
            campaign=campaign,
            progress=_progress,
            owned=False,
            accept_campaign=accept_campaign,
            backend=backend,
        )
    except SandmanError as exc:
        _fail(exc)
    if json_out:
        _emit(
            {
                "session_id": sb.id,
                "campaign": sb.record.campaign,
                "image": sb.record.image,
                "backend": sb.record.backend,
            }
        )
    else:
        click.echo(sb.id)


@session.command("exec")
@click.argument("session_id")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
@click.option("--timeout", type=click.FloatRange(min=0.001), help="Seconds before the exec's tree is killed.")
@click.option("--cwd", help="Working directory, relative to the workspace.")
@click.option("--stdin", "with_stdin", is_flag=True, help="Forward this process's stdin to the command.")
@click.option(
    "-e",
    "--env",
    "env_pairs",
    multiple=True,
    metavar="KEY=VALUE",
    help="Set a variable for this exec (repeatable); the policy's environment rules apply.",
)
@raw_option
@json_option
def session_exec(
    session_id: str,
    command: tuple[str, ...],
    timeout: float | None,
    cwd: str | None,
    with_stdin: bool,
    env_pairs: tuple[str, ...],
    raw: bool,
    json_out: bool,
) -> None:
    """Run COMMAND in session SESSION_ID and exit with its exit code.

    Options go before --, the command after it:  sandman session exec ID --timeout 60 -- make test

    Output written to a terminal has its control sequences made inert; --raw turns that off.
    """
    from sandman.cli.terminal import for_fd
    from sandman.core.client import write_all
    from sandman.core.session import ExecResult, Sandbox

    held = {fd: for_fd(fd, raw or json_out) for fd in (1, 2)}
    try:
        if not command:
            raise UsageError("no command given: sandman session exec ID -- CMD")
        env: dict[str, str] = {}
        for pair in env_pairs:
            key, sep, value = pair.partition("=")
            if not sep or not key:
                raise UsageError(f"-e {pair!r}: write KEY=VALUE")
            env[key] = value
        sb = Sandbox.attach(session_id)
        data = sys.stdin.buffer.read() if with_stdin else None
        result = None
        for item in sb.stream(list(command), timeout=timeout, cwd=cwd, stdin=data, env=env or None):
            if isinstance(item, ExecResult):
                result = item
            else:
                fd = 1 if item.stream == "stdout" else 2
                tty = held[fd]
                write_all(fd, tty.feed(item.data) if tty is not None else item.data)
    except SandmanError as exc:
        _flush_held(held)
        _fail(exc)
    _flush_held(held)
    assert result is not None
    if json_out:
        _emit(result.as_json(), compact=True)
    sys.exit(result.exit_code)


@session.command("shell")
@click.argument("session_id")
@click.option("--shell", "shell_cmd", default="/bin/bash", show_default=True)
def session_shell(session_id: str, shell_cmd: str) -> None:
    """An interactive shell in SESSION_ID (a pseudo-terminal inside both layers).

    The shell drives your terminal directly: its output is NOT neutralized (unlike `run` and
    `session exec`), so what runs in it can set your terminal's title, clipboard (OSC 52) or
    screen. Use it only where you would accept that."""
    import shutil
    import termios
    import tty

    from sandman.core.client import write_all
    from sandman.core.session import ExecResult, Sandbox

    if not sys.stdin.isatty():
        _fail(UsageError("session shell needs a terminal; use `sandman session exec ID -- CMD` from scripts"))
    size = shutil.get_terminal_size()

    def keys() -> Any:
        while True:
            chunk = os.read(0, 4096)
            if not chunk:
                return
            yield chunk

    saved = termios.tcgetattr(0)
    code = 1
    try:
        sb = Sandbox.attach(session_id)
        tty.setraw(0)
        for item in sb.stream([shell_cmd, "-i"], tty=(size.lines, size.columns), stdin=keys(), timeout=None):
            if isinstance(item, ExecResult):
                code = item.exit_code
            else:
                write_all(1, item.data)
    except SandmanError as exc:
        termios.tcsetattr(0, termios.TCSADRAIN, saved)
        _fail(exc)
    finally:
        termios.tcsetattr(0, termios.TCSADRAIN, saved)
    sys.exit(code)


@session.command("ls")
@click.option("--all", "all_", is_flag=True, help="Include ended sessions.")
@json_option
def session_ls(all_: bool, json_out: bool) -> None:
    """List sessions (live ones unless --all)."""
    from sandman.core.runner import Runner

    try:
        _reconcile_quietly()
        records = [r for r in Runner().state.sessions(live_only=not all_) if r.kind in ("session", "pool")]
    except SandmanError as exc:
        _fail(exc)
    if json_out:
        _emit([r.as_json() for r in records])
        return
    import time

    click.echo(f"{'ID':<17}{'STATE':<10}{'CAMPAIGN':<20}{'AGE':>8}  WORKSPACE")
    for r in records:
        age = f"{(time.time() - r.created) / 60:.0f}m"
        click.echo(f"{r.id:<17}{r.state:<10}{r.campaign:<20}{age:>8}  {r.workspace}")


@session.command("logs")
@click.argument("session_id")
@json_option
def session_logs(session_id: str, json_out: bool) -> None:
    """The session's events: creation, every exec and its cause, reports, refusals, stop."""
    from sandman.core.runner import Runner

    try:
        events = Runner().state.events(session=session_id)
    except SandmanError as exc:
        _fail(exc)
    if not events:
        _fail(UsageError(f"no events for session {session_id!r}: see `sandman session ls --all`"))
    _print_events(events, json_out)


@session.command("stop")
@click.argument("session_id", required=False)
@click.option("--all", "all_", is_flag=True, help="Stop every live session.")
@json_option
def session_stop(session_id: str | None, all_: bool, json_out: bool) -> None:
    """Stop a session (or --all): every process is killed at once, the container removed."""
    from sandman.core.runner import Runner
    from sandman.core.session import Sandbox

    try:
        if not session_id and not all_:
            raise UsageError("name a session id, or pass --all")
        ids = (
            [session_id]
            if session_id
            else [r.id for r in Runner().state.sessions(live_only=True) if r.kind in ("session", "pool")]
        )
        stopped = []
        poison: dict[str, list[str]] = {}
        for sid in ids:
            assert sid is not None
            sb = Sandbox.attach(sid)
            sb.close()
            stopped.append(sid)
            if sb.poison:
                poison[sid] = sb.poison
    except SandmanError as exc:
        _fail(exc)
    if json_out:
        _emit({"stopped": stopped, **({"poison": poison} if poison else {})})
    else:
        for sid in stopped:
            click.echo(f"stopped {sid}")
        for sid, lines in poison.items():
            _say(
                f"WARNING: session {sid} left what would make your own git or editor run its code "
                f"(review with `sandman inspect`): " + "; ".join(lines)
            )
    if poison:
        sys.exit(65)


@session.command("update")
@click.argument("session_id")
@click.option("--cpus", type=click.FloatRange(min=0.01))
@click.option("--memory", help="New memory cap (memory+swap), e.g. 1g.")
@click.option("--pids", type=click.IntRange(min=16))
@click.option("--policy", help="Switch to this policy (name or file) without a restart where possible.")
@json_option
def session_update(
    session_id: str,
    cpus: float | None,
    memory: str | None,
    pids: int | None,
    policy: str | None,
    json_out: bool,
) -> None:
    """Change a running session in place: CPU, memory or pids caps (docker update), or its
    policy (commands, environment, secrets, deny list apply from the next exec; changes that
    need a new container are refused by name)."""
    from sandman.core.session import Sandbox
    from sandman.policy import cli_size

    applied: dict[str, list[str]] = {}
    try:
        sb = Sandbox.attach(session_id)
        if policy:
            applied = sb.update_policy(policy)
        sb.update(cpus=cpus, memory=cli_size(memory, "--memory") if memory else None, pids=pids)
    except SandmanError as exc:
        _fail(exc)
    limits = json.loads(sb.record.limits)
    limits.pop("campaign_env", None)
    if json_out:
        _emit({"session_id": session_id, "limits": limits, "policy": applied})
        return
    click.echo(f"{session_id}: " + ", ".join(f"{k}={v}" for k, v in limits.items()))
    for when, keys in applied.items():
        if keys:
            click.echo(f"  {when.replace('_', ' ')}: {', '.join(keys)}")


@click.group()
def pool() -> None:
    """Warm pools: fresh sandboxes kept ready for a campaign."""


@pool.command("start")
@workspace_option()
@click.option("--size", type=click.IntRange(min=1, max=64), default=2, show_default=True)
@click.option("--campaign", help="Campaign name.")
@click.option("--policy", help="Policy name or file.")
@click.option("--detach", is_flag=True, help="Keep the pool in a background process and return.")
@backend_option
def pool_start(
    workspace: Path, size: int, campaign: str | None, policy: str | None, detach: bool, backend: str | None
) -> None:
    """Keep SIZE fresh sandboxes ready; runs until Ctrl-C (or in the background with --detach)."""
    import signal
    import subprocess
    import time

    from sandman.core.pool import Pool

    if detach:
        args = (
            [
                sys.executable,
                "-m",
                "sandman",
                "pool",
                "start",
                "-w",
                os.path.abspath(workspace),
                "--size",
                str(size),
            ]
            + (["--campaign", campaign] if campaign else [])
            + (["--policy", policy] if policy else [])
            + (["--backend", backend] if backend else [])
        )
        proc = subprocess.Popen(
            args,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        click.echo(f"pool maintainer started (pid {proc.pid}); stop it with `sandman pool stop -w {workspace}`")
        return
    try:
        _reconcile_quietly()
        p = Pool(workspace, size, policy=policy, campaign=campaign, backend=backend).start()
    except SandmanError as exc:
        _fail(exc)
    _progress(f"pool ready: {p.ready()} sandbox(es) for {p.workspace.path}; Ctrl-C stops it")
    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while not stop:
        time.sleep(0.2)
    p.close()


@pool.command("acquire")
@workspace_option()
@click.option("--campaign", help="Campaign name.")
@click.option("--policy", help="Policy name or file.")
@click.option("--timeout", type=float, default=60.0, show_default=True)
@backend_option
@json_option
def pool_acquire(
    workspace: Path, campaign: str | None, policy: str | None, timeout: float, backend: str | None, json_out: bool
) -> None:
    """Take a ready sandbox out of the pool; it becomes an ordinary session (stop it when done)."""
    from sandman.backends.image import load_campaign
    from sandman.core.pool import acquire, pool_key
    from sandman.core.runner import Runner
    from sandman.core.session import _as_policy
    from sandman.core.workspace import resolve_workspace

    try:
        runner = Runner(backend=backend)
        ws = resolve_workspace(workspace)
        pol = runner.policy(None, ws.path) if policy is None else _as_policy(runner, policy, ws.path)
        key = pool_key(ws.path, load_campaign(ws.path, campaign).name, pol, runner.backend_name)
        sb = acquire(key, runner.settings, timeout=timeout, owned=False)
    except SandmanError as exc:
        _fail(exc)
    if json_out:
        _emit({"session_id": sb.id})
    else:
        click.echo(sb.id)


@pool.command("stop")
@click.option("-w", "--workspace", type=click.Path(path_type=Path), help="Only this workspace's pool.")
@json_option
def pool_stop(workspace: Path | None, json_out: bool) -> None:
    """Stop pool maintainers and destroy the sandboxes still waiting in their pools."""
    import contextlib
    import signal
    import time

    from sandman.core.runner import Runner
    from sandman.core.session import Sandbox
    from sandman.core.state import SessionState

    try:
        runner = Runner()
        target = str(workspace.resolve()) if workspace else None

        def pooled() -> list[Any]:
            return [
                r
                for r in runner.state.sessions(live_only=True, kind="pool")
                if r.state == SessionState.POOLED.value and (not target or r.workspace == target)
            ]

        # Maintainers first (they would refill), then whatever they left behind.
        owners = {r.owner_pid for r in pooled() if r.owner_pid and r.owner_pid != os.getpid()}
        for pid in owners:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while any(_pid_exists(pid) for pid in owners) and time.monotonic() < deadline:
            time.sleep(0.1)
        stopped = []
        for rec in pooled():
            Sandbox(settings=runner.settings, _record=rec, _runner=runner)._teardown(
                rec, SessionState.STOPPED, "pool stopped"
            )
            stopped.append(rec.id)
    except SandmanError as exc:
        _fail(exc)
    if json_out:
        _emit({"stopped": stopped, "maintainers": sorted(owners)})
    else:
        click.echo(f"stopped {len(stopped)} pooled sandbox(es), {len(owners)} maintainer(s)")


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
