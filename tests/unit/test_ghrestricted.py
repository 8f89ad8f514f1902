"""gh-restricted: gh's flag syntax parsed as gh (cobra/pflag) parses it, and the policy decided on that.

Every trick an agent could use to make our reading differ from gh's is a row below; so is every command
and flag that must never pass, and every way a write could escape its draft / allowed-repo / own-PR box.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from sandman.errors import SandmanError
from sandman.upcall.ghrestricted import (
    NEVER,
    Decision,
    GhAction,
    GhConfig,
    GhError,
    GhRefused,
    Rule,
    decide,
    evaluate,
    execute,
    parse_gh_args,
    parse_repo,
)

APP = "acme/app"
DRAFTS = GhConfig(mode="draft-prs", allowed_repos=[APP])
DRAFTS_TWO = GhConfig(mode="draft-prs", allowed_repos=[APP, "acme/lib"])
READ_ONLY = GhConfig(mode="read-only", allowed_repos=[APP])
OPEN_READS = GhConfig()  # read-only, any repo
CREATE = ["pr", "create", "--title", "T", "--body", "B", "--head", "feat"]


def refused(argv: list[str], config: GhConfig = DRAFTS, prs: set[int] | None = None) -> Decision:
    d = evaluate(argv, config, prs if prs is not None else set())
    assert not d.allowed, f"{argv} was allowed: {d.action}"
    assert d.action is None
    assert d.message.startswith("gh-restricted: ")
    return d


def allowed(argv: list[str], config: GhConfig = DRAFTS, prs: set[int] | None = None) -> GhAction:
    d = evaluate(argv, config, prs if prs is not None else set())
    assert d.allowed, d.message
    assert d.rule is Rule.ALLOWED and d.action is not None
    return d.action


# ----- parsing: what gh would read ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "flags", "args"),
    [
        (["pr", "create", "--title=x"], {"title": "x"}, ()),
        (["pr", "create", "--title", "x"], {"title": "x"}, ()),
        (["pr", "create", "-t", "x"], {"title": "x"}, ()),
        (["pr", "create", "-tx"], {"title": "x"}, ()),
        (["pr", "create", "-t=x"], {"title": "x"}, ()),  # pflag drops the '=' after a shorthand
        (["pr", "create", "--title="], {"title": ""}, ()),
        (["pr", "create", "--title=a=b"], {"title": "a=b"}, ()),
        (["pr", "create", "--title", "-f"], {"title": "-f"}, ()),  # a value, even if it looks like a flag
        (["pr", "create", "--title", "--draft=false"], {"title": "--draft=false"}, ()),
        (["pr", "create", "--title", "a", "--title", "b"], {"title": "b"}, ()),  # last one wins
        (["pr", "create", "-t", "a", "--title=b", "-tc"], {"title": "c"}, ()),
        (["pr", "create", "-d"], {"draft": True}, ()),
        (["pr", "create", "--draft"], {"draft": True}, ()),
        (["pr", "create", "--draft=true"], {"draft": True}, ()),
        (["pr", "create", "--draft=1"], {"draft": True}, ()),
        (["pr", "create", "--draft=T"], {"draft": True}, ()),
        (["pr", "create", "--draft=false"], {"draft": False}, ()),
        (["pr", "create", "--draft=0"], {"draft": False}, ()),
        (["pr", "create", "--draft=F"], {"draft": False}, ()),
        (["pr", "create", "-d=false"], {"draft": False}, ()),
        (["pr", "create", "-d", "--draft=false"], {"draft": False}, ()),
        (["pr", "create", "--draft=false", "-d"], {"draft": True}, ()),
        (["pr", "create", "--draft", "false"], {"draft": True}, ("false",)),  # bool flags take no next word
        (["pr", "create", "-dt", "x"], {"draft": True, "title": "x"}, ()),  # combined shorthands
        (["pr", "create", "-dtx"], {"draft": True, "title": "x"}, ()),
        (["pr", "create", "-dtf"], {"draft": True, "title": "f"}, ()),  # 'f' is -t's value here
        (["pr", "view", "-Racme/app", "5"], {"repo": "acme/app"}, ("5",)),
        (["pr", "view", "-R=acme/app", "5"], {"repo": "acme/app"}, ("5",)),
        (["pr", "view", "--repo=acme/app", "5"], {"repo": "acme/app"}, ("5",)),
        (["pr", "view", "5", "-R", "acme/app"], {"repo": "acme/app"}, ("5",)),  # flags after positionals
        (["pr", "view", "-R", "acme/app", "5", "--comments"], {"repo": "acme/app", "comments": True}, ("5",)),
        (["pr", "view", "--", "5"], {}, ("5",)),
        (["pr", "view", "-R", "x/y", "--", "-R", "acme/app"], {"repo": "x/y"}, ("-R", "acme/app")),
        (["pr", "create", "-t", "x", "--", "--draft=false"], {"title": "x"}, ("--draft=false",)),
        (["pr", "view", "-"], {}, ("-",)),
        (["pr", "list", "-l", "a,b", "--label", "c"], {"label": ("a", "b", "c")}, ()),  # slices append
        (["pr", "list", "--label", '"x,y",z'], {"label": ("x,y", "z")}, ()),  # ... and are CSV
        (["pr", "list", "-L5", "--limit", "7"], {"limit": 7}, ()),
        (["pr", "list", "--json", "number,title"], {"json": ("number", "title")}, ()),
        (["run", "list", "-w", "ci.yml"], {"workflow": "ci.yml"}, ()),  # -w is not --web everywhere
    ],
)
def test_parse_like_gh(argv: list[str], flags: dict[str, object], args: tuple[str, ...]) -> None:
    req = parse_gh_args(argv)
    assert req.known
    assert req.flags == flags
    assert req.args == args


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["pr", "new"], ("pr", "create")),
        (["pr", "ls"], ("pr", "list")),
        (["issue", "ls"], ("issue", "list")),
        (["run", "ls"], ("run", "list")),
        (["release", "ls"], ("release", "list")),
    ],
)
def test_gh_aliases_resolve(argv: list[str], command: tuple[str, str]) -> None:
    assert parse_gh_args(argv).command == command


@pytest.mark.parametrize(
    ("argv", "rule"),
    [
        ([], Rule.BAD_SYNTAX),
        (["pr", "create", "--title"], Rule.BAD_SYNTAX),  # flag needs an argument
        (["pr", "create", "-t"], Rule.BAD_SYNTAX),
        (["pr", "create", "---title=x"], Rule.BAD_SYNTAX),
        (["pr", "create", "--=x"], Rule.BAD_SYNTAX),
        (["pr", "create", "--draft="], Rule.BAD_SYNTAX),  # not a Go boolean
        (["pr", "create", "--draft=yes"], Rule.BAD_SYNTAX),
        (["pr", "create", "-d=maybe"], Rule.BAD_SYNTAX),
        (["pr", "list", "--limit=ten"], Rule.BAD_SYNTAX),
        (["pr", "list", "-L0x10"], Rule.BAD_SYNTAX),
        (["pr", "view", "5\x00"], Rule.BAD_SYNTAX),
        (["-R", "acme/app", "pr", "view", "5"], Rule.BAD_SYNTAX),  # flags before the command
        (["pr", "-R", "acme/app", "view", "5"], Rule.BAD_SYNTAX),
        (["--version"], Rule.BAD_SYNTAX),
        (["pr", "create", "--label", "bug"], Rule.UNKNOWN_FLAG),  # fail closed on writes
        (["pr", "create", "--reviewer=someone"], Rule.UNKNOWN_FLAG),
        (["pr", "create", "-a", "@me"], Rule.UNKNOWN_FLAG),
        (["pr", "edit", "1", "--add-label", "x"], Rule.UNKNOWN_FLAG),
        (["pr", "comment", "1", "--edit-last"], Rule.UNKNOWN_FLAG),
        (["pr", "view", "5", "--verbose"], Rule.UNKNOWN_FLAG),  # ... and on reads
        (["pr", "view", "5", "--help"], Rule.UNKNOWN_FLAG),
        (["pr", "view", "5", "-h"], Rule.UNKNOWN_FLAG),
        (["repo", "view", "-R", "acme/app"], Rule.UNKNOWN_FLAG),  # repo view has no --repo
        (["pr", "create", "-dz"], Rule.UNKNOWN_FLAG),
        (["pr", "create", "-d="], Rule.UNKNOWN_FLAG),  # pflag reads '=' as the next shorthand
    ],
)
def test_parse_refusals(argv: list[str], rule: Rule) -> None:
    with pytest.raises(GhRefused) as info:
        parse_gh_args(argv)
    assert info.value.rule is rule
    assert str(info.value).startswith("gh-restricted: ")
    assert isinstance(info.value, SandmanError)
    assert refused(argv).rule is rule  # evaluate() turns it into a refused Decision


def test_unknown_commands_are_not_parsed() -> None:
    req = parse_gh_args(["issue", "create", "-F", "x"])
    assert not req.known and req.command == ("issue", "create") and req.flags == {}


# ----- forbidden flags: refused anywhere -----------------------------------------------------------------

FORBIDDEN = [
    [*CREATE, "-f"],
    [*CREATE, "--fill"],
    [*CREATE, "-F", "/etc/passwd"],
    [*CREATE, "--body-file=/etc/passwd"],
    [*CREATE, "-df"],  # combined shorthands
    [*CREATE, "--recover", "/tmp/x.json"],
    [*CREATE, "--web"],
    [*CREATE, "-w"],
    [*CREATE, "--editor"],
    [*CREATE, "--field", "a=b"],
    [*CREATE, "--raw-field=a=b"],
    [*CREATE, "--input", "x.json"],
    ["pr", "edit", "1", "-F", "x"],
    ["pr", "comment", "1", "-e"],
    ["pr", "comment", "1", "--editor"],
    ["pr", "comment", "1", "-w"],
    ["pr", "view", "5", "-f", "x"],
    ["pr", "view", "5", "--field=x"],
    ["pr", "view", "5", "-F", "x"],
    ["pr", "view", "5", "--input=x"],
    ["pr", "view", "5", "--web"],
    ["pr", "view", "5", "-w"],
    ["pr", "view", "5", "-cw"],
    ["pr", "list", "--json", "number", "--jq", "$ENV"],  # gh's jq can read the token from $ENV
    ["pr", "list", "--json", "number", "-q", "."],
    ["pr", "list", "--json", "number", "--template", "{{.}}"],
    ["pr", "list", "--json", "number", "-t", "{{.}}"],
    ["pr", "list", "--search", "repo:evil/secret"],
    ["pr", "list", "-S", "x"],
    ["issue", "list", "-S", "x"],
    ["pr", "checks", "5", "--watch"],
    ["pr", "checks", "5", "-i", "1"],
    ["run", "list", "--web"],  # unknown to 'run list' in gh, still reported as forbidden
    ["run", "view", "5", "--hostname", "x"],
    ["release", "list", "-f"],
]


@pytest.mark.parametrize("argv", FORBIDDEN, ids=lambda a: " ".join(a))
@pytest.mark.parametrize("config", [DRAFTS, READ_ONLY], ids=["draft-prs", "read-only"])
def test_forbidden_flags_anywhere(argv: list[str], config: GhConfig) -> None:
    d = refused(argv, config, {1})
    assert d.rule is Rule.FORBIDDEN_FLAG
    assert "is never allowed" in d.message


def test_flag_value_that_looks_forbidden_is_just_a_value() -> None:
    action = allowed(["pr", "create", "--title", "-f", "--body=--web", "--head", "feat"])
    assert action.flags["title"] == "-f" and action.flags["body"] == "--web"
    # the rebuilt argv keeps them as values: --title=-f, never a bare -f
    assert "--title=-f" in action.argv() and "-f" not in action.argv()


# ----- commands that are never allowed, and unknown ones ------------------------------------------------

ALWAYS_REFUSED = [
    ["auth", "token"],
    ["auth", "status"],
    ["auth", "login", "--with-token"],
    ["auth"],
    ["auth", "--help"],
    ["api", "repos/acme/app"],
    ["api", "graphql", "-f", "query=x"],
    ["api"],
    ["pr", "ready", "1"],
    ["pr", "merge", "1"],
    ["pr", "merge", "1", "--admin"],
    ["pr", "close", "1"],
    ["pr", "reopen", "1"],
    ["pr", "review", "1", "--approve"],
    ["pr", "checkout", "1"],
    ["repo", "delete", "acme/app", "--yes"],
    ["repo", "edit", "acme/app"],
    ["repo", "clone", "acme/app"],
    ["repo", "archive"],
    ["repo", "rename", "x"],
    ["repo", "create", "x"],
    ["repo", "fork"],
    ["secret", "list"],
    ["secret", "set", "X"],
    ["variable", "list"],
    ["ssh-key", "add", "k.pub"],
    ["gpg-key", "list"],
    ["config", "set", "editor", "vim"],
    ["config", "get", "oauth_token"],
    ["extension", "install", "evil/gh-x"],
    ["extensions", "list"],
    ["ext", "exec", "x"],
    ["alias", "set", "x", "!sh"],
    ["codespace", "ssh"],
    ["cs", "list"],
    ["workflow", "run", "deploy.yml"],
    ["workflow", "enable", "x"],
    ["run", "rerun", "1"],
    ["run", "cancel", "1"],
    ["run", "download", "1"],
    ["release", "create", "v1"],
    ["release", "delete", "v1"],
    ["release", "upload", "v1", "/etc/passwd"],
    ["release", "download", "v1"],
    ["browse"],
]


@pytest.mark.parametrize("argv", ALWAYS_REFUSED, ids=lambda a: " ".join(a))
@pytest.mark.parametrize("config", [DRAFTS, READ_ONLY], ids=["draft-prs", "read-only"])
def test_never_allowed(argv: list[str], config: GhConfig) -> None:
    d = refused(argv, config, {1})
    assert d.rule is Rule.NEVER_ALLOWED
    assert "is never allowed" in d.message


def test_refusal_messages_name_the_command() -> None:
    assert refused(["pr", "merge", "1"]).message.startswith("gh-restricted: 'pr merge' is never allowed")
    assert refused(["auth", "token"]).message.startswith("gh-restricted: 'auth token' is never allowed")
    assert refused(["api", "user"]).message.startswith("gh-restricted: 'api' is never allowed")


def test_never_list_covers_the_brief() -> None:
    for key in [
        ("auth",),
        ("api",),
        ("pr", "ready"),
        ("pr", "merge"),
        ("pr", "close"),
        ("repo", "delete"),
        ("secret",),
        ("variable",),
        ("ssh-key",),
        ("gpg-key",),
        ("config",),
        ("extension",),
        ("alias",),
        ("codespace",),
        ("workflow", "run"),
    ]:
        assert key in NEVER


@pytest.mark.parametrize(
    "argv",
    [
        ["issue", "create", "-t", "x"],
        ["issue", "comment", "1", "-b", "x"],
        ["gist", "view", "1"],
        ["search", "prs", "x"],
        ["status"],
        ["pr"],
        ["pr", "frobnicate"],
        ["gh", "pr", "view", "1"],
        ["label", "list"],
        ["workflow", "view", "x"],
        ["run", "watch", "1"],
        ["my-extension"],
        ["completion", "-s", "bash"],
        ["org", "list"],
        ["project", "list"],
        ["cache", "delete", "--all"],
        ["repo", "list"],
        ["issue", "status"],
    ],
    ids=lambda a: " ".join(a),
)
def test_unknown_commands_refused(argv: list[str]) -> None:
    d = refused(argv)
    assert d.rule is Rule.UNKNOWN_COMMAND


# ----- reads ---------------------------------------------------------------------------------------------

READS = [
    ["pr", "list"],
    ["pr", "list", "--state", "merged", "-L", "5", "--author", "octocat", "-l", "bug"],
    ["pr", "view", "5"],
    ["pr", "view", "#5", "--comments", "--json", "number,title"],
    ["pr", "diff", "5"],
    ["pr", "diff", "5", "--patch", "--color=never"],
    ["pr", "checks", "5", "--required"],
    ["pr", "status"],
    ["issue", "list", "-s", "closed"],
    ["issue", "view", "7", "-c"],
    ["repo", "view"],
    ["repo", "view", "acme/app", "--json", "name"],
    ["run", "list", "-b", "main", "-w", "CI"],
    ["run", "view", "123", "--log-failed"],
    ["run", "view", "123", "--job", "456"],
    ["release", "list"],
    ["release", "view"],
    ["release", "view", "v1.2.3"],
]


@pytest.mark.parametrize("argv", READS, ids=lambda a: " ".join(a))
@pytest.mark.parametrize("config", [DRAFTS, READ_ONLY], ids=["draft-prs", "read-only"])
def test_reads_allowed_in_both_modes(argv: list[str], config: GhConfig) -> None:
    action = allowed(argv, config)
    assert action.kind == "read" and action.repo == APP


def test_read_argv_is_rebuilt_from_the_normalized_request() -> None:
    assert allowed(["pr", "view", "#5", "-Racme/app", "-c"]).argv() == [
        "pr",
        "view",
        "--repo=acme/app",
        "--comments",
        "--",
        "5",
    ]
    assert allowed(["pr", "ls", "-l", "a,b", "-lc", "-L", "5", "-s", "all"]).argv() == [
        "pr",
        "list",
        "--repo=acme/app",
        "--label=a,b,c",
        "--limit=5",
        "--state=all",
    ]
    assert allowed(["pr", "list", "--draft=false"]).argv() == [
        "pr",
        "list",
        "--repo=acme/app",
        "--draft=false",
    ]
    assert allowed(["repo", "view"]).argv() == ["repo", "view", "--", "acme/app"]
    assert allowed(["release", "view", "v1"]).argv() == ["release", "view", "--repo=acme/app", "--", "v1"]


@pytest.mark.parametrize(
    ("argv", "config", "rule"),
    [
        (["pr", "list", "-R", "evil/secret"], READ_ONLY, Rule.REPO_NOT_ALLOWED),
        (["pr", "view", "5", "-R", APP, "-R", "evil/secret"], READ_ONLY, Rule.REPO_NOT_ALLOWED),
        (["repo", "view", "evil/secret"], READ_ONLY, Rule.REPO_NOT_ALLOWED),
        (["pr", "list"], OPEN_READS, Rule.REPO_REQUIRED),  # never guessed from a git checkout
        (["pr", "list"], DRAFTS_TWO, Rule.REPO_REQUIRED),
        (["pr", "list", "-R", "other.example.com/acme/app"], READ_ONLY, Rule.BAD_REPO),
        (["pr", "list", "-R", "https://evil.example/acme/app"], READ_ONLY, Rule.BAD_REPO),
        (["pr", "list", "-R", "http://github.com/acme/app"], READ_ONLY, Rule.BAD_REPO),
        (["pr", "list", "-R", "acme"], READ_ONLY, Rule.BAD_REPO),
        (["pr", "list", "-R", "acme/app/extra/x"], READ_ONLY, Rule.BAD_REPO),
        (["pr", "list", "-R", "acme/.."], READ_ONLY, Rule.BAD_REPO),
        (["pr", "view"], READ_ONLY, Rule.BAD_ARGUMENT),  # gh would use the host's current branch
        (["pr", "view", "https://github.com/evil/secret/pull/1"], READ_ONLY, Rule.BAD_ARGUMENT),
        (["pr", "view", "feature-branch"], READ_ONLY, Rule.BAD_ARGUMENT),
        (["pr", "view", "1", "2"], READ_ONLY, Rule.BAD_ARGUMENT),
        (["pr", "view", "0"], READ_ONLY, Rule.BAD_ARGUMENT),
        (["issue", "view", "https://github.com/evil/secret/issues/7"], READ_ONLY, Rule.BAD_ARGUMENT),
        (["run", "view", "abc"], READ_ONLY, Rule.BAD_ARGUMENT),
        (["run", "view"], READ_ONLY, Rule.BAD_ARGUMENT),
        (["pr", "list", "extra"], READ_ONLY, Rule.BAD_ARGUMENT),
        (["release", "view", "../../../evil/secret/releases/1"], READ_ONLY, Rule.BAD_ARGUMENT),
        (["release", "view", "-v1"], READ_ONLY, Rule.UNKNOWN_FLAG),
        (["pr", "list", "--state", "everything"], READ_ONLY, Rule.BAD_VALUE),
        (["pr", "list", "--limit", "0"], READ_ONLY, Rule.BAD_VALUE),
        (["pr", "list", "--limit", "100000"], READ_ONLY, Rule.BAD_VALUE),
        (["pr", "list", "--author", "x repo:evil/secret"], READ_ONLY, Rule.BAD_VALUE),
        (["pr", "list", "--label", "x repo:evil/secret"], READ_ONLY, Rule.BAD_VALUE),
        (["pr", "list", "--head", "a:b"], READ_ONLY, Rule.BAD_VALUE),
        (["pr", "list", "--json", "number,title.x"], READ_ONLY, Rule.BAD_VALUE),
        (["pr", "list", "--json", ""], READ_ONLY, Rule.BAD_VALUE),
        (["run", "list", "-w", "../../../evil/secret"], READ_ONLY, Rule.BAD_VALUE),
        (["run", "view", "1", "--job", "1/../2"], READ_ONLY, Rule.BAD_VALUE),
        (["pr", "diff", "5", "--color", "sometimes"], READ_ONLY, Rule.BAD_VALUE),
    ],
)
def test_read_refusals(argv: list[str], config: GhConfig, rule: Rule) -> None:
    assert refused(argv, config).rule is rule


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("acme/app", "acme/app"),
        ("ACME/App", "acme/app"),
        ("github.com/acme/app", "acme/app"),
        ("GitHub.com/acme/app", "acme/app"),
        ("https://github.com/acme/app", "acme/app"),
        ("https://github.com/acme/app/", "acme/app"),
    ],
)
def test_repo_spellings(given: str, expected: str) -> None:
    action = allowed(["pr", "list", "-R", given], READ_ONLY)
    assert action.repo == expected  # normalized to the allowed_repos spelling


def test_any_repo_readable_when_no_allowlist() -> None:
    assert allowed(["pr", "list", "-R", "someone/else"], OPEN_READS).repo == "someone/else"


def test_enterprise_host_in_repo_spec() -> None:
    config = GhConfig(allowed_repos=[APP], host="GHE.example.com")
    assert config.host == "ghe.example.com"
    assert allowed(["pr", "list", "-R", "ghe.example.com/acme/app"], config).repo == APP
    assert refused(["pr", "list", "-R", "github.com/acme/app"], config).rule is Rule.BAD_REPO
    assert parse_repo("localhost:8443/a/b", "localhost:8443") == "a/b"


# ----- writes ---------------------------------------------------------------------------------------------


def test_pr_create_is_always_a_draft() -> None:
    action = allowed(CREATE)  # no --draft given: forced
    assert action.kind == "write" and action.repo == APP
    assert action.flags == {"title": "T", "body": "B", "draft": True, "head": "feat"}
    assert action.argv() == [
        "pr",
        "create",
        "--repo=acme/app",
        "--body=B",
        "--draft",
        "--head=feat",
        "--title=T",
    ]
    assert allowed([*CREATE, "-d", "--base", "develop"]).flags["base"] == "develop"
    assert allowed([*CREATE, "--draft=false", "--draft"]).flags["draft"] is True  # last one wins


@pytest.mark.parametrize("flag", ["--draft=false", "--draft=0", "--draft=f", "--draft=False", "-d=false", "-d=0"])
def test_pr_create_undraft_refused(flag: str) -> None:
    d = refused([*CREATE, flag])
    assert d.rule is Rule.DRAFT_ONLY
    assert refused([*CREATE, "-d", flag]).rule is Rule.DRAFT_ONLY  # the later one wins


def test_repeated_repo_last_wins() -> None:
    assert refused([*CREATE, "-R", APP, "-R", "evil/x"]).rule is Rule.REPO_NOT_ALLOWED
    assert allowed([*CREATE, "-R", "evil/x", "-R", APP]).repo == APP
    assert allowed([*CREATE, "-Revil/x", "--repo=acme/app"]).repo == APP
    assert refused([*CREATE, "--repo=acme/app", "-Revil/x"]).rule is Rule.REPO_NOT_ALLOWED


@pytest.mark.parametrize(
    ("argv", "config", "rule"),
    [
        (CREATE, READ_ONLY, Rule.READ_ONLY),
        (["pr", "edit", "1", "-t", "x"], READ_ONLY, Rule.READ_ONLY),
        (["pr", "comment", "1", "-b", "x"], READ_ONLY, Rule.READ_ONLY),
        ([*CREATE, "-R", "evil/x"], DRAFTS, Rule.REPO_NOT_ALLOWED),
        (CREATE, DRAFTS_TWO, Rule.REPO_REQUIRED),
        (CREATE, GhConfig(mode="draft-prs"), Rule.REPO_REQUIRED),
        ([*CREATE, "-R", APP], GhConfig(mode="draft-prs"), Rule.REPO_NOT_ALLOWED),  # writes need a list
        (["pr", "create", "--body", "B", "--head", "feat"], DRAFTS, Rule.MISSING_VALUE),
        (["pr", "create", "--title", " ", "--body", "B", "--head", "feat"], DRAFTS, Rule.MISSING_VALUE),
        (["pr", "create", "--title", "T", "--head", "feat"], DRAFTS, Rule.MISSING_VALUE),
        (["pr", "create", "--title", "T", "--body", "B"], DRAFTS, Rule.MISSING_VALUE),  # no --head
        (["pr", "create", "-t", "T", "-b", "B", "-H", "evil:feat"], DRAFTS, Rule.BAD_VALUE),
        (["pr", "create", "-t", "T", "-b", "B", "-H", "-x"], DRAFTS, Rule.BAD_VALUE),
        (["pr", "create", "-t", "T", "-b", "B", "-H", "a..b"], DRAFTS, Rule.BAD_VALUE),
        ([*CREATE, "-B", "main branch"], DRAFTS, Rule.BAD_VALUE),
        (["pr", "create", "-t", "x" * 300, "-b", "B", "-H", "feat"], DRAFTS, Rule.BAD_VALUE),
        ([*CREATE, "extra"], DRAFTS, Rule.BAD_ARGUMENT),
    ],
)
def test_write_refusals(argv: list[str], config: GhConfig, rule: Rule) -> None:
    assert refused(argv, config, {1}).rule is rule


def test_edit_and_comment_only_on_session_prs() -> None:
    assert allowed(["pr", "edit", "3", "--title", "New"], prs={3}).argv() == [
        "pr",
        "edit",
        "--repo=acme/app",
        "--title=New",
        "--",
        "3",
    ]
    assert allowed(["pr", "comment", "#3", "-b", "hi"], prs={3}).flags == {"body": "hi"}
    d = refused(["pr", "edit", "4", "--title", "x"], prs={3})
    assert d.rule is Rule.NOT_SESSION_PR and "#4" in d.message
    assert refused(["pr", "comment", "4", "--body", "x"], prs={3}).rule is Rule.NOT_SESSION_PR
    assert refused(["pr", "comment", "4", "--body", "x"], prs=set()).rule is Rule.NOT_SESSION_PR
    assert refused(["pr", "edit", "3"], prs={3}).rule is Rule.MISSING_VALUE
    assert refused(["pr", "comment", "3"], prs={3}).rule is Rule.MISSING_VALUE
    assert refused(["pr", "comment", "3", "-b", ""], prs={3}).rule is Rule.MISSING_VALUE
    assert refused(["pr", "edit"], prs={3}).rule is Rule.BAD_ARGUMENT  # gh would use the host's branch
    assert refused(["pr", "edit", "https://github.com/acme/app/pull/3", "-t", "x"], prs={3}).rule is Rule.BAD_ARGUMENT


def test_session_prs_with_several_repos_need_the_repo() -> None:
    # a bare number does not say which repository; with two allowed repos it matches nothing
    d = decide(parse_gh_args(["pr", "edit", "3", "-R", "acme/lib", "-t", "x"]), DRAFTS_TWO, {3})
    assert not d.allowed and d.rule is Rule.NOT_SESSION_PR
    ok = decide(parse_gh_args(["pr", "edit", "3", "-R", "acme/lib", "-t", "x"]), DRAFTS_TWO, {("acme/lib", 3)})
    assert ok.allowed and ok.action is not None and ok.action.repo == "acme/lib"
    other = decide(parse_gh_args(["pr", "edit", "3", "-R", APP, "-t", "x"]), DRAFTS_TWO, {("acme/lib", 3)})
    assert not other.allowed and other.rule is Rule.NOT_SESSION_PR


def test_edit_cannot_undraft_or_retarget() -> None:
    assert refused(["pr", "edit", "3", "--draft=false"], prs={3}).rule is Rule.UNKNOWN_FLAG
    assert refused(["pr", "edit", "3", "-t", "x", "-R", "evil/x"], prs={3}).rule is Rule.REPO_NOT_ALLOWED


def test_config_validation() -> None:
    with pytest.raises(ValidationError):
        GhConfig(mode="admin")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        GhConfig(allowed_repos=["not-a-repo"])
    with pytest.raises(ValidationError):
        GhConfig(host="evil.example/path")
    with pytest.raises(ValidationError):
        GhConfig(token="x")  # type: ignore[call-arg]
    assert GhConfig(allowed_repos=["a/b", "A/B"]).allowed_repos == ["a/b"]


# ----- execute() with a stand-in gh (the real one runs in tests/integration/test_gh_fake.py) --------------

TOKEN = "ghp_unitTestToken0000000000000000000000"


def fake_gh(tmp_path: Path, script: str) -> str:
    path = tmp_path / "gh"
    path.write_text(f"#!{sys.executable}\n{script}")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_execute_environment_and_argv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "host-secret")
    monkeypatch.setenv("GITHUB_TOKEN", "host-token")
    gh = fake_gh(
        tmp_path,
        "import json, os, sys\nprint(json.dumps({'argv': sys.argv[1:], 'env': dict(os.environ),"
        " 'cwd': os.getcwd()}))\n",
    )
    config = GhConfig(mode="draft-prs", allowed_repos=[APP], host="localhost:8443")
    decision = evaluate([*CREATE, "-R", APP], config, set())
    result = execute(decision, config, TOKEN, gh_path=gh, env_extra={"SSL_CERT_FILE": "/x/ca.pem"})
    assert result.exit_code == 0, result.stderr
    seen = json.loads(result.stdout.replace("[REDACTED]", "TOKEN"))
    assert decision.action is not None
    assert seen["argv"] == decision.action.argv()
    env = seen["env"]
    assert env.pop("GH_ENTERPRISE_TOKEN") == "TOKEN"  # the value was scrubbed from what we returned
    assert env.pop("GH_HOST") == "localhost:8443"
    assert env.pop("SSL_CERT_FILE") == "/x/ca.pem"
    assert env.pop("GH_PROMPT_DISABLED") == "1" and env.pop("NO_COLOR") == "1"
    assert env.pop("GH_NO_UPDATE_NOTIFIER") == "1" and env.pop("GIT_CONFIG_NOSYSTEM") == "1"
    home = env.pop("HOME")
    assert env.pop("GIT_CEILING_DIRECTORIES") == os.path.dirname(home)
    assert seen["cwd"] == home and home.rsplit("/", 1)[-1].startswith("sandman-gh-")
    assert not os.path.exists(home)  # removed afterwards
    env.pop("PATH")
    env.pop("LC_CTYPE", None)  # added by Python's own startup on some systems
    assert env == {}
    assert TOKEN not in result.stdout + result.stderr
    assert result.created_pr is None  # the stand-in printed no PR URL


def test_execute_github_com_uses_gh_token(tmp_path: Path) -> None:
    gh = fake_gh(
        tmp_path,
        "import os\nprint(sorted(k for k in os.environ if k.startswith('GH_')))\n"
        "print('https://github.com/acme/app/pull/42')\n",
    )
    result = execute(evaluate(CREATE, DRAFTS, set()), DRAFTS, TOKEN, gh_path=gh)
    assert "'GH_TOKEN'" in result.stdout and "GH_HOST" not in result.stdout
    assert result.created_pr == 42


def test_execute_created_pr_must_match_the_repo(tmp_path: Path) -> None:
    gh = fake_gh(tmp_path, "print('https://github.com/evil/x/pull/42')\n")
    assert execute(evaluate(CREATE, DRAFTS, set()), DRAFTS, TOKEN, gh_path=gh).created_pr is None


def test_execute_scrubs_token_and_caps_output(tmp_path: Path) -> None:
    gh = fake_gh(
        tmp_path,
        "import os, sys\nt = os.environ['GH_TOKEN']\nprint(t)\nsys.stderr.write(t + 'x' * 5000)\nsys.exit(3)\n",
    )
    result = execute(evaluate(["pr", "list"], DRAFTS, set()), DRAFTS, TOKEN, gh_path=gh, max_output=1000)
    assert result.exit_code == 3
    assert TOKEN not in result.stdout and TOKEN not in result.stderr
    assert "[REDACTED]" in result.stdout
    assert result.truncated and len(result.stderr) <= 1000


def test_execute_token_split_by_the_cap_is_scrubbed(tmp_path: Path) -> None:
    gh = fake_gh(tmp_path, "import os\nprint('x' * 990 + os.environ['GH_TOKEN'])\n")
    result = execute(evaluate(["pr", "list"], DRAFTS, set()), DRAFTS, TOKEN, gh_path=gh, max_output=1000)
    assert result.truncated and TOKEN[:10] not in result.stdout and result.stdout.endswith("[REDACTED]")


def test_execute_timeout_kills(tmp_path: Path) -> None:
    gh = fake_gh(tmp_path, "import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    result = execute(evaluate(["pr", "list"], DRAFTS, set()), DRAFTS, TOKEN, gh_path=gh, timeout=0.5)
    assert result.timed_out and result.exit_code == 124
    assert "started" in result.stdout and "timed out" in result.stderr


def test_execute_refuses_what_decide_refused(tmp_path: Path) -> None:
    gh = fake_gh(tmp_path, "raise SystemExit('must not run')\n")
    with pytest.raises(GhRefused) as info:
        execute(evaluate(["auth", "token"], DRAFTS, set()), DRAFTS, TOKEN, gh_path=gh)
    assert info.value.rule is Rule.NEVER_ALLOWED
    # a write decided under draft-prs is not run under a read-only config
    with pytest.raises(GhRefused) as info:
        execute(evaluate(CREATE, DRAFTS, set()), READ_ONLY, TOKEN, gh_path=gh)
    assert info.value.rule is Rule.READ_ONLY
    with pytest.raises(GhRefused):
        execute(
            evaluate(CREATE, DRAFTS, set()),
            GhConfig(mode="draft-prs", allowed_repos=["acme/lib"]),
            TOKEN,
            gh_path=gh,
        )


@pytest.mark.parametrize(
    "key",
    ["GH_TOKEN", "GH_HOST", "GITHUB_TOKEN", "HOME", "PATH", "LD_PRELOAD", "GIT_DIR", "BAD-NAME", "gh_debug"],
)
def test_execute_env_extra_cannot_override(tmp_path: Path, key: str) -> None:
    gh = fake_gh(tmp_path, "print('ran')\n")
    with pytest.raises(GhError):
        execute(evaluate(["pr", "list"], DRAFTS, set()), DRAFTS, TOKEN, gh_path=gh, env_extra={key: "x"})


def test_execute_missing_gh_and_bad_token(tmp_path: Path) -> None:
    with pytest.raises(GhError, match="apt-get install gh"):
        execute(evaluate(["pr", "list"], DRAFTS, set()), DRAFTS, TOKEN, gh_path=str(tmp_path / "nope"))
    gh = fake_gh(tmp_path, "print('ran')\n")
    for token in ["", "a b", "tok\n"]:
        with pytest.raises(GhError):
            execute(evaluate(["pr", "list"], DRAFTS, set()), DRAFTS, token, gh_path=gh)
