"""The draft-PR flow end to end, with real parts: an agent inside a sandman session edits, commits,
pushes through `sandman-upcall git-push` to a real local bare repository, and opens a draft PR with
`gh pr create` — the real `gh` CLI, on the host, through gh-restricted, against a local HTTPS
stand-in for the GitHub API (tests/support/fake_github.py, with a CA the test creates). Then every
refusal, each with a clear error inside the sandbox and an audit record; and the token nowhere."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandman.core.session import Sandbox
from sandman.core.state import StateStore
from sandman.settings import Settings
from tests.conftest import make_workspace
from tests.support.fake_github import FakeGitHub

pytestmark = pytest.mark.docker
REPO = "acme/app"


def git(*args: str, cwd: Path) -> str:
    env = {"PATH": os.environ["PATH"], "HOME": str(cwd), "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def world(tmp_path: Path, engine: object, agent_image: str) -> Iterator[tuple[Sandbox, FakeGitHub, Path]]:
    remote = tmp_path / "remote.git"
    git("init", "--bare", "-q", "-b", "main", str(remote), cwd=tmp_path)
    ws = tmp_path / "app"
    ws.mkdir()
    git("init", "-q", "-b", "widget", cwd=ws)
    (ws / "README.md").write_text("# app\n")
    git("add", "README.md", cwd=ws)
    git("-c", "user.name=t", "-c", "user.email=t@example.invalid", "commit", "-qm", "init", cwd=ws)
    make_workspace(ws)
    with FakeGitHub() as fake:
        fake.add_repo(REPO)
        fake.add_repo("evil/secret")
        fake.add_pull(REPO, "Someone else's PR", head="other", author="someone-else")  # PR #1
        policy = tmp_path / "policy.toml"
        policy.write_text(
            f'[upcalls.helpers.git-push]\nremote = "{remote}"\n'
            f'[upcalls.helpers.gh]\nmode = "draft-prs"\nallowed_repos = ["{REPO}"]\nhost = "{fake.host}"\n'
            f'ca_file = "{fake.ca_pem}"\n'
        )
        settings = Settings(
            state_dir=tmp_path / "state", runtime_dir=tmp_path / "run", secrets={"GITHUB_TOKEN": fake.token}
        )
        with Sandbox(ws, policy=str(policy), settings=settings) as sb:
            yield sb, fake, remote


def agent(sb: Sandbox, script: str) -> tuple[int, str, str]:
    res = sb.exec(["sh", "-c", script], timeout=120)
    return res.exit_code, res.stdout.decode(errors="replace"), res.stderr.decode(errors="replace")


def test_draft_pr_flow_and_refusals(world: tuple[Sandbox, FakeGitHub, Path]) -> None:
    sb, fake, remote = world
    code, out, err = agent(
        sb,
        """
        set -e
        echo "a widget" > widget.txt
        git add widget.txt
        git -c user.name=agent -c user.email=agent@example.invalid commit -qm "Add widget"
        sandman-upcall git-push
        gh pr create --draft --title "Add widget" --body "Made in a sandbox" --head sandman/widget --repo acme/app
    """,
    )
    assert code == 0, out + err
    assert "pushed widget to sandman/widget" in out
    # The branch arrived in the real bare repository, with the commit.
    log = git("--git-dir", str(remote), "log", "--format=%s", "sandman/widget", cwd=remote.parent)
    assert log.splitlines()[0] == "Add widget"
    # Exactly one draft PR creation, for the allowed repository.
    creations = fake.requests_for("PullRequestCreate")
    assert len(creations) == 1
    assert creations[0].variables["input"]["draft"] is True
    pr_number = int(out.strip().rsplit("/", 1)[1])
    # Edits are allowed on the session's own PR, and only there.
    assert agent(sb, f"gh pr comment {pr_number} --repo acme/app --body 'tests pass'")[0] == 0
    refusals = {
        "disallowed repo, no --draft": "gh pr create --title x --body y --head sandman/widget --repo evil/secret",
        "auth token": "gh auth token",
        "api": "gh api /user",
        "merge": "gh pr merge 1 --repo acme/app",
        "edit someone else's PR": "gh pr edit 1 --repo acme/app --title mine",
        "draft=false": "gh pr create --draft=false --title x --body y --head sandman/widget --repo acme/app",
        "push to main": "sandman-upcall git-push main",
        "force push": "sandman-upcall git-push --force",
        "refspec push": "sandman-upcall git-push +widget:main",
        "helper not in the policy": "sandman-upcall noop",
    }
    for what, command in refusals.items():
        code, out, err = agent(sb, command)
        assert code == 126, (what, code, out, err)
        assert err.startswith("sandman-upcall: ") and len(err.strip().splitlines()) == 1, (what, err)
    assert len(fake.requests_for("PullRequestCreate")) == 1  # refused calls never reached the API
    assert "MergePullRequest" not in fake.operations()
    assert git("--git-dir", str(remote), "branch", "--list", cwd=remote.parent).split() == ["sandman/widget"]
    # The audit log shows the accepted and the refused calls.
    events = [e for e in StateStore(sb.settings.state_dir).events(session=sb.id) if e.event == "upcall"]
    verdicts = [(e.detail["helper"], e.verdict) for e in events]
    assert verdicts.count(("gh", "ok")) == 2 and verdicts.count(("git-push", "ok")) == 1
    assert verdicts.count(("gh", "refused")) == 6 and verdicts.count(("git-push", "refused")) == 3
    assert ("noop", "refused") in verdicts


def test_the_token_is_nowhere_inside_or_in_any_log(world: tuple[Sandbox, FakeGitHub, Path]) -> None:
    sb, fake, _ = world
    assert agent(sb, "gh pr list --repo acme/app")[0] == 0
    _code, out, err = agent(
        sb,
        (
            "cat /proc/[0-9]*/environ /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' '\\n' > /tmp/seen;"
            "grep -rl . /workspace /tmp /home/agent 2>/dev/null | xargs cat 2>/dev/null >> /tmp/seen;"
            "env >> /tmp/seen; wc -l < /tmp/seen; cat /tmp/seen"
        ),
    )
    assert int(out.split()[0]) > 5  # the capture saw environments and files
    assert fake.token not in out + err
    for root in (sb.settings.state_dir, Path(sb.record.runtime_dir), sb.workspace.path):
        for path in root.rglob("*"):
            if path.is_file():
                assert fake.token.encode() not in path.read_bytes(), path
