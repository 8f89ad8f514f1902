"""sandman.core.poison on temporary workspaces: the git config parser (checked against git itself), the
scanner (what it reports, what it never follows or opens), baselines, quarantine and the CLI.

Whether the attacks are real, and whether quarantine defuses them for the host user's git, is
tests/security/test_poison_host_git.py.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from sandman.cli import app
from sandman.core import poison
from sandman.core.poison import Baseline, Finding, parse_git_config, quarantine, scan_workspace, take_baseline
from sandman.core.poison.model import _parts_of
from sandman.core.poison.quarantining import _copy_then_unlink

GIT_ENV = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_TERMINAL_PROMPT": "0"}


def git(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["git", "-c", "init.defaultBranch=main", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=cwd,
        env=GIT_ENV,
        capture_output=True,
        check=True,
    )


def repo(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    git("init", "-q", str(path))
    (path / "README").write_text("hello\n")
    git("add", "README", cwd=path)
    git("commit", "-qm", "init", cwd=path)
    return path


def keys(findings: list[Finding]) -> set[tuple[str, str]]:
    return {(f.path, f.key) for f in findings}


def by(findings: list[Finding], path: str, key: str) -> Finding:
    for f in findings:
        if (f.path, f.key) == (path, key):
            return f
    raise AssertionError(f"no finding {path}: {key} in {[f.line() for f in findings]}")


# -- the parser -----------------------------------------------------------------------------------


def _entries(data: bytes) -> list[tuple[str, str | None]]:
    return [(e.name, e.value) for e in parse_git_config(data).entries]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (b"[core]\n\tfsmonitor = /x\n", [("core.fsmonitor", "/x")]),
        (b"[CoRe]\nFSMonitor=/x\n", [("core.fsmonitor", "/x")]),  # section and key: any case
        (b'[diff "Foo"]\n textconv = cat\n', [("diff.Foo.textconv", "cat")]),  # subsection as written
        (b"[diff.Foo]\n textconv = cat\n", [("diff.foo.textconv", "cat")]),  # old style: lowercased
        (b"[core]\n fsmonitor\n", [("core.fsmonitor", None)]),  # bare key: true
        (b"[core]\n editor = vi \\\n -x\n", [("core.editor", "vi  -x")]),  # continuation line
        (b'[core]\n editor = "a # b" ; c\n', [("core.editor", "a # b")]),  # quotes, comment
        (b'[core]\n editor = a\\tb\\"c\\\\d\n', [("core.editor", 'a\tb"c\\d')]),  # escapes
        (b"[core]fsmonitor=x\n", [("core.fsmonitor", "x")]),  # a key on the header's line
        (b"\xef\xbb\xbf[core]\r\n fsmonitor = x\r\n", [("core.fsmonitor", "x")]),  # BOM, CRLF
        (b'[a "s\\"q"]\n k = v\n', [('a.s"q.k', "v")]),
        (b"[core]\n fsmonitor = x\n!!bad\n[core]\n pager = y\n", [("core.fsmonitor", "x"), ("core.pager", "y")]),
    ],
)
def test_parser_reads_git_syntax(text: bytes, expected: list[tuple[str, str | None]]) -> None:
    assert _entries(text) == expected


def test_parser_records_lines_git_refuses_and_reads_on() -> None:
    parsed = parse_git_config(b"[core]\n fsmonitor = a\\q\n!!\n pager = less\n")
    assert parsed.errors == [2, 3]
    assert [e.name for e in parsed.entries] == ["core.fsmonitor", "core.pager"]


def _git_list(path: Path, data: bytes) -> tuple[int, list[tuple[str, str | None]]]:
    path.write_bytes(data)
    p = subprocess.run(["git", "config", "-f", str(path), "--list", "-z"], capture_output=True, env=GIT_ENV)
    out: list[tuple[str, str | None]] = []
    for rec in p.stdout.split(b"\0")[:-1]:
        if b"\n" in rec:
            name, value = rec.split(b"\n", 1)
            out.append((name.decode("utf-8", "replace"), value.decode("utf-8", "replace")))
        else:
            out.append((rec.decode("utf-8", "replace"), None))
    return p.returncode, out


_TOKENS = [
    b"[", b"]", b"core", b"Core", b" ", b"\t", b"\n", b"\r\n", b"\r", b"=", b'"', b"\\", b"\\n", b"\\t",
    b"\\\n", b"#", b";", b"fsmonitor", b"a", b"-", b".", b"x y", b"\xc3\xa9", b"\xff", b"\x00", b"1",
    b"sub", b"[core]", b'[diff "x"]', b'\\"', b"\v", b"\f",
]  # fmt: skip


@pytest.mark.parametrize("seed", [1, 2])
def test_parser_agrees_with_git_on_random_input(tmp_path: Path, seed: int) -> None:
    """A differential test against this host's git: same entries where git accepts the file; where
    git refuses it, what git read before the error is a prefix of ours and we record an error."""
    rng = random.Random(seed)
    for _ in range(250):
        data = b"".join(rng.choice(_TOKENS) for _ in range(rng.randint(1, 40)))
        rc, theirs = _git_list(tmp_path / "c", data)
        parsed = parse_git_config(data)
        ours = [(e.name, e.value) for e in parsed.entries]
        if rc == 0:
            assert (ours, parsed.errors) == (theirs, []), data
        else:
            assert ours[: len(theirs)] == theirs and parsed.errors, data


# -- the scanner ----------------------------------------------------------------------------------


def test_a_clean_repository_has_no_findings(tmp_path: Path) -> None:
    ws = repo(tmp_path / "ws")
    (ws / "src").mkdir()
    (ws / "src" / "HEAD").write_text("not a repository\n")
    assert scan_workspace(ws) == []


def test_config_keys_that_run_commands(tmp_path: Path) -> None:
    ws = repo(tmp_path / "ws")
    with (ws / ".git" / "config").open("a") as fh:
        fh.write(
            "[core]\n\tfsmonitor = ./fsm.sh\n\tpager = less-evil\n\thooksPath = .githooks\n"
            '[alias]\n\tst = !sh -c evil\n\tco = checkout\n[filter "x"]\n\tclean = evil\n'
            '[diff "y"]\n\ttextconv = evil\n[credential]\n\thelper = evil\n[pager]\n\tlog = false\n'
            '[remote "o"]\n\turl = ext::sh -c evil\n\tuploadpack = evil\n[core]\n\tfsmonitor = true\n'
        )
    found = scan_workspace(ws)
    assert keys(found) == {
        (".git/config", k)
        for k in (
            "core.fsmonitor",
            "core.pager",
            "core.hookspath",
            "alias.st",
            "filter.x.clean",
            "diff.y.textconv",
            "credential.helper",
            "remote.o.url",
            "remote.o.uploadpack",
        )
    }
    assert by(found, ".git/config", "core.fsmonitor").value == "./fsm.sh"
    assert by(found, ".git/config", "alias.st").kind == "exec"
    assert by(found, ".git/config", "core.hookspath").kind == "redirect"


def test_gitdir_file_and_its_target(tmp_path: Path) -> None:
    ws = repo(tmp_path / "ws")
    os.rename(ws / ".git", ws / ".g")
    (ws / ".git").write_text("gitdir: .g\n")
    git("config", "-f", str(ws / ".g" / "config"), "core.fsmonitor", "/tmp/x")
    found = scan_workspace(ws)
    assert by(found, ".git", "gitdir").value == ".g"
    assert by(found, ".g/config", "core.fsmonitor").kind == "exec"
    assert by(found, ".g", "gitdir").kind == "lookalike"


def test_a_pointer_target_that_is_no_repository_is_still_read(tmp_path: Path) -> None:
    """git needs HEAD there, but the scan reads what a pointer names whatever it looks like."""
    ws = tmp_path / "ws"
    (ws / "x").mkdir(parents=True)
    (ws / ".git").write_text("gitdir: x\n")
    (ws / "x" / "config").write_text("[core]\n\tsshCommand = evil\n")
    assert (("x/config", "core.sshcommand")) in keys(scan_workspace(ws))


def test_pointers_outside_the_workspace_are_reported_not_read(tmp_path: Path) -> None:
    ws = repo(tmp_path / "ws")
    (ws / ".git" / "commondir").write_text("/etc\n")
    with (ws / ".git" / "config").open("a") as fh:
        fh.write("[include]\n\tpath = ~/.evil\n[core]\n\tworktree = /home\n")
    found = scan_workspace(ws)
    assert "outside the workspace" in by(found, ".git/commondir", "commondir").detail
    assert by(found, ".git/config", "include.path").kind == "include"
    assert by(found, ".git/config", "core.worktree").kind == "redirect"


def test_a_worktree_inside_but_through_a_symlink_is_reported(tmp_path: Path) -> None:
    ws = repo(tmp_path / "ws")
    (ws / "link").symlink_to(tmp_path, target_is_directory=True)
    (ws / "real").mkdir()
    git("config", "core.worktree", "../link", cwd=ws)
    assert by(scan_workspace(ws), ".git/config", "core.worktree").value == "../link"
    git("config", "core.worktree", "../real", cwd=ws)
    assert scan_workspace(ws) == []


def test_includes_inside_the_workspace_are_followed(tmp_path: Path) -> None:
    ws = repo(tmp_path / "ws")
    (ws / "cfg").mkdir()
    (ws / "cfg" / "a").write_text('[includeIf "gitdir:/"]\n\tpath = b\n')
    (ws / "cfg" / "b").write_text("[core]\n\tfsmonitor = evil\n")
    with (ws / ".git" / "config").open("a") as fh:
        fh.write("[include]\n\tpath = ../cfg/a\n")
    found = keys(scan_workspace(ws))
    assert {(".git/config", "include.path"), ("cfg/a", "includeif.gitdir:/.path"), ("cfg/b", "core.fsmonitor")} <= found


def test_symlinks_are_reported_never_followed(tmp_path: Path) -> None:
    ws = repo(tmp_path / "ws")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config").write_text("[core]\n\tfsmonitor = evil\n")
    (outside / "hook").write_text("#!/bin/sh\n")
    (ws / ".git" / "config").unlink()
    (ws / ".git" / "config").symlink_to(outside / "config")
    (ws / ".git" / "hooks" / "pre-push").symlink_to(outside / "hook")
    sub = ws / "linked"
    sub.symlink_to(outside, target_is_directory=True)
    found = scan_workspace(ws)
    assert by(found, ".git/config", "config").kind == "redirect"
    assert by(found, ".git/hooks/pre-push", "hook:pre-push").value.startswith("-> ")
    assert not any(f.key == "core.fsmonitor" for f in found)  # the target was never read
    assert not any(f.path.startswith("linked") for f in found)


def test_dot_git_symlink(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    repo(tmp_path / "elsewhere")
    (ws / ".git").symlink_to(tmp_path / "elsewhere" / ".git")
    assert by(scan_workspace(ws), ".git", "gitdir").value.startswith("-> ")


def test_a_fifo_is_never_opened(tmp_path: Path) -> None:
    ws = repo(tmp_path / "ws")
    (ws / ".git" / "config").unlink()
    os.mkfifo(ws / ".git" / "config")
    os.mkfifo(ws / ".git" / "hooks" / "pre-commit")
    result: list[list[Finding]] = []
    t = threading.Thread(target=lambda: result.append(scan_workspace(ws)), daemon=True)
    t.start()
    t.join(10)
    assert result, "the scan blocked on a FIFO"
    assert by(result[0], ".git/config", "config").kind == "special"
    assert by(result[0], ".git/hooks/pre-commit", "hook:pre-commit").kind == "special"


def test_hooks_samples_are_skipped_others_reported(tmp_path: Path) -> None:
    ws = repo(tmp_path / "ws")
    hooks = ws / ".git" / "hooks"
    (hooks / "pre-commit").write_text("#!/bin/sh\ntrue\n")
    (hooks / "post-checkout").write_text("#!/bin/sh\ntrue\n")
    (hooks / "post-checkout").chmod(0o755)
    (hooks / "pre-commit.sample").write_text("changed\n")
    found = scan_workspace(ws)
    assert keys(found) == {
        (".git/hooks/pre-commit", "hook:pre-commit"),
        (".git/hooks/post-checkout", "hook:post-checkout"),
    }
    assert by(found, ".git/hooks/pre-commit", "hook:pre-commit").value.startswith("not executable")
    assert by(found, ".git/hooks/post-checkout", "hook:post-checkout").value.startswith("executable")


def test_hookspath_inside_the_workspace_is_listed(tmp_path: Path) -> None:
    ws = repo(tmp_path / "ws")
    git("config", "core.hooksPath", ".githooks", cwd=ws)
    (ws / ".githooks").mkdir()
    (ws / ".githooks" / "pre-commit").write_text("#!/bin/sh\n")
    assert (".githooks/pre-commit", "hook:pre-commit") in keys(scan_workspace(ws))


def test_nested_repositories_modules_and_worktrees(tmp_path: Path) -> None:
    ws = repo(tmp_path / "ws")
    repo(ws / "vendor" / "lib")
    git("config", "-f", str(ws / "vendor/lib/.git/config"), "core.fsmonitor", "evil")
    mod = ws / ".git" / "modules" / "sub"
    mod.mkdir(parents=True)
    (ws / "sub").mkdir()
    for d in ("objects", "refs", "hooks"):
        (mod / d).mkdir()
    (mod / "HEAD").write_text("ref: refs/heads/main\n")
    (mod / "config").write_text("[core]\n\tworktree = ../../../sub\n\tfsmonitor = evil\n")
    (mod / "hooks" / "post-checkout").write_text("#!/bin/sh\n")
    git("worktree", "add", "-q", str(ws / "wt"), cwd=ws)
    found = scan_workspace(ws)
    k = keys(found)
    assert ("vendor/lib/.git", "gitdir") in k and by(found, "vendor/lib/.git", "gitdir").kind == "nested-repo"
    assert ("vendor/lib/.git/config", "core.fsmonitor") in k
    assert (".git/modules/sub/config", "core.fsmonitor") in k
    assert (".git/modules/sub/config", "core.worktree") not in k  # inside the workspace: the usual layout
    assert (".git/modules/sub/hooks/post-checkout", "hook:post-checkout") in k
    assert ("wt/.git", "gitdir") in k and (".git/worktrees/wt/gitdir", "gitdir") in k
    assert not any(f.kind == "lookalike" for f in found)  # modules/ and worktrees/ are where git keeps them


def test_node_modules_names_are_walked_but_not_parsed(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "node_modules" / "pkg" / ".git").mkdir(parents=True)
    (ws / "node_modules" / "pkg" / ".envrc").write_text("evil\n")
    (ws / "node_modules" / "pkg" / ".git" / "config").write_text("[core]\n\tfsmonitor = evil\n")
    (ws / ".envrc").write_text("use nix\n")
    (ws / ".vscode").mkdir()
    (ws / ".vscode" / "tasks.json").write_text('{"tasks": [{"runOptions": {"runOn": "folderOpen"}}]}')
    (ws / ".vscode" / "settings.json").write_text('{"python.defaultInterpreterPath": "./evil", "editor.tabSize": 2}')
    (ws / ".devcontainer").mkdir()
    (ws / ".devcontainer" / "devcontainer.json").write_text('{"initializeCommand": "evil"}')
    k = keys(scan_workspace(ws))
    assert ("node_modules/pkg/.git/config", "core.fsmonitor") in k
    assert not any(p == "node_modules/pkg/.envrc" for p, _ in k)
    assert {
        (".envrc", "direnv"),
        (".vscode/tasks.json", "vscode:folderOpen"),
        (".vscode/settings.json", "vscode:settings"),
        (".devcontainer/devcontainer.json", "devcontainer:initializeCommand"),
    } <= k


def test_lines_git_refuses_and_hidden_key_names_are_reported(tmp_path: Path) -> None:
    ws = repo(tmp_path / "ws")
    with (ws / ".git" / "config").open("a") as fh:
        fh.write("# core.fsmonitor was here\n!!garbage\n")
    k = keys(scan_workspace(ws))
    assert (".git/config", "syntax") in k and (".git/config", "text:fsmonitor") in k


def test_hostile_names_are_printable_and_reversible(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    name = os.fsdecode(b"\x1b]52;c;x\x07\xff\\")
    git_dir = ws / name / ".git"
    git_dir.mkdir(parents=True)
    (git_dir / "config").write_text("[core]\n\tpager = evil\x1b[2J\n")
    found = scan_workspace(ws)
    f = by(found, "\\x1b]52;c;x\\x07\\xff\\\\/.git/config", "core.pager")
    assert "\x1b" not in f.line() and "\x07" not in f.line()
    report = quarantine(ws, found, tmp_path / "q")
    assert [x.method for x in report.files if x.path.endswith("config")] == ["rename"]
    assert not (git_dir / "config").exists()


def test_limits_are_reported_and_never_suppressed(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    for i in range(50):
        (ws / f"d{i}").mkdir(parents=True)
    base = take_baseline(ws, limit=20)
    assert base.truncated
    found = scan_workspace(ws, base, limit=20)
    assert [f.kind for f in found] == ["truncated"]


def test_a_deep_tree_is_skipped_not_the_rest(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / Path(*["d"] * (poison.MAX_DEPTH + 5))).mkdir(parents=True)
    (ws / "z" / ".git").mkdir(parents=True)
    (ws / "z" / ".git" / "config").write_text("[core]\n\tpager = evil\n")
    found = scan_workspace(ws)
    assert ("z/.git/config", "core.pager") in keys(found)
    assert "deeper than" in by(found, ".", "scan").detail


def test_failures_are_findings_not_exceptions(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    assert [f.kind for f in scan_workspace(missing)] == ["error"]
    base = take_baseline(missing)
    assert base.error
    Baseline.model_validate_json(base.model_dump_json())


# -- baselines ------------------------------------------------------------------------------------


def test_a_baseline_reports_only_new_and_changed(tmp_path: Path) -> None:
    ws = repo(tmp_path / "ws")
    hooks = ws / ".git" / "hooks"
    (hooks / "post-commit").write_text("#!/bin/sh\necho mine\n")
    (hooks / "pre-push").write_text("#!/bin/sh\necho mine\n")
    git("config", "alias.lg", "!git log --oneline", cwd=ws)
    base = Baseline.model_validate_json(take_baseline(ws).model_dump_json())  # survives JSON
    assert scan_workspace(ws, base) == []
    (hooks / "pre-commit").write_text("#!/bin/sh\nevil\n")
    (hooks / "pre-push").write_text("#!/bin/sh\nevil\n")
    git("config", "core.fsmonitor", "evil", cwd=ws)
    found = scan_workspace(ws, base)
    assert {(f.path, f.key, f.status) for f in found} == {
        (".git/hooks/pre-commit", "hook:pre-commit", "new"),
        (".git/hooks/pre-push", "hook:pre-push", "changed"),
        (".git/config", "core.fsmonitor", "changed"),
    }


def test_a_git_dir_renamed_away_is_missing(tmp_path: Path) -> None:
    ws = repo(tmp_path / "ws")
    base = take_baseline(ws)
    os.rename(ws / ".git", ws / ".git2")
    found = scan_workspace(ws, base)
    assert by(found, ".git", "gitdir").kind == "missing"
    assert by(found, ".git2", "gitdir").kind == "lookalike"


# -- quarantine -----------------------------------------------------------------------------------


def test_quarantine_moves_flagged_files_and_writes_a_manifest(tmp_path: Path) -> None:
    ws = repo(tmp_path / "ws")
    git("config", "core.fsmonitor", "evil", cwd=ws)
    (ws / ".git" / "hooks" / "pre-commit").write_text("#!/bin/sh\nevil\n")
    repo(ws / "sub")
    found = scan_workspace(ws)
    assert by(found, "sub/.git", "gitdir").kind == "nested-repo"
    config_bytes = (ws / ".git" / "config").read_bytes()
    report = quarantine(ws, found, tmp_path / "q")
    assert not (ws / ".git" / "config").exists() and not (ws / ".git" / "hooks" / "pre-commit").exists()
    assert (tmp_path / "q" / "files" / ".git" / "config").read_bytes() == config_bytes  # whole
    assert (ws / "sub" / ".git").is_dir()  # directories are never moved
    manifest = json.loads(Path(report.manifest or "").read_text())
    rows = {r["path"]: r for r in manifest["files"]}
    assert rows[".git/config"]["method"] == "rename" and rows[".git/config"]["keys"] == ["core.fsmonitor"]
    assert "whole" in manifest["note"]
    assert "sub/.git" not in rows  # a nested repository is a directory: its flagged files move, it stays
    assert keys(scan_workspace(ws)) == {("sub/.git", "gitdir")}


def test_quarantine_never_goes_through_a_symlink(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    victim = tmp_path / "victim"
    (victim / ".git").mkdir(parents=True)
    (victim / ".git" / "config").write_text("[user]\n\tname = me\n")
    (ws / "link").symlink_to(victim, target_is_directory=True)
    forged = Finding(path="link/.git/config", key="core.fsmonitor", kind="exec", detail="forged")
    report = quarantine(ws, [forged], tmp_path / "q")
    assert report.files[0].method == "failed"
    assert (victim / ".git" / "config").exists()
    with pytest.raises(ValueError):
        _parts_of("../etc/passwd")


def test_copy_then_unlink_when_rename_cannot(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "f").write_bytes(b"data")
    src, dst = os.open(tmp_path / "a", os.O_RDONLY), os.open(tmp_path / "b", os.O_RDONLY)
    try:
        _copy_then_unlink(src, "f", dst, "f", os.stat("f", dir_fd=src, follow_symlinks=False))
    finally:
        os.close(src)
        os.close(dst)
    assert not (tmp_path / "a" / "f").exists() and (tmp_path / "b" / "f").read_bytes() == b"data"


# -- the CLI --------------------------------------------------------------------------------------


def test_cli_inspect(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDMAN_STATE_DIR", str(tmp_path / "state"))
    ws = repo(tmp_path / "ws")
    runner = CliRunner()
    clean = runner.invoke(app, ["inspect", "-w", str(ws)])
    assert clean.exit_code == 0 and clean.stdout == ""
    git("config", "alias.st", "!touch /tmp/evil", cwd=ws)
    text = runner.invoke(app, ["inspect", "-w", str(ws)])
    assert text.exit_code == 65
    assert text.stdout.startswith(".git/config: alias.st = !touch /tmp/evil (")
    out = runner.invoke(app, ["inspect", "-w", str(ws), "--json", "--quarantine"])
    assert out.exit_code == 65
    rows = json.loads(out.stdout)
    assert [(r["path"], r["key"], r["kind"]) for r in rows] == [(".git/config", "alias.st", "exec")]
    assert rows[0]["quarantined"].startswith(str(tmp_path / "state" / "quarantine" / "inspect-"))
    assert runner.invoke(app, ["inspect", "-w", str(ws)]).exit_code == 0
    assert runner.invoke(app, ["inspect", "-w", str(tmp_path / "nope")]).exit_code == 3
