"""The ``sandman`` command line: a thin layer over the library. Every command that prints data
takes ``--json``; user mistakes get one line and a distinct exit code, never a traceback.

This module is the entry point (``app``, ``main``) and names every command; the commands live by
group: ``run`` (run.py), ``session`` and ``pool`` (sessions.py), the host and its engine (admin.py),
policy, campaign, inspect, scan and audit (trust.py), with the shared options and output helpers in
common.py. Heavy imports stay inside the commands, so importing the CLI stays cheap.
"""

from __future__ import annotations

import sys

import click

from sandman import __version__
from sandman.cli import admin, run, sessions, trust
from sandman.cli.common import _fail
from sandman.errors import SandmanError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="sandman")
def app() -> None:
    """Run AI coding agents and other untrusted commands in a two-layer sandbox:
    a hardened container (no network, no capabilities, our seccomp profile, read-only root)
    with a bubblewrap layer inside."""


for _command in (
    run.run,
    sessions.session,
    sessions.pool,
    admin.doctor,
    admin.backends_cmd,
    admin.image,
    admin.gc,
    admin.config,
    trust.policy_group,
    trust.campaign_group,
    trust.inspect_workspace,
    trust.scan,
    trust.audit,
):
    app.add_command(_command)
del _command


def main() -> None:
    try:
        app(prog_name="sandman")
    except SandmanError as exc:
        _fail(exc)
    except KeyboardInterrupt:
        sys.exit(130)
