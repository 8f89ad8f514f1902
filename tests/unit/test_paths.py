"""Host-side path rules: escapes, symlinks and deny globs, each refused with the reason."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from sandman.errors import ConfigError, UsageError
from sandman.policy.paths import (
    DEFAULT_ALLOW,
    DEFAULT_DENY,
    DEFAULT_PROTECTED,
    Denied,
    PathDenied,
    denied_by,
    find_denied,
    validate_path,
)


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    (root / "src").mkdir(parents=True)
    (root / "src" / "app.py").write_text("print()\n")
    (root / "ok.txt").write_text("ok\n")
    (root / ".env").write_text("SECRET=1\n")
    (root / ".env.example").write_text("SECRET=\n")
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text("[core]\n")
    return root


@pytest.mark.parametrize(
    ("rel", "rule"),
    [
        (".env", ".env"),
        ("sub/.env", ".env"),
        ("a/b/c/.env", ".env"),
        (".env.local", ".env.*"),
        ("config/.env.production", ".env.*"),
        ("credentials.json", "**/credentials.json"),
        ("config/credentials.json", "**/credentials.json"),
        ("my_secret.txt", "**/*secret*"),
        ("deep/dir/secrets/readme.md", "**/*secret*"),  # a denied directory covers its contents
        ("db_password", "**/*password*"),
        ("server.pem", "**/*.pem"),
        ("certs/server.pem", "**/*.pem"),
        ("tls/private.key", "**/*.key"),
        ("id_rsa", "id_rsa"),
        ("home/id_rsa", "id_rsa"),
        ("id_ed25519", "id_ed25519"),
        (".ssh", ".ssh"),
        (".ssh/known_hosts", ".ssh"),
        ("vendor/.ssh/config", ".ssh"),
        (".git/config", ".git/config"),
        ("./.env", ".env"),
        (".env.example/id_rsa", "id_rsa"),  # an allowed directory does not un-deny its contents
        (".ssh/.env.example", ".ssh"),  # nor can allow re-include under a denied directory
    ],
)
def test_denied_by_default_rules(rel: str, rule: str) -> None:
    assert denied_by(rel, DEFAULT_DENY, DEFAULT_ALLOW) == rule


@pytest.mark.parametrize(
    "rel",
    [
        ".env.example",
        "sub/.env.sample",
        ".env.template",
        "environment.py",
        "env",
        "keys.txt",
        "src/keymap.py",
        "id_rsa.pub",
        "README.md",
        ".git/configs",  # anchored glob, whole component: .git/config only
        "sub/.git/config",  # anchored at the workspace root; a nested repo's config is not the host's
        ".git/HEAD",
        "",
        ".",
    ],
)
def test_not_denied_by_default_rules(rel: str) -> None:
    assert denied_by(rel) is None


@pytest.mark.parametrize(
    ("rel", "deny", "allow", "expected"),
    [
        ("build/out.bin", ("/build",), (), "/build"),  # a leading / anchors
        ("src/build/out.bin", ("/build",), (), None),
        ("logs/", ("logs/",), (), "logs/"),  # a trailing / is ignored
        ("a/b/c/d.txt", ("a/**/d.txt",), (), "a/**/d.txt"),
        ("a/d.txt", ("a/**/d.txt",), (), "a/**/d.txt"),  # ** is zero or more components
        ("x/a/d.txt", ("a/**/d.txt",), (), None),
        ("x/y/data/dump.sql", ("**/data/*.sql",), (), "**/data/*.sql"),
        ("data/x/dump.sql", ("**/data/*.sql",), (), None),  # * never crosses a /
        ("certs/dev.pem", ("*.pem",), ("certs/dev.pem",), None),  # allow wins on the same path
        ("certs/prod.pem", ("*.pem",), ("certs/dev.pem",), "*.pem"),
        ("x.txt", ("*",), ("x.txt",), None),
    ],
)
def test_glob_semantics(rel: str, deny: tuple[str, ...], allow: tuple[str, ...], expected: str | None) -> None:
    assert denied_by(rel, deny, allow) == expected


@pytest.mark.parametrize("bad", ["", "/", "a//b", "../x", "a/./b"])
def test_bad_globs_are_config_errors(bad: str) -> None:
    with pytest.raises(ConfigError, match="path glob"):
        denied_by("x", (bad,), ())


def test_a_single_string_is_not_taken_for_a_list_of_globs() -> None:
    with pytest.raises(TypeError):
        denied_by("x", ".env", ())  # a str is a Sequence[str] to mypy, so only runtime can catch it


def test_protected_paths_are_exported() -> None:
    assert {".git/hooks", ".git/config", ".git/commondir", ".sandman", "**/.git/config"} <= set(DEFAULT_PROTECTED)


@pytest.mark.parametrize(
    "rel",
    [
        ".ENV",
        "KEY.PEM",
        "Secret.txt",
        "SERVER.PEM",
        ".Env.Production",
        "ID_RSA",
        ".envrc",
        "id_ecdsa",
        "id_ed25519",
        ".aws/credentials",
        "a/.aws/credentials",
        ".git-credentials",
        ".npmrc",
        ".netrc",
        ".pypirc",
        "cert.p12",
        "cert.PFX",
        "prod.tfstate",
        "prod.tfstate.backup",
        ".docker/config.json",
        ".kube/config",
    ],
)
def test_denied_whatever_the_case_and_the_widened_list(rel: str) -> None:
    assert denied_by(rel) is not None


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("ok.txt", "ok.txt"),
        ("src/app.py", "src/app.py"),
        ("./src/../ok.txt", "ok.txt"),
        (".", ""),
        (".env.example", ".env.example"),
        ("new/dir/file.txt", "new/dir/file.txt"),  # does not exist yet: fine without must_exist
        ("environment.py", "environment.py"),
    ],
)
def test_allowed_relative_paths_resolve_inside(ws: Path, given: str, expected: str) -> None:
    assert validate_path(ws, given) == ws.resolve() / expected


def test_absolute_path_inside_is_allowed(ws: Path) -> None:
    assert validate_path(ws, ws / "src" / "app.py", must_exist=True) == ws / "src" / "app.py"
    assert validate_path(ws, str(ws)) == ws


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("../outside.txt", "escapes the workspace"),
        ("src/../../outside.txt", "escapes the workspace"),
        ("/etc/passwd", "escapes the workspace"),
        ("../ws-evil/x", "escapes the workspace"),  # the sibling-prefix trick
        ("a\x00b", "NUL byte"),
        ("", "empty"),
        (".env", "denied by rule '.env'"),
        ("sub/.env", "denied by rule '.env'"),
        ("config/credentials.json", "denied by rule '\\*\\*/credentials.json'"),
        ("my_secret.txt", "denied by rule '\\*\\*/\\*secret\\*'"),
        ("server.pem", "denied by rule '\\*\\*/\\*.pem'"),
        ("id_rsa", "denied by rule 'id_rsa'"),
        (".ssh/known_hosts", "denied by rule '.ssh'"),
        (".git/config", "denied by rule '.git/config'"),
    ],
)
def test_refused_paths(ws: Path, given: str, message: str) -> None:
    (ws.parent / "ws-evil").mkdir()
    (ws.parent / "ws-evil" / "x").write_text("evil\n")
    with pytest.raises(PathDenied, match=message) as info:
        validate_path(ws, given)
    assert info.value.exit_code == 5
    assert isinstance(info.value, UsageError)


def test_sibling_prefix_absolute_path_is_refused(ws: Path) -> None:
    evil = ws.parent / "ws-evil"
    evil.mkdir()
    (evil / "x").write_text("evil\n")
    assert str(evil).startswith(str(ws))  # the string-prefix check this guards against would pass
    with pytest.raises(PathDenied, match="escapes the workspace"):
        validate_path(ws, evil / "x")


@pytest.mark.parametrize(
    ("links", "given"),
    [
        ({"passwd": "/etc/passwd"}, "passwd"),
        ({"up": ".."}, "up/ws/../other.txt"),
        ({"etc": "/etc"}, "etc/passwd"),
        ({"etc": "/etc"}, "etc/does-not-exist"),
        ({"dangling": "/nonexistent/target"}, "dangling"),
        ({"a": "b", "b": "c", "c": "/etc/passwd"}, "a"),  # a chain ending outside
        ({"a": "src/b", "src/b": "../c", "c": "/etc"}, "a/hostname"),
        ({"sibling": "../ws-evil"}, "sibling"),
    ],
)
def test_symlinks_pointing_outside_are_refused(ws: Path, links: dict[str, str], given: str) -> None:
    (ws.parent / "ws-evil").mkdir()
    for name, target in links.items():
        (ws / name).symlink_to(target)
    with pytest.raises(PathDenied, match="is a symlink that points outside the workspace \\(-> /"):
        validate_path(ws, given)


@pytest.mark.parametrize(
    ("links", "given", "message"),
    [
        ({"ok.link": ".env"}, "ok.link", "resolves to '.env', which is denied by rule '.env'"),
        ({"innocent": ".git"}, "innocent/config", "resolves to '.git/config', which is denied"),
        ({"src/cfg": "../.ssh"}, "src/cfg/id", "resolves to '.ssh/id', which is denied by rule '.ssh'"),
        ({".env": "ok.txt"}, ".env", "is denied by rule '.env'"),
        ({"id_rsa": "ok.txt"}, "id_rsa", "is denied by rule 'id_rsa'"),
        ({"loop": "loop2", "loop2": "loop"}, "loop", "symlink loop"),
    ],
)
def test_symlinks_to_and_named_like_denied_paths_are_refused(
    ws: Path, links: dict[str, str], given: str, message: str
) -> None:
    (ws / ".env").unlink()
    (ws / ".ssh").mkdir()
    for name, target in links.items():
        (ws / name).symlink_to(target)
    with pytest.raises(PathDenied, match=message):
        validate_path(ws, given)


def test_symlink_inside_the_workspace_resolves(ws: Path) -> None:
    (ws / "app").symlink_to("src/app.py")
    assert validate_path(ws, "app", must_exist=True) == ws / "src" / "app.py"


def test_symlinked_workspace_accepts_both_spellings(ws: Path, tmp_path: Path) -> None:
    link = tmp_path / "ws-link"
    link.symlink_to(ws)
    assert validate_path(link, "ok.txt") == ws / "ok.txt"
    assert validate_path(link, ws / "ok.txt") == ws / "ok.txt"
    assert validate_path(ws, link / "ok.txt") == ws / "ok.txt"
    with pytest.raises(PathDenied, match="denied by rule '.env'"):
        validate_path(link, link / ".env")


def test_must_exist(ws: Path) -> None:
    assert validate_path(ws, "missing.txt") == ws / "missing.txt"
    with pytest.raises(UsageError, match="does not exist in the workspace") as info:
        validate_path(ws, "missing.txt", must_exist=True)
    assert not isinstance(info.value, PathDenied)


def test_custom_rules_replace_the_defaults(ws: Path) -> None:
    assert validate_path(ws, ".env", deny=()) == ws / ".env"
    with pytest.raises(PathDenied, match="denied by rule 'src'"):
        validate_path(ws, "src/app.py", deny=("src",))
    assert validate_path(ws, "src/app.py", deny=("src",), allow=("src",)) == ws / "src" / "app.py"


def _tree(root: Path) -> None:
    files = [
        ".env",
        ".env.example",
        "README.md",
        "src/app.py",
        "src/config/credentials.json",
        "src/config/settings.py",
        "deploy/certs/server.pem",
        "deploy/certs/server.crt",
        "secrets/a.txt",
        "secrets/nested/b.txt",
        ".ssh/id_rsa",
        ".git/config",
        ".git/HEAD",
        ".git/objects/ab/cdef",
        ".git/objects/secret-looking",
        "node_modules/pkg/.env",
        "lib/.env.local",
    ]
    for rel in files:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x\n")
    (root / "node_modules" / "my_password_dir").mkdir()
    (root / "link-to-env").symlink_to(".env")  # innocent name, denied target: validate_path's job
    (root / "id_ed25519").symlink_to("/etc/passwd")  # denied name: masked whatever it points at
    (root / "outside").symlink_to("/etc")  # never followed
    (root / "lib" / "api.key").mkdir()  # a directory named like a denied file


def test_find_denied_on_a_real_tree(tmp_path: Path) -> None:
    root = tmp_path / "ws"
    root.mkdir()
    _tree(root)
    scan = find_denied(root)
    found = {(d.path.relative_to(scan.root).as_posix(), d.is_dir) for d in scan.paths}
    assert found == {
        (".env", False),
        ("src/config/credentials.json", False),
        ("deploy/certs/server.pem", False),
        ("secrets", True),  # masked as a whole; not descended into
        (".ssh", True),
        (".git/config", False),
        ("lib/.env.local", False),
        ("lib/api.key", True),
        ("id_ed25519", False),  # a symlink: is_dir False, never followed
        ("node_modules/my_password_dir", True),  # node_modules is walked too: secrets hide anywhere
        ("node_modules/pkg/.env", False),
    }
    assert [d.is_link for d in scan.paths if d.path.name == "id_ed25519"] == [True]
    # .git/objects is not walked into (object files have hex names).
    assert not any("objects/" in str(d.path) for d in scan.paths)
    assert not scan.truncated
    assert scan.unreadable == ()
    assert all(isinstance(d, Denied) for d in scan.paths)
    assert scan.root == root.resolve()


def test_find_denied_says_when_the_limit_cut_it_short(tmp_path: Path) -> None:
    root = tmp_path / "ws"
    (root / "deep" / "deeper").mkdir(parents=True)
    for i in range(50):
        (root / "deep" / "deeper" / f"f{i}.txt").write_text("x")
    (root / "deep" / "deeper" / "z.pem").write_text("x")
    (root / ".env").write_text("x")
    scan = find_denied(root, limit=10)
    assert scan.truncated  # callers fail closed on this
    full = find_denied(root, limit=1000)
    assert not full.truncated and full.scanned == 54
    assert {d.path.name for d in full.paths} == {".env", "z.pem"}


def test_a_rescan_sees_changes_and_keeps_listings_of_unchanged_dirs(tmp_path: Path) -> None:
    from sandman.policy.paths import WorkspaceScanner

    root = tmp_path / "ws"
    (root / "a" / "b").mkdir(parents=True)
    old = time.time() - 60
    for d in (root / "a" / "b", root / "a", root):
        os.utime(d, (old, old))
    scanner = WorkspaceScanner(root)
    assert scanner.scan().paths == ()
    (root / "a" / "b" / "credentials.json").write_text("x")  # changes b's mtime: b is listed again
    assert [d.path.name for d in scanner.scan().paths] == ["credentials.json"]
    (root / "a").rename(root / "moved")
    assert [d.path.relative_to(root.resolve()).as_posix() for d in scanner.scan().paths] == ["moved/b/credentials.json"]


def test_find_denied_through_a_symlinked_workspace(tmp_path: Path) -> None:
    root = tmp_path / "ws"
    root.mkdir()
    (root / ".env").write_text("x")
    link = tmp_path / "link"
    link.symlink_to(root)
    scan = find_denied(link)
    assert scan.root == root.resolve()
    assert scan.paths == (Denied(root.resolve() / ".env", False),)  # nlink 1, not a link


def test_find_denied_on_20k_files_is_fast(tmp_path: Path) -> None:
    root = tmp_path / "ws"
    for d in range(200):
        sub = root / f"pkg{d}" / "mod"
        sub.mkdir(parents=True)
        for f in range(100):
            (sub / f"file{f}.py").write_text("")
    (root / "pkg7" / "mod" / ".env").write_text("x")
    start = time.perf_counter()
    scan = find_denied(root, limit=50_000)
    elapsed = time.perf_counter() - start
    assert scan.scanned == 200 * 2 + 200 * 100 + 1
    assert [d.path.name for d in scan.paths] == [".env"]
    # Generous for slow CI machines; measured about 0.1 s on a laptop-class host.
    assert elapsed < 5.0, f"find_denied took {elapsed:.2f}s on {scan.scanned} entries"
    if os.environ.get("SANDMAN_PRINT_TIMINGS"):
        print(f"find_denied: {scan.scanned} entries in {elapsed * 1000:.0f} ms")


def test_a_directory_with_more_subdirectories_than_descriptors_is_still_walked(tmp_path: Path) -> None:
    import resource

    from sandman.policy.paths import WorkspaceScanner

    root = tmp_path / "ws"
    (root / "config").mkdir(parents=True)
    (root / "config" / "credentials.json").write_text("x")
    for i in range(400):
        (root / f"zz{i:04d}").mkdir()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        scan = WorkspaceScanner(root).scan()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert not scan.failed and not scan.truncated
    assert [d.path.name for d in scan.paths] == ["credentials.json"]


def test_a_directory_swapped_during_the_walk_never_hides_a_secret(tmp_path: Path) -> None:
    import ctypes
    import threading

    from sandman.policy.paths import WorkspaceScanner

    root = tmp_path / "ws"
    (root / "config").mkdir(parents=True)
    (root / "config" / "credentials.json").write_text("x")
    (root / "decoy").mkdir()
    (root / "decoy" / "readme").write_text("x")
    libc = ctypes.CDLL(None, use_errno=True)
    stop = threading.Event()

    def flip() -> None:  # renameat2(RENAME_EXCHANGE) config <-> decoy, as fast as it goes
        a, b = os.fsencode(root / "config"), os.fsencode(root / "decoy")
        while not stop.is_set():
            libc.syscall(316, -100, a, -100, b, 2)

    t = threading.Thread(target=flip, daemon=True)
    t.start()
    complete = missed = 0
    try:
        for _ in range(400):
            scan = WorkspaceScanner(root).scan()  # fresh each time: no cache to lean on
            if scan.failed:
                continue  # fail closed: the caller refuses to start
            complete += 1
            missed += not any(d.path.name == "credentials.json" for d in scan.paths)
    finally:
        stop.set()
        t.join()
    assert missed == 0
    assert complete > 0  # positive control: most walks finish even under the flipper
