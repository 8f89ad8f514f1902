"""The ``sandman`` command line: a thin layer over the library. Every command that prints data
takes ``--json``; user mistakes get one line and a distinct exit code, never a traceback."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from sandman import __version__
from sandman.errors import SandmanError

app = typer.Typer(
    name="sandman",
    help="Run AI coding agents and other untrusted commands in a two-layer sandbox "
    "(a hardened container with bubblewrap inside).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
image_app = typer.Typer(help="Build, list and prune sandman's images.", no_args_is_help=True)
config_app = typer.Typer(help="Inspect sandman's settings.", no_args_is_help=True)
app.add_typer(image_app, name="image")
app.add_typer(config_app, name="config")

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")]


def _say(message: str) -> None:
    sys.stderr.write(f"sandman: {message}\n")
    sys.stderr.flush()


def _progress(message: str) -> None:
    # Build chatter goes to stderr, dimmed when it is a terminal, so stdout stays the command's.
    if sys.stderr.isatty():
        sys.stderr.write(f"\x1b[2m› {message}\x1b[0m\n")
    else:
        sys.stderr.write(f"› {message}\n")
    sys.stderr.flush()


def _emit(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def _fail(exc: SandmanError) -> NoReturn:
    _say(f"error: {exc}")
    raise typer.Exit(exc.exit_code)


def _write(stream: Any) -> Any:
    buf = stream.buffer

    def sink(data: bytes) -> None:
        buf.write(data)
        buf.flush()

    return sink


@app.command(context_settings={"allow_interspersed_args": False})
def run(
    command: Annotated[list[str] | None, typer.Argument(help="The command and its arguments (after --).")] = None,
    workspace: Annotated[Path, typer.Option("--workspace", "-w", help="Project directory, mounted read-write.")] = Path("."),
    campaign: Annotated[str | None, typer.Option(help="Campaign name (.sandman/campaigns/NAME.toml).")] = None,
    policy: Annotated[Path | None, typer.Option(help="Policy file (default: the operator's or sandman's).")] = None,
    cpus: Annotated[float | None, typer.Option(help="CPU cap, e.g. 1.5.")] = None,
    memory: Annotated[str | None, typer.Option(help="Memory cap (memory+swap), e.g. 512m or 2g.")] = None,
    pids: Annotated[int | None, typer.Option(help="Maximum number of processes.")] = None,
    timeout: Annotated[float | None, typer.Option(help="Seconds before the whole process tree is killed.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Run CMD in a fresh sandbox on WORKSPACE; exit with its exit code.

    stdout and stderr stream live and separately. With --json, one object follows at the end:
    exit_code, cause (exit, timeout, oom, killed, error), duration_s, session_id.
    """
    from sandman.policy import cli_size
    from sandman.runner import Runner

    try:
        if timeout is not None and timeout <= 0:
            raise_usage("--timeout must be a positive number of seconds")
        if cpus is not None and cpus <= 0:
            raise_usage("--cpus must be positive")
        runner = Runner(progress=_progress)
        pol = runner.policy(policy)
        pol = pol.with_resources(cpus=cpus, memory=cli_size(memory, "--memory") if memory else None, pids=pids)
        result = runner.run(
            command or [],
            workspace,
            policy=pol,
            campaign=campaign,
            timeout=timeout,
            stdout=_write(sys.stdout),
            stderr=_write(sys.stderr),
        )
    except SandmanError as exc:
        if json_out:
            _emit({"exit_code": exc.exit_code, "cause": "error", "error": str(exc), "duration_s": 0, "session_id": None})
        _fail(exc)
    if json_out:
        _emit(result.as_json())
    elif result.cause.value in ("timeout", "oom"):
        _say(f"command ended by {result.cause.value} after {result.duration_s:.1f}s")
    raise typer.Exit(result.exit_code)


def raise_usage(message: str) -> NoReturn:
    from sandman.errors import UsageError

    raise UsageError(message)


@app.command()
def doctor(json_out: JsonOpt = False) -> None:
    """Check that this host can run sandman, with the fix for each failure."""
    from sandman.doctor import as_json, run_checks
    from sandman.settings import Settings

    try:
        checks = run_checks(Settings.load())
    except SandmanError as exc:
        _fail(exc)
    report = as_json(checks)
    if json_out:
        _emit(report)
    else:
        for c in checks:
            mark = "pass" if c.ok else ("FAIL" if c.required else "warn")
            line = f"[{mark}] {c.name}: {c.detail}"
            if not c.ok and c.fix:
                line += f"\n       fix: {c.fix}"
            print(line)
    raise typer.Exit(0 if report["ok"] else 1)


@image_app.command("build")
def image_build(
    workspace: Annotated[Path, typer.Option("--workspace", "-w", help="Workspace whose campaign to build.")] = Path("."),
    campaign: Annotated[str | None, typer.Option(help="Campaign name.")] = None,
    rebuild: Annotated[bool, typer.Option(help="Rebuild even when the image is cached.")] = False,
    base_only: Annotated[bool, typer.Option("--base-only", help="Only the base and agent images (no workspace).")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Build (or find cached) the image for a workspace's campaign."""
    from sandman.image import Campaign, CampaignImage, load_campaign
    from sandman.runner import Runner
    from sandman.workspace import resolve_workspace

    try:
        runner = Runner(progress=_progress)
        camp = Campaign("base", CampaignImage(), None) if base_only else load_campaign(resolve_workspace(workspace).path, campaign)
        tag = runner.images().ensure(camp, _progress, rebuild=rebuild)
    except SandmanError as exc:
        _fail(exc)
    if json_out:
        _emit({"campaign": camp.name, "image": tag})
    else:
        print(tag)


@image_app.command("ls")
def image_ls(json_out: JsonOpt = False) -> None:
    """List sandman's images (only those carrying io.sandman labels)."""
    from sandman.runner import Runner

    try:
        rows = Runner().images().list()
    except SandmanError as exc:
        _fail(exc)
    if json_out:
        _emit(rows)
        return
    print(f"{'KIND':<13}{'CAMPAIGN':<20}{'ID':<14}{'SIZE':>9}  TAGS")
    for r in rows:
        print(f"{r['kind']:<13}{r['campaign']:<20}{r['id']:<14}{r['size_mb']:>7}MB  {', '.join(r['tags'])}")


@image_app.command("prune")
def image_prune(
    all_: Annotated[bool, typer.Option("--all", help="Also remove the offline-built base image.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Remove sandman-labelled images no container uses. Never touches other images."""
    from sandman.runner import Runner

    try:
        removed = Runner().images().prune(keep_offline_base=not all_)
    except SandmanError as exc:
        _fail(exc)
    if json_out:
        _emit({"removed": removed})
    else:
        for r in removed:
            print(f"removed {r}")
        print(f"{len(removed)} image(s) removed")


@config_app.command("show")
def config_show(json_out: JsonOpt = False) -> None:
    """Print the effective settings and where each value came from (secrets masked)."""
    from sandman.settings import Settings, config_file, describe

    try:
        views = describe(Settings.load())
    except SandmanError as exc:
        _fail(exc)
    if json_out:
        _emit({"config_file": str(config_file()), "settings": [v.__dict__ for v in views]})
        return
    print(f"# config file: {config_file()}")
    width = max(len(v.name) for v in views)
    for v in views:
        print(f"{v.name:<{width}}  {v.value}   [{v.source}]")


@app.command()
def version() -> None:
    """Print sandman's version."""
    print(__version__)


def main() -> None:
    try:
        app()
    except SandmanError as exc:  # anything not already turned into an exit by a command
        _say(f"error: {exc}")
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
