"""git-push and gh through a real sandbox: the agent plants the routes out of its workspace from
inside (commondir and alternates to host paths, packed-refs as a symlink to a host file), commits a
deny-listed file, and asks for a draft PR from a branch it never pushed. Every attempt is refused or
fails without a byte of the host reaching the remote or the sandbox; a plain push still works."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from sandman.core.session import Sandbox
from sandman.settings import Settings
from tests.conftest import make_workspace, skip_unless
from tests.support.fake_github import FakeGitHub
from tests.support.git_world import git

pytestmark = [
    pytest.mark.docker,
    skip_unless(shutil.which("bwrap") is not None, "needs bubblewrap: scripts/setup installs it"),
]
REPO = "acme/app"


@pytest.fixture
def world(tmp_path: Path, engine: object, agent_image: str) -> Iterator[tuple[Sandbox, Path, Path, str]]:
    marker = f"zz-hostsecret-{secrets.token_hex(12)}"
    host = tmp_path / "host"
    host.mkdir()
    (host / "secret.txt").write_text(f"{marker}:line-1\n{marker}:line-2\n")
    git("init", "-q", "-b", "main", cwd=host)
    git("add", "secret.txt", cwd=host)
    git("commit", "-qm", f"private {marker}", cwd=host)
    remote = tmp_path / "remote.git"
    git("init", "--bare", "-q", "-b", "main", str(remote), cwd=tmp_path)
    ws = tmp_path / "app"
    ws.mkdir()
    git("init", "-q", "-b", "widget", cwd=ws)
    (ws / "README.md").write_text("# app\n")
    git("add", "README.md", cwd=ws)
    git("commit", "-qm", "init", cwd=ws)
    make_workspace(ws)
    with FakeGitHub() as fake:
        fake.add_repo(REPO)
        policy = tmp_path / "policy.toml"
        policy.write_text(
            f'[upcalls.helpers.git-push]\nremote = "{remote}"\n'
            f'[upcalls.helpers.gh]\nmode = "draft-prs"\nallowed_repos = ["{REPO}"]\nhost = "{fake.host}"\n'
            f'ca_file = "{fake.ca_pem}"\n'
        )
        settings = Settings(
            state_dir=tmp_path / "state",
            runtime_dir=tmp_path / "run",
            secrets={"GITHUB_TOKEN": SecretStr(fake.token)},
        )
        with Sandbox(ws, policy=str(policy), settings=settings) as sb:
            yield sb, remote, host, marker


def agent(sb: Sandbox, script: str) -> tuple[int, str]:
    res = sb.exec(["sh", "-c", script], timeout=120)
    return res.exit_code, res.stdout.decode(errors="replace") + res.stderr.decode(errors="replace")


def remote_dump(remote: Path) -> str:
    out = subprocess.run(
        ["git", "--git-dir", str(remote), "cat-file", "--batch-all-objects", "--batch"], capture_output=True
    ).stdout
    return out.decode("utf-8", "replace")


def test_hostile_git_dir_from_inside_a_sandbox(world: tuple[Sandbox, Path, Path, str]) -> None:
    sb, remote, host, marker = world
    host_commit = git("rev-parse", "HEAD", cwd=host).strip()
    seen: list[str] = []
    # commondir to a host repository: refused up front
    # (each plant is removed in the same exec: at the next exec's start the sandbox masks it)
    code, out = agent(
        sb,
        f"printf '%s\\n' '{host}/.git' > .git/commondir; sandman-upcall git-push main; c=$?; rm .git/commondir; exit $c",
    )
    seen.append(out)
    assert code == 126 and "commondir exists" in out, out
    # alternates to a host object store, a ref to the host commit: refused up front
    code, out = agent(
        sb,
        f"printf '%s\\n' '{host}/.git/objects' > .git/objects/info/alternates;"
        f"echo {host_commit} > .git/refs/heads/stolen; sandman-upcall git-push stolen; c=$?;"
        "rm .git/objects/info/alternates .git/refs/heads/stolen; exit $c",
    )
    seen.append(out)
    assert code == 126 and "alternates exists" in out, out
    # packed-refs as a symlink to host files (the sandbox cannot read them; host git could)
    code, out = agent(
        sb,
        f"rm -f .git/packed-refs; ln -s {host}/secret.txt .git/packed-refs; sandman-upcall git-push;"
        "ln -sf /etc/shadow .git/packed-refs; sandman-upcall git-push; rm .git/packed-refs",
    )
    seen.append(out)
    # the positive control: a clean branch pushes, and a PR from it is allowed
    code, out = agent(
        sb,
        "echo w > widget.txt && git add widget.txt && "
        "git -c user.name=a -c user.email=a@example.invalid commit -qm widget && sandman-upcall git-push && "
        "gh pr create --draft --head sandman/widget --title t --body b --repo acme/app",
    )
    seen.append(out)
    assert code == 0, out
    # a deny-listed file committed: refused, named
    code, out = agent(
        sb,
        "git checkout -qb leaky; echo K=v > .env; git add -f .env;"
        "git -c user.name=a -c user.email=a@example.invalid commit -qm oops; sandman-upcall git-push",
    )
    seen.append(out)
    assert code == 126 and "'.env'" in out and "deny list" in out, out
    # a PR from a branch the session never pushed
    code, out = agent(sb, "gh pr create --draft --head main --base other --title t --body b --repo acme/app")
    seen.append(out)
    assert code == 126 and "head-not-pushed" in out, out
    branches = git("--git-dir", str(remote), "branch", "--list", "--format=%(refname:short)", cwd=remote.parent)
    assert branches.split() == ["sandman/widget"]
    dump = remote_dump(remote)
    assert marker not in dump and host_commit not in dump
    assert all(marker not in text for text in seen), seen
    if os.geteuid() == 0:
        shadow = Path("/etc/shadow").read_text().splitlines()[0]
        assert all(shadow not in text for text in seen)
