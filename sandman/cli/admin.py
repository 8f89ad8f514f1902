"""The host and its engine: ``doctor`` (with ``--verify``, the escape battery), ``backends``,
``image`` (build, ls, prune), ``gc`` and ``config``."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import click

from sandman.cli.common import _emit, _fail, _progress, backend_option, json_option, workspace_option
from sandman.errors import SandmanError


@click.command()
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


@click.command("backends")
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


@click.group()
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


@click.command()
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


@click.group()
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
