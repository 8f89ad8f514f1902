"""pytest plugin (entry point ``pytest11``): sandman sandboxes as fixtures.

  sandman_sandbox            a fresh SandmanContainer per test (function scope)
  sandman_session_factory    make(workspace=None, policy=None, **limits) -> started SandmanContainer,
                             all stopped at the end of the test session

Configure with ``@pytest.mark.sandman(policy=..., workspace=..., cpus=..., memory=..., pids=...)`` or
the ini options ``sandman_policy`` and ``sandman_workspace``. When a test fails, the audit events of
every sandbox it used (and the container's logs) are attached to its report.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

_USED = pytest.StashKey[list[Any]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("sandman_policy", "policy name (default, strict) or file for sandman fixtures", default="")
    parser.addini("sandman_workspace", "workspace directory for sandman fixtures (default: a scratch dir)", default="")
    parser.addini("sandman_backend", "backend for sandman fixtures (default: the `backend` setting)", default="")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "sandman(policy=, workspace=, backend=, cpus=, memory=, pids=): sandman fixture options",
    )


def _options(node: pytest.Item | None, config: pytest.Config, overrides: dict[str, Any]) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    if config.getini("sandman_policy"):
        opts["policy"] = config.getini("sandman_policy")
    if config.getini("sandman_backend"):
        opts["backend"] = config.getini("sandman_backend")
    if config.getini("sandman_workspace"):
        opts["workspace"] = str(Path(str(config.rootpath)) / config.getini("sandman_workspace"))
    if node is not None:
        marker = node.get_closest_marker("sandman")
        if marker is not None:
            opts.update(marker.kwargs)
    opts.update({k: v for k, v in overrides.items() if v is not None})
    return opts


def _start(opts: dict[str, Any]) -> Any:
    from sandman.testing import SandmanContainer

    box = SandmanContainer(opts.get("workspace"), policy=opts.get("policy"), backend=opts.get("backend"))
    limits = {k: opts[k] for k in ("cpus", "memory", "pids") if opts.get(k) is not None}
    if limits:
        box.with_limits(**limits)
    return box.start()


@pytest.fixture
def sandman_sandbox(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A started SandmanContainer for this test; stopped afterwards, whatever happened."""
    box = _start(_options(request.node, request.config, {}))
    request.node.stash.setdefault(_USED, []).append(box)
    try:
        yield box
    finally:
        box.stop()


@pytest.fixture(scope="session")
def sandman_session_factory(request: pytest.FixtureRequest) -> Generator[Callable[..., Any], None, None]:
    """Start sandboxes on demand: ``make(workspace=None, policy=None, cpus=, memory=, pids=)``."""
    started: list[Any] = []

    def make(workspace: str | Path | None = None, policy: str | None = None, **limits: Any) -> Any:
        box = _start(_options(None, request.config, {"workspace": workspace, "policy": policy, **limits}))
        started.append(box)
        return box

    try:
        yield make
    finally:
        for box in started:
            box.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    for box in item.stash.get(_USED, []):
        try:
            events = box.sandbox.state.events(session=box.session_id)
            lines = [json.dumps(e.as_json(), default=str) for e in events]
            report.sections.append((f"sandman audit {box.session_id}", "\n".join(lines)))
            out, err = box.get_logs()
            logs = (out + err).decode(errors="replace")
            if logs:
                report.sections.append((f"sandman container log {box.session_id}", logs[-20000:]))
        except Exception as exc:
            report.sections.append(("sandman", f"could not collect the sandbox's events: {exc!r}"))
