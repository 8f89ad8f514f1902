"""Layer 1 is minimal for layer 2: drop any one seccomp relaxation, or mask /proc as Docker does by
default, and the real bubblewrap command fails; with sandman's full profile it succeeds.

Each container is built by ``container_kwargs`` exactly as sandman builds it (tini -> bwrap -> the
exec shim -> ``true``), created through docker-py's low-level API and always removed.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandman import resources
from sandman.backends.base import ContainerSpec
from sandman.backends.docker import container_kwargs
from sandman.core.bwrap import BwrapSpec, bwrap_argv
from sandman.core.runner import TINI
from sandman.policy import Resources
from sandman.policy.seccomp import Relaxation, build_profile, render
from tests.conftest import SANDBOX_UID, make_workspace

pytestmark = pytest.mark.docker

TEST_LABEL = "io.sandman.test"
TEST_KIND = "minimality"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    parent = tmp_path_factory.mktemp("minimality")
    parent.chmod(0o755)
    run = make_workspace(parent / "run")
    make_workspace(run / "control")  # the one runtime subdir a sandbox container writes
    return make_workspace(parent / "ws"), run


@pytest.fixture(scope="module")
def sandbox_resources() -> Resources:
    """The resources of sandman's default policy (what a real sandbox gets)."""
    from sandman.core.runner import Runner

    return Runner().policy(None).resources


@pytest.fixture(scope="module", autouse=True)
def no_leftovers(engine: Any) -> Iterator[None]:
    yield
    for c in engine.containers(all=True, filters={"label": f"{TEST_LABEL}={TEST_KIND}"}):
        with contextlib.suppress(Exception):
            engine.remove_container(c["Id"], force=True, v=True)


def bwrap_kwargs(
    image: str, dirs: tuple[Path, Path], res: Resources, profile: str, *, docker_proc_masks: bool = False
) -> dict[str, Any]:
    ws, run = dirs
    spec = ContainerSpec(
        image=image,
        command=[TINI, "--", *bwrap_argv(BwrapSpec(command=["true"]))],
        session_id=f"sm-min-{secrets.token_hex(4)}",
        campaign=TEST_KIND,
        workspace=str(ws),
        runtime_dir=str(run),
        uid=SANDBOX_UID,
        gid=SANDBOX_UID,
        resources=res,
        seccomp_profile=profile,
        kind=TEST_KIND,
    )
    kwargs = container_kwargs(spec)
    kwargs["labels"][TEST_LABEL] = TEST_KIND
    if docker_proc_masks:
        # Without sandman's empty lists the engine applies its default masked/read-only /proc paths.
        del kwargs["host_config"]["MaskedPaths"]
        del kwargs["host_config"]["ReadonlyPaths"]
    return kwargs


def run_container(engine: Any, kwargs: dict[str, Any]) -> tuple[int, str]:
    """(exit code, stderr) of one container; it is removed whatever happens."""
    container_id = None
    try:
        container_id = engine.create_container(**kwargs)["Id"]
        engine.start(container_id)
        code = int(engine.wait(container_id, timeout=120)["StatusCode"])
        err = engine.logs(container_id, stdout=False, stderr=True).decode(errors="replace")
        return code, err.strip()
    finally:
        if container_id is not None:
            engine.remove_container(container_id, force=True, v=True)


def test_generated_profile_is_the_shipped_one() -> None:
    """The variants below are derived from exactly what sandman ships."""
    assert render(build_profile()) == resources.seccomp_profile_path().read_text()


def test_control_full_profile_runs_bwrap(
    engine: Any, agent_image: str, dirs: tuple[Path, Path], sandbox_resources: Resources
) -> None:
    profile = resources.seccomp_profile_path().read_text()
    code, err = run_container(engine, bwrap_kwargs(agent_image, dirs, sandbox_resources, profile))
    assert (code, err) == (0, "")


@pytest.mark.parametrize("relaxation", list(Relaxation), ids=lambda r: r.value)
def test_each_relaxation_is_needed(
    engine: Any,
    agent_image: str,
    dirs: tuple[Path, Path],
    sandbox_resources: Resources,
    relaxation: Relaxation,
) -> None:
    profile = render(build_profile(without=frozenset({relaxation})))
    code, err = run_container(engine, bwrap_kwargs(agent_image, dirs, sandbox_resources, profile))
    assert code != 0 and "bwrap:" in err, (
        f"bubblewrap still works without the {relaxation.value!r} relaxation (exit {code}, stderr {err!r}): "
        "the relaxation is not needed and sandman's seccomp profile should drop it"
    )


def test_docker_default_proc_masks_break_bwrap(
    engine: Any, agent_image: str, dirs: tuple[Path, Path], sandbox_resources: Resources
) -> None:
    profile = resources.seccomp_profile_path().read_text()
    kwargs = bwrap_kwargs(agent_image, dirs, sandbox_resources, profile, docker_proc_masks=True)
    code, err = run_container(engine, kwargs)
    assert code != 0 and "bwrap:" in err and "proc" in err, (code, err)
