"""The ``sandman`` command line: a thin layer over the library. Every command that prints data
takes ``--json``; user mistakes get one line and a distinct exit code, never a traceback.

``run`` goes through the controller (see ``sandman.controller``) so that the CLI itself imports
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
from sandman.errors import SandmanError

F = TypeVar("F", bound=Callable[..., Any])


def _say(message: str) -> None:
    sys.stderr.write(f"sandman: {message}\n")
    sys.stderr.flush()


def _progress(message: str) -> None:
    sys.stderr.write(f"\u203a {message}\n")
    sys.stderr.flush()


def _emit(data: Any, compact: bool = False) -> None:
    sys.stdout.write(json.dumps(data, default=str, indent=None if compact else 2) + "\n")
    sys.stdout.flush()


def _fail(exc: SandmanError) -> NoReturn:
    _say(f"error: {exc}")
    sys.exit(exc.exit_code)


def json_option(f: F) -> F:
    return click.option("--json", "json_out", is_flag=True, help="Print JSON instead of text.")(f)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="sandman")
def app() -> None:
    """Run AI coding agents and other untrusted commands in a two-layer sandbox:
    a hardened container (no network, no capabilities, our seccomp profile, read-only root)
    with a bubblewrap layer inside."""


@app.command(context_settings={"allow_interspersed_args": False})
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
@click.option(
    "-w",
    "--workspace",
    type=click.Path(path_type=Path),
    default=Path("."),
    show_default=True,
    help="Project directory, mounted read-write at /workspace.",
)
@click.option(
    "--campaign", help="Campaign name (.sandman/campaigns/NAME.toml); default: .sandman/image.toml."
)
@click.option(
    "--policy", type=click.Path(path_type=Path), help="Policy file (default: the operator's, else sandman's)."
)
@click.option("--cpus", type=click.FloatRange(min=0.01), help="CPU cap, e.g. 1.5.")
@click.option("--memory", help="Memory cap (memory+swap), e.g. 512m or 2g.")
@click.option("--pids", type=click.IntRange(min=16), help="Maximum number of processes.")
@click.option(
    "--timeout", type=click.FloatRange(min=0.001), help="Seconds before the whole process tree is killed."
)
@json_option
def run(
    command: tuple[str, ...],
    workspace: Path,
    campaign: str | None,
    policy: Path | None,
    cpus: float | None,
    memory: str | None,
    pids: int | None,
    timeout: float | None,
    json_out: bool,
) -> None:
    """Run COMMAND in a fresh sandbox on WORKSPACE and exit with its exit code.

    Put the command after --, e.g.  sandman run -w . -- make test

    stdout and stderr stream live and separately. With --json, one line of JSON follows the
    output: exit_code, cause (exit, timeout, oom, killed, error), duration_s, session_id.
    """
    args = {
        "command": list(command),
        "workspace": os.path.abspath(workspace),
        "campaign": campaign,
        "policy": os.path.abspath(policy) if policy else None,
        "cpus": cpus,
        "memory": memory,
        "pids": pids,
        "timeout": timeout,
    }
    if os.environ.get("SANDMAN_IN_PROCESS") == "1":
        code, result, error = _run_in_process(args)
    else:
        from sandman import client

        code, result, error = client.run(args)
    if error is not None:
        _say(f"error: {error}")
        result = {"exit_code": code, "cause": "error", "error": error, "duration_s": 0.0, "session_id": None}
    elif result and result.get("cause") in ("timeout", "oom") and not json_out:
        _say(f"command ended by {result['cause']} after {result['duration_s']:.1f}s (exit {code})")
    if json_out and result is not None:
        _emit(result, compact=True)
    sys.exit(code)


def _run_in_process(args: dict[str, Any]) -> tuple[int, dict[str, Any] | None, str | None]:
    from sandman.client import write_all
    from sandman.policy import cli_size
    from sandman.runner import Runner

    def sink(fd: int) -> Callable[[bytes], None]:
        return lambda data: write_all(fd, data)

    try:
        runner = Runner(progress=_progress)
        pol = runner.policy(Path(args["policy"]) if args["policy"] else None)
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
@json_option
def doctor(json_out: bool) -> None:
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
            click.echo(f"[{mark}] {c.name}: {c.detail}")
            if not c.ok and c.fix:
                click.echo(f"       fix: {c.fix}")
    sys.exit(0 if report["ok"] else 1)


@app.group()
def image() -> None:
    """Build, list and prune sandman's images."""


@image.command("build")
@click.option(
    "-w",
    "--workspace",
    type=click.Path(path_type=Path),
    default=Path("."),
    show_default=True,
    help="Workspace whose campaign image to build.",
)
@click.option("--campaign", help="Campaign name.")
@click.option("--rebuild", is_flag=True, help="Rebuild even when the image is cached.")
@click.option("--base-only", is_flag=True, help="Only the base and agent images (no workspace needed).")
@json_option
def image_build(
    workspace: Path, campaign: str | None, rebuild: bool, base_only: bool, json_out: bool
) -> None:
    """Build (or find cached) the image for a workspace's campaign."""
    from sandman.image import Campaign, CampaignImage, load_campaign
    from sandman.runner import Runner
    from sandman.workspace import resolve_workspace

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
    from sandman.runner import Runner

    try:
        rows = Runner().images().list_images()
    except SandmanError as exc:
        _fail(exc)
    if json_out:
        _emit(rows)
        return
    click.echo(f"{'KIND':<13}{'CAMPAIGN':<20}{'ID':<14}{'SIZE':>9}  TAGS")
    for r in rows:
        click.echo(
            f"{r['kind']:<13}{r['campaign']:<20}{r['id']:<14}{r['size_mb']:>7}MB  {', '.join(r['tags'])}"
        )


@image.command("prune")
@click.option("--all", "all_", is_flag=True, help="Remove every unused sandman image, current ones too.")
@json_option
def image_prune(all_: bool, json_out: bool) -> None:
    """Remove stale sandman images (all but the newest of each). Never touches other images."""
    from sandman.runner import Runner

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


def main() -> None:
    try:
        app(prog_name="sandman")
    except SandmanError as exc:
        _fail(exc)
    except KeyboardInterrupt:
        sys.exit(130)
