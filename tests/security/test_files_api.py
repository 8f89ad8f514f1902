"""The files API (``sb.files``) against a hostile workspace, on the real filesystem: writes to git's
and sandman's control files are refused, no symlink is followed in any component, the work is done
as the workspace owner and not as root, and a ``renameat2(RENAME_EXCHANGE)`` loop that beats the
old check-then-open (shown here too, as the positive control of the attack) never wins.

Built on ``sandman.core.files.Files`` with a Workspace and a Policy directly: no engine needed."""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sandman.core import files as files_mod
from sandman.core.files import Files
from sandman.core.workspace import Workspace
from sandman.errors import UsageError
from sandman.policy import Policy
from sandman.policy.paths import PathDenied, validate_path
from tests.conftest import SANDBOX_UID, make_workspace, skip_unless

AS_ROOT = os.geteuid() == 0
needs_root = skip_unless(AS_ROOT, "proves the files API drops root: run as root, as CI does")

SYS_RENAMEAT2 = 316  # x86_64
RENAME_EXCHANGE = 2
RACE_TRIES = 3000
RACE_SECONDS = 20.0
REAL = b"the real d/f\n"


class Audit(list[tuple[str, str, dict[str, Any]]]):
    def __call__(self, event: str, verdict: str, **detail: Any) -> None:
        self.append((event, verdict, detail))

    def refused(self) -> int:
        return sum(1 for e in self if e[0] == "path.refused")


def files_for(ws: Path, policy: Policy | None = None) -> tuple[Files, Audit]:
    st = ws.stat()
    audit = Audit()
    pol = policy or Policy()
    return Files(Workspace(ws.resolve(), st.st_uid, st.st_gid), lambda: pol, audit), audit


@pytest.fixture(params=["openat2", "walk"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """Both ways of opening: openat2 (asserted to be there) and the O_NOFOLLOW walk used on ENOSYS."""
    if request.param == "walk":
        monkeypatch.setattr(files_mod, "_openat2_ok", False)
    else:
        monkeypatch.setattr(files_mod, "_openat2_ok", None)
        fd = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
        try:
            assert files_mod._have_openat2(fd), "this kernel has no openat2 (Linux 5.6+): the walk is all it tests"
        finally:
            os.close(fd)
    return str(request.param)


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    tmp_path.chmod(0o755)
    return make_workspace(tmp_path / "ws")


def own(ws: Path) -> None:
    make_workspace(ws)  # what the test made as root becomes the owner's, as the agent's would be


def test_enosys_falls_back_to_the_walk(monkeypatch: pytest.MonkeyPatch, ws: Path) -> None:
    monkeypatch.setattr(files_mod, "_SYS_OPENAT2", 100_000)  # no such syscall: ENOSYS
    monkeypatch.setattr(files_mod, "_openat2_ok", None)
    (ws / "a.txt").write_text("hi\n")
    own(ws)
    files, _ = files_for(ws)
    assert files.read("a.txt") == b"hi\n"
    assert files_mod._openat2_ok is False


def test_writes_to_git_and_sandman_control_files_are_refused(mode: str, ws: Path) -> None:
    (ws / ".git" / "hooks").mkdir(parents=True)  # a real repository's layout
    (ws / "sub").mkdir()
    own(ws)
    policy = Policy.model_validate({"filesystem": {"protected": [".git/hooks", ".git/config", "Makefile"]}})
    files, audit = files_for(ws, policy)
    refused = {
        ".git/hooks/pre-commit": "**/.git",
        ".git/commondir": "**/.git",
        ".git/info/attributes": "**/.git",
        ".git/worktrees/w/commondir": "**/.git",
        "sub/.git/config": "**/.git",
        "sub/.git": "**/.git",  # a `.git` file with gitdir: would redirect git
        ".GIT/hooks/pre-commit": "**/.git",
        ".sandman/image.toml": ".sandman",
        ".sandman/policy.toml": ".sandman",
        "Makefile": "Makefile",
        "./.git/../.git/hooks/post-checkout": "**/.git",
    }
    for path, rule in refused.items():
        with pytest.raises(PathDenied) as info:
            files.write(path, "#!/bin/sh\ntouch /tmp/pwned\n")
        msg = str(info.value)
        assert repr(path) in msg and repr(rule) in msg and "read-only for the sandbox" in msg, msg
        assert info.value.exit_code == 5
    assert audit.refused() == len(refused)
    assert all(e[2]["path"] in refused for e in audit if e[0] == "path.refused")
    assert os.listdir(ws / ".git" / "hooks") == []
    assert not (ws / ".sandman").exists() and not (ws / "sub" / ".git").exists() and not (ws / "Makefile").exists()
    assert not (ws / ".GIT").exists()
    # Reads keep the deny list only: the protected hooks dir is readable, `.env` is not.
    (ws / ".git" / "hooks" / "pre-commit.sample").write_text("sample\n")
    (ws / ".env").write_text("SECRET=1\n")
    own(ws)
    assert files.read(".git/hooks/pre-commit.sample") == b"sample\n"
    for bad in (".env", "../outside", "/etc/passwd"):
        with pytest.raises(PathDenied, match="denied by rule|escapes"):
            files.read(bad)

    # Positive control: an ordinary path is written, owned by the workspace owner, not by root.
    files.write("notes/a.txt", "hello\n")
    assert (ws / "notes" / "a.txt").read_bytes() == b"hello\n"
    owner = SANDBOX_UID if AS_ROOT else os.geteuid()
    assert (ws / "notes" / "a.txt").stat().st_uid == owner
    assert (ws / "notes").stat().st_uid == owner
    files.write("notes/a.txt", "again\n", make_dirs=False)  # truncated and rewritten in place
    assert files.read("notes/a.txt") == b"again\n"
    assert ("file.write", "ok", {"path": "notes/a.txt", "bytes": 6}) in audit
    with pytest.raises(UsageError, match="make_dirs"):
        files.write("nodir/a.txt", "x", make_dirs=False)


def test_a_symlink_in_any_component_is_refused(mode: str, ws: Path, tmp_path: Path) -> None:
    (tmp_path / "b").write_text("outside the workspace\n")
    (ws / "notes").mkdir()
    (ws / "notes" / "x.txt").write_text("inside\n")
    (ws / "link").symlink_to("/etc")
    (ws / "a").symlink_to("..")
    (ws / "in").symlink_to("notes")  # even one that stays inside
    (ws / "fl").symlink_to("notes/x.txt")
    (ws / "dangling").symlink_to(tmp_path / "created-through-a-dangling-link")
    own(ws)
    files, audit = files_for(ws)
    attempts: list[tuple[str, Callable[[], object], str]] = [
        ("link/passwd", lambda: files.read("link/passwd"), "link"),
        ("a/b", lambda: files.read("a/b"), "a"),
        ("a/ws/notes/x.txt", lambda: files.read("a/ws/notes/x.txt"), "a"),
        ("in/x.txt", lambda: files.read("in/x.txt"), "in"),
        ("fl", lambda: files.read("fl"), "fl"),
        ("link/evil", lambda: files.write("link/evil", "x"), "link"),
        ("a/b", lambda: files.write("a/b", "overwritten"), "a"),
        ("a/new/deep", lambda: files.write("a/new/deep", "x"), "a"),
        ("fl", lambda: files.write("fl", "overwritten"), "fl"),
        ("dangling", lambda: files.write("dangling", "x"), "dangling"),
        ("link", lambda: files.list("link"), "link"),
        ("a", lambda: files.list("a"), "a"),
    ]
    for path, call, link in attempts:
        with pytest.raises(PathDenied) as info:
            call()
        msg = str(info.value)
        assert repr(path) in msg and f"symlink {link!r}" in msg, msg
    assert audit.refused() == len(attempts)
    assert not Path("/etc/evil").exists()
    assert (tmp_path / "b").read_text() == "outside the workspace\n"
    assert not (tmp_path / "new").exists() and not (tmp_path / "created-through-a-dangling-link").exists()
    assert (ws / "notes" / "x.txt").read_text() == "inside\n"

    # Positive control: plain nested paths work, and a listing shows the links without following them.
    files.write("x/y/z.txt", "nested\n")
    assert files.read("x/y/z.txt") == b"nested\n"
    assert files.read(str(ws / "x" / "y" / "z.txt")) == b"nested\n"  # absolute, inside the workspace
    assert [(f.path, f.is_dir) for f in files.list("x/y")] == [("x/y/z.txt", False)]
    top = {f.path: f for f in files.list(".")}
    assert top["link"].is_symlink and not top["link"].is_dir and top["x"].is_dir and not top["x"].is_symlink


def test_a_fifo_does_not_hang_the_host(mode: str, ws: Path) -> None:
    os.mkfifo(ws / "pipe")
    own(ws)
    files, _ = files_for(ws)
    with pytest.raises(UsageError, match="not a regular file"):
        files.read("pipe")
    with pytest.raises(UsageError, match="not a regular file"):
        files.write("pipe", "x")


@needs_root
def test_the_work_is_done_as_the_workspace_owner(mode: str, ws: Path) -> None:
    (ws / "mine.txt").write_text("ok\n")
    own(ws)
    (ws / "rootonly.txt").write_text("root's\n")  # left to root, mode 0600: the owner cannot read it
    (ws / "rootonly.txt").chmod(0o600)
    (ws / "rootdir").mkdir(mode=0o755)  # the owner cannot create in it
    files, audit = files_for(ws)
    with pytest.raises(
        PathDenied, match=f"'rootonly.txt': permission denied to the workspace owner .uid {SANDBOX_UID}"
    ):
        files.read("rootonly.txt")
    with pytest.raises(PathDenied, match="permission denied"):
        files.write("rootdir/x", "x")
    with pytest.raises(PathDenied, match="permission denied"):
        files.write("rootonly.txt", "x")
    assert os.listdir(ws / "rootdir") == [] and (ws / "rootonly.txt").read_text() == "root's\n"
    assert audit.refused() == 3
    assert files.read("mine.txt") == b"ok\n"


# -- the exchange race ----------------------------------------------------------------------------
@contextlib.contextmanager
def exchanging(ws: Path, a: str = "d", b: str = "l", seconds: float = 120) -> Iterator[None]:
    """A child process, as the workspace owner (like the agent), swapping ``a`` and ``b`` in a
    ``renameat2(RENAME_EXCHANGE)`` loop until the block ends (or ``seconds`` pass)."""
    ws_fd = os.open(ws, os.O_PATH | os.O_DIRECTORY)
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(SANDBOX_UID)
            os.setuid(SANDBOX_UID)
            sc = ctypes.CDLL(None, use_errno=True).syscall
            args = [ctypes.c_long(x) for x in (SYS_RENAMEAT2, ws_fd)]
            call = (*args, ctypes.c_char_p(a.encode()), ctypes.c_long(ws_fd), ctypes.c_char_p(b.encode()))
            flag = ctypes.c_long(RENAME_EXCHANGE)
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                for _ in range(500):
                    sc(*call, flag)
        finally:
            os._exit(0)
    os.close(ws_fd)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


class Tally:
    def __init__(self) -> None:
        self.tries = self.ok = self.refused = self.other = self.marker = 0

    def __repr__(self) -> str:
        return f"tries={self.tries} ok={self.ok} refused={self.refused} other={self.other} marker={self.marker}"


def race(fn: Callable[[], bytes | None], marker: bytes, tries: int = RACE_TRIES) -> Tally:
    """``fn`` tried ``tries`` times while the swapper runs, and on until it succeeded once (at most
    RACE_SECONDS). The yield between tries keeps a fast loop from falling in step with the swapper
    (a create in ``d`` holds d's inode lock, which the exchange waits for). An in-process loop spans
    only a few scheduler slices, so its share of successes varies a lot on a loaded machine."""
    t = Tally()
    deadline = time.monotonic() + RACE_SECONDS
    while (t.tries < tries or t.ok == 0) and time.monotonic() < deadline:
        t.tries += 1
        os.sched_yield()
        try:
            got = fn()
        except PathDenied:
            t.refused += 1
            continue
        except (UsageError, OSError):
            t.other += 1
            continue
        t.ok += 1
        if got is not None and marker in got:
            t.marker += 1
        elif got is not None:
            assert got == REAL, got
    return t


@needs_root
def test_the_exchange_race_never_reaches_the_host(tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = f"host-secret-{secrets.token_hex(12)}".encode()
    host = tmp_path / "host"
    host.mkdir(mode=0o700)
    (host / "f").write_bytes(marker + b"\n")
    (host / "f").chmod(0o600)
    (ws / "d").mkdir()
    (ws / "d" / "f").write_bytes(REAL)
    (ws / "l").symlink_to(host)
    own(ws)
    real_dir_ino = (ws / "d").stat().st_ino
    files, _ = files_for(ws)
    figures: dict[str, Tally] = {}

    def naive_read() -> bytes:  # the old code: validate_path (realpath), then open the result
        real = validate_path(ws, "d/f", must_exist=True)
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            return os.read(fd, 4096)
        finally:
            os.close(fd)

    def naive_write() -> None:
        real = validate_path(ws, "d/naive-new")
        os.close(os.open(real, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644))

    root_fd = os.open(ws, os.O_PATH | os.O_DIRECTORY)
    try:
        with exchanging(ws):
            seen = set()
            for _ in range(20000):  # the swapper is running: d is seen as a directory and as a link
                seen.add((ws / "d").is_symlink())
                if len(seen) == 2:
                    break
            assert seen == {True, False}, "the renameat2 loop does not swap d and l"

            # Positive control of the attack: the old check-then-open does reach the host.
            figures["naive read"] = race(naive_read, marker)
            figures["naive write"] = race(naive_write, marker)
            naive_created = (host / "naive-new").exists()
            with contextlib.suppress(FileNotFoundError):
                (host / "naive-new").unlink()

            # The descriptor walk alone, run as root in-process (no uid drop to help it).
            for walk_mode, ok in (("openat2", True), ("walk", False)):
                monkeypatch.setattr(files_mod, "_openat2_ok", ok)
                figures[f"{walk_mode} read as root"] = race(
                    lambda: files_mod._read_at(root_fd, "d/f", ("d", "f"), 4096), marker
                )
                figures[f"{walk_mode} write as root"] = race(
                    lambda: files_mod._write_at(root_fd, "d/new", ("d", "new"), b"x", True), marker
                )
            monkeypatch.setattr(files_mod, "_openat2_ok", None)

            # The files API end to end (as root: through the child that runs as the owner).
            figures["files.read"] = race(lambda: files.read("d/f"), marker)
            figures["files.write"] = race(lambda: files.write("d/api-new", "y"), marker)  # d/new is root's now
    finally:
        os.close(root_fd)
    print("\nexchange race:", *(f"  {k}: {v}" for k, v in figures.items()), sep="\n")

    assert figures["naive read"].marker >= 1, f"the race did not reproduce here: {figures['naive read']}"
    for name, t in figures.items():
        if name.startswith("naive"):
            continue
        assert t.marker == 0, f"{name} returned the host file: {t}"
        # Positive control: the tries also ran while d was really a directory, and then succeeded;
        # the API's (a fork each) span seconds, so their share of successes is steady.
        least = t.tries // 20 if name.startswith("files.") else 1
        assert t.ok >= least, f"{name}: too few successes for a meaningful race: {t}"
        assert t.other == 0, f"{name}: errors other than a refusal: {t}"
    assert os.listdir(host) == ["f"], "something was created in the root-only host directory"
    assert (host / "f").read_bytes() == marker + b"\n"
    real_dir = next(p for p in (ws / "d", ws / "l") if not p.is_symlink())
    assert real_dir.stat().st_ino == real_dir_ino and (real_dir / "new").read_bytes() == b"x"
    assert (real_dir / "api-new").read_bytes() == b"y" and (real_dir / "api-new").stat().st_uid == SANDBOX_UID
    print(f"  naive write created a file in the root-only dir: {naive_created}")
