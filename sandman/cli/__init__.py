"""The ``sandman`` command line: a thin layer over the library. Every command that prints data
takes ``--json``; user mistakes get one line and a distinct exit code, never a traceback.

``run`` goes through the controller (see ``sandman.core.controller``) so that the CLI itself imports
almost nothing; set SANDMAN_IN_PROCESS=1 to run everything in this process instead.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

from sandman import __version__
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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="sandman")
def app() -> None:
    """Run AI coding agents and other untrusted commands in a two-layer sandbox:
    a hardened container (no network, no capabilities, our seccomp profile, read-only root)
    with a bubblewrap layer inside."""


@app.command(context_settings={"allow_interspersed_args": False})
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


def _flush_held(held: dict[int, Any]) -> None:
    """Write what the terminal neutralizers still hold (an unfinished sequence), made inert."""
    import contextlib

    from sandman.core.client import write_all

    for fd, tty in held.items():
        if tty is not None:
            with contextlib.suppress(OSError):
                write_all(fd, tty.flush())


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


@app.command()
@click.option(
    "--verify", is_flag=True, help="Also run the escape battery in a real sandbox on this host, with its controls."
)
@click.option("--policy", help="Policy to verify with (name or file); default: the operator's.")
@click.option(
    "-w",
    "--workspace",
    type=click.Path(path_type=Path),
    help="Also check this workspace: deny-listed files in its git history, its disk quota mechanism.",
)
@backend_option
@json_option
def doctor(verify: bool, policy: str | None, workspace: Path | None, backend: str | None, json_out: bool) -> None:
    """Check that this host can run sandman, with the fix for each failure.

    With --verify, run the non-destructive escape battery inside a real sandbox (your engine, your
    kernel, your policy) and print probe, expected, observed and pass/fail for each, plus the
    engine and runc versions with a warning for a runc older than the fixes of known escapes."""
    from sandman.cli.doctor import as_json, run_checks
    from sandman.settings import Settings

    try:
        settings = Settings.load()
        checks = run_checks(settings, backend)
        if workspace is not None:
            from sandman.cli.doctor import workspace_checks
            from sandman.core.workspace import resolve_workspace
            from sandman.policy import effective_policy, named_policy_path

            ws = resolve_workspace(workspace)
            operator = named_policy_path(policy) if policy else settings.default_policy
            checks += workspace_checks(settings, ws.path, effective_policy(operator, ws.path).policy)
    except SandmanError as exc:
        _fail(exc)
    report: dict[str, Any] = as_json(checks)
    if verify and report["ok"]:
        try:
            report["verify"] = _verify(settings, policy, backend)
        except SandmanError as exc:
            _fail(exc)
        report["ok"] = report["ok"] and report["verify"]["ok"]
    if json_out:
        _emit(report)
    else:
        for c in checks:
            mark = "pass" if c.ok else ("FAIL" if c.required else "warn")
            click.echo(f"[{mark}] {c.name}: {c.detail}")
            if not c.ok and c.fix:
                click.echo(f"       fix: {c.fix}")
        if "verify" in report:
            _print_verify(report["verify"])
    sys.exit(0 if report["ok"] else 1)


@app.command("backends")
@json_option
def backends_cmd(json_out: bool) -> None:
    """List what can run layer 1 here: each backend, whether it is available, the walls it
    gives, and when unavailable the exact reason and the fix.

    Choose one with --backend NAME (run, session create, pool, doctor) or the `backend` setting."""
    from sandman import backends
    from sandman.settings import Settings

    try:
        rows = backends.describe_all(Settings.load())
    except SandmanError as exc:
        _fail(exc)
    if json_out:
        _emit(rows)
        return
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        mark = "yes" if r["available"] else "no "
        click.echo(f"{r['name']:<{width}}  {mark}  walls: {' + '.join(r['walls']) or '-'}")
        click.echo(f"{'':<{width}}       {r['detail'] if r['available'] else r['reason']}")
        for note in (r.get("capabilities") or {}).get("notes", []):
            click.echo(f"{'':<{width}}       note: {note}")
        if not r["available"] and r["fix"]:
            click.echo(f"{'':<{width}}       fix: {r['fix']}")


def _verify(settings: Any, policy: str | None, backend: str | None = None) -> dict[str, Any]:
    import secrets as _secrets
    import shutil
    import tempfile

    from sandman.core.session import Sandbox
    from sandman.core.verify import host_listener, host_secrets_from_env, run_battery, runc_warnings, runtime_versions

    scratch = Path(tempfile.mkdtemp(prefix="sandman-verify-"))
    # A canary secret in this process's environment: the battery shows it never reaches the sandbox.
    canary = {"SANDMAN_VERIFY_CANARY": "sandman-canary-" + _secrets.token_hex(16)}
    os.environ.update(canary)
    try:
        if os.geteuid() == 0:
            from sandman import backends

            owner = backends.backend_class(backend or settings.backend).workspace_owner(settings)
            os.chown(scratch, *(owner or (1000, 1000)))
        with Sandbox(scratch, policy=policy, settings=settings, backend=backend) as sb, host_listener() as port:
            rows = run_battery(sb, port, host_secrets={**host_secrets_from_env(), **canary})
            versions = runtime_versions(sb.backend)
    finally:
        os.environ.pop("SANDMAN_VERIFY_CANARY", None)
        shutil.rmtree(scratch, ignore_errors=True)
    warnings = runc_warnings(versions.get("runc_effective"))
    return {
        "ok": all(r.ok for r in rows),
        "probes": [r.__dict__ if not hasattr(r, "model_dump") else r.model_dump() for r in rows],
        "versions": versions,
        "warnings": warnings,
    }


def _print_verify(result: dict[str, Any]) -> None:
    probes = result["probes"]
    width = max(len(p["name"]) for p in probes)
    click.echo("")
    click.echo(f"{'PROBE':<{width}}  RESULT  EXPECTED / OBSERVED")
    for p in probes:
        ok = p["passed"] and p["control_passed"]
        verdict = "pass" if ok else ("FAIL" if p["control_passed"] else "n/a")
        click.echo(f"{p['name']:<{width}}  {verdict:<6}  expected: {p['expected']}")
        click.echo(f"{'':<{width}}          observed: {p['observed'][:300]}")
        click.echo(f"{'':<{width}}          control:  {p['control_observed'][:200]}")
    versions = result["versions"]
    click.echo("")
    click.echo("versions: " + ", ".join(f"{k}={v}" for k, v in versions.items() if v))
    for warning in result["warnings"]:
        click.echo(f"[warn] {warning}")
    passed = sum(1 for p in probes if p["passed"] and p["control_passed"])
    click.echo(f"{passed}/{len(probes)} probes passed with their controls")


@app.group()
def image() -> None:
    """Build, list and prune sandman's images."""


@image.command("build")
@workspace_option("Workspace whose campaign image to build.")
@click.option("--campaign", help="Campaign name.")
@click.option("--rebuild", is_flag=True, help="Rebuild even when the image is cached.")
@click.option("--base-only", is_flag=True, help="Only the base and agent images (no workspace needed).")
@json_option
def image_build(workspace: Path, campaign: str | None, rebuild: bool, base_only: bool, json_out: bool) -> None:
    """Build (or find cached) the image for a workspace's campaign."""
    from sandman.backends.image import Campaign, CampaignImage, load_campaign
    from sandman.core.runner import Runner
    from sandman.core.workspace import resolve_workspace

    try:
        runner = Runner(progress=_progress)
        if base_only:
            camp = Campaign("base", CampaignImage(), None)
        else:
            camp = load_campaign(resolve_workspace(workspace).path, campaign)
        tag = runner.images().ensure(camp, _progress, rebuild=rebuild)
    except SandmanError as exc:
        _fail(exc)
    if json_out:
        _emit({"campaign": camp.name, "image": tag})
    else:
        click.echo(tag)


@image.command("ls")
@json_option
def image_ls(json_out: bool) -> None:
    """List sandman's images (only those carrying io.sandman labels)."""
    from sandman.core.runner import Runner

    try:
        rows = Runner().images().list_images()
    except SandmanError as exc:
        _fail(exc)
    if json_out:
        _emit(rows)
        return
    click.echo(f"{'KIND':<13}{'CAMPAIGN':<20}{'ID':<14}{'SIZE':>9}  TAGS")
    for r in rows:
        click.echo(f"{r['kind']:<13}{r['campaign']:<20}{r['id']:<14}{r['size_mb']:>7}MB  {', '.join(r['tags'])}")


@image.command("prune")
@click.option("--all", "all_", is_flag=True, help="Remove every unused sandman image, current ones too.")
@json_option
def image_prune(all_: bool, json_out: bool) -> None:
    """Remove stale sandman images (all but the newest of each). Never touches other images."""
    from sandman.core.runner import Runner

    try:
        removed = Runner().images().prune(everything=all_)
    except SandmanError as exc:
        _fail(exc)
    if json_out:
        _emit({"removed": removed})
        return
    for r in removed:
        click.echo(f"removed {r}")
    click.echo(f"{len(removed)} image(s) removed")


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


@app.group()
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


def _print_events(events: list[Any], json_out: bool) -> None:
    from datetime import datetime

    if json_out:
        _emit([e.as_json() for e in events])
        return
    for e in events:
        when = datetime.fromtimestamp(e.ts).strftime("%Y-%m-%d %H:%M:%S")
        detail = " ".join(f"{k}={json.dumps(v)}" for k, v in e.detail.items())
        click.echo(f"{when}  {e.session or '-':<16} {e.event:<16} {e.verdict:<8} {detail}")


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


@app.group()
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


@app.command()
@json_option
def gc(json_out: bool) -> None:
    """Reconcile with the engine: reap orphaned containers and runtime dirs, mark lost sessions."""
    from sandman.core.reaper import backends_in_use, reconcile
    from sandman.core.runner import Runner

    try:
        runner = Runner()
        report = reconcile(backends_in_use(runner.state, runner.backend), runner.state, runner.settings.runtime_dir)
    except SandmanError as exc:
        _fail(exc)
    if json_out:
        _emit(report.as_json())
        return
    click.echo(
        f"removed {len(report.removed_containers)} container(s), "
        f"{len(report.removed_runtime_dirs)} runtime dir(s); marked {len(report.marked)} session(s)"
    )
    for sid, state in report.marked.items():
        click.echo(f"  {sid}: {state}")


@app.command()
@click.option("--session", "session_id", help="Only this session's events.")
@click.option("--since", help="Only events newer than this (10m, 2h, 1d, or an ISO time).")
@json_option
def audit(session_id: str | None, since: str | None, json_out: bool) -> None:
    """The audit log: sessions, execs with their exit cause, refusals, violations. No secrets."""
    from sandman.core.runner import Runner

    try:
        events = Runner().state.events(session=session_id, since=_since(since))
    except SandmanError as exc:
        _fail(exc)
    _print_events(events, json_out)


@app.group("policy")
def policy_group() -> None:
    """Inspect, check and explain policies."""


@policy_group.command("show")
@click.option("-w", "--workspace", type=click.Path(path_type=Path), help="Include this workspace's campaign policy.")
@click.option("--policy", help="Operator policy name (default, strict) or file.")
@json_option
def policy_show(workspace: Path | None, policy: str | None, json_out: bool) -> None:
    """The effective policy, with the source of every value."""
    from sandman.core.workspace import resolve_workspace
    from sandman.policy import effective_policy, flatten, named_policy_path
    from sandman.settings import Settings

    try:
        settings = Settings.load()
        ws = resolve_workspace(workspace).path if workspace else None
        operator = named_policy_path(policy) if policy else settings.default_policy
        eff = effective_policy(operator, ws)
    except SandmanError as exc:
        _fail(exc)
    values = flatten(eff.policy.model_dump(mode="json"))
    from sandman.policy.enforce import landlock_abi

    abi = landlock_abi()
    allowlist = (
        "none (any program)"
        if eff.policy.commands.allow is None
        else f"enforced by the kernel (Landlock ABI {abi})"
        if abi
        else "advisory: no Landlock on this kernel, so only the top-level command is checked"
    )
    if json_out:
        _emit(
            {
                "files": [str(f) for f in eff.files],
                "policy": eff.policy.model_dump(mode="json"),
                "sources": eff.sources,
                "enforcement": {"commands.allow": allowlist},
            }
        )
        return
    click.echo("# files: " + ", ".join(str(f) for f in eff.files))
    click.echo(f"# command allowlist: {allowlist}")
    width = max(len(k) for k in values)
    for key, value in values.items():
        click.echo(f"{key:<{width}}  {json.dumps(value)}   [{eff.sources.get(key, 'built-in default')}]")


@policy_group.command("check")
@click.argument("file", type=click.Path(path_type=Path))
@click.option(
    "-w",
    "--workspace",
    type=click.Path(path_type=Path),
    help="Also check a workspace under this policy (deny-listed files in its git history).",
)
@json_option
def policy_check(file: Path, workspace: Path | None, json_out: bool) -> None:
    """Validate a policy file (an operator's, or a campaign's .sandman/policy.toml)."""
    from sandman.policy import CAMPAIGN_POLICY, effective_policy
    from sandman.settings import Settings

    warnings: list[str] = []
    try:
        resolved = file.resolve()
        if resolved.name == CAMPAIGN_POLICY.name and resolved.parent.name == CAMPAIGN_POLICY.parent.name:
            eff = effective_policy(Settings.load().default_policy, resolved.parent.parent)
        else:
            eff = effective_policy(resolved)
        if workspace is not None:
            from sandman.cli.doctor import workspace_checks
            from sandman.core.workspace import resolve_workspace

            ws = resolve_workspace(workspace)
            pol = effective_policy(resolved if resolved.name != CAMPAIGN_POLICY.name else None, ws.path).policy
            warnings = [f"{c.name}: {c.detail}" for c in workspace_checks(Settings.load(), ws.path, pol) if not c.ok]
    except SandmanError as exc:
        if json_out:
            _emit({"ok": False, "error": str(exc)})
        _fail(exc)
    if json_out:
        _emit({"ok": True, "name": eff.policy.name, "files": [str(f) for f in eff.files], "warnings": warnings})
    else:
        click.echo(f"{file}: ok (policy {eff.policy.name!r})")
        for warning in warnings:
            _say(f"warning: {warning}")


@policy_group.command("explain", context_settings={"allow_interspersed_args": False})
@workspace_option()
@click.option("--policy", help="Operator policy name or file.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
@json_option
def policy_explain(workspace: Path, policy: str | None, command: tuple[str, ...], json_out: bool) -> None:
    """Would COMMAND be allowed in WORKSPACE, and by which rule? Exit 0 allowed, 126 refused."""
    from sandman.core.workspace import resolve_workspace
    from sandman.policy import effective_policy, named_policy_path
    from sandman.policy.enforce import CommandRefused, check_argv
    from sandman.settings import Settings

    try:
        ws = resolve_workspace(workspace)
        operator = named_policy_path(policy) if policy else Settings.load().default_policy
        pol = effective_policy(operator, ws.path).policy
        check_argv(list(command), pol, ws)
        verdict = {"allowed": True, "reason": "no rule refuses it"}
    except CommandRefused as exc:
        verdict = {"allowed": False, "reason": str(exc)}
    except SandmanError as exc:
        _fail(exc)
    if json_out:
        _emit({"command": list(command), **verdict})
    else:
        click.echo(("allowed: " if verdict["allowed"] else "refused: ") + str(verdict["reason"]))
    sys.exit(0 if verdict["allowed"] else 126)


@app.command()
@click.argument("file", type=click.Path(allow_dash=True, dir_okay=False, path_type=str))
@click.option("--redact", is_flag=True, help="Write the input with every finding redacted to stdout.")
@json_option
def scan(file: str, redact: bool, json_out: bool) -> None:
    """Look for leaked credentials in FILE (or - for stdin): known secrets from the settings, common
    credential patterns, and their base64, URL and hex encodings. Exit 1 when anything is found.
    Findings name the kind and a short fingerprint, never the value."""
    from sandman.policy.enforce import make_scrubber
    from sandman.settings import Settings

    try:
        settings = Settings.load()
        data = sys.stdin.buffer.read() if file == "-" else Path(file).read_bytes()
    except OSError as exc:
        _fail(UsageError(f"cannot read {file}: {exc.strerror}"))
    except SandmanError as exc:
        _fail(exc)
    scrubber = make_scrubber({n: v.get_secret_value() for n, v in settings.secrets.items()})
    stream = scrubber.stream()
    out = bytearray()
    for i in range(0, len(data), 1 << 16):
        out += stream.feed(data[i : i + (1 << 16)])
    out += stream.flush()
    findings = stream.findings
    if redact:
        sys.stdout.buffer.write(bytes(out))
    elif json_out:
        _emit({"findings": [f.model_dump() for f in findings]})
    else:
        for f in findings:
            click.echo(f"{file}: bytes {f.start}-{f.end}: {f.kind} ({f.encoding}), fingerprint {f.fingerprint}")
        click.echo(f"{len(findings)} finding(s)", err=True)
    sys.exit(1 if findings else 0)


@app.group()
def config() -> None:
    """Inspect sandman's settings."""


@config.command("show")
@json_option
def config_show(json_out: bool) -> None:
    """Print the effective settings and where each value came from (secrets masked)."""
    from sandman.settings import Settings, config_file, describe

    try:
        views = describe(Settings.load())
    except SandmanError as exc:
        _fail(exc)
    if json_out:
        _emit({"config_file": str(config_file()), "settings": [v.__dict__ for v in views]})
        return
    click.echo(f"# config file: {config_file()}")
    width = max(len(v.name) for v in views)
    for v in views:
        click.echo(f"{v.name:<{width}}  {v.value}   [{v.source}]")


@app.group("campaign")
def campaign_group() -> None:
    """A workspace's campaign (.sandman/): what sandman last built or accepted from it."""


@campaign_group.command("accept")
@workspace_option()
@click.option("--dry-run", is_flag=True, help="Show the change without accepting it.")
@json_option
def campaign_accept(workspace: Path, dry_run: bool, json_out: bool) -> None:
    """Accept the workspace's current .sandman/ files after showing how they changed.

    The sandbox can write the workspace, so a changed image.toml or policy.toml is refused until
    the operator accepts it here (or with --accept-campaign)."""
    from sandman.core.workspace import resolve_workspace
    from sandman.policy import campaign
    from sandman.settings import Settings

    try:
        settings = Settings.load()
        ws = resolve_workspace(workspace)
        now = campaign.snapshot(ws.path)
        before = campaign.accepted(settings.state_dir, ws.path) or campaign.Snapshot({})
    except SandmanError as exc:
        _fail(exc)
    changed = before.digest != now.digest
    text = campaign.diff(before, now)
    if not dry_run and changed:
        campaign.record(settings.state_dir, ws.path, now)
        from sandman.core.state import StateStore

        store = StateStore(settings.state_dir)
        store.audit(None, "campaign.accepted", workspace=str(ws.path), digest=now.digest[:16], files=sorted(now.files))
        store.close()
    if json_out:
        _emit({"workspace": str(ws.path), "changed": changed, "accepted": changed and not dry_run, "diff": text})
        return
    if not changed:
        click.echo(f"{ws.path}: the campaign files are as last accepted; nothing to do")
        return
    sys.stdout.write(text)
    click.echo(("would accept" if dry_run else "accepted") + f" the campaign files of {ws.path}")


@app.command("inspect")
@workspace_option("Workspace to inspect (read only; git is never run on it).")
@click.option(
    "--quarantine",
    "do_quarantine",
    is_flag=True,
    help="Move every flagged file (whole config files, hooks, .git files, pointers) to "
    "<state_dir>/quarantine/inspect-<time>/ with a manifest.",
)
@click.option(
    "--accept",
    is_flag=True,
    help="Accept what is found as yours (your hooks, your configs): sandbox starts, which refuse a "
    "workspace where such things appeared since, start again.",
)
@json_option
def inspect_workspace(workspace: Path, do_quarantine: bool, accept: bool, json_out: bool) -> None:
    """Find what would make your own git, editor or shell run code an agent left in WORKSPACE.

    Looks for git config keys that run commands (core.fsmonitor, alias.x = !cmd, filters,
    pagers, hooksPath...) in every config git could read (.git/config, `.git` files, commondir,
    modules, worktrees, nested repositories, includes), hooks, `.git` renamed away, and
    editor auto-run files. Prints `path: key = value (why)`; exits 65 when anything is found, 0
    when nothing is. Without a baseline, your own hooks and submodule `.git` files are reported too.
    """
    import contextlib
    import time

    from sandman.core import poison
    from sandman.errors import WorkspaceError

    ws = Path(os.path.abspath(workspace))
    if not ws.is_dir():
        _fail(WorkspaceError(f"workspace {str(workspace)!r} is not a directory: pass the project's directory"))
    findings = poison.scan_workspace(ws)
    if accept:
        from sandman.core.workspace import resolve_workspace
        from sandman.policy.enforce import _gate_key, accept_poison
        from sandman.settings import Settings

        try:
            accept_poison(Settings.load(), resolve_workspace(ws), [_gate_key(f) for f in findings])
        except SandmanError as exc:
            _fail(exc)
        _say(f"accepted {len(findings)} finding(s) in {ws} as yours: sandboxes start there again")
    moved: dict[str, str] = {}
    report: poison.QuarantineReport | None = None
    if do_quarantine and findings:
        from sandman.settings import Settings

        try:
            settings = Settings.load()
            dest = poison.quarantine_dir(settings.state_dir, f"inspect-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
            report = poison.quarantine(ws, findings, dest)
        except SandmanError as exc:
            _fail(exc)
        except OSError as exc:
            _fail(SandmanError(f"cannot quarantine into the state dir: {exc.strerror or exc}"))
        moved = {f.path: f.dest or "" for f in report.moved}
        with contextlib.suppress(Exception):
            from sandman.core.state import StateStore

            store = StateStore(settings.state_dir)
            poison.audit(store, None, findings, report)
            store.close()
    if json_out:
        rows = [f.model_dump() for f in findings]
        if do_quarantine:
            for row in rows:
                row["quarantined"] = moved.get(row["path"])
        _emit(rows)
    else:
        for f in findings:
            click.echo(f.line())
        click.echo(f"{len(findings)} finding(s) in {ws}", err=True)
    if report is not None:
        _say(f"quarantined {len(report.moved)} file(s) to {report.dest_dir} (manifest: {report.manifest})")
        for q in report.files:
            if q.method == "failed":
                _say(f"could not quarantine {q.path}: {q.error}")
    sys.exit(poison.EXIT_FOUND if findings and not accept else 0)


def main() -> None:
    try:
        app(prog_name="sandman")
    except SandmanError as exc:
        _fail(exc)
    except KeyboardInterrupt:
        sys.exit(130)
