"""The command allowlist: git's destructive calls refused however they are spelled, others pass."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sandman.policy.commands import (
    DEFAULT_COMMANDS,
    DEFAULT_RULES,
    CommandsPolicy,
    ProgramRule,
    Verdict,
    check_command,
    explain,
)

GIT = CommandsPolicy(rules=DEFAULT_RULES)


@pytest.mark.parametrize(
    ("cmd", "rule"),
    [
        ("git push --force", "commands.rules.git.blocked: 'push --force'"),
        ("git push origin main --force", "commands.rules.git.blocked: 'push --force'"),
        ("git push -f", "commands.rules.git.blocked: 'push -f'"),
        ("git -C x push --force", "commands.rules.git.blocked: 'push --force'"),
        ("git -c a=b push -f origin main", "commands.rules.git.blocked: 'push -f'"),
        ("git push origin +main", "commands.rules.git.blocked: 'push +*'"),
        ("git push origin +HEAD:refs/heads/main", "commands.rules.git.blocked: 'push +*'"),
        ("git push origin -- +main", "commands.rules.git.blocked: 'push +*'"),  # still a refspec after --
        (
            "git --git-dir=.git push --force-with-lease=main",
            "commands.rules.git.blocked: 'push --force-with-lease'",
        ),
        (
            "git --git-dir .git --work-tree . push --force-with-lease",
            "commands.rules.git.blocked: 'push --force-with-lease'",
        ),
        (
            "git --no-pager -p --bare --namespace=x --exec-path=/x push --mirror",
            "commands.rules.git.blocked: 'push --mirror'",
        ),
        ("git push --forc", "commands.rules.git.blocked: 'push --force'"),  # git accepts unique prefixes
        ("git push --force-w", "commands.rules.git.blocked: 'push --force-with-lease'"),
        ("git push --force=yes", "commands.rules.git.blocked: 'push --force'"),
        ("git push -vf", "commands.rules.git.blocked: 'push -f'"),
        ("git push origin --delete topic", "commands.rules.git.blocked: 'push --delete'"),
        ("git push -d origin topic", "commands.rules.git.blocked: 'push -d'"),
        ("git push origin :topic", "commands.rules.git.blocked: 'push :?*'"),
        ("git push --prune origin", "commands.rules.git.blocked: 'push --prune'"),
        ("git reset --hard", "commands.rules.git.blocked: 'reset --hard'"),
        ("git reset HEAD~3 --hard", "commands.rules.git.blocked: 'reset --hard'"),
        ("git clean -f", "commands.rules.git.blocked: 'clean -f'"),
        ("git clean -fd", "commands.rules.git.blocked: 'clean -f'"),
        ("git clean -df", "commands.rules.git.blocked: 'clean -f'"),
        ("git clean -xdf", "commands.rules.git.blocked: 'clean -f'"),
        ("git clean -xfd", "commands.rules.git.blocked: 'clean -f'"),
        ("git clean --force", "commands.rules.git.blocked: 'clean --force'"),
        ("git checkout -f main", "commands.rules.git.blocked: 'checkout -f'"),
        ("git switch --discard-changes main", "commands.rules.git.blocked: 'switch --discard-changes'"),
        ("git branch -D topic", "commands.rules.git.blocked: 'branch -D'"),
        ("git branch -df topic", "commands.rules.git.blocked: 'branch -d -f'"),
        ("git branch --delete --force topic", "commands.rules.git.blocked: 'branch --delete --force'"),
        ("git filter-branch --tree-filter x", "commands.rules.git.blocked_subcommands: 'filter-branch'"),
        ("/usr/bin/git push --force", "commands.rules.git.blocked: 'push --force'"),
        (
            "/usr/lib/git-core/git-push --force",
            "commands.rules.git.blocked: 'push --force'",
        ),  # git-push is git push
        # git itself refuses `git -- push` ("unknown option: --"); so do we, rather than guess.
        ("git -- push --force", "commands.rules.git"),
        ("git -- status", "commands.rules.git"),
        ("git --frobnicate status", "commands.rules.git"),
        # Settings on the command line that turn an allowed command into a blocked one.
        ("git -c alias.p=push p --force", "commands.rules.git"),
        ("git -c Alias.st=status st", "commands.rules.git"),
        ("git --config-env=alias.x=VAR x", "commands.rules.git"),
        ("git -c remote.origin.push=+refs/heads/*:refs/heads/* push", "commands.rules.git"),
        ("git -c clean.requireForce=false clean", "commands.rules.git"),
    ],
)
def test_git_refusals_name_the_rule(cmd: str, rule: str) -> None:
    verdict = check_command(cmd.split(), GIT)
    assert not verdict.allowed, verdict
    assert verdict.rule == rule
    assert verdict.reason


@pytest.mark.parametrize(
    "cmd",
    [
        "git push",
        "git push origin main",
        "git push origin :",  # "matching" refs, not a deletion
        "git push --force-if-includes",  # only a guard for --force-with-lease
        "git push --no-force origin main",
        "git push origin main:main",
        "git -C sub push origin topic",
        "git reset --soft HEAD~1",
        "git reset --mixed",
        "git clean -n",
        "git clean -nd",
        "git clean --dry-run -x",
        "git checkout main",
        "git checkout -b topic",
        "git branch -d topic",
        "git status",
        "git -c user.name=x commit -m msg",
        "git commit -m -f",  # no entry names commit, so its options do not matter
        "git log -- --force",  # after -- it is a path
        "git --version",
        "git",
        "/usr/bin/git status",
        "git-status",
        "gitk --all",  # a different program
    ],
)
def test_git_allowed(cmd: str) -> None:
    verdict = check_command(cmd.split(), GIT)
    assert verdict.allowed, verdict


@pytest.mark.parametrize(
    ("policy", "argv", "allowed", "rule"),
    [
        (CommandsPolicy(allow=["git", "make"]), ["rm", "-rf", "x"], False, "commands.allow"),
        (CommandsPolicy(allow=["git", "make"]), ["/bin/rm", "-rf", "x"], False, "commands.allow"),
        (CommandsPolicy(allow=["git", "make"]), ["make", "test"], True, "commands.allow"),
        (CommandsPolicy(allow=["git"]), ["git-push"], False, "commands.allow"),  # its own name counts
        (CommandsPolicy(), ["rm", "-rf", "x"], True, "commands.allow"),
        (CommandsPolicy(allow=[]), ["true"], False, "commands.allow"),
        (CommandsPolicy(), [], False, "commands"),
        (CommandsPolicy(), [""], False, "commands"),
        (CommandsPolicy(), ["/usr/bin/"], False, "commands"),
        (
            CommandsPolicy(allow=["git"], rules=DEFAULT_RULES),
            ["git", "push", "-f"],
            False,
            "commands.rules.git.blocked: 'push -f'",
        ),
    ],
)
def test_allowlist(policy: CommandsPolicy, argv: list[str], allowed: bool, rule: str) -> None:
    verdict = check_command(argv, policy)
    assert (verdict.allowed, verdict.rule) == (allowed, rule), verdict


def test_allowlist_refusal_text() -> None:
    verdict = check_command(["rm", "-rf", "x"], CommandsPolicy(allow=["git"]))
    assert f"{verdict.rule}: {verdict.reason}".startswith("commands.allow: 'rm' is not in the allowlist")


LIMITED = CommandsPolicy(
    rules={
        "git": ProgramRule(allowed_subcommands=["status", "diff", "log", "push"], blocked=["push --force"]),
        "npm": ProgramRule(allowed_subcommands=["test", "ci"], blocked_subcommands=["publish"]),
        "rm": ProgramRule(blocked=["-r /", "--recursive /"]),
        "docker": ProgramRule(blocked_subcommands=["rm"]),
    }
)


@pytest.mark.parametrize(
    ("cmd", "allowed", "rule"),
    [
        ("git status", True, "commands.rules.git"),
        ("git -C sub diff --stat", True, "commands.rules.git"),
        ("git commit -m x", False, "commands.rules.git.allowed_subcommands"),
        ("git --version", False, "commands.rules.git.allowed_subcommands"),
        ("git", False, "commands.rules.git.allowed_subcommands"),
        ("git push --force", False, "commands.rules.git.blocked: 'push --force'"),
        ("npm test", True, "commands.rules.npm"),
        ("npm ci --silent", True, "commands.rules.npm"),
        ("npm install", False, "commands.rules.npm.allowed_subcommands"),
        ("npm publish", False, "commands.rules.npm.blocked_subcommands: 'publish'"),
        # Options before a generic program's subcommand cannot be parsed: refused with the fix.
        ("npm --silent publish", False, "commands.rules.npm"),
        ("docker --context x rm c", False, "commands.rules.docker"),
        ("docker ps -a", True, "commands.rules.docker"),
        ("rm -rf /", False, "commands.rules.rm.blocked: '-r /'"),
        ("rm / -fr", False, "commands.rules.rm.blocked: '-r /'"),
        ("rm --recursive --force /", False, "commands.rules.rm.blocked: '--recursive /'"),
        ("rm -rf build", True, "commands.rules.rm"),
        ("rm file", True, "commands.rules.rm"),
        ("make test", True, "commands.allow"),  # no rule for make
    ],
)
def test_subcommand_rules(cmd: str, allowed: bool, rule: str) -> None:
    verdict = check_command(cmd.split(), LIMITED)
    assert (verdict.allowed, verdict.rule) == (allowed, rule), verdict


def test_refusal_reasons_say_what_matched() -> None:
    verdict = check_command(["git", "-C", "x", "push", "origin", "-vf"], GIT)
    assert verdict.reason == "'git push -vf' matches the blocked 'push -f'"
    assert "put the subcommand first" in check_command(["npm", "--silent", "publish"], LIMITED).reason
    assert "not one of status, diff, log, push" in check_command(["git", "commit"], LIMITED).reason
    assert "unknown" not in check_command(["git", "--", "push"], GIT).reason
    assert "'--'" in check_command(["git", "--", "push"], GIT).reason


def test_explain_is_one_line() -> None:
    text = explain(["git", "push", "--force"], GIT)
    assert text == (
        "refused: git push --force (commands.rules.git.blocked: 'push --force': "
        "'git push --force' matches the blocked 'push --force')"
    )
    assert explain(["git", "status"], GIT).startswith("allowed: git status (commands.rules.git: ")
    assert "\n" not in explain(["sh", "-c", "a\nb"], CommandsPolicy(allow=["git"]))
    assert str(Verdict(False, "commands.allow", "'rm' is not in the allowlist")) == (
        "refused by commands.allow: 'rm' is not in the allowlist"
    )


def test_default_commands_policy_has_the_git_rules() -> None:
    assert DEFAULT_COMMANDS.allow is None
    assert not check_command(["git", "push", "-f"], DEFAULT_COMMANDS).allowed
    assert CommandsPolicy().rules == DEFAULT_COMMANDS.rules  # an allowlist alone keeps the git rules
    assert CommandsPolicy(rules={}).rules == {}  # only an explicit empty table drops them


def test_argv_must_be_a_sequence_of_arguments() -> None:
    with pytest.raises(TypeError):
        check_command("git push --force", GIT)


@pytest.mark.parametrize(
    "data",
    [
        {"allow": ["/usr/bin/git"]},
        {"allow": [""]},
        {"rules": {"/usr/bin/git": {}}},
        {"rules": {"git": {"blocked": [""]}}},
        {"rules": {"git": {"blocked": ["push --force-with-lease=main"]}}},
        {"rules": {"git": {"blocked_subcommands": ["--force"]}}},
        {"rules": {"git": {"allowed_subcommands": ["push origin"]}}},
        {"rules": {"git": {"blockd": ["push --force"]}}},
        {"unknown": 1},
    ],
)
def test_invalid_policies_are_refused(data: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        CommandsPolicy.model_validate(data)


def test_policy_from_toml_like_data() -> None:
    policy = CommandsPolicy.model_validate(
        {"allow": ["git", "python3"], "rules": {"git": {"blocked": ["push --force", "push +*"]}}}
    )
    assert not check_command(["git", "push", "origin", "+main"], policy).allowed
    assert check_command(["python3", "-c", "import os"], policy).allowed


def test_a_change_in_any_subpackage_makes_a_new_controller_key() -> None:
    """The client must not talk to a controller running older code of any layer (the package
    is regrouped in subpackages: a top-level-only stamp would miss them)."""
    import os
    import time
    from pathlib import Path

    import sandman
    from sandman.core.protocol import controller_key

    deep = Path(sandman.__file__).parent / "core" / "poison" / "model.py"
    before, st = controller_key(), deep.stat()
    try:
        os.utime(deep, ns=(st.st_atime_ns, time.time_ns() + 10**15))  # past every other file
        assert controller_key() != before
    finally:
        os.utime(deep, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert controller_key() == before
