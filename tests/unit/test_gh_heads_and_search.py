"""gh-restricted: a draft PR's head must be a branch the session pushed, and no filter value may
carry search syntax into the query gh builds (gh quotes a value only when it holds whitespace)."""

from __future__ import annotations

import pytest

from sandman.upcall.ghrestricted import GhConfig, Rule, evaluate
from sandman.upcall.helpers import _REF

APP = "acme/app"
DRAFTS = GhConfig(mode="draft-prs", allowed_repos=[APP])
PREFIXED = GhConfig(mode="draft-prs", allowed_repos=[APP], head_prefix="sandman/")


def create(head: str) -> list[str]:
    return ["pr", "create", "--draft", "--title", "T", "--body", "B", "--head", head, "--base", "other"]


# ----- the head of a draft PR -------------------------------------------------------------------------


def test_head_must_be_a_branch_this_session_pushed() -> None:
    pushed = {"sandman/widget"}
    d = evaluate(create("main"), DRAFTS, set(), pushed)
    assert not d.allowed and d.rule is Rule.HEAD_NOT_PUSHED
    assert "'main' is not a branch this session pushed" in d.message and "sandman/widget" in d.message
    ok = evaluate(create("sandman/widget"), DRAFTS, set(), pushed)
    assert ok.allowed and ok.action is not None and ok.action.flags["head"] == "sandman/widget"


def test_nothing_pushed_yet_refuses_every_head() -> None:
    d = evaluate(create("sandman/widget"), DRAFTS, set(), set())
    assert not d.allowed and d.rule is Rule.HEAD_NOT_PUSHED and "none yet" in d.message


def test_without_a_record_the_prefix_is_the_rule() -> None:
    d = evaluate(create("main"), PREFIXED, set(), None)
    assert not d.allowed and d.rule is Rule.HEAD_NOT_PUSHED and "'sandman/'" in d.message
    assert evaluate(create("sandman/anything"), PREFIXED, set(), None).allowed
    # the record, when there is one, wins over the prefix
    assert not evaluate(create("sandman/anything"), PREFIXED, set(), {"sandman/widget"}).allowed


@pytest.mark.parametrize("head", ["widget\n", "main\n", "a:b", "-x", "x..y", "owner:branch"])
def test_malformed_heads_refused(head: str) -> None:
    d = evaluate(create(head), DRAFTS, set(), {head})
    assert not d.allowed and d.rule is Rule.BAD_VALUE


def test_git_push_branch_names_are_matched_whole() -> None:
    assert _REF.fullmatch("widget")
    assert _REF.fullmatch("feature/x-1.2")
    for bad in ("widget\n", "widget\nmain", "\nwidget", "a..b", "x.lock", "x/", "/x", "a//b", "a@{1}", ""):
        assert not _REF.fullmatch(bad), bad


# ----- search qualifiers ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["pr", "list", "--label", "(repo:evil/secret)"],
        ["pr", "list", "--label", "a)OR(repo:evil/secret"],
        ["pr", "list", "--label", "bug,(repo:evil/secret)"],
        ["pr", "list", "-l", "repo:evil/secret"],
        ["pr", "list", "--label", "x repo:evil/secret"],
        ["pr", "list", "--label", "type: bug"],
        ["pr", "list", "--label", 'a"b'],
        ["pr", "list", "--label", "a\\b"],
        ["pr", "list", "--label", "a\x7fb"],
        ["issue", "list", "--label", "(org:evil)"],
        ["issue", "list", "--milestone", "v1:repo:evil/secret"],
        ["issue", "list", "--milestone", "(is:private)"],
        ["pr", "list", "--author", "bob\n"],
        ["pr", "list", "--assignee", "(repo:evil/secret)"],
        ["issue", "list", "--mention", "a:b"],
        ["pr", "list", "--base", "x:y"],
        ["pr", "list", "--head", "(repo:evil/secret)"],
    ],
)
def test_search_syntax_in_filter_values_refused(argv: list[str]) -> None:
    d = evaluate([*argv, "-R", APP], GhConfig(), set())
    assert not d.allowed and d.rule is Rule.BAD_VALUE, d.message


@pytest.mark.parametrize(
    "argv",
    [
        ["pr", "list", "--label", "bug"],
        ["pr", "list", "--label", "help wanted", "--label", "good first issue"],
        ["pr", "list", "--label", "priority-1"],
        ["issue", "list", "--milestone", "v1.0"],
        ["pr", "list", "--author", "@me", "--base", "main", "--head", "sandman/widget"],
    ],
)
def test_plain_filter_values_pass(argv: list[str]) -> None:
    d = evaluate([*argv, "-R", APP], GhConfig(), set())
    assert d.allowed, d.message
