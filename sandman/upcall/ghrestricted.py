"""gh-restricted: the host-side front for the GitHub CLI that sandboxed agents reach through an upcall.

One module on purpose: the command table is what both the pflag parser and the policy read (a flag
known to one and not the other is a hole), and a gh command's whole path, table, parse, decide,
execute, is reviewed as one.

``parse_gh_args`` reads a gh command line the way gh (cobra/pflag) does, ``decide`` applies the session's
rules (see "Policy" below), and ``execute`` runs the real gh from the normalized request only.
"""

from __future__ import annotations

import contextlib
import csv
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, field_validator

from sandman.errors import SandmanError
from sandman.upcall.gitjail import drain

FlagValue = bool | int | str | tuple[str, ...]
FlagKind = Literal["bool", "int", "string", "csv", "forbidden"]
Mode = Literal["read-only", "draft-prs"]

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_MAX_OUTPUT = 1 << 20  # bytes kept per stream
MAX_TITLE = 256
MAX_BODY = 65536
_NO_ENV: Mapping[str, str] = MappingProxyType({})


class Rule(StrEnum):
    """Why a request was allowed or refused (the audit log keeps this)."""

    ALLOWED = "allowed"
    NEVER_ALLOWED = "never-allowed"
    UNKNOWN_COMMAND = "unknown-command"
    FORBIDDEN_FLAG = "forbidden-flag"
    UNKNOWN_FLAG = "unknown-flag"
    BAD_SYNTAX = "bad-syntax"
    READ_ONLY = "read-only"
    REPO_REQUIRED = "repo-required"
    BAD_REPO = "bad-repo"
    REPO_NOT_ALLOWED = "repo-not-allowed"
    DRAFT_ONLY = "draft-only"
    MISSING_VALUE = "missing-value"
    BAD_VALUE = "bad-value"
    BAD_ARGUMENT = "bad-argument"
    NOT_SESSION_PR = "not-session-pr"
    HEAD_NOT_PUSHED = "head-not-pushed"


class GhRefused(SandmanError):
    """gh-restricted refused the request; ``rule`` names the rule, ``str()`` says why."""

    exit_code = 77  # EX_NOPERM

    def __init__(self, rule: Rule, message: str) -> None:
        super().__init__(message if message.startswith("gh-restricted:") else f"gh-restricted: {message}")
        self.rule = rule


class GhError(SandmanError):
    """gh could not be run (not installed, bad helper configuration)."""

    exit_code = 69


# ----- configuration and models ---------------------------------------------------------------------

_OWNER = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,38})\Z")
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,100}\Z")
_HOST = re.compile(r"^[a-z0-9](?:[a-z0-9.-]{0,252})(?::[0-9]{1,5})?\Z")


def _valid_repo_name(owner: str, name: str) -> bool:
    return bool(_OWNER.match(owner) and _NAME.match(name) and name not in (".", ".."))


class GhConfig(BaseModel):
    """One session's gh-restricted settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Mode = "read-only"
    allowed_repos: list[str] = []  # "owner/name"; empty: reads may target any repo, writes none
    host: str = "github.com"  # GitHub Enterprise / test servers: "ghe.example.com" or "localhost:8443"
    # 'pr create --head' must start with this when the caller has no record of the session's pushes
    # (decide's pushed_heads is None); None: no prefix rule. The gh upcall helper always sets both.
    head_prefix: str | None = None

    @field_validator("allowed_repos")
    @classmethod
    def _check_repos(cls, repos: list[str]) -> list[str]:
        seen: dict[str, str] = {}
        for repo in repos:
            owner, sep, name = repo.partition("/")
            if not sep or not _valid_repo_name(owner, name):
                raise ValueError(f"allowed_repos entry {repo!r} is not OWNER/NAME")
            seen.setdefault(repo.lower(), repo)
        return list(seen.values())

    @field_validator("host")
    @classmethod
    def _check_host(cls, host: str) -> str:
        host = host.strip().lower()
        if not _HOST.match(host):
            raise ValueError(f"host {host!r} is not a hostname[:port]")
        return host


class GhRequest(BaseModel):
    """A parsed gh command line. ``known`` is False for commands outside the table (flags unparsed)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    command: tuple[str, ...]
    known: bool
    flags: dict[str, FlagValue] = {}  # canonical long name -> final value (last one wins)
    args: tuple[str, ...] = ()  # positionals, in order


class GhAction(BaseModel):
    """A normalized request: what gh will be asked to do, and the only source of its argv."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    command: tuple[str, str]
    kind: Literal["read", "write"]
    repo: str  # owner/name, spelled as in allowed_repos when listed there
    number: int | None = None  # the PR / issue / run the command targets
    tag: str | None = None  # release view
    flags: dict[str, FlagValue] = {}

    def argv(self) -> list[str]:
        """gh's arguments (without the program): flags as ``--name=value``, positionals after ``--``."""
        out = list(self.command)
        if self.command != ("repo", "view"):
            out.append(f"--repo={self.repo}")
        for name in sorted(self.flags):
            value = self.flags[name]
            if isinstance(value, bool):
                out.append(f"--{name}" if value else f"--{name}=false")
            elif isinstance(value, tuple):
                out.append(f"--{name}={','.join(value)}")
            else:
                out.append(f"--{name}={value}")
        positional = [self.repo] if self.command == ("repo", "view") else []
        if self.number is not None:
            positional.append(str(self.number))
        if self.tag is not None:
            positional.append(self.tag)
        if positional:
            out.extend(["--", *positional])
        return out


class Decision(BaseModel):
    """The verdict on one request. ``action`` is set exactly when ``allowed``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    allowed: bool
    rule: Rule
    message: str
    command: tuple[str, ...]
    action: GhAction | None = None


class GhResult(BaseModel):
    """What gh did. Output is decoded UTF-8 (invalid bytes replaced), capped, and never holds the token."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    exit_code: int
    stdout: str
    stderr: str
    created_pr: int | None = None
    argv: tuple[str, ...] = ()  # what gh was run with (program name excluded)
    timed_out: bool = False
    truncated: bool = False


# Policy, in order (the first rule that matches refuses; every message names its rule):
#
# * 'never-allowed': 'auth' (incl. 'auth token'), 'api', 'pr ready/merge/close/reopen/review/
#   checkout', 'repo delete/edit/...', 'secret', 'variable', 'ssh-key', 'gpg-key', 'config',
#   'extension', 'alias', 'codespace', 'workflow run', ... ; 'unknown-command': everything not
#   in the fixed list below (gh extensions included).
# * 'forbidden-flag': '-f'/'-F'/'--field'/'--raw-field'/'--input' anywhere, '--web',
#   '--editor', '--body-file' (reads a host file), '--fill' (reads the host's git), '--recover',
#   '--jq' (gh's jq has '$ENV', which holds the token), '--template', '--search' (a search query
#   can name other repositories), '--watch'. 'unknown-flag': any flag the command's table lacks, for
#   reads as well as writes (an unknown flag's arity is unknown, so the line cannot be parsed safely).
# * Reads (both modes): 'pr list/view/diff/checks/status', 'issue list/view', 'repo view',
#   'run list/view', 'release list/view'; they must target an allowed repo when 'allowed_repos' is set.
# * Writes ('draft-prs' mode only, repo in 'allowed_repos'): 'pr create' is always a draft
#   ('--draft' is forced, '--draft=false' refused) and needs '--title', '--body' and '--head'
#   ('--fill' is refused: it reads commits from the host's checkout, not the sandbox's); the head
#   must be a branch this session pushed through git-push ('head-not-pushed'; without a record of
#   the pushes, one under 'head_prefix'); 'pr edit N' ('--title'/'--body'/'--base') and
#   'pr comment N --body' only on PRs this session created.
# * Filter values that gh puts into a search query ('--label', '--milestone', logins, branches)
#   may not carry search syntax: no ':' qualifiers, parentheses, quotes or control characters
#   (gh quotes a value only when it holds whitespace, so '(repo:evil/secret)' would pass unquoted).
#
# The repo comes from '--repo/-R' ('OWNER/REPO', 'HOST/OWNER/REPO' or 'https://HOST/OWNER/REPO' on
# the configured host), or is the only entry of 'allowed_repos'; gh is never left to guess it from a git
# checkout. PR, issue and run selectors must be numbers (a URL would name its own repo). Flags must come
# after the command words ('pr view 5 -R o/r', not 'pr -R o/r view 5').

# ----- the command table ----------------------------------------------------------------------------


@dataclass(frozen=True)
class FlagSpec:
    name: str
    kind: FlagKind
    short: str | None = None
    choices: tuple[str, ...] = ()
    reason: str = ""  # for kind == "forbidden"


Positional = Literal["none", "pr", "number", "tag", "repo"]


@dataclass(frozen=True)
class CommandSpec:
    kind: Literal["read", "write"]
    flags: tuple[FlagSpec, ...]
    positional: Positional = "none"
    positional_required: bool = False
    repo_flag: bool = True

    def long(self, name: str) -> FlagSpec | None:
        return next((f for f in self.flags if f.name == name), None)

    def short(self, char: str) -> FlagSpec | None:
        return next((f for f in self.flags if f.short == char), None)


_WHY_WEB = "it opens a browser on the host"
_WHY_JQ = "gh's jq can read the helper's environment ($ENV), which holds the token; filter in the sandbox"
_WHY_TEMPLATE = "output templates are not supported; use --json and format in the sandbox"
_WHY_BODY_FILE = "it reads a file on the host; pass the text with --body"
_WHY_SEARCH = "a search query can name other repositories"

_FORBIDDEN_LONG: dict[str, str] = {
    "field": "it sends arbitrary API fields",
    "raw-field": "it sends arbitrary API fields",
    "input": "it sends an arbitrary request body",
    "web": _WHY_WEB,
    "editor": "it starts an editor on the host",
    "body-file": _WHY_BODY_FILE,
    "fill": "it reads commits from the host's git checkout; pass --title and --body",
    "recover": "it reads a file on the host",
    "jq": _WHY_JQ,
    "template": _WHY_TEMPLATE,
    "search": _WHY_SEARCH,
    "watch": "it runs until the helper's timeout",
    "hostname": "the host is fixed by the session",
}
# -f / -F are refused whatever they mean to a command (--field, --fill, --body-file, ...)
_FORBIDDEN_SHORT: dict[str, str] = {"f": "field", "F": "body-file"}


def _forbid(name: str, short: str | None = None) -> FlagSpec:
    return FlagSpec(name, "forbidden", short, reason=_FORBIDDEN_LONG[name])


_JSON = (FlagSpec("json", "csv"), _forbid("jq", "q"), _forbid("template", "t"))
_WEB = _forbid("web", "w")
_STATES_PR = ("open", "closed", "merged", "all")
_STATES_ISSUE = ("open", "closed", "all")

SPECS: dict[tuple[str, str], CommandSpec] = {
    ("pr", "list"): CommandSpec(
        "read",
        (
            FlagSpec("app", "string"),
            FlagSpec("assignee", "string", "a"),
            FlagSpec("author", "string", "A"),
            FlagSpec("base", "string", "B"),
            FlagSpec("draft", "bool", "d"),
            FlagSpec("head", "string", "H"),
            FlagSpec("label", "csv", "l"),
            FlagSpec("limit", "int", "L"),
            _forbid("search", "S"),
            FlagSpec("state", "string", "s", choices=_STATES_PR),
            _WEB,
            *_JSON,
        ),
    ),
    ("pr", "view"): CommandSpec("read", (FlagSpec("comments", "bool", "c"), _WEB, *_JSON), "pr", True),
    ("pr", "diff"): CommandSpec(
        "read",
        (
            FlagSpec("color", "string", choices=("always", "never", "auto")),
            FlagSpec("name-only", "bool"),
            FlagSpec("patch", "bool"),
            _WEB,
        ),
        "pr",
        True,
    ),
    ("pr", "checks"): CommandSpec(
        "read",
        (
            FlagSpec("required", "bool"),
            _forbid("watch"),
            FlagSpec("interval", "forbidden", "i", reason="it only works with --watch"),
            _WEB,
        ),
        "pr",
        True,
    ),
    ("pr", "status"): CommandSpec("read", (FlagSpec("conflict-status", "bool", "c"), *_JSON)),
    ("issue", "list"): CommandSpec(
        "read",
        (
            FlagSpec("app", "string"),
            FlagSpec("assignee", "string", "a"),
            FlagSpec("author", "string", "A"),
            FlagSpec("label", "csv", "l"),
            FlagSpec("limit", "int", "L"),
            FlagSpec("mention", "string"),
            FlagSpec("milestone", "string", "m"),
            _forbid("search", "S"),
            FlagSpec("state", "string", "s", choices=_STATES_ISSUE),
            _WEB,
            *_JSON,
        ),
    ),
    ("issue", "view"): CommandSpec("read", (FlagSpec("comments", "bool", "c"), _WEB, *_JSON), "number", True),
    ("repo", "view"): CommandSpec("read", (FlagSpec("branch", "string", "b"), _WEB, *_JSON), "repo", repo_flag=False),
    ("run", "list"): CommandSpec(
        "read",
        (
            FlagSpec("branch", "string", "b"),
            FlagSpec("limit", "int", "L"),
            FlagSpec("user", "string", "u"),
            FlagSpec("workflow", "string", "w"),
            *_JSON,
        ),
    ),
    ("run", "view"): CommandSpec(
        "read",
        (
            FlagSpec("exit-status", "bool"),
            FlagSpec("job", "string", "j"),
            FlagSpec("log", "bool"),
            FlagSpec("log-failed", "bool"),
            FlagSpec("verbose", "bool", "v"),
            _WEB,
            *_JSON,
        ),
        "number",
        True,
    ),
    ("release", "list"): CommandSpec(
        "read",
        (
            FlagSpec("exclude-drafts", "bool"),
            FlagSpec("exclude-pre-releases", "bool"),
            FlagSpec("limit", "int", "L"),
        ),
    ),
    ("release", "view"): CommandSpec("read", (_WEB, *_JSON), "tag"),
    ("pr", "create"): CommandSpec(
        "write",
        (
            FlagSpec("title", "string", "t"),
            FlagSpec("body", "string", "b"),
            FlagSpec("draft", "bool", "d"),
            FlagSpec("head", "string", "H"),
            FlagSpec("base", "string", "B"),
            _forbid("body-file", "F"),
            _forbid("fill", "f"),
            _forbid("recover"),
            _WEB,
        ),
    ),
    ("pr", "edit"): CommandSpec(
        "write",
        (
            FlagSpec("title", "string", "t"),
            FlagSpec("body", "string", "b"),
            FlagSpec("base", "string", "B"),
            _forbid("body-file", "F"),
        ),
        "pr",
        True,
    ),
    ("pr", "comment"): CommandSpec(
        "write",
        (
            FlagSpec("body", "string", "b"),
            _forbid("body-file", "F"),
            _forbid("editor", "e"),
            _WEB,
        ),
        "pr",
        True,
    ),
}
_REPO_FLAG = FlagSpec("repo", "string", "R")

# gh's own aliases for the commands above
_ALIASES: dict[tuple[str, str], str] = {
    ("pr", "new"): "create",
    ("pr", "ls"): "list",
    ("issue", "ls"): "list",
    ("run", "ls"): "list",
    ("release", "ls"): "list",
}
# top-level commands that take a subcommand (so "auth token" is reported as such)
_GROUPS = frozenset(
    {
        "pr",
        "issue",
        "repo",
        "run",
        "release",
        "workflow",
        "auth",
        "secret",
        "variable",
        "ssh-key",
        "gpg-key",
        "config",
        "extension",
        "extensions",
        "ext",
        "alias",
        "codespace",
        "cs",
        "gist",
        "label",
        "search",
        "cache",
        "org",
        "project",
        "ruleset",
        "attestation",
    }
)

NEVER: dict[tuple[str, ...], str] = {
    ("auth",): "credentials never leave the helper",
    ("api",): "raw API calls bypass every rule",
    ("pr", "ready"): "PRs made here stay drafts; a human marks them ready",
    ("pr", "merge"): "merging is for humans",
    ("pr", "close"): "closing is for humans",
    ("pr", "reopen"): "reopening is for humans",
    ("pr", "review"): "reviews (approvals) are for humans",
    ("pr", "checkout"): "it runs git on the host",
    ("repo", "delete"): "it destroys a repository",
    ("repo", "edit"): "it changes repository settings",
    ("repo", "archive"): "it changes repository settings",
    ("repo", "rename"): "it changes repository settings",
    ("repo", "create"): "it creates repositories",
    ("repo", "fork"): "it creates repositories",
    ("repo", "clone"): "it runs git on the host",
    ("repo", "sync"): "it pushes to a repository",
    ("repo", "deploy-key"): "it manages credentials",
    ("repo", "set-default"): "it writes gh's host configuration",
    ("secret",): "it manages secrets",
    ("variable",): "it manages Actions variables",
    ("ssh-key",): "it manages credentials",
    ("gpg-key",): "it manages credentials",
    ("config",): "it changes gh's host configuration",
    ("extension",): "extensions run arbitrary code on the host",
    ("extensions",): "extensions run arbitrary code on the host",
    ("ext",): "extensions run arbitrary code on the host",
    ("alias",): "aliases can run shell commands on the host",
    ("codespace",): "it reaches other machines",
    ("cs",): "it reaches other machines",
    ("workflow", "run"): "it starts workflows with the repository's secrets",
    ("workflow", "enable"): "it changes workflows",
    ("workflow", "disable"): "it changes workflows",
    ("run", "rerun"): "it starts workflows with the repository's secrets",
    ("run", "cancel"): "it changes workflow runs",
    ("run", "delete"): "it changes workflow runs",
    ("run", "download"): "it writes files on the host",
    ("release", "create"): "it publishes releases",
    ("release", "delete"): "it deletes releases",
    ("release", "delete-asset"): "it deletes release assets",
    ("release", "edit"): "it changes releases",
    ("release", "upload"): "it reads host files and publishes them",
    ("release", "download"): "it writes files on the host",
    ("browse",): "it opens a browser on the host",
}

READS = tuple(" ".join(c) for c, s in SPECS.items() if s.kind == "read")
WRITES = tuple(" ".join(c) for c, s in SPECS.items() if s.kind == "write")


# ----- parsing (pflag semantics) ----------------------------------------------------------------------

_TRUE = frozenset({"1", "t", "T", "TRUE", "true", "True"})  # Go's strconv.ParseBool
_FALSE = frozenset({"0", "f", "F", "FALSE", "false", "False"})
_INT = re.compile(r"^[+-]?(?:0|[1-9][0-9]{0,8})\Z")


def _lookup_long(spec: CommandSpec, name: str, command: str) -> FlagSpec:
    flag = _REPO_FLAG if name == "repo" and spec.repo_flag else spec.long(name)
    if flag is None and name in _FORBIDDEN_LONG:
        flag = _forbid(name)
    if flag is None:
        raise GhRefused(Rule.UNKNOWN_FLAG, f"'{command}' does not accept --{name} here")
    if flag.kind == "forbidden":
        short = f"/-{flag.short}" if flag.short else ""
        raise GhRefused(Rule.FORBIDDEN_FLAG, f"'--{name}{short}' is never allowed ({flag.reason})")
    return flag


def _lookup_short(spec: CommandSpec, char: str, command: str) -> FlagSpec:
    if char in _FORBIDDEN_SHORT:
        raise GhRefused(
            Rule.FORBIDDEN_FLAG,
            f"'-{char}' is never allowed (-f/-F send fields, fill from the host's git or read host files)",
        )
    flag = _REPO_FLAG if char == "R" and spec.repo_flag else spec.short(char)
    if flag is None:
        raise GhRefused(Rule.UNKNOWN_FLAG, f"'{command}' does not accept -{char} here")
    if flag.kind == "forbidden":
        raise GhRefused(Rule.FORBIDDEN_FLAG, f"'--{flag.name}/-{char}' is never allowed ({flag.reason})")
    return flag


def _set(values: dict[str, FlagValue], flag: FlagSpec, raw: str, shown: str) -> None:
    if flag.kind == "bool":
        if raw in _TRUE:
            values[flag.name] = True
        elif raw in _FALSE:
            values[flag.name] = False
        else:
            raise GhRefused(Rule.BAD_SYNTAX, f"invalid boolean {raw!r} for {shown}")
    elif flag.kind == "int":
        if not _INT.match(raw):
            raise GhRefused(Rule.BAD_SYNTAX, f"invalid number {raw!r} for {shown}")
        values[flag.name] = int(raw)
    elif flag.kind == "csv":
        # pflag's StringSlice: every occurrence appends, each value is one CSV record
        items = next(csv.reader([raw]), []) if raw else []
        previous = values.get(flag.name, ())
        values[flag.name] = (*(previous if isinstance(previous, tuple) else ()), *items)
    else:
        values[flag.name] = raw


def _parse_flags(spec: CommandSpec, args: Sequence[str], command: str) -> tuple[dict[str, FlagValue], tuple[str, ...]]:
    values: dict[str, FlagValue] = {}
    positional: list[str] = []
    i = 0
    while i < len(args):
        s = args[i]
        i += 1
        if len(s) < 2 or s[0] != "-":
            positional.append(s)  # includes "" and "-"
        elif s == "--":
            positional.extend(args[i:])
            break
        elif s[1] == "-":
            name, eq, value = s[2:].partition("=")
            if not name or name[0] in "-=":
                raise GhRefused(Rule.BAD_SYNTAX, f"bad flag syntax: {s}")
            flag = _lookup_long(spec, name, command)
            if eq:
                raw = value  # --flag=value
            elif flag.kind == "bool":
                raw = "true"  # --flag (a following word is a positional, as in pflag)
            elif i < len(args):
                raw = args[i]  # --flag value (taken even if it starts with "-", as in pflag)
                i += 1
            else:
                raise GhRefused(Rule.BAD_SYNTAX, f"flag needs an argument: --{name}")
            _set(values, flag, raw, f"--{name}")
        else:
            shorts = s[1:]
            while shorts:
                char = shorts[0]
                flag = _lookup_short(spec, char, command)
                if len(shorts) > 2 and shorts[1] == "=":
                    raw, shorts = shorts[2:], ""  # -t=value
                elif flag.kind == "bool":
                    raw, shorts = "true", shorts[1:]  # -d, or -dt... (combined)
                elif len(shorts) > 1:
                    raw, shorts = shorts[1:], ""  # -tvalue
                elif i < len(args):
                    raw, shorts = args[i], ""  # -t value
                    i += 1
                else:
                    raise GhRefused(Rule.BAD_SYNTAX, f"flag needs an argument: -{char}")
                _set(values, flag, raw, f"-{char}")
    return values, tuple(positional)


def parse_gh_args(argv: list[str]) -> GhRequest:
    """Parse a gh command line (without the program name). Raises GhRefused on malformed input and on
    unknown or forbidden flags of a known command; unknown commands parse to ``known=False``."""
    if not argv:
        raise GhRefused(Rule.BAD_SYNTAX, "no gh command given")
    if any("\x00" in a for a in argv):
        raise GhRefused(Rule.BAD_SYNTAX, "arguments must not contain NUL bytes")
    if argv[0].startswith("-"):
        raise GhRefused(Rule.BAD_SYNTAX, f"put the command first (e.g. 'pr view 5 -R OWNER/REPO'), not {argv[0]!r}")
    group = argv[0]
    if group not in _GROUPS or len(argv) < 2:
        return GhRequest(command=(group,), known=False)
    if argv[1].startswith("-"):
        if (group,) in NEVER:
            return GhRequest(command=(group,), known=False)
        raise GhRefused(
            Rule.BAD_SYNTAX,
            f"put the subcommand right after {group!r} (e.g. '{group} list -R OWNER/REPO'), not {argv[1]!r}",
        )
    command = (group, _ALIASES.get((group, argv[1]), argv[1]))
    spec = SPECS.get(command)
    if spec is None:
        return GhRequest(command=command, known=False)
    flags, args = _parse_flags(spec, argv[2:], " ".join(command))
    return GhRequest(command=command, known=True, flags=flags, args=args)


# ----- policy -------------------------------------------------------------------------------------------

_BRANCH_BAD = re.compile(r"(^[-/.])|(\.\.)|(//)|(@\{)|([/.]$)|(\.lock$)|(/\.)")
_BRANCH_OK = re.compile(r"^[A-Za-z0-9._/+-]{1,255}\Z")
_TAG_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/+-]{0,127}\Z")
_LOGIN_OK = re.compile(r"^@?[A-Za-z0-9](?:[A-Za-z0-9-]{0,38})(?:\[bot\])?\Z")
_LABEL_OK = re.compile(r"[^\x00-\x1f\x7f\"\\:()]{1,100}")  # fullmatch; no search syntax (see Policy)
_WORKFLOW_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._ -]{0,99}\Z")
_JSON_FIELD = re.compile(r"^[A-Za-z]{1,64}\Z")
_SELECTOR = re.compile(r"^#?([1-9][0-9]{0,11})\Z")
_DIGITS = re.compile(r"^[1-9][0-9]{0,19}\Z")


def _branch(value: str, flag: str) -> str:
    if not _BRANCH_OK.match(value) or _BRANCH_BAD.search(value):
        raise GhRefused(
            Rule.BAD_VALUE,
            f"{flag} {value!r} is not a plain branch name (letters, digits, '._/+-'; no ':' cross-repo heads)",
        )
    return value


def parse_repo(value: str, host: str) -> str:
    """``OWNER/REPO``, ``HOST/OWNER/REPO`` or ``https://HOST/OWNER/REPO`` on ``host`` -> ``owner/repo``."""
    text = value.strip()
    if text.lower().startswith(("https://", "http://")):
        url = urlsplit(text)
        if url.scheme != "https" or url.hostname is None or (url.netloc.lower() != host):
            raise GhRefused(Rule.BAD_REPO, f"repository URL {value!r} is not on {host}")
        parts = url.path.strip("/").split("/")
        if url.query or url.fragment:
            raise GhRefused(Rule.BAD_REPO, f"repository URL {value!r} has a query or fragment")
    else:
        parts = text.split("/")
        if len(parts) == 3:
            if parts[0].lower() != host:
                raise GhRefused(Rule.BAD_REPO, f"repository {value!r} is not on {host}")
            parts = parts[1:]
    if len(parts) != 2 or not _valid_repo_name(parts[0], parts[1]):
        raise GhRefused(Rule.BAD_REPO, f"{value!r} is not OWNER/REPO")
    return f"{parts[0]}/{parts[1]}"


def _resolve_repo(req: GhRequest, spec: CommandSpec, config: GhConfig) -> str:
    given: str | None = None
    if spec.positional == "repo":
        if len(req.args) > 1:
            raise GhRefused(Rule.BAD_ARGUMENT, "'repo view' takes at most one repository")
        given = req.args[0] if req.args else None
    elif "repo" in req.flags:
        value = req.flags["repo"]
        given = value if isinstance(value, str) else None
    if given is None:
        if len(config.allowed_repos) == 1:
            return config.allowed_repos[0]
        raise GhRefused(
            Rule.REPO_REQUIRED,
            f"'{' '.join(req.command)}' needs --repo OWNER/REPO"
            + (f" (one of: {', '.join(config.allowed_repos)})" if config.allowed_repos else ""),
        )
    repo = parse_repo(given, config.host)
    for allowed in config.allowed_repos:
        if allowed.lower() == repo.lower():
            return allowed
    if config.allowed_repos or spec.kind == "write":
        listed = ", ".join(config.allowed_repos) or "none"
        raise GhRefused(Rule.REPO_NOT_ALLOWED, f"repository '{repo}' is not allowed (allowed_repos: {listed})")
    return repo


def _text(flags: dict[str, FlagValue], name: str, limit: int, required: bool, nonblank: bool) -> str | None:
    value = flags.get(name)
    if value is None:
        if required:
            raise GhRefused(Rule.MISSING_VALUE, f"--{name} is required")
        return None
    assert isinstance(value, str)
    if nonblank and not value.strip():
        raise GhRefused(Rule.MISSING_VALUE, f"--{name} must not be empty")
    if len(value) > limit:
        raise GhRefused(Rule.BAD_VALUE, f"--{name} is longer than {limit} characters")
    return value


def _check_filter(name: str, value: FlagValue) -> FlagValue:
    """Validate a read command's filter flag; values that could smuggle search qualifiers are refused."""
    if name in ("assignee", "author", "mention", "user", "app"):
        if not isinstance(value, str) or not _LOGIN_OK.match(value):
            raise GhRefused(Rule.BAD_VALUE, f"--{name} {value!r} is not a GitHub login")
    elif name in ("base", "head", "branch"):
        assert isinstance(value, str)
        _branch(value, f"--{name}")
    elif name in ("label", "milestone"):
        for item in value if isinstance(value, tuple) else (str(value),):
            if not _LABEL_OK.fullmatch(item) or "," in item:
                raise GhRefused(
                    Rule.BAD_VALUE,
                    f"--{name} {item!r} is not allowed: gh puts it into a search query, so no ':', parentheses, "
                    "quotes, commas or control characters (list without it and filter the --json "
                    "output in the sandbox)",
                )
    elif name == "workflow":
        if not isinstance(value, str) or not _WORKFLOW_OK.match(value):
            raise GhRefused(Rule.BAD_VALUE, f"--workflow {value!r} is not a workflow name, file name or ID")
    elif name == "job":
        if not isinstance(value, str) or not _DIGITS.match(value):
            raise GhRefused(Rule.BAD_VALUE, f"--job {value!r} is not a job ID")
    elif name == "json":
        assert isinstance(value, tuple)
        if not value or not all(_JSON_FIELD.match(v) for v in value):
            raise GhRefused(Rule.BAD_VALUE, "--json needs field names (letters only), e.g. --json=number,title")
    elif name == "limit":
        assert isinstance(value, int)
        if not 1 <= value <= 1000:
            raise GhRefused(Rule.BAD_VALUE, "--limit must be between 1 and 1000")
    return value


def _selector(req: GhRequest, spec: CommandSpec) -> tuple[int | None, str | None]:
    command = " ".join(req.command)
    if spec.positional in ("none", "repo"):
        if spec.positional == "none" and req.args:
            raise GhRefused(Rule.BAD_ARGUMENT, f"'{command}' takes no arguments (got {req.args[0]!r})")
        return None, None
    if len(req.args) > 1:
        raise GhRefused(Rule.BAD_ARGUMENT, f"'{command}' takes one argument (got {len(req.args)})")
    if not req.args:
        if spec.positional_required:
            what = {"pr": "a PR number", "number": "a number"}.get(spec.positional, "an argument")
            raise GhRefused(
                Rule.BAD_ARGUMENT,
                f"'{command}' needs {what}; gh-restricted never guesses it from a git checkout",
            )
        return None, None
    arg = req.args[0]
    if spec.positional == "tag":
        if not _TAG_OK.match(arg) or ".." in arg or "//" in arg:
            raise GhRefused(Rule.BAD_ARGUMENT, f"{arg!r} is not a release tag")
        return None, arg
    m = _SELECTOR.match(arg)
    if not m:
        what = "a number"
        if spec.positional == "pr":
            what = "a PR number (URLs and branch names are not accepted)"
        raise GhRefused(Rule.BAD_ARGUMENT, f"'{command}' needs {what}, not {arg!r}")
    return int(m.group(1)), None


def _is_session_pr(repo: str, number: int, config: GhConfig, session_prs: Collection[int | tuple[str, int]]) -> bool:
    if (repo, number) in session_prs or any(
        isinstance(p, tuple) and p[0].lower() == repo.lower() and p[1] == number for p in session_prs
    ):
        return True
    # a bare number is unambiguous only when the session can write to a single repository
    return len(config.allowed_repos) == 1 and number in session_prs


def _decide(
    req: GhRequest,
    config: GhConfig,
    session_prs: Collection[int | tuple[str, int]],
    pushed_heads: Collection[str] | None = None,
) -> GhAction:
    command = " ".join(req.command)
    for size in (1, 2):
        reason = NEVER.get(req.command[:size]) if len(req.command) >= size else None
        if reason:
            raise GhRefused(Rule.NEVER_ALLOWED, f"'{command}' is never allowed ({reason})")
    spec = SPECS.get((req.command[0], req.command[1])) if req.known and len(req.command) == 2 else None
    if spec is None:
        hint = (
            "needs a subcommand" if req.command[0] in _GROUPS and len(req.command) == 1 else "is not an allowed command"
        )
        raise GhRefused(
            Rule.UNKNOWN_COMMAND,
            f"'{command}' {hint} (reads: {', '.join(READS)}; writes in draft-prs mode: {', '.join(WRITES)})",
        )
    if spec.kind == "write" and config.mode != "draft-prs":
        raise GhRefused(Rule.READ_ONLY, f"'{command}' is a write and this session is read-only")
    flags = dict(req.flags)
    for name, value in flags.items():
        flag = _REPO_FLAG if name == "repo" else spec.long(name)
        if flag is not None and flag.choices and value not in flag.choices:
            raise GhRefused(Rule.BAD_VALUE, f"--{name} must be one of {', '.join(flag.choices)}")
    repo = _resolve_repo(req, spec, config)
    flags.pop("repo", None)
    number, tag = _selector(req, spec)
    cmd = (req.command[0], req.command[1])

    if spec.kind == "read":
        flags = {name: _check_filter(name, value) for name, value in flags.items()}
        flags = {name: value for name, value in flags.items() if value != ()}  # e.g. --label=""
        return GhAction(command=cmd, kind="read", repo=repo, number=number, tag=tag, flags=flags)

    if cmd == ("pr", "create"):
        if flags.get("draft") is False:
            raise GhRefused(Rule.DRAFT_ONLY, "'pr create' always makes a draft; --draft=false is never allowed")
        title = _text(flags, "title", MAX_TITLE, required=True, nonblank=True)
        body = _text(flags, "body", MAX_BODY, required=True, nonblank=False)
        head = flags.get("head")
        if not isinstance(head, str):
            raise GhRefused(Rule.MISSING_VALUE, "--head BRANCH is required (the branch pushed for this PR)")
        _check_head(_branch(head, "--head"), config, pushed_heads)
        out: dict[str, FlagValue] = {"title": title or "", "body": body or "", "draft": True, "head": head}
        if "base" in flags:
            out["base"] = _branch(str(flags["base"]), "--base")
        return GhAction(command=cmd, kind="write", repo=repo, flags=out)

    assert number is not None  # pr edit / pr comment require a PR number
    if not _is_session_pr(repo, number, config, session_prs):
        raise GhRefused(
            Rule.NOT_SESSION_PR,
            f"'{command}' is only allowed on PRs this session created (#{number} in {repo} is not one)",
        )
    if cmd == ("pr", "comment"):
        body = _text(flags, "body", MAX_BODY, required=True, nonblank=True)
        return GhAction(command=cmd, kind="write", repo=repo, number=number, flags={"body": body or ""})
    # pr edit
    out = {}
    if "title" in flags:
        out["title"] = _text(flags, "title", MAX_TITLE, required=True, nonblank=True) or ""
    if "body" in flags:
        out["body"] = _text(flags, "body", MAX_BODY, required=True, nonblank=False) or ""
    if "base" in flags:
        out["base"] = _branch(str(flags["base"]), "--base")
    if not out:
        raise GhRefused(Rule.MISSING_VALUE, "'pr edit' needs --title, --body or --base")
    return GhAction(command=cmd, kind="write", repo=repo, number=number, flags=out)


def _check_head(head: str, config: GhConfig, pushed_heads: Collection[str] | None) -> None:
    if pushed_heads is not None:
        if head not in pushed_heads:
            listed = ", ".join(sorted(pushed_heads)) or "none yet"
            raise GhRefused(
                Rule.HEAD_NOT_PUSHED,
                f"--head {head!r} is not a branch this session pushed (push it first with "
                f"'sandman-upcall git-push'; pushed: {listed})",
            )
    elif config.head_prefix is not None and not head.startswith(config.head_prefix):
        raise GhRefused(
            Rule.HEAD_NOT_PUSHED,
            f"--head {head!r} is not a branch pushed through git-push (those start with {config.head_prefix!r})",
        )


def decide(
    req: GhRequest,
    config: GhConfig,
    session_prs: Collection[int | tuple[str, int]],
    pushed_heads: Collection[str] | None = None,
) -> Decision:
    """Apply the policy. ``session_prs`` holds the PRs this session created: ``(repo, number)`` pairs, or
    bare numbers, which count only when ``allowed_repos`` has exactly one entry. ``pushed_heads``: the
    remote branches this session pushed, the only heads 'pr create' accepts; None when the caller keeps
    no such record (then ``config.head_prefix``, if set, is the rule)."""
    try:
        action = _decide(req, config, session_prs, pushed_heads)
    except GhRefused as refused:
        return Decision(allowed=False, rule=refused.rule, message=str(refused), command=req.command)
    what = f"{action.kind} '{' '.join(action.command)}' on {action.repo}"
    return Decision(
        allowed=True,
        rule=Rule.ALLOWED,
        message=f"gh-restricted: allowed {what}",
        command=req.command,
        action=action,
    )


def evaluate(
    argv: list[str],
    config: GhConfig,
    session_prs: Collection[int | tuple[str, int]],
    pushed_heads: Collection[str] | None = None,
) -> Decision:
    """``parse_gh_args`` then ``decide``, with a parse refusal turned into a refused Decision."""
    try:
        req = parse_gh_args(argv)
    except GhRefused as refused:
        words = [a for a in argv[:2] if not a.startswith("-")]
        return Decision(allowed=False, rule=refused.rule, message=str(refused), command=tuple(words))
    return decide(req, config, session_prs, pushed_heads)


# ----- execution --------------------------------------------------------------------------------------

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_RESERVED_ENV = frozenset({"PATH", "HOME", "NO_COLOR", "GIT_CEILING_DIRECTORIES", "GIT_CONFIG_NOSYSTEM"})
_RESERVED_PREFIXES = ("GH_", "GITHUB_", "GIT_", "LD_")


def _gh_env(config: GhConfig, token: str, home: str, env_extra: Mapping[str, str]) -> dict[str, str]:
    for key in env_extra:
        upper = key.upper()
        if not _ENV_NAME.match(key) or upper in _RESERVED_ENV or upper.startswith(_RESERVED_PREFIXES):
            raise GhError(f"gh-restricted: env_extra may not set {key!r}")
    env = dict(env_extra)
    env.update(
        {
            "PATH": os.environ.get("PATH") or os.defpath,
            "HOME": home,
            "GH_PROMPT_DISABLED": "1",
            "NO_COLOR": "1",
            "GH_NO_UPDATE_NOTIFIER": "1",
            # gh runs `git remote -v` / `git status` in its working directory (our empty HOME): keep git
            # from searching parent directories or reading the system config
            "GIT_CEILING_DIRECTORIES": os.path.dirname(home),
            "GIT_CONFIG_NOSYSTEM": "1",
        }
    )
    if config.host == "github.com":
        env["GH_TOKEN"] = token
    else:
        env["GH_HOST"] = config.host
        env["GH_ENTERPRISE_TOKEN"] = token
    return env


def _scrub(data: bytes, token: str, cut: bool) -> str:
    """Decode and remove the token; if the cap cut the output, a token split by the cut goes too."""
    text = data.decode("utf-8", "replace").replace(token, "[REDACTED]")
    if cut:
        for size in range(len(token) - 1, 3, -1):
            if text.endswith(token[:size]):
                return text[:-size] + "[REDACTED]"
    return text


def _created_pr(stdout: str, host: str, repo: str) -> int | None:
    pattern = re.compile(
        rf"^https://{re.escape(host)}/{re.escape(repo)}/pull/([0-9]+)\s*$", re.IGNORECASE | re.MULTILINE
    )
    found = pattern.findall(stdout)
    return int(found[-1]) if found else None


def execute(
    decision: Decision,
    config: GhConfig,
    token: str,
    gh_path: str = "gh",
    env_extra: Mapping[str, str] = _NO_ENV,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    max_output: int = DEFAULT_MAX_OUTPUT,
) -> GhResult:
    """Run gh for an allowed decision: argv from ``decision.action`` only, no shell, stdin closed, a
    private HOME (and working directory), only the token and gh's non-interactive settings in the
    environment, a timeout (exit 124) and ``max_output`` bytes kept per stream. The token's value is
    scrubbed from what is returned."""
    action = decision.action
    if not decision.allowed or action is None:
        raise GhRefused(decision.rule, decision.message)
    if action.kind == "write" and config.mode != "draft-prs":  # a decision made under other settings
        raise GhRefused(Rule.READ_ONLY, f"'{' '.join(action.command)}' is a write and this session is read-only")
    if (config.allowed_repos or action.kind == "write") and action.repo not in config.allowed_repos:
        raise GhRefused(Rule.REPO_NOT_ALLOWED, f"repository '{action.repo}' is not allowed")
    if not token or any(c.isspace() or ord(c) < 32 for c in token):
        raise GhError("gh-restricted: the GitHub token is empty or malformed")
    path = os.environ.get("PATH") or os.defpath
    exe = shutil.which(gh_path, path=path)
    if exe is None:
        raise GhError(f"gh-restricted: {gh_path!r} not found; install the GitHub CLI (apt-get install gh)")
    args = action.argv()
    with tempfile.TemporaryDirectory(prefix="sandman-gh-") as home:
        env = _gh_env(config, token, home, env_extra)
        proc = subprocess.Popen(  # argv built from the normalized action; no shell
            [exe, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=home,
            close_fds=True,
            start_new_session=True,
        )
        out: list[bytes] = []
        err: list[bytes] = []
        out_cut: list[bool] = []
        err_cut: list[bool] = []
        assert proc.stdout is not None and proc.stderr is not None
        readers = [
            threading.Thread(target=drain, args=(proc.stdout, out, max_output, out_cut), daemon=True),
            threading.Thread(target=drain, args=(proc.stderr, err, max_output, err_cut), daemon=True),
        ]
        for reader in readers:
            reader.start()
        timed_out = False
        try:
            exit_code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # gh and anything it started (git), nothing else
            proc.wait()
            exit_code = 124
        for reader in readers:
            reader.join(timeout=5)
    stdout = _scrub(b"".join(out), token, bool(out_cut))
    stderr = _scrub(b"".join(err), token, bool(err_cut))
    if timed_out:
        stderr += f"\ngh-restricted: gh timed out after {timeout:g}s and was killed\n"
    created = None
    if action.command == ("pr", "create") and exit_code == 0:
        created = _created_pr(stdout, config.host, action.repo)
    return GhResult(
        exit_code=exit_code,
        stdout=stdout,
        stderr=stderr,
        created_pr=created,
        argv=tuple(args),
        timed_out=timed_out,
        truncated=bool(out_cut or err_cut),
    )
