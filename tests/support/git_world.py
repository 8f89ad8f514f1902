"""A workspace repository, a bare "remote" and planted host secrets, for git-push's tests."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
from pathlib import Path
from typing import Any

from sandman.core.workspace import Workspace
from sandman.policy import Policy
from sandman.settings import Settings
from sandman.upcall.helpers import GitPushConfig, GitPushHelper, HelperContext, HelperResult
from tests.conftest import SANDBOX_UID, make_workspace


def git(*args: str, cwd: Path) -> str:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(cwd),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.invalid",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.invalid",
        "GIT_CONFIG_COUNT": "1",  # the workspace belongs to the sandbox uid; the test runs as root
        "GIT_CONFIG_KEY_0": "safe.directory",
        "GIT_CONFIG_VALUE_0": "*",
    }
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout


def commit(repo: Path, files: dict[str, str], message: str) -> str:
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
        git("add", "-f", name, cwd=repo)
    git("commit", "-qm", message, cwd=repo)
    return git("rev-parse", "HEAD", cwd=repo).strip()


class World:
    """A workspace repo (owned by the sandbox uid), a bare remote, planted host secrets."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.marker = f"zz-hostsecret-{secrets.token_hex(12)}"  # sorts after "refs/": packed-refs lookups reach it
        self.remote = tmp / "remote.git"
        git("init", "--bare", "-q", "-b", "main", str(self.remote), cwd=tmp)
        # the upstream project, already on the remote; its history holds a deny-listed path
        seed = tmp / "seed"
        seed.mkdir()
        git("init", "-q", "-b", "main", cwd=seed)
        commit(seed, {"README.md": "# app\n", "docs/secret-handling.md": "how we handle them\n"}, "upstream")
        git("push", "-q", str(self.remote), "main", cwd=seed)
        self.ws = tmp / "app"
        git("clone", "-q", str(self.remote), str(self.ws), cwd=tmp)
        git("checkout", "-qb", "widget", cwd=self.ws)
        commit(self.ws, {"widget.txt": "a widget\n"}, "Add widget")
        # host-side things the agent must never reach: a repository, its objects, a file
        self.host_repo = tmp / "host-repo"
        self.host_repo.mkdir()
        git("init", "-q", "-b", "main", cwd=self.host_repo)
        self.host_commit = commit(self.host_repo, {"private.txt": f"{self.marker}\n"}, f"private {self.marker}")
        git("branch", "hostonly", cwd=self.host_repo)
        self.host_file = tmp / "host-secret.txt"
        self.host_file.write_text("".join(f"{self.marker}:host-line-{n}:x:y\n" for n in range(1, 3)))
        make_workspace(self.ws)
        self.state = tmp / "state"
        self.events: list[tuple[str, dict[str, Any]]] = []

    @property
    def git_dir(self) -> Path:
        return self.ws / ".git"

    def helper(self) -> GitPushHelper:
        settings = Settings(state_dir=self.state, runtime_dir=self.tmp / "run")
        return GitPushHelper(GitPushConfig(remote=str(self.remote)), settings)

    def push(self, *args: str) -> HelperResult:
        helper = self.helper()
        ws = Workspace(self.ws.resolve(), SANDBOX_UID, SANDBOX_UID) if os.geteuid() == 0 else self._own_ws()
        ctx = HelperContext(
            "sm-gitpush-test",
            ws,
            helper.settings,
            record=lambda event, **detail: self.events.append((event, detail)),
            policy=Policy(),
        )
        return asyncio.run(helper.run(list(args), None, ctx))

    def _own_ws(self) -> Workspace:
        return Workspace(self.ws.resolve(), os.getuid(), os.getgid())

    def remote_branches(self) -> list[str]:
        return git("--git-dir", str(self.remote), "branch", "--list", "--format=%(refname:short)", cwd=self.tmp).split()

    def remote_dump(self) -> str:
        """Everything the remote holds: every object's content."""
        out = subprocess.run(
            ["git", "--git-dir", str(self.remote), "cat-file", "--batch-all-objects", "--batch"],
            capture_output=True,
            check=True,
        ).stdout
        return out.decode("utf-8", "replace")

    def assert_nothing_leaked(self, result: HelperResult | str) -> None:
        shown = result if isinstance(result, str) else result.stdout + result.stderr
        assert self.marker not in shown
        assert self.marker not in self.remote_dump()
        assert self.host_commit not in self.remote_dump()
        assert not _has_object(self.remote, self.host_commit), "the host commit reached the remote"

    def own(self) -> None:
        make_workspace(self.ws)


def _has_object(repo: Path, sha: str) -> bool:
    return subprocess.run(["git", "--git-dir", str(repo), "cat-file", "-e", sha], capture_output=True).returncode == 0
