"""A local stand-in for the GitHub API (REST under /api/v3, GraphQL at /api/graphql) for tests that run
the real ``gh``: HTTPS on 127.0.0.1 with a throwaway CA, a token check, and a record of every request.

Point gh at it with ``GH_HOST=localhost:PORT``, ``GH_ENTERPRISE_TOKEN=<token>`` and
``SSL_CERT_FILE=<ca.pem>`` (:meth:`FakeGitHub.gh_env`). It answers, by operation name, what gh 2.23 was
seen to send for ``pr create/list/view/diff/checks/status/comment/edit`` and ``repo view``; anything else
gets a GraphQL error naming the operation. Answers carry every field those queries select (a superset).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import re
import ssl
import tempfile
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_TOKEN = "ghp_fakeTokenForTests0123456789abcdefABCD"
_OPERATION = re.compile(r"(?:^|[\s}])(query|mutation)\s+([A-Za-z_][A-Za-z0-9_]*)")
_DOCS = "https://docs.github.com/rest"
_MAX_BODY = 4 << 20


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class RecordedRequest:
    """One request as the server saw it. ``headers`` has the Authorization value replaced."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: Any
    status: int = 0
    operation: str | None = None  # GraphQL operation name
    variables: dict[str, Any] = field(default_factory=dict)


@dataclass
class FakeComment:
    id: int
    body: str
    author: str
    created_at: str


@dataclass
class FakePullRequest:
    number: int
    title: str
    body: str
    head: str
    base: str
    draft: bool
    author: str
    state: str = "OPEN"
    created_at: str = field(default_factory=_now)
    updated_at: str = field(default_factory=_now)
    maintainer_can_modify: bool = True
    comments: list[FakeComment] = field(default_factory=list)


@dataclass
class FakeRepo:
    owner: str
    name: str
    database_id: int
    default_branch: str = "main"
    description: str = ""
    pulls: dict[int, FakePullRequest] = field(default_factory=dict)
    next_number: int = 1

    @property
    def full_name(self) -> str:
        return f"{self.owner}/{self.name}"

    @property
    def node_id(self) -> str:
        return f"R_fake{self.database_id}"


@dataclass
class _Text:
    """A plain-text answer (diffs), sent as is instead of JSON."""

    text: str


class GraphQLError(Exception):
    """Answered as ``{"data": ..., "errors": [...]}`` with HTTP 200, the way GitHub does."""

    def __init__(self, message: str, type_: str = "NOT_FOUND", path: list[str] | None = None, data: Any = None) -> None:
        super().__init__(message)
        self.type = type_
        self.path = path or []
        self.data = data


@dataclass
class _Certs:
    ca_pem: Path
    cert_pem: Path
    key_pem: Path


def _make_certs(directory: Path) -> _Certs:
    """A throwaway CA and a server certificate for localhost / 127.0.0.1 signed by it."""
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sandman fake GitHub test CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    certs = _Certs(directory / "ca.pem", directory / "server.pem", directory / "server-key.pem")
    certs.ca_pem.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    certs.cert_pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    certs.key_pem.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    certs.key_pem.chmod(0o600)
    return certs


class FakeGitHub:
    """The fake API server. Use as a context manager; ``add_repo`` before running gh."""

    def __init__(self, token: str = DEFAULT_TOKEN, viewer: str = "sandman-bot") -> None:
        self.token = token
        self.viewer = viewer
        self.viewer_id = 4242
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[RecordedRequest] = []
        self.lock = threading.Lock()
        self._next_id = 1000
        self._tmp = tempfile.TemporaryDirectory(prefix="fake-github-")
        self._certs = _make_certs(Path(self._tmp.name))
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ----- lifecycle -------------------------------------------------------------------------------

    def start(self) -> FakeGitHub:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        server.daemon_threads = True
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(str(self._certs.cert_pem), str(self._certs.key_pem))
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-github", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self._tmp.cleanup()

    def __enter__(self) -> FakeGitHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ----- what tests use --------------------------------------------------------------------------

    @property
    def port(self) -> int:
        assert self._server is not None, "FakeGitHub is not started"
        return int(self._server.server_address[1])

    @property
    def host(self) -> str:
        """The value for GH_HOST (and GhConfig.host): gh then calls https://<host>/api/v3 and /api/graphql."""
        return f"localhost:{self.port}"

    @property
    def ca_pem(self) -> Path:
        return self._certs.ca_pem

    def gh_env(self) -> dict[str, str]:
        """What gh needs besides GH_HOST and the token: trust in the test CA."""
        return {"SSL_CERT_FILE": str(self._certs.ca_pem)}

    def add_repo(self, full_name: str, default_branch: str = "main", description: str = "") -> FakeRepo:
        owner, name = full_name.split("/")
        with self.lock:
            repo = FakeRepo(
                owner,
                name,
                database_id=len(self.repos) + 1,
                default_branch=default_branch,
                description=description,
            )
            self.repos[full_name.lower()] = repo
        return repo

    def add_pull(
        self,
        full_name: str,
        title: str,
        head: str,
        base: str = "main",
        body: str = "",
        draft: bool = False,
        author: str = "someone-else",
    ) -> FakePullRequest:
        """A PR that already exists (not created through gh), e.g. one this session must not touch."""
        with self.lock:
            repo = self.repos[full_name.lower()]
            return self._new_pull(repo, title, body, head, base, draft, author)

    def operations(self) -> list[str]:
        """GraphQL operation names received, in order (requests that passed the token check)."""
        with self.lock:
            return [r.operation for r in self.requests if r.operation and r.status == 200]

    def requests_for(self, operation: str) -> list[RecordedRequest]:
        with self.lock:
            return [r for r in self.requests if r.operation == operation]

    def clear_requests(self) -> None:
        with self.lock:
            self.requests.clear()

    # ----- state helpers ---------------------------------------------------------------------------

    def _new_pull(
        self, repo: FakeRepo, title: str, body: str, head: str, base: str, draft: bool, author: str
    ) -> FakePullRequest:
        pr = FakePullRequest(repo.next_number, title, body, head, base, draft, author)
        repo.pulls[pr.number] = pr
        repo.next_number += 1
        return pr

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _repo(self, owner: str, name: str, path: list[str] | None = None) -> FakeRepo:
        repo = self.repos.get(f"{owner}/{name}".lower())
        if repo is None:
            raise GraphQLError(
                f"Could not resolve to a Repository with the name '{owner}/{name}'.",
                path=path or ["repository"],
                data={"repository": None},
            )
        return repo

    def _pull(self, repo: FakeRepo, number: int) -> FakePullRequest:
        pr = repo.pulls.get(number)
        if pr is None:
            raise GraphQLError(
                f"Could not resolve to a PullRequest with the number of {number}.",
                path=["repository", "pullRequest"],
                data={"repository": {"pullRequest": None}},
            )
        return pr

    def _pull_by_node(self, node_id: str) -> tuple[FakeRepo, FakePullRequest]:
        for repo in self.repos.values():
            for pr in repo.pulls.values():
                if self._pr_node_id(repo, pr) == node_id:
                    return repo, pr
        raise GraphQLError(f"Could not resolve to a node with the global id of '{node_id}'", path=["node"])

    def base_url(self) -> str:
        return f"https://{self.host}"

    # ----- JSON shapes -----------------------------------------------------------------------------

    @staticmethod
    def _pr_node_id(repo: FakeRepo, pr: FakePullRequest) -> str:
        return f"PR_fake{repo.database_id}x{pr.number}"

    def _user(self, login: str) -> dict[str, Any]:
        return {"login": login, "id": f"U_fake{login}", "name": login, "__typename": "User"}

    def _repo_gql(self, repo: FakeRepo) -> dict[str, Any]:
        url = f"{self.base_url()}/{repo.full_name}"
        return {
            "id": repo.node_id,
            "name": repo.name,
            "nameWithOwner": repo.full_name,
            "owner": {"id": f"U_fake{repo.owner}", "login": repo.owner},
            "description": repo.description,
            "url": url,
            "hasIssuesEnabled": True,
            "hasWikiEnabled": False,
            "viewerPermission": "WRITE",
            "defaultBranchRef": {"name": repo.default_branch},
            "parent": None,
            "isPrivate": False,
            "isFork": False,
            "isArchived": False,
            "mergeCommitAllowed": True,
            "rebaseMergeAllowed": True,
            "squashMergeAllowed": True,
            "stargazerCount": 0,
            "forkCount": 0,
            "watchers": {"totalCount": 0},
            "issues": {"totalCount": 0},
            "pullRequests": {"totalCount": len(repo.pulls)},
            "createdAt": "2024-01-01T00:00:00Z",
            "updatedAt": _now(),
            "pushedAt": _now(),
            "homepageUrl": "",
            "visibility": "PUBLIC",
            "repositoryTopics": {"nodes": []},
            "licenseInfo": None,
            "primaryLanguage": None,
        }

    def _pr_gql(self, repo: FakeRepo, pr: FakePullRequest) -> dict[str, Any]:
        url = f"{self.base_url()}/{repo.full_name}/pull/{pr.number}"
        comments = [
            {
                "id": f"IC_fake{c.id}",
                "author": self._user(c.author),
                "authorAssociation": "MEMBER",
                "body": c.body,
                "createdAt": c.created_at,
                "includesCreatedEdit": False,
                "isMinimized": False,
                "minimizedReason": "",
                "reactionGroups": [],
                "url": f"{url}#issuecomment-{c.id}",
                "viewerDidAuthor": c.author == self.viewer,
            }
            for c in pr.comments
        ]
        empty_page = {"hasNextPage": False, "endCursor": None}
        return {
            "__typename": "PullRequest",
            "id": self._pr_node_id(repo, pr),
            "url": url,
            "number": pr.number,
            "title": pr.title,
            "state": pr.state,
            "body": pr.body,
            "author": self._user(pr.author),
            "isDraft": pr.draft,
            "maintainerCanModify": pr.maintainer_can_modify,
            "mergeable": "MERGEABLE",
            "additions": 3,
            "deletions": 1,
            "changedFiles": 1,
            "commits": {"totalCount": 1},
            "baseRefName": pr.base,
            "headRefName": pr.head,
            "headRepositoryOwner": {"id": f"U_fake{repo.owner}", "login": repo.owner, "name": repo.owner},
            "headRepository": {"id": repo.node_id, "name": repo.name},
            "isCrossRepository": False,
            "reviewRequests": {"nodes": []},
            "reviews": {"nodes": [], "pageInfo": empty_page, "totalCount": 0},
            "assignees": {"nodes": [], "totalCount": 0},
            "labels": {"nodes": [], "totalCount": 0},
            "projectCards": {"nodes": [], "totalCount": 0},
            "projectItems": {"nodes": [], "pageInfo": empty_page},
            "milestone": None,
            "comments": {"nodes": comments, "pageInfo": empty_page, "totalCount": len(comments)},
            "reactionGroups": [],
            "createdAt": pr.created_at,
            "updatedAt": pr.updated_at,
            "closed": pr.state != "OPEN",
            "statusCheckRollup": {"nodes": [{"commit": {"statusCheckRollup": None}}]},
            "reviewDecision": None,
            "latestReviews": {"nodes": []},
            "mergeStateStatus": "CLEAN",
            "baseRef": {"branchProtectionRule": None},
        }

    def _pr_rest(self, repo: FakeRepo, pr: FakePullRequest) -> dict[str, Any]:
        api = f"{self.base_url()}/api/v3/repos/{repo.full_name}"
        user = {"login": pr.author, "id": self.viewer_id, "type": "User"}
        repo_rest = self._repo_rest(repo)
        return {
            "url": f"{api}/pulls/{pr.number}",
            "id": repo.database_id * 100000 + pr.number,
            "node_id": self._pr_node_id(repo, pr),
            "html_url": f"{self.base_url()}/{repo.full_name}/pull/{pr.number}",
            "number": pr.number,
            "state": "open" if pr.state == "OPEN" else "closed",
            "locked": False,
            "title": pr.title,
            "user": user,
            "body": pr.body,
            "created_at": pr.created_at,
            "updated_at": pr.updated_at,
            "closed_at": None,
            "merged_at": None,
            "draft": pr.draft,
            "head": {
                "label": f"{repo.owner}:{pr.head}",
                "ref": pr.head,
                "sha": "0" * 40,
                "user": user,
                "repo": repo_rest,
            },
            "base": {
                "label": f"{repo.owner}:{pr.base}",
                "ref": pr.base,
                "sha": "1" * 40,
                "user": user,
                "repo": repo_rest,
            },
            "maintainer_can_modify": pr.maintainer_can_modify,
            "comments": len(pr.comments),
        }

    def _repo_rest(self, repo: FakeRepo) -> dict[str, Any]:
        return {
            "id": repo.database_id,
            "node_id": repo.node_id,
            "name": repo.name,
            "full_name": repo.full_name,
            "private": False,
            "owner": {"login": repo.owner, "id": repo.database_id, "type": "Organization"},
            "html_url": f"{self.base_url()}/{repo.full_name}",
            "description": repo.description,
            "fork": False,
            "default_branch": repo.default_branch,
            "permissions": {"admin": False, "maintain": False, "push": True, "triage": True, "pull": True},
        }

    # ----- GraphQL ---------------------------------------------------------------------------------

    def graphql(self, operation: str, variables: dict[str, Any]) -> dict[str, Any]:
        handler = getattr(self, f"_gql_{operation}", None)
        if handler is None:
            raise GraphQLError(f"fake_github: unhandled GraphQL operation {operation!r}", type_="UNHANDLED")
        result: dict[str, Any] = handler(variables)
        return result

    def _gql_UserCurrent(self, v: dict[str, Any]) -> dict[str, Any]:
        return {"viewer": {"login": self.viewer}}

    def _gql_RepositoryInfo(self, v: dict[str, Any]) -> dict[str, Any]:
        return {"repository": self._repo_gql(self._repo(v["owner"], v["name"]))}

    def _gql_PullRequestByNumber(self, v: dict[str, Any]) -> dict[str, Any]:
        repo = self._repo(v["owner"], v["repo"])
        return {"repository": {"pullRequest": self._pr_gql(repo, self._pull(repo, int(v["pr_number"])))}}

    def _gql_PullRequestProjectItems(self, v: dict[str, Any]) -> dict[str, Any]:
        repo = self._repo(v["owner"], v["name"])
        pr = self._pull(repo, int(v["number"]))
        return {"repository": {"pullRequest": {"projectItems": self._pr_gql(repo, pr)["projectItems"]}}}

    def _list_prs(self, repo: FakeRepo, v: dict[str, Any]) -> list[FakePullRequest]:
        states = v.get("state") or ["OPEN"]
        prs = [p for p in repo.pulls.values() if p.state in states]
        if v.get("headBranch"):
            prs = [p for p in prs if p.head == v["headBranch"]]
        if v.get("baseBranch"):
            prs = [p for p in prs if p.base == v["baseBranch"]]
        return sorted(prs, key=lambda p: p.number, reverse=True)

    def _gql_PullRequestList(self, v: dict[str, Any]) -> dict[str, Any]:
        repo = self._repo(v["owner"], v["repo"])
        prs = self._list_prs(repo, v)
        limit = int(v.get("limit") or 30)
        nodes = [self._pr_gql(repo, p) for p in prs[:limit]]
        return {
            "repository": {
                "pullRequests": {
                    "totalCount": len(prs),
                    "nodes": nodes,
                    "pageInfo": {"hasNextPage": len(prs) > limit, "endCursor": None},
                }
            }
        }

    def _gql_PullRequestForBranch(self, v: dict[str, Any]) -> dict[str, Any]:
        repo = self._repo(v["owner"], v["repo"])
        prs = [
            p
            for p in repo.pulls.values()
            if p.head == v.get("headRefName") and p.state in (v.get("states") or ["OPEN", "CLOSED", "MERGED"])
        ]
        nodes = [self._pr_gql(repo, p) for p in prs]
        return {"repository": {"pullRequests": {"nodes": nodes}}}

    def _gql_PullRequestStatusChecks(self, v: dict[str, Any]) -> dict[str, Any]:
        repo, pr = self._pull_by_node(str(v["id"]))
        rollup = {"contexts": {"nodes": [], "pageInfo": {"hasNextPage": False, "endCursor": None}}}
        node = {
            **self._pr_gql(repo, pr),
            "statusCheckRollup": {"nodes": [{"commit": {"statusCheckRollup": rollup}}]},
        }
        return {"node": node}

    def _gql_PullRequestStatus(self, v: dict[str, Any]) -> dict[str, Any]:
        repo = self._repo(v["owner"], v["repo"])
        mine = [p for p in repo.pulls.values() if p.author == self.viewer and p.state == "OPEN"]
        on_branch = [p for p in repo.pulls.values() if v.get("headRefName") and p.head == v["headRefName"]]

        def edges(prs: list[FakePullRequest]) -> list[dict[str, Any]]:
            return [{"node": self._pr_gql(repo, p)} for p in sorted(prs, key=lambda p: -p.number)]

        return {
            "repository": {
                "defaultBranchRef": {"name": repo.default_branch},
                "pullRequests": {"totalCount": len(on_branch), "edges": edges(on_branch)},
            },
            "viewerCreated": {"totalCount": len(mine), "edges": edges(mine)},
            "reviewRequested": {"totalCount": 0, "edges": []},
        }

    def _gql_PullRequestCreate(self, v: dict[str, Any]) -> dict[str, Any]:
        inp = v["input"]
        repo = next((r for r in self.repos.values() if r.node_id == inp.get("repositoryId")), None)
        if repo is None:
            raise GraphQLError(
                f"Could not resolve to a node with the global id of '{inp.get('repositoryId')}'",
                path=["createPullRequest"],
            )
        head = str(inp["headRefName"])
        if ":" in head:
            owner, head = head.split(":", 1)
            if owner.lower() != repo.owner.lower():
                raise GraphQLError(
                    f"Head sha can't be blank, Base sha can't be blank, No commits between "
                    f"{inp['baseRefName']} and {inp['headRefName']}",
                    type_="UNPROCESSABLE",
                    path=["createPullRequest"],
                )
        if any(p.head == head and p.state == "OPEN" for p in repo.pulls.values()):
            raise GraphQLError(
                f"A pull request already exists for {repo.owner}:{head}.",
                type_="UNPROCESSABLE",
                path=["createPullRequest"],
            )
        pr = self._new_pull(
            repo,
            str(inp["title"]),
            str(inp.get("body") or ""),
            head,
            str(inp["baseRefName"]),
            bool(inp.get("draft", False)),
            self.viewer,
        )
        if inp.get("maintainerCanModify") is False:
            pr.maintainer_can_modify = False
        return {"createPullRequest": {"pullRequest": self._pr_gql(repo, pr)}}

    def _gql_CommentCreate(self, v: dict[str, Any]) -> dict[str, Any]:
        inp = v["input"]
        repo, pr = self._pull_by_node(str(inp["subjectId"]))
        comment = FakeComment(self._new_id(), str(inp["body"]), self.viewer, _now())
        pr.comments.append(comment)
        url = f"{self.base_url()}/{repo.full_name}/pull/{pr.number}#issuecomment-{comment.id}"
        return {"addComment": {"commentEdge": {"node": {"url": url}}}}

    def _gql_PullRequestUpdate(self, v: dict[str, Any]) -> dict[str, Any]:
        inp = v["input"]
        _repo, pr = self._pull_by_node(str(inp["pullRequestId"]))
        if "title" in inp:
            pr.title = str(inp["title"])
        if "body" in inp:
            pr.body = str(inp["body"])
        if "baseRefName" in inp:
            pr.base = str(inp["baseRefName"])
        pr.updated_at = _now()
        return {"updatePullRequest": {"__typename": "UpdatePullRequestPayload"}}

    # ----- REST ------------------------------------------------------------------------------------

    def diff(self, repo: FakeRepo, pr: FakePullRequest, patch: bool) -> str:
        """A small, well-formed diff (or mbox patch) for any PR: one file, three lines added, one removed."""
        diff = (
            "diff --git a/README.md b/README.md\n"
            "index 3b18e51..a9c2f7e 100644\n"
            "--- a/README.md\n"
            "+++ b/README.md\n"
            "@@ -1,2 +1,4 @@\n"
            " # project\n"
            f"-old line\n+{pr.title}\n+\n+{pr.head}\n"
        )
        if not patch:
            return diff
        return (
            f"From {'0' * 40} Mon Sep 17 00:00:00 2001\nFrom: {pr.author} <{pr.author}@example.invalid>\n"
            f"Subject: [PATCH] {pr.title}\n\n---\n{diff}--\n2.39.2\n"
        )

    def rest(self, method: str, path: str, body: Any, accept: str = "") -> tuple[int, Any]:
        parts = [p for p in path.split("/") if p]
        if parts == ["user"] and method == "GET":
            return 200, {"login": self.viewer, "id": self.viewer_id, "type": "User"}
        if len(parts) >= 3 and parts[0] == "repos":
            repo = self.repos.get(f"{parts[1]}/{parts[2]}".lower())
            if repo is None:
                return 404, {"message": "Not Found", "documentation_url": _DOCS}
            rest = parts[3:]
            if rest == [] and method == "GET":
                return 200, self._repo_rest(repo)
            if rest == ["pulls"] and method == "GET":
                prs = sorted(repo.pulls.values(), key=lambda p: p.number, reverse=True)
                return 200, [self._pr_rest(repo, p) for p in prs if p.state == "OPEN"]
            if rest == ["pulls"] and method == "POST":
                pr = self._new_pull(
                    repo,
                    str(body["title"]),
                    str(body.get("body") or ""),
                    str(body["head"]),
                    str(body["base"]),
                    bool(body.get("draft", False)),
                    self.viewer,
                )
                return 201, self._pr_rest(repo, pr)
            if len(rest) == 2 and rest[0] == "pulls" and rest[1].isdigit():
                pr_ = repo.pulls.get(int(rest[1]))
                if pr_ is None:
                    return 404, {"message": "Not Found", "documentation_url": _DOCS}
                if method == "PATCH":
                    for key in ("title", "body", "base"):
                        if key in body:
                            setattr(pr_, key, str(body[key]))
                elif "diff" in accept or "patch" in accept:
                    return 200, _Text(self.diff(repo, pr_, patch="patch" in accept))
                return 200, self._pr_rest(repo, pr_)
            if len(rest) == 3 and rest[0] == "issues" and rest[2] == "comments" and method == "POST":
                pr_ = repo.pulls.get(int(rest[1])) if rest[1].isdigit() else None
                if pr_ is None:
                    return 404, {"message": "Not Found", "documentation_url": _DOCS}
                comment = FakeComment(self._new_id(), str(body["body"]), self.viewer, _now())
                pr_.comments.append(comment)
                return 201, {"id": comment.id, "body": comment.body, "user": {"login": self.viewer}}
        return 404, {"message": "Not Found", "documentation_url": _DOCS}


def _make_handler(gh: FakeGitHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "GitHub.com"
        sys_version = ""

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

        def _send(self, status: int, payload: Any, extra: dict[str, str] | None = None) -> None:
            if isinstance(payload, _Text):
                data, ctype = payload.text.encode(), "text/plain; charset=utf-8"
            else:
                data, ctype = json.dumps(payload).encode(), "application/json; charset=utf-8"
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("X-GitHub-Media-Type", "github.v3; format=json")
            self.send_header("X-Oauth-Scopes", "repo, read:org")
            for key, value in (extra or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)

        def _handle(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length > _MAX_BODY:
                self._send(413, {"message": "Payload too large"})
                return
            raw = self.rfile.read(length) if length else b""
            body: Any = None
            if raw:
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = raw.decode("utf-8", "replace")
            headers = {k: v for k, v in self.headers.items()}
            auth = headers.pop("Authorization", "")
            scheme, _, presented = auth.partition(" ")
            if auth:
                headers["Authorization"] = f"{scheme} [redacted]"
            url = urlsplit(self.path)
            rec = RecordedRequest(self.command, url.path, parse_qs(url.query), headers, body)
            if isinstance(body, dict) and isinstance(body.get("query"), str):
                m = _OPERATION.search(body["query"])
                rec.operation = m.group(2) if m else None
                rec.variables = dict(body.get("variables") or {})
            with gh.lock:
                gh.requests.append(rec)
            if scheme.lower() not in ("token", "bearer") or presented != gh.token:
                rec.status = 401
                self._send(401, {"message": "Bad credentials", "documentation_url": _DOCS})
                return
            with gh.lock:
                status, payload = self._dispatch(url.path, body, rec)
            rec.status = status
            self._send(status, payload)

        def _dispatch(self, path: str, body: Any, rec: RecordedRequest) -> tuple[int, Any]:
            if path == "/api/graphql" and self.command == "POST":
                if rec.operation is None:
                    return 200, {"errors": [{"message": "fake_github: a GraphQL document without a named operation"}]}
                try:
                    return 200, {"data": gh.graphql(rec.operation, rec.variables)}
                except GraphQLError as err:
                    return 200, {
                        "data": err.data,
                        "errors": [
                            {
                                "type": err.type,
                                "path": err.path,
                                "locations": [{"line": 1, "column": 1}],
                                "message": str(err),
                            }
                        ],
                    }
                except (KeyError, TypeError, ValueError) as err:
                    return 200, {"errors": [{"message": f"fake_github: bad variables: {err!r}"}]}
            if path.startswith("/api/v3/"):
                try:
                    return gh.rest(self.command, path[len("/api/v3") :], body, self.headers.get("Accept", ""))
                except (KeyError, TypeError, ValueError) as err:
                    return 422, {"message": f"Validation Failed: {err!r}", "documentation_url": _DOCS}
            return 404, {"message": "Not Found", "documentation_url": _DOCS}

        do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _handle

    return Handler
