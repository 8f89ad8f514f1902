"""Deny-listed files in a repository's git history: found (reachable, unreachable, staged),
cached by the object store's shape, turned into known secrets and a one-line warning."""

from __future__ import annotations

import importlib.util
import os
import shutil
import stat
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from sandman.errors import ConfigError
from sandman.policy import effective_policy, load_policy, named_policy_path
from sandman.policy.paths import DEFAULT_ALLOW, DEFAULT_DENY, denied_by
from sandman.secrets import githistory
from sandman.secrets.githistory import describe, find_history_secrets, secrets_from
from sandman.upcall.gitjail import JailResult

ROOT = Path(__file__).resolve().parents[2]
SECRET = "sk-live-123456789"
ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.invalid",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.invalid",
    "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
    "HOME": "/nonexistent",
}


class PlainGit:
    """A stand-in for gitjail.run_git on the test's own (trusted) repositories: same signature and
    result, no jail, and it records every call."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, git_dir: Path, args: Sequence[str], *, timeout: float = 60, max_output: int = 1 << 20,
                 **_: object) -> JailResult:  # fmt: skip
        self.calls.append(list(args))
        proc = subprocess.run(
            ["git", "-c", "safe.directory=*", "--git-dir", str(git_dir), *args],
            capture_output=True,
            timeout=timeout,
            env=ENV,
            cwd="/",
        )
        out = proc.stdout[:max_output]
        return JailResult(proc.returncode, out, proc.stderr.decode(), len(proc.stdout) > max_output)

    def listed(self) -> int:
        """How many full-history listings ran."""
        return sum(1 for c in self.calls if c[:2] == ["rev-list", "--objects"] and "--all" in c)


def git(repo: Path, *args: str) -> str:
    out = subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=ENV)
    return out.stdout.strip()


def age(repo: Path, seconds: int = 60) -> None:
    """Every mtime under .git moved back: a store changed within the last 2s is not cached."""
    past = time.time() - seconds
    for root, dirs, files in os.walk(repo / ".git"):
        for name in dirs + files:
            os.utime(os.path.join(root, name), (past, past), follow_symlinks=False)


def commit_all(repo: Path, message: str) -> None:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "--allow-empty", "-m", message)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """.env committed, then removed; .env.example (allowed) still there."""
    ws = tmp_path / "ws"
    ws.mkdir()
    git(ws, "init", "-q", "-b", "main")
    (ws / "README").write_text("hello\n")
    (ws / ".env").write_text(f"# local\nAPI_KEY={SECRET}\nDEBUG=1\n")
    (ws / ".env.example").write_text("API_KEY=changeme-please\n")
    commit_all(ws, "first")
    git(ws, "rm", "-q", ".env")
    commit_all(ws, "remove .env")
    age(ws)
    return ws


@pytest.fixture
def runner() -> PlainGit:
    return PlainGit()


def scan(ws: Path, cache: Path, runner: PlainGit, **kw: object) -> githistory.HistoryScan:
    result = find_history_secrets(ws, cache_dir=cache, runner=runner, **kw)  # type: ignore[arg-type]
    assert result.error is None, result.error
    return result


def test_a_removed_env_is_found_with_its_content(repo: Path, tmp_path: Path, runner: PlainGit) -> None:
    result = scan(repo, tmp_path / "cache", runner)
    assert [f.path for f in result.files] == [".env"]  # .env.example is allowed, README not denied
    (env,) = result.files
    assert env.rule == ".env"
    (blob,) = env.blobs
    assert blob.content == f"# local\nAPI_KEY={SECRET}\nDEBUG=1\n".encode()
    assert blob.sources == ("refs",) and blob.size == len(blob.content) and not blob.too_large
    assert not result.cached and result.commits == 2 and result.unreachable_commits == 0


def test_a_second_scan_hits_the_cache_and_lists_nothing(repo: Path, tmp_path: Path, runner: PlainGit) -> None:
    first = scan(repo, tmp_path / "cache", runner)
    assert runner.listed() == 1
    runner.calls.clear()
    second = scan(repo, tmp_path / "cache", runner)
    assert second.cached and second.files == first.files and second.key == first.key
    assert [c[0] for c in runner.calls] == ["show"]  # only the contents, read back by blob id
    assert second.git_calls == 1


def test_the_cache_holds_no_content_and_is_private(repo: Path, tmp_path: Path, runner: PlainGit) -> None:
    scan(repo, tmp_path / "cache", runner)
    (path,) = (tmp_path / "cache").iterdir()
    assert SECRET not in path.read_text() and ".env" in path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "cache").stat().st_mode) == 0o700


def test_a_damaged_cache_is_scanned_again(repo: Path, tmp_path: Path, runner: PlainGit) -> None:
    first = scan(repo, tmp_path / "cache", runner)
    (path,) = (tmp_path / "cache").iterdir()
    path.write_text(path.read_text().replace('"history":[[', '"history":[[1,'))
    again = scan(repo, tmp_path / "cache", runner)
    assert not again.cached and again.files == first.files and runner.listed() == 2
    assert scan(repo, tmp_path / "cache", runner).cached


def test_a_new_commit_changes_the_key(repo: Path, tmp_path: Path, runner: PlainGit) -> None:
    first = scan(repo, tmp_path / "cache", runner)
    (repo / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nAAAA\n")
    commit_all(repo, "oops")
    git(repo, "rm", "-q", "id_rsa")
    commit_all(repo, "fix")
    age(repo)
    second = scan(repo, tmp_path / "cache", runner)
    assert second.key != first.key and not second.cached and runner.listed() == 2
    assert [f.path for f in second.files] == [".env", "id_rsa"]
    third = scan(repo, tmp_path / "cache", runner)
    assert third.cached and runner.listed() == 2


def test_a_store_changed_just_now_is_not_cached(repo: Path, tmp_path: Path, runner: PlainGit) -> None:
    commit_all(repo, "just now")
    first = scan(repo, tmp_path / "cache", runner)
    assert any("not cached" in n for n in first.notes)
    assert not scan(repo, tmp_path / "cache", runner).cached and runner.listed() == 2


def test_other_deny_lists_are_other_keys(repo: Path, tmp_path: Path, runner: PlainGit) -> None:
    scan(repo, tmp_path / "cache", runner)
    narrow = scan(repo, tmp_path / "cache", runner, deny=["*.pem"], allow=[])
    assert not narrow.cached and narrow.files == ()
    wide = scan(repo, tmp_path / "cache", runner, deny=[".env*"], allow=[])
    assert [f.path for f in wide.files] == [".env", ".env.example"]


def test_unreachable_commits_count(repo: Path, tmp_path: Path, runner: PlainGit) -> None:
    """A deleted branch's commit, its reflog gone too: still in .git/objects, so still readable."""
    git(repo, "checkout", "-q", "-b", "feature")
    (repo / "server.key").write_text("-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0B\n")
    commit_all(repo, "add a key")
    lost = git(repo, "rev-parse", "HEAD")
    git(repo, "checkout", "-q", "main")
    git(repo, "branch", "-q", "-D", "feature")
    git(repo, "reflog", "expire", "--expire=now", "--all")
    age(repo)
    result = scan(repo, tmp_path / "cache", runner)
    assert result.unreachable_commits == 1
    key = next(f for f in result.files if f.path == "server.key")
    assert key.blobs[0].sources == ("unreachable",) and b"MIIEvQIBADANBgkqhkiG9w0B" in (key.blobs[0].content or b"")
    assert lost and "git gc --prune=now" in describe(result)


def test_a_staged_file_is_found_and_an_index_change_lists_only_the_index(
    repo: Path, tmp_path: Path, runner: PlainGit
) -> None:
    scan(repo, tmp_path / "cache", runner)
    (repo / "db_password.txt").write_text("hunter2-but-longer\n")
    git(repo, "add", "db_password.txt")
    age(repo)
    runner.calls.clear()
    result = scan(repo, tmp_path / "cache", runner)
    assert not result.cached and runner.listed() == 1  # git add wrote a loose object: store changed
    staged = next(f for f in result.files if f.path == "db_password.txt")
    assert staged.blobs[0].sources == ("index",) and staged.blobs[0].content == b"hunter2-but-longer\n"
    assert "staged only" in describe(result) and "git rm --cached" in describe(result)
    # Only the index file changes (a refresh): the history is not listed again.
    os.utime(repo / ".git" / "index", (time.time() - 30, time.time() - 30))
    runner.calls.clear()
    again = scan(repo, tmp_path / "cache", runner)
    assert again.cached and again.files == result.files and runner.listed() == 0
    assert ["rev-list", "--objects", "--indexed-objects", "--missing=allow-any"] in runner.calls


def test_stashes_and_linked_worktrees_indexes_count(repo: Path, tmp_path: Path, runner: PlainGit) -> None:
    (repo / ".env.local").write_text("STASHED=stashed-secret-42\n")
    git(repo, "stash", "push", "-q", "--include-untracked")
    git(repo, "worktree", "add", "-q", str(tmp_path / "wt"))
    (tmp_path / "wt" / ".npmrc").write_text("//registry.npmjs.org/:_authToken=npm_abcdefghijklmnop\n")
    git(tmp_path / "wt", "add", ".npmrc")
    age(repo)
    result = scan(repo, tmp_path / "cache", runner)
    found = {f.path: f.blobs[0].sources for f in result.files}
    assert found == {".env": ("refs",), ".env.local": ("refs",), ".npmrc": ("index",)}
    git(repo, "stash", "drop", "-q")
    age(repo)
    dropped = scan(repo, tmp_path / "cache", runner)
    assert {f.path: f.blobs[0].sources for f in dropped.files}[".env.local"] == ("unreachable",)


def test_a_blob_over_the_cap_is_reported_too_large(repo: Path, tmp_path: Path, runner: PlainGit) -> None:
    result = scan(repo, tmp_path / "cache", runner, max_blob=10)
    (blob,) = result.files[0].blobs
    assert blob.too_large and blob.content is None and blob.size > 10
    assert result.unscrubbable == ((".env", blob),)
    assert secrets_from(result) == {}
    assert "too large to scrub" in describe(result)


@pytest.mark.parametrize("kind", ["gitdir-file", "symlink", "alternates", "commondir"])
def test_borrowed_or_redirected_git_dirs_are_refused(repo: Path, tmp_path: Path, runner: PlainGit, kind: str) -> None:
    git_dir = repo / ".git"
    if kind == "gitdir-file":
        shutil.move(git_dir, tmp_path / "real.git")
        git_dir.write_text(f"gitdir: {tmp_path / 'real.git'}\n")
    elif kind == "symlink":
        shutil.move(git_dir, tmp_path / "real.git")
        git_dir.symlink_to(tmp_path / "real.git")
    elif kind == "alternates":
        (git_dir / "objects" / "info").mkdir(exist_ok=True)
        (git_dir / "objects" / "info" / "alternates").write_text("/somewhere/else/objects\n")
    else:
        (git_dir / "commondir").write_text("../..\n")
    result = find_history_secrets(repo, cache_dir=tmp_path / "cache", runner=runner)
    assert result.error and result.files == () and runner.calls == []
    assert describe(result).startswith("git history not scanned: ")


def test_no_repository_is_nothing_to_say(tmp_path: Path, runner: PlainGit) -> None:
    result = find_history_secrets(tmp_path, cache_dir=tmp_path / "cache", runner=runner)
    assert not result.is_repository and result.error is None and describe(result) == "" and runner.calls == []


def test_secrets_from_gives_the_file_and_its_values(repo: Path, tmp_path: Path, runner: PlainGit) -> None:
    result = scan(repo, tmp_path / "cache", runner)
    oid8 = result.files[0].blobs[0].oid[:8]
    assert secrets_from(result) == {
        f"history:.env@{oid8}": f"# local\nAPI_KEY={SECRET}\nDEBUG=1",
        f"history:.env@{oid8}:API_KEY": SECRET,  # DEBUG=1 is too short to be one
    }


def test_every_version_is_a_secret(repo: Path, tmp_path: Path, runner: PlainGit) -> None:
    for value in ("first-password-1234", "second-password-5678"):
        (repo / ".env").write_text(f'export DB_PASSWORD="{value}"\n')
        commit_all(repo, value)
    age(repo)
    values = set(secrets_from(scan(repo, tmp_path / "cache", runner)).values())
    assert {SECRET, "first-password-1234", "second-password-5678"} <= values


MATCH_PATHS = [
    *(f"pkg{i % 7}/sub/module_{i}.py" for i in range(50)),
    *(".env", "a/.env", ".env.example", "a/.ENV.example", "a/.env.local", ".git/config", "x/.git/config"),
    *("home/.aws/credentials", ".aws/credentials", "a/.AWS/Credentials", ".ssh/id_rsa", ".ssh/x/y", "secrets/a"),
    *("my_secret_dir/file", "id_rsa.pub", "a/b/c/d/server.PEM", ".kube/config", "deep/.env.example/inner"),
    *(".env.example/x", "a b/.env", "ünï/.npmrc", "a//.env", "/x/.env", "a/./.env", "a/.", "./.env", "a/b/"),
    *("//", "", "x/../.env", "..", "a/..", "secrets/ok", "secrets/ok/x", "top.key", "x/top.key", "a/b", "a/x/y/b"),
    *("a/b/c", "docs/public.txt", "docs/x.txt", "notes.txt", "x.example", "secrets", "Secrets/OK", "."),
]
MATCH_LISTS = [
    (DEFAULT_DENY, DEFAULT_ALLOW),
    ((".env", "secrets/**", "/top.key", "a/**/b"), ("secrets/ok",)),
    (("**",), ()),
    (("*.txt", "docs/"), ("docs/public.txt", "*.example")),
    (("a/b",), ("a",)),
    (("secrets/**",), ("secrets",)),
    (("**/b/",), ()),
]


@pytest.mark.parametrize(("deny", "allow"), MATCH_LISTS)
def test_the_path_matcher_is_denied_by(deny: tuple[str, ...], allow: tuple[str, ...]) -> None:
    def expected(path: str) -> str | None:
        try:
            return denied_by(path, deny, allow) if path.strip("/") else None
        except ValueError:
            return None

    for order in (MATCH_PATHS, MATCH_PATHS[::-1]):  # parents met before and after their children
        match = githistory._Matcher(deny, allow)
        assert [match(p) for p in order] == [expected(p) for p in order]


def test_values_worth_registering() -> None:
    text = (
        "# comment=ignored-because-comment\n"
        "export TOKEN='quoted-token-value'\n"
        "NODE_ENV=production\n"
        "API_URL=https://api.example.com/v1\n"
        "DB_URL=postgres://user:pa55word@db/app\n"
        "SHORT=abc\n"
        "PLAIN=unquoted-value-123 # a comment\n"
        'json_key: "yaml-or-json-secret",\n'
    )
    assert list(githistory._values(text)) == [
        ("TOKEN", "quoted-token-value"),
        ("DB_URL", "postgres://user:pa55word@db/app"),
        ("PLAIN", "unquoted-value-123 # a comment"),
        ("PLAIN", "unquoted-value-123"),
        ("json_key", "yaml-or-json-secret"),
    ]


def test_describe_names_the_files_and_the_fix(repo: Path, tmp_path: Path, runner: PlainGit) -> None:
    line = describe(scan(repo, tmp_path / "cache", runner))
    assert "\n" not in line and ".env (1 version)" in line
    assert "git filter-repo --invert-paths --path .env" in line and "rotate" in line


def test_an_empty_repository_has_nothing(tmp_path: Path, runner: PlainGit) -> None:
    git(tmp_path, "init", "-q")
    age(tmp_path)
    result = scan(tmp_path, tmp_path / "cache", runner)
    assert result.files == () and result.commits == 0


def _make_big_repo() -> object:
    spec = importlib.util.spec_from_file_location("make_big_repo", ROOT / "scripts" / "make_big_repo.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_500_commit_repository(tmp_path: Path, runner: PlainGit) -> None:
    big: Any = _make_big_repo()
    ws = big.make_big_repo(tmp_path / "big", commits=500, files=300)
    age(ws)
    result = scan(ws, tmp_path / "cache", runner)
    assert result.commits == 500 and [f.path for f in result.files] == [".env"]
    assert big.SECRET in secrets_from(result).values() and runner.listed() == 1
    assert scan(ws, tmp_path / "cache", runner).cached and runner.listed() == 1


def test_through_the_real_jail(repo: Path, tmp_path: Path) -> None:
    """The default runner is gitjail.run_git; as root, the repository must belong to someone else."""
    if os.geteuid() == 0:
        subprocess.run(["chown", "-R", "1000:1000", str(repo)], check=True)
        os.chmod(tmp_path, 0o755)
    result = find_history_secrets(repo, cache_dir=tmp_path / "cache")
    assert result.error is None, result.error
    assert [f.path for f in result.files] == [".env"] and SECRET in secrets_from(result).values()
    assert find_history_secrets(repo, cache_dir=tmp_path / "cache").cached


def test_policy_git_history_modes() -> None:
    assert load_policy().filesystem.git_history == "scrub"
    assert load_policy(named_policy_path("strict")).filesystem.git_history == "refuse"


def test_a_campaign_cannot_loosen_git_history(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / ".sandman").mkdir(parents=True)
    (ws / ".sandman" / "policy.toml").write_text('[filesystem]\ngit_history = "scrub"\n')
    with pytest.raises(ConfigError, match="git_history"):
        effective_policy(named_policy_path("strict"), ws)
    (ws / ".sandman" / "policy.toml").write_text('[filesystem]\ngit_history = "refuse"\n')
    assert effective_policy(None, ws).policy.filesystem.git_history == "refuse"
    strict = effective_policy(named_policy_path("strict"), None).policy
    assert strict.filesystem.git_history == "refuse" and strict.resources.memory == 512 << 20
