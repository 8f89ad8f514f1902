"""git-push against a hostile .git: real git, real bwrap, a real bare "remote" in tmp.

The helper used to run git on the host against the workspace's `.git`, which the agent controls.
Each route out of the workspace is planted here with a unique marker in a host repository, object
store or file: nothing of it may reach the remote or the helper's answer. Each route is tried twice:
through the helper as it is (refused up front where the `.git` shape says so), and with the up-front
check switched off, so the jail alone must hold (the agent can race the check). Beside them: a
normal push still works, and a commit adding a deny-listed path is refused with the path named.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from sandman.upcall import gitjail
from sandman.upcall.helpers import HelperError, HelperResult
from tests.conftest import IN_CI, make_workspace, skip_unless
from tests.support.git_world import World, _has_object, commit, git

pytestmark = skip_unless(shutil.which("bwrap") is not None, "needs bubblewrap: scripts/setup installs it")


@pytest.fixture
def world(tmp_path: Path) -> World:
    tmp_path.chmod(0o755)
    return World(tmp_path)


@pytest.fixture(params=["checked", "jail-only"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """'jail-only' switches the up-front check off: the agent can win a race against it."""
    if request.param == "jail-only":
        monkeypatch.setattr(gitjail, "check_git_dir", lambda fd: None)
    return str(request.param)


def run_push(world: World, *args: str) -> HelperResult | str:
    """The helper's answer, or its refusal's message."""
    try:
        return world.push(*args)
    except HelperError as exc:
        return str(exc)


# -- positive control ----------------------------------------------------------------------------


def test_a_normal_push_works_and_is_recorded(world: World) -> None:
    result = world.push()
    assert result.exit_code == 0, result
    assert result.stdout.startswith("pushed widget to sandman/widget\n")
    assert "sandman/widget" in world.remote_branches()
    log = git("--git-dir", str(world.remote), "log", "--format=%s", "sandman/widget", cwd=world.tmp)
    assert log.splitlines() == ["Add widget", "upstream"]
    assert world.events == [("git.pushed", {"branch": "sandman/widget", "source": "widget"})]
    # a second push of a new commit goes through the same (reused) bare repository
    commit(world.ws, {"more.txt": "more\n"}, "More")
    world.own()
    assert world.push("widget").exit_code == 0
    assert git("--git-dir", str(world.remote), "log", "-1", "--format=%s", "sandman/widget", cwd=world.tmp) == "More\n"


# -- the three routes out, and config ------------------------------------------------------------


def test_commondir_to_a_host_repository(world: World, mode: str) -> None:
    (world.git_dir / "commondir").write_text(f"{world.host_repo / '.git'}\n")
    world.own()
    result = run_push(world, "hostonly")
    if mode == "checked":
        assert isinstance(result, str) and ".git/commondir exists" in result
    else:
        assert not isinstance(result, str) and result.exit_code != 0
    world.assert_nothing_leaked(result)
    assert "sandman/hostonly" not in world.remote_branches()


def test_commondir_config_include_oracle(world: World, mode: str) -> None:
    """The agent's config (here through commondir, and directly) includes a host file: git must
    never read it, so its first line can never come back in an error."""
    (world.git_dir / "config").write_text(f"[include]\n\tpath = {world.host_file}\n[core]\n\tbare = false\n")
    common = world.tmp / "agent-common"
    shutil.copytree(world.git_dir, common)
    (common / "config").write_text(f"[include]\n\tpath = {world.host_file}\n")
    (world.git_dir / "commondir").write_text(f"{common}\n")
    world.own()
    make_workspace(common)
    result = run_push(world)
    world.assert_nothing_leaked(result)


def test_config_include_of_a_host_file(world: World) -> None:
    with (world.git_dir / "config").open("a") as f:
        f.write(f"[include]\n\tpath = {world.host_file}\n[uploadpack]\n\tpackObjectsHook = touch {world.tmp}/pwned\n")
    world.own()
    result = world.push()
    assert result.exit_code == 0, result  # the agent's config is never read, not even in the jail
    world.assert_nothing_leaked(result)
    assert not (world.tmp / "pwned").exists()


def test_alternates_to_a_host_object_store(world: World, mode: str) -> None:
    (world.git_dir / "objects" / "info" / "alternates").write_text(f"{world.host_repo / '.git' / 'objects'}\n")
    (world.git_dir / "refs" / "heads" / "stolen").write_text(f"{world.host_commit}\n")
    world.own()
    result = run_push(world, "stolen")
    if mode == "checked":
        assert isinstance(result, str) and ".git/objects/info/alternates exists" in result
    else:
        assert not isinstance(result, str) and result.exit_code != 0
    world.assert_nothing_leaked(result)
    assert "sandman/stolen" not in world.remote_branches()


def test_http_alternates_refused(world: World) -> None:
    (world.git_dir / "objects" / "info" / "http-alternates").write_text("http://127.0.0.1:9/x\n")
    world.own()
    result = run_push(world)
    assert isinstance(result, str) and "http-alternates exists" in result


@pytest.mark.parametrize("target", ["host-file", "etc-shadow"])
def test_packed_refs_symlink_to_a_host_file(world: World, target: str) -> None:
    path = world.host_file if target == "host-file" else Path("/etc/shadow")
    (world.git_dir / "packed-refs").unlink(missing_ok=True)
    (world.git_dir / "packed-refs").symlink_to(path)
    world.own()
    result = run_push(world)
    world.assert_nothing_leaked(result)
    shown = result if isinstance(result, str) else result.stdout + result.stderr
    if target == "etc-shadow" and Path("/etc/shadow").exists() and os.geteuid() == 0:
        first = Path("/etc/shadow").read_text().splitlines()[0]
        assert first not in shown and first not in world.remote_dump()


def test_refs_symlink_to_a_host_file(world: World) -> None:
    (world.git_dir / "refs" / "heads" / "leak").symlink_to(world.host_file)
    world.own()
    result = run_push(world, "leak")
    world.assert_nothing_leaked(result)
    assert "sandman/leak" not in world.remote_branches()


def test_objects_dir_symlink_to_a_host_store(world: World) -> None:
    objects = world.git_dir / "objects"
    shutil.rmtree(objects)
    objects.symlink_to(world.host_repo / ".git" / "objects")
    (world.git_dir / "refs" / "heads" / "stolen").write_text(f"{world.host_commit}\n")
    world.own()
    result = run_push(world, "stolen")
    world.assert_nothing_leaked(result)
    assert not isinstance(result, str) and result.exit_code != 0


# -- the shape of .git, and HEAD ------------------------------------------------------------------


def test_git_dir_symlink_and_gitdir_file_refused(world: World) -> None:
    real = world.tmp / "elsewhere.git"
    world.git_dir.rename(real)
    world.git_dir.symlink_to(real)
    result = run_push(world)
    assert isinstance(result, str) and "directory" in result
    world.git_dir.unlink()
    world.git_dir.write_text(f"gitdir: {world.host_repo / '.git'}\n")
    result = run_push(world, "hostonly")
    assert isinstance(result, str) and "directory" in result
    world.assert_nothing_leaked(result)


def test_head_fifo_symlink_and_huge_are_refused_at_once(world: World) -> None:
    head = world.git_dir / "HEAD"
    head.unlink()
    os.mkfifo(head)
    started = time.monotonic()
    result = run_push(world)
    assert isinstance(result, str) and "HEAD" in result and "not a regular file" in result
    assert time.monotonic() - started < 5
    head.unlink()
    head.symlink_to(world.host_file)
    result = run_push(world)
    assert isinstance(result, str) and "HEAD" in result
    assert world.marker not in result
    head.unlink()
    head.write_text("ref: refs/heads/" + "a" * (8 << 20))
    result = run_push(world)
    # refused either by the HEAD read (4 KiB) or the ref check (64 KiB): never read whole
    assert isinstance(result, str) and ("not a valid branch name" in result or "HEAD" in result)
    assert len(result) < 4096 + 200


def test_branch_name_with_a_newline_refused(world: World) -> None:
    result = run_push(world, "widget\n")
    assert isinstance(result, str) and "not a valid branch name" in result
    (world.git_dir / "HEAD").write_text("ref: refs/heads/widget\n\n")  # HEAD's own newline is stripped
    world.own()
    assert world.push().exit_code == 0


# -- the deny list --------------------------------------------------------------------------------


def test_a_commit_adding_env_is_refused_naming_it(world: World) -> None:
    git("checkout", "-qb", "leaky", cwd=world.ws)
    commit(world.ws, {".env": "API_KEY=x\n"}, "oops")
    commit(world.ws, {"fine.txt": "fine\n"}, "fine")
    world.own()
    result = run_push(world)
    assert isinstance(result, str) and "'.env'" in result and "deny list" in result
    assert "sandman/leaky" not in world.remote_branches()
    # Red-team round 4: what a refused push fetched stayed on the host's disk for good.
    assert not (world.state / "git" / "sm-gitpush-test.git").exists()


def test_a_path_added_then_removed_is_still_refused(world: World) -> None:
    git("checkout", "-qb", "history", cwd=world.ws)
    commit(world.ws, {"keys/server.pem": "-----BEGIN-----\n"}, "add key")
    git("rm", "-q", "keys/server.pem", cwd=world.ws)
    git("commit", "-qm", "remove key", cwd=world.ws)
    world.own()
    result = run_push(world)
    assert isinstance(result, str) and "keys/server.pem" in result
    assert "sandman/history" not in world.remote_branches()


def test_an_evil_merge_adding_env_is_refused(world: World) -> None:
    git("checkout", "-qb", "side", cwd=world.ws)
    commit(world.ws, {"side.txt": "side\n"}, "side")
    git("checkout", "-q", "widget", cwd=world.ws)
    git("merge", "-q", "--no-ff", "--no-commit", "side", cwd=world.ws)
    (world.ws / ".env").write_text("TOKEN=x\n")
    git("add", "-f", ".env", cwd=world.ws)
    git("commit", "-qm", "merge side", cwd=world.ws)
    world.own()
    result = run_push(world)
    assert isinstance(result, str) and "'.env'" in result


def test_allowed_paths_and_history_already_on_the_remote_pass(world: World) -> None:
    """`.env.example` is exempt, and upstream's docs/secret-handling.md is already on the remote:
    only the commits the remote lacks are checked."""
    commit(world.ws, {".env.example": "API_KEY=\n"}, "example env")
    world.own()
    result = world.push()
    assert result.exit_code == 0, result


def test_a_new_branch_with_no_shared_history_checks_every_commit(world: World) -> None:
    git("checkout", "-q", "--orphan", "fresh", cwd=world.ws)
    git("rm", "-rqf", ".", cwd=world.ws)
    commit(world.ws, {"config/db_password.txt": "hunter2\n"}, "fresh start")
    commit(world.ws, {"other.txt": "x\n"}, "more")
    world.own()
    result = run_push(world)
    assert isinstance(result, str) and "config/db_password.txt" in result


# -- the jail itself ------------------------------------------------------------------------------


def test_the_jail_sees_nothing_of_the_host(world: World) -> None:
    """`git diff --no-index` reads any path it can see: inside the jail, host paths do not exist."""
    ok = gitjail.run_git(world.git_dir, ["cat-file", "-p", "HEAD"])
    assert ok.exit_code == 0 and b"Add widget" in ok.stdout
    for path in (world.host_file, world.host_repo / "private.txt", Path("/etc/passwd"), Path("/root"), world.tmp):
        probe = gitjail.run_git(world.git_dir, ["diff", "--no-index", "--no-ext-diff", "/dev/null", str(path)])
        assert world.marker not in probe.stderr and world.marker.encode() not in probe.stdout
        assert probe.stdout == b"", (path, probe)
        assert "Could not access" in probe.stderr, (path, probe)
    # the repository itself, and /usr, are there
    seen = gitjail.run_git(world.git_dir, ["diff", "--no-index", "/dev/null", f"{gitjail.SOURCE}/HEAD"])
    assert b"ref: refs/heads/widget" in seen.stdout


def test_the_jail_runs_as_the_owner_never_root(world: World) -> None:
    if os.geteuid() != 0:
        (pytest.fail if IN_CI else pytest.skip)("the uid switch is for a root controller: CI runs as root")
    (world.git_dir / "info").mkdir(exist_ok=True)
    world.own()
    with pytest.raises(gitjail.GitJailError, match="never run as root"):
        gitjail.run_git(world.git_dir, ["status"], uid=0, gid=0)
    os.lchown(world.git_dir, 0, 0)
    with pytest.raises(gitjail.GitJailError, match="never run as root"):
        gitjail.run_git(world.git_dir, ["status"])


def test_the_jail_times_out(world: World) -> None:
    started = time.monotonic()
    result = gitjail.run_git(world.git_dir, ["-c", "alias.slow=!sleep 30", "slow"], timeout=1)
    assert result.exit_code in (124, 1, 127)  # no shell in some setups: the alias may fail at once
    assert time.monotonic() - started < 10


def test_error_text_is_cleaned_and_capped() -> None:
    text = gitjail.clean_error("a\x1b[31mred\x00\n" + "x" * 10000, 100)
    assert "\x1b" not in text and "\x00" not in text and len(text) < 200 and text.endswith("truncated]")


def test_bare_repository_tampering_is_refused(world: World) -> None:
    assert world.push().exit_code == 0
    bare = world.state / "git" / "sm-gitpush-test.git"
    (bare / "objects" / "info" / "alternates").write_text(f"{world.host_repo / '.git' / 'objects'}\n")
    result = run_push(world)
    assert isinstance(result, str) and "alternates" in result
    assert not bare.exists()  # a refused push leaves nothing behind, the tampering included
    assert world.push().exit_code == 0  # a fresh bare repository
    (bare / "refs" / "heads" / "evil").symlink_to(world.host_file)
    result = run_push(world)
    assert isinstance(result, str) and "not a file" in result
    world.assert_nothing_leaked(result)
    assert not _has_object(world.remote, world.host_commit)


def test_a_repository_swapped_during_set_up_is_caught_in_the_jail(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bwrap 0.8 resolves what it binds back to a path: if the agent swapped the path in between,
    the jail holds another directory than the one checked. The first thing run in the jail
    compares device and inode with the checked descriptor, and the config with sandman's."""
    monkeypatch.setattr(gitjail, "_devino", lambda fd: "1:1")
    with pytest.raises(gitjail.GitJailError, match="replaced while the jail was set up"):
        gitjail.run_git(world.git_dir, ["rev-parse", "HEAD"])
    monkeypatch.undo()
    real = gitjail._data_fd
    monkeypatch.setattr(gitjail, "_data_fd", lambda data: real(b"[core]\n\tbare = true\n"))
    with pytest.raises(gitjail.GitJailError, match="config was replaced"):
        gitjail.run_git(world.git_dir, ["rev-parse", "HEAD"])


def test_the_agents_config_is_never_read_in_the_jail(world: World) -> None:
    (world.git_dir / "config").write_text('[core]\n\tpager = "touch /tmp/pwned"\n[alias]\n\tx = !id\n')
    world.own()
    shown = gitjail.run_git(world.git_dir, ["config", "--list", "--show-origin"])
    assert b"pwned" not in shown.stdout and b"alias" not in shown.stdout
    assert b"extensions.objectformat=sha1" in shown.stdout
    (world.git_dir / "config").write_text("[extensions]\n\tobjectFormat = sha256\n")
    fd = gitjail.open_git_dir(world.git_dir)
    try:
        assert b"objectformat = sha256" in gitjail.neutral_config(fd)
    finally:
        os.close(fd)


def test_a_shallow_clone_pushes(world: World) -> None:
    shutil.rmtree(world.ws)
    git("clone", "-q", "--depth", "1", f"file://{world.remote}", str(world.ws), cwd=world.tmp)
    git("checkout", "-qb", "widget", cwd=world.ws)
    commit(world.ws, {"widget.txt": "a widget\n"}, "Add widget")
    world.own()
    result = world.push()
    assert result.exit_code == 0, result
    assert "sandman/widget" in world.remote_branches()


def test_refs_that_read_without_end_are_refused_and_git_memory_is_capped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Red-team round 3: a ref symlinked to /dev/zero (or a FIFO the agent feeds) made the jailed
    git read gigabytes into host memory. Such refs are refused before git runs, and each jailed
    git's heap is capped for a ref swapped in after the check."""
    import threading

    from sandman.upcall import gitjail

    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(
        [
            "git",
            "-C",
            str(repo),
            "-c",
            "user.email=a@b",
            "-c",
            "user.name=a",
            "commit",
            "-q",
            "--allow-empty",
            "-m",
            "x",
        ],
        check=True,
    )
    git_dir = repo / ".git"

    def check() -> None:
        fd = gitjail.open_git_dir(git_dir)
        try:
            gitjail.check_git_dir(fd)
        finally:
            os.close(fd)

    check()  # positive control: a plain repository passes
    heads = git_dir / "refs" / "heads"
    (heads / "zz").symlink_to("/dev/zero")
    with pytest.raises(gitjail.GitJailError, match=r"refs/heads/zz is not a regular file"):
        check()
    (heads / "zz").unlink()
    os.mkfifo(heads / "ff")
    with pytest.raises(gitjail.GitJailError, match=r"refs/heads/ff is not a regular file"):
        check()
    # A FIFO swapped in after the check: git reads it, and the jail's heap cap ends git.
    monkeypatch.setattr(gitjail, "check_git_dir", lambda fd: None)
    for p in [repo, *repo.rglob("*")]:
        os.lchown(p, 1000, 1000)  # git never runs as root on an agent's repository
    stop = threading.Event()

    def feed() -> None:
        chunk = b"0" * (1 << 20)
        with contextlib.suppress(OSError), open(heads / "ff", "wb") as f:
            for _ in range(4096):  # 4 GiB at most
                if stop.is_set():
                    break
                f.write(chunk)

    t = threading.Thread(target=feed, daemon=True)
    t.start()
    res = gitjail.run_git(git_dir, ["for-each-ref"], timeout=60)
    stop.set()
    t.join(30)
    assert res.exit_code != 0 and "memory" in res.stderr.lower(), res
