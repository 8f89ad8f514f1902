"""What may run and what was left behind: ``policy`` (show, check, explain), ``campaign accept``,
``inspect`` (what would make the operator's own tools run an agent's code), ``scan`` (leaked
credentials) and ``audit`` (the event log)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from sandman.cli.common import _emit, _fail, _print_events, _say, _since, json_option, workspace_option
from sandman.errors import SandmanError, UsageError


@click.group("policy")
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


@click.group("campaign")
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


@click.command("inspect")
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


@click.command()
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


@click.command()
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
