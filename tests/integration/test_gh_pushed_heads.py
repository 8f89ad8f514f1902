"""The two upcall helpers together, without a container: git-push (real git, real bwrap, a bare
"remote") records what it pushed in the session's audit log; the gh helper (the real gh, against
tests/support/fake_github.py) opens a draft PR only from such a branch."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
from pydantic import SecretStr

from sandman.core.state import StateStore
from sandman.core.workspace import Workspace
from sandman.policy import Policy
from sandman.settings import Settings
from sandman.upcall.ghhelper import GhHelper, GhHelperConfig
from sandman.upcall.helpers import GitPushConfig, GitPushHelper, HelperContext, HelperError
from tests.conftest import SANDBOX_UID, skip_unless
from tests.support.fake_github import FakeGitHub
from tests.support.git_world import World

pytestmark = skip_unless(
    shutil.which("bwrap") is not None and shutil.which("gh") is not None, "needs bubblewrap and gh (scripts/setup)"
)
SESSION = "sm-gh-heads"


def test_draft_pr_only_from_a_branch_this_session_pushed(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    world = World(tmp_path)
    with FakeGitHub() as fake:
        fake.add_repo("acme/app")
        settings = Settings(
            state_dir=tmp_path / "state", runtime_dir=tmp_path / "run", secrets={"GITHUB_TOKEN": SecretStr(fake.token)}
        )
        policy = Policy.model_validate({"upcalls": {"helpers": {"git-push": {"remote": str(world.remote)}}}})
        store = StateStore(settings.state_dir)
        ctx = HelperContext(
            SESSION,
            Workspace(world.ws.resolve(), SANDBOX_UID, SANDBOX_UID),
            settings,
            record=lambda event, **detail: store.audit(SESSION, event, "ok", **detail),
            policy=policy,
        )
        gh = GhHelper(
            GhHelperConfig(mode="draft-prs", allowed_repos=["acme/app"], host=fake.host, ca_file=str(fake.ca_pem)),
            settings,
        )
        create = ["pr", "create", "--draft", "--title", "T", "--body", "B", "--repo", "acme/app", "--head"]

        def refused(head: str) -> str:
            with pytest.raises(HelperError) as info:
                asyncio.run(gh.run([*create, head, "--base", "main"], None, ctx))
            return str(info.value)

        # nothing pushed yet: even a prefixed branch is refused
        assert "rule: head-not-pushed" in refused("sandman/widget")
        push = GitPushHelper(GitPushConfig(remote=str(world.remote)), settings)
        assert asyncio.run(push.run([], None, ctx)).exit_code == 0
        assert GitPushHelper.pushed_branches(settings, SESSION) == {"sandman/widget"}
        # `--head main --base other`: a branch the session never pushed
        message = refused("main")
        assert "'main' is not a branch this session pushed" in message and "rule: head-not-pushed" in message
        assert "rule: head-not-pushed" in refused("sandman/other")
        assert fake.requests_for("PullRequestCreate") == []
        result = asyncio.run(gh.run([*create, "sandman/widget"], None, ctx))
        assert result.exit_code == 0, result
        assert len(fake.requests_for("PullRequestCreate")) == 1
        store.close()
