"""The real gh, run through gh-restricted's execute(), against a local fake GitHub (tests/support).

What reaches the API must be exactly the normalized request (one draft PR on the allowed repo, nothing
for refused requests), a wrong token must be refused, and no token value may ever appear in gh's output.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator

import pytest

from sandman.upcall.ghrestricted import Decision, GhConfig, GhResult, Rule, evaluate, execute
from tests.support.fake_github import FakeGitHub

APP = "acme/app"
WRONG_TOKEN = "ghp_wrongTokenWrongTokenWrongToken000000"


@pytest.fixture(scope="module")
def gh_path() -> str:
    path = shutil.which("gh")
    if path is None:
        pytest.fail("the GitHub CLI is not installed: apt-get install -y gh", pytrace=False)
    return path


@pytest.fixture
def fake() -> Iterator[FakeGitHub]:
    with FakeGitHub() as server:
        server.add_repo(APP, description="the allowed repository")
        server.add_repo("evil/secret")
        server.add_pull(APP, "Someone else's PR", head="other-work", author="someone-else")  # #1
        yield server


class Session:
    """One agent session: its config, the PRs it created, and every result (checked for the token)."""

    def __init__(self, fake: FakeGitHub, gh_path: str, mode: str = "draft-prs") -> None:
        self.fake = fake
        self.gh_path = gh_path
        self.config = GhConfig(mode=mode, allowed_repos=[APP], host=fake.host)  # type: ignore[arg-type]
        self.prs: set[int | tuple[str, int]] = set()
        self.results: list[GhResult] = []

    def decide(self, argv: list[str]) -> Decision:
        return evaluate(argv, self.config, self.prs)

    def run(self, argv: list[str], token: str | None = None) -> GhResult:
        decision = self.decide(argv)
        assert decision.allowed, decision.message
        result = execute(
            decision,
            self.config,
            token or self.fake.token,
            gh_path=self.gh_path,
            env_extra=self.fake.gh_env(),
        )
        self.results.append(result)
        if result.created_pr is not None and decision.action is not None:
            self.prs.add((decision.action.repo, result.created_pr))
        return result

    def assert_no_token_shown(self) -> None:
        for result in self.results:
            for token in (self.fake.token, WRONG_TOKEN):
                assert token not in result.stdout and token not in result.stderr


@pytest.fixture
def session(fake: FakeGitHub, gh_path: str) -> Iterator[Session]:
    s = Session(fake, gh_path)
    yield s
    s.assert_no_token_shown()


def create(session: Session, title: str = "Add widget", head: str = "sandman/widget") -> int:
    result = session.run(["pr", "create", "--title", title, "--body", "Body\nline 2", "--head", head])
    assert result.exit_code == 0, result.stderr
    assert result.created_pr is not None, result.stdout
    return result.created_pr


def test_gh_version(gh_path: str) -> None:
    out = subprocess.run([gh_path, "--version"], capture_output=True, text=True, check=True).stdout
    assert out.startswith("gh version 2.")


def test_draft_pr_creation_is_one_request_on_the_allowed_repo(session: Session, fake: FakeGitHub) -> None:
    fake.clear_requests()
    number = create(session)  # no --draft given: gh-restricted adds it
    assert number == 2  # #1 existed
    creations = fake.requests_for("PullRequestCreate")
    assert len(creations) == 1
    payload = creations[0].variables["input"]
    assert payload["repositoryId"] == fake.repos[APP].node_id
    assert payload["draft"] is True
    assert payload["title"] == "Add widget" and payload["body"] == "Body\nline 2"
    assert payload["headRefName"] == "sandman/widget" and payload["baseRefName"] == "main"
    # gh 2.23's whole flow: look the repo up, check for an open PR on the branch, create
    assert fake.operations() == ["RepositoryInfo", "PullRequestForBranch", "PullRequestCreate"]
    assert all(r.variables.get("owner", "acme") == "acme" for r in fake.requests)
    assert all(r.headers["Authorization"] == "token [redacted]" for r in fake.requests)
    assert all(r.headers["User-Agent"].startswith("GitHub CLI") for r in fake.requests)
    pr = fake.repos[APP].pulls[number]
    assert pr.draft and pr.author == fake.viewer and pr.head == "sandman/widget"
    assert session.prs == {(APP, number)}


def test_view_list_diff_on_created_pr(session: Session, fake: FakeGitHub) -> None:
    number = create(session)
    view = session.run(["pr", "view", str(number)])
    assert view.exit_code == 0, view.stderr
    assert "Add widget" in view.stdout and "DRAFT" in view.stdout and "line 2" in view.stdout
    listing = session.run(["pr", "list", "-R", APP, "--json", "number,isDraft,title"])
    assert listing.exit_code == 0, listing.stderr
    assert f'"number":{number}' in listing.stdout.replace(" ", "") and '"isDraft":true' in listing.stdout
    diff = session.run(["pr", "diff", f"#{number}"])
    assert diff.exit_code == 0 and diff.stdout.startswith("diff --git"), diff.stderr
    assert fake.requests_for("PullRequestByNumber")[0].variables == {
        "owner": "acme",
        "repo": "app",
        "pr_number": number,
    }


def test_comment_and_edit_only_on_own_pr(session: Session, fake: FakeGitHub) -> None:
    number = create(session)
    comment = session.run(["pr", "comment", str(number), "--body", "Ready for a look"])
    assert comment.exit_code == 0, comment.stderr
    assert f"/acme/app/pull/{number}#issuecomment-" in comment.stdout
    edit = session.run(["pr", "edit", str(number), "--title=Add widget (v2)"])
    assert edit.exit_code == 0, edit.stderr
    pr = fake.repos[APP].pulls[number]
    assert pr.title == "Add widget (v2)" and pr.draft
    assert [c.body for c in pr.comments] == ["Ready for a look"]
    updates = fake.requests_for("PullRequestUpdate")
    assert len(updates) == 1 and updates[0].variables["input"] == {
        "pullRequestId": f"PR_fake1x{number}",
        "title": "Add widget (v2)",
    }
    # PR #1 was not created by this session: refused before gh runs, nothing reaches the server
    fake.clear_requests()
    for argv in (["pr", "edit", "1", "--title", "mine now"], ["pr", "comment", "1", "--body", "hi"]):
        decision = session.decide(argv)
        assert not decision.allowed and decision.rule is Rule.NOT_SESSION_PR
    assert fake.requests == []
    assert fake.repos[APP].pulls[1].title == "Someone else's PR"


def test_wrong_token_is_refused_and_never_shown(session: Session, fake: FakeGitHub) -> None:
    fake.clear_requests()
    result = session.run(["pr", "create", "--title", "T", "--body", "B", "--head", "x"], token=WRONG_TOKEN)
    assert result.exit_code != 0
    assert result.created_pr is None
    assert "401" in result.stderr or "Bad credentials" in result.stderr, result.stderr
    assert fake.requests and all(r.status == 401 for r in fake.requests)
    assert fake.repos[APP].pulls.keys() == {1}
    view = session.run(["pr", "view", "1"], token=WRONG_TOKEN)
    assert view.exit_code != 0 and "Someone else" not in view.stdout


def test_refused_requests_never_reach_the_server(session: Session, fake: FakeGitHub) -> None:
    create(session)
    fake.clear_requests()
    for argv in (
        ["pr", "create", "-t", "T", "-b", "B", "-H", "x", "--draft=false"],
        ["pr", "create", "-t", "T", "-b", "B", "-H", "x", "-R", APP, "-R", "evil/secret"],
        ["pr", "ready", "2"],
        ["pr", "merge", "2"],
        ["auth", "token"],
        ["api", "graphql", "-f", "query={viewer{login}}"],
        ["pr", "view", "2", "--json", "number", "--jq", "$ENV"],
        ["pr", "list", "-R", "evil/secret"],
    ):
        decision = session.decide(argv)
        assert not decision.allowed, argv
    assert fake.requests == []


def test_read_only_session_reads(fake: FakeGitHub, gh_path: str) -> None:
    session = Session(fake, gh_path, mode="read-only")
    result = session.run(["pr", "view", "1", "-R", "ACME/app"])
    assert result.exit_code == 0 and "Someone else's PR" in result.stdout, result.stderr
    assert not session.decide(["pr", "create", "-t", "T", "-b", "B", "-H", "x"]).allowed
    missing = session.run(["pr", "view", "99"])
    assert missing.exit_code != 0 and "Could not resolve to a PullRequest" in missing.stderr
    session.assert_no_token_shown()
