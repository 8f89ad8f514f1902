"""The host user's next git never runs the agent's code (issue: host-side git and workspace poisoning).

Inside: `.git` is bound onto itself (it cannot be renamed, removed or replaced by a `gitdir:`
file), its config and hooks and every nested repository's are read-only. After the session: what
the agent could still leave (a nested repository, `.git/commondir`, ...) is reported by path and
key, and quarantined when the policy says so. The host's git runs as the workspace owner, as a
real user's would (as root it would refuse the repository outright, proving nothing).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandman.core.session import Sandbox
from sandman.policy import Policy
from sandman.settings import Settings
from tests.conftest import SANDMAN, make_workspace

UID = 1000


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory the workspace owner can reach (pytest's own tmp dirs are root's, mode 0700)."""
    path = Path(tempfile.mkdtemp(prefix="sandman-poison-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def ws(base: Path) -> Path:
    root = base / "ws"
    root.mkdir()
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / "README").write_text("hi\n")
    subprocess.run(["git", "-C", str(root), "add", "README"], check=True)
    subprocess.run(
        ["git", "-C", str(root), "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "init"], check=True
    )
    return make_workspace(root)


@pytest.fixture
def marker(base: Path) -> Iterator[Path]:
    d = base / "markers"
    d.mkdir(mode=0o777)
    d.chmod(0o777)
    yield d / "PWNED"


def host_git(ws: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """git as the workspace's owner, with an empty global config: the host user's next command."""
    home = ws.parent / "home"
    home.mkdir(exist_ok=True)
    os.chown(home, UID, UID)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(["git", *args], cwd=cwd or ws, env=env, user=UID, group=UID, capture_output=True, text=True)


ATTACKS = r"""
mv .git .git2 2>/dev/null && echo RENAMED
rm -f .git 2>/dev/null; printf 'gitdir: .g\n' > .git 2>/dev/null && echo GITDIR-FILE
mkdir -p .g/objects .g/refs && printf 'ref: refs/heads/main\n' > .g/HEAD
printf '[core]\n\tfsmonitor = touch {marker}\n' > .g/config
git config core.fsmonitor 'touch {marker}' 2>/dev/null && echo CONFIG
printf '#!/bin/sh\ntouch {marker}\n' > .git/hooks/pre-commit 2>/dev/null && echo HOOK
mkdir -p sub && git -C sub init -q && git -C sub config core.fsmonitor 'touch {marker}' && echo NESTED
echo done
"""


def test_a_git_replacement_attack_leaves_the_hosts_git_clean_and_the_rest_is_reported(
    engine: object, agent_image: str, ws: Path, settings: Settings, marker: Path
) -> None:
    sb = Sandbox(ws, settings=settings)
    res = sb.exec(["sh", "-c", ATTACKS.format(marker=marker)])
    sb.close()
    out = res.stdout.decode()
    # Inside: .git cannot be renamed or replaced, its config and hooks are read-only...
    assert "RENAMED" not in out and "GITDIR-FILE" not in out
    assert "CONFIG" not in out and "HOOK" not in out
    # ...but a nested repository is the agent's to make.
    assert "NESTED" in out and out.endswith("done\n"), res.stderr
    assert (ws / ".git").is_dir() and not (ws / ".git2").exists()
    # The host user's next git status in the workspace runs nothing of the agent's.
    status = host_git(ws, "status", "--short")
    assert status.returncode == 0, status.stderr
    assert not marker.exists()
    # What was left is reported by path and key.
    assert any(line.startswith("sub/.git/config: core.fsmonitor") for line in sb.poison), sb.poison
    # Positive control: that nested config is live — the host's git in sub/ would run it.
    host_git(ws, "status", cwd=ws / "sub")
    assert marker.exists()


def test_quarantine_moves_what_the_agent_left(
    engine: object, agent_image: str, ws: Path, settings: Settings, marker: Path
) -> None:
    policy = Policy.model_validate({"filesystem": {"on_poison": "quarantine"}})
    sb = Sandbox(ws, settings=settings, policy=policy)
    sb.exec(["sh", "-c", ATTACKS.format(marker=marker)])
    sb.exec(
        [
            "sh",
            "-c",
            f"printf '../.g\\n' > .git/commondir && printf '[core]\\n\\tfsmonitor = touch {marker}\\n' > .g/config",
        ]
    )
    sb.close()
    assert any("commondir" in line for line in sb.poison), sb.poison
    assert not (ws / ".git" / "commondir").exists()
    assert host_git(ws, "status").returncode == 0
    host_git(ws, "status", cwd=ws / "sub")
    assert not marker.exists()  # nothing of the agent's ran, anywhere
    quarantined = list((settings.state_dir / "quarantine").rglob("*"))
    assert any(p.name == "config" for p in quarantined) and any(p.name == "commondir" for p in quarantined)


def test_a_clean_session_reports_nothing(engine: object, agent_image: str, ws: Path, settings: Settings) -> None:
    with Sandbox(ws, settings=settings) as sb:
        res = sb.exec(
            ["sh", "-c", "echo x >> README && git -c user.email=a@b -c user.name=a commit -qam edit && echo OK"]
        )
        assert res.stdout == b"OK\n", res.stderr  # the agent can still commit (objects, refs, index)
    assert sb.poison == []


def test_the_next_start_refuses_what_an_earlier_sandbox_left_until_the_operator_acts(
    engine: object, agent_image: str, ws: Path, settings: Settings, marker: Path
) -> None:
    from sandman.policy.enforce import PoisonedWorkspace

    with Sandbox(ws, settings=settings) as sb:  # first use: the workspace as it is is the operator's
        # The red team's route: .git is writable (objects, refs), so a missing .git/commondir can be made.
        sb.exec(
            [
                "sh",
                "-c",
                "mkdir -p evil && cp -r .git/objects .git/refs .git/HEAD evil/ && "
                f"printf '[core]\\n\\tfsmonitor = touch {marker}\\n' > evil/config && echo ../evil > .git/commondir",
            ]
        )
    assert any("commondir" in line for line in sb.poison)  # reported at the end...
    with pytest.raises(PoisonedWorkspace, match=r"\.git/commondir"):  # ...and the next start refuses
        Sandbox(ws, settings=settings)
    env = {**os.environ, "SANDMAN_STATE_DIR": str(settings.state_dir), "SANDMAN_RUNTIME_DIR": str(settings.runtime_dir)}
    proc = subprocess.run([*SANDMAN, "inspect", "-w", str(ws), "--quarantine"], capture_output=True, text=True, env=env)
    assert "commondir" in proc.stdout and "quarantined" in proc.stderr, proc.stderr
    host_git(ws, "status")
    assert not marker.exists()
    with Sandbox(ws, settings=settings) as sb:  # positive control: removed, it starts again
        assert sb.exec(["true"]).exit_code == 0


@pytest.mark.parametrize(
    "plant",
    [
        # a nested repository deeper than the scan walks, with a gitlink so the host's git goes there
        "d=$(python3 -c \"print('/'.join(['d'] * 300))\") && mkdir -p $d/sub && git -C $d/sub init -q && "
        "git -C $d/sub config core.fsmonitor 'touch {marker}' && echo DONE",
        # a config too large to read whole, its executing key after the cap
        'mkdir -p sub && git -C sub init -q && python3 -c "import sys; '
        "open('sub/.git/config', 'a').write('#' * (17 << 20) + '\\n[core]\\n\\tfsmonitor = touch {marker}\\n')\" && echo DONE",
    ],
    ids=["too-deep", "too-big"],
)
def test_what_the_scan_cannot_see_through_gates_the_next_start(
    engine: object, agent_image: str, ws: Path, settings: Settings, marker: Path, plant: str
) -> None:
    from sandman.policy.enforce import PoisonedWorkspace

    with Sandbox(ws, settings=settings) as sb:
        res = sb.exec(["sh", "-c", plant.format(marker=marker)])
        assert res.stdout.endswith(b"DONE\n"), res.stderr
    assert sb.poison  # reported...
    with pytest.raises(PoisonedWorkspace):  # ...and an incomplete check fails closed
        Sandbox(ws, settings=settings)
