"""Poison: what an agent can leave in a workspace that makes the host user's own tools run its code.

The sandbox lets the agent write the workspace, and the host user's git obeys what it finds there:
``core.fsmonitor`` in a config runs a command on the next ``git status``; so do hooks, aliases
starting with ``!``, filters, pagers, editors... and git can be pointed at an agent-made config in
many ways besides ``.git/config`` (a ``.git`` *file* saying ``gitdir: .g``, ``.git`` renamed away and
replaced, ``commondir``, ``.git/modules/*``, linked worktrees, nested repositories, ``include.path``).
Protection inside the sandbox (read-only ``.git`` config and hooks) narrows this; this module is
the independent check afterwards, on the host, and catches what protection cannot.

:func:`scan_workspace` reads the workspace the way an attacker cannot steer: from directory
descriptors, one name at a time, with ``O_NOFOLLOW|O_NONBLOCK``; it never follows a symlink, never
opens anything but a regular file (never a FIFO or device), reads at most :data:`MAX_FILE_BYTES` of
a file and never runs git. It parses git's config syntax itself, like git's own parser
(``config.c``), and in doubt reports more, not less: lines git would refuse are skipped and
parsing goes on, and a sweep for dangerous key names catches what the parser did not read as a key.

:func:`take_baseline` before a session and ``scan_workspace(ws, baseline)`` after it report only
what is new or changed, i.e. the agent's. Both are cheap and never raise: a scan that fails or stops
early says so in a finding (kinds ``error`` and ``truncated``) that no baseline suppresses.

:func:`quarantine` moves flagged files (whole config files, hooks, pointer files) out of the
workspace into a host directory, with a manifest.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_ENTRIES = 200_000  # directory entries looked at before the scan stops (and says so)
MAX_SECONDS = 30.0
MAX_DEPTH = 256  # directory depth; deeper makes the check incomplete, which gates the next start
MAX_FILE_BYTES = 16 << 20  # read from one file; a larger config is reported (and gates the next start)
MAX_TOTAL_BYTES = 64 << 20
MAX_FINDINGS = 2000
MAX_INCLUDE_DEPTH = 10  # git's own limit
EXIT_FOUND = 65  # `sandman inspect`: something was found (EX_DATAERR)

Kind = Literal[
    "exec",  # a config key whose value git runs as a command
    "redirect",  # makes git read or write elsewhere: hooksPath, core.worktree, alternates, symlinks
    "include",  # include.path / includeIf.*.path: another file is read as config
    "hook",  # a file in a hooks directory
    "gitdir",  # a `.git` file or symlink, a commondir or worktree gitdir pointer
    "nested-repo",  # a `.git` directory below the workspace root
    "lookalike",  # a directory git accepts as a repository (HEAD, objects, refs) under another name
    "missing",  # a `.git` the baseline had is gone (renamed away?)
    "special",  # a FIFO, device or socket where git reads, or a file too large to check
    "autorun",  # editor / shell tooling that runs workspace code when the folder is opened or entered
    "unparsed",  # config text git may read differently from sandman's parser
    "truncated",  # the scan stopped early: what lies past it was not checked
    "error",  # the scan failed
]
Status = Literal["present", "new", "changed"]

_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_O_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_ALWAYS = ("truncated", "error")  # kinds a baseline never suppresses


class Finding(BaseModel):
    """One thing in the workspace that can make a host tool run or read what the agent chose."""

    model_config = ConfigDict(frozen=True)

    path: str = Field(description="workspace-relative, '/'-separated; '.' is the workspace itself")
    key: str = Field(description="config key (core.fsmonitor), hook:<name>, gitdir, commondir, ...")
    kind: Kind
    value: str = Field(default="", description="the value as written (made printable), or a digest")
    detail: str = Field(description="why it matters: what runs it, or where it points")
    status: Status = Field(default="present", description="new/changed: relative to a baseline")

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps([self.path, self.key, self.kind, self.value]).encode()).hexdigest()[:32]

    def line(self) -> str:
        """``path: key = value (why)``; every part is printable (no control characters)."""
        value = f" = {self.value}" if self.value else ""
        status = f"{self.status}: " if self.status != "present" else ""
        return f"{self.path}: {_printable(self.key)}{value} ({status}{self.detail})"


class Baseline(BaseModel):
    """What was there before the session (JSON-serialisable: ``model_dump_json``)."""

    version: Literal[1] = 1
    workspace: str = ""
    taken: float = 0.0
    findings: list[Finding] = Field(default_factory=list)
    digests: dict[str, str] = Field(default_factory=dict, description="path -> sha256 of each flagged file")
    gitdirs: dict[str, str] = Field(default_factory=dict, description="path -> dir/file/symlink/lookalike")
    truncated: bool = False
    error: str | None = None


class QuarantinedFile(BaseModel):
    path: str
    dest: str | None = None
    keys: list[str] = Field(default_factory=list)
    method: Literal["rename", "copy", "skipped", "failed"]
    sha256: str | None = None
    size: int | None = None
    error: str | None = None


class QuarantineReport(BaseModel):
    dest_dir: str
    manifest: str | None = None
    files: list[QuarantinedFile] = Field(default_factory=list)
    note: str = (
        "config files are quarantined whole: legitimate settings in them moved too; "
        "restore a file by moving it back from files/ to the same path in the workspace"
    )

    @property
    def moved(self) -> list[QuarantinedFile]:
        return [f for f in self.files if f.method in ("rename", "copy")]


# -- printable, reversible paths ------------------------------------------------------------------


def _printable(text: str, cap: int = 240) -> str:
    out = []
    for ch in text:
        o = ord(ch)
        if o < 0x20 or 0x7F <= o < 0xA0:
            out.append(f"\\x{o:02x}")
        elif 0xD800 <= o < 0xE000 or o in (0x2028, 0x2029, 0x200E, 0x200F) or 0x202A <= o <= 0x202E:
            out.append(f"\\u{o:04x}")
        else:
            out.append(ch)
    s = "".join(out)
    return s if len(s) <= cap else s[:cap] + "..."


def _enc_name(name: str) -> str:
    """A file name as printable UTF-8, reversibly: ``\\`` and every byte that is not printable
    UTF-8 become ``\\\\`` / ``\\xNN``."""
    raw = os.fsencode(name)
    text = raw.decode("utf-8", "surrogateescape")
    if "\\" not in text and text.isprintable() and all(not (0xD800 <= ord(c) < 0xE000) for c in text):
        return text
    out = []
    for ch in text:
        o = ord(ch)
        if ch == "\\":
            out.append("\\\\")
        elif 0xDC80 <= o <= 0xDCFF:
            out.append(f"\\x{o - 0xDC00:02x}")
        elif not ch.isprintable():
            out.extend(f"\\x{b:02x}" for b in ch.encode("utf-8", "surrogateescape"))
        else:
            out.append(ch)
    return "".join(out)


def _dec_name(text: str) -> str:
    out = bytearray()
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "\\" and text.startswith("\\\\", i):
            out += b"\\"
            i += 2
        elif ch == "\\" and re.match(r"\\x[0-9a-fA-F]{2}", text[i : i + 4]):
            out.append(int(text[i + 2 : i + 4], 16))
            i += 4
        else:
            out += ch.encode("utf-8")
            i += 1
    return os.fsdecode(bytes(out))


def _rel(parts: tuple[str, ...]) -> str:
    return "/".join(_enc_name(p) for p in parts) or "."


def _parts_of(path: str) -> tuple[str, ...]:
    """The names of a Finding's path; refuses anything that is not a plain relative path."""
    if path in ("", "."):
        return ()
    names = tuple(_dec_name(p) for p in path.split("/"))
    for n in names:
        if n in ("", ".", "..") or "/" in n or "\x00" in n:
            raise ValueError(f"not a workspace-relative path: {path!r}")
    return names


# -- git's config syntax --------------------------------------------------------------------------

_SPACE = frozenset(" \t\n\r")  # git's own isspace(): not \v or \f
_ALPHA = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_KEYCHAR = _ALPHA | frozenset("0123456789-")
_ESCAPES = {"t": "\t", "b": "\b", "n": "\n", "\\": "\\", '"': '"'}


@dataclass(frozen=True)
class ConfigEntry:
    name: str  # as git compares it: section and key lowercased, subsection as written
    value: str | None  # None: a bare key, which git reads as true
    line: int

    @property
    def section(self) -> str:
        return self.name.split(".", 1)[0]

    @property
    def key(self) -> str:
        return self.name.rsplit(".", 1)[-1] if "." in self.name else ""

    @property
    def subsection(self) -> str | None:
        first, last = self.name.find("."), self.name.rfind(".")
        return self.name[first + 1 : last] if 0 <= first < last else None


@dataclass
class ParsedConfig:
    entries: list[ConfigEntry] = field(default_factory=list)
    errors: list[int] = field(default_factory=list)  # lines git refuses ("bad config line N")


class _Reader:
    """git's get_next_char(): CRLF reads as LF, end of input reads as a final LF."""

    def __init__(self, text: str) -> None:
        self.s, self.i, self.n = text, 0, len(text)
        self.eof = False
        self.line = 1
        self.last = ""

    def next(self) -> str:
        if self.i >= self.n:
            self.eof = True
            self.last = "\n"
            return "\n"
        c = self.s[self.i]
        self.i += 1
        if c == "\r" and self.i < self.n and self.s[self.i] == "\n":
            c = "\n"
            self.i += 1
        if c == "\n":
            self.line += 1
        self.last = c
        return c

    def skip_line(self) -> None:
        while self.last != "\n":
            self.next()


def _base_var(r: _Reader) -> str | None:
    name: list[str] = []
    while True:
        c = r.next()
        if r.eof:
            return None
        if c == "]":
            return "".join(name)
        if c in _SPACE:
            return _extended_base_var(r, name, c)
        if c not in _KEYCHAR and c != ".":
            return None
        name.append(c.lower())


def _extended_base_var(r: _Reader, name: list[str], c: str) -> str | None:
    while True:
        if c == "\n":
            return None
        c = r.next()
        if c not in _SPACE:
            break
    if c != '"':
        return None
    name.append(".")
    while True:
        c = r.next()
        if c == "\n":
            return None
        if c == '"':
            break
        if c == "\\":
            c = r.next()
            if c == "\n":
                return None
        name.append(c)
    if r.next() != "]":
        return None
    return "".join(name)


def _parse_value(r: _Reader) -> tuple[str, bool]:
    """git's parse_value(): (value, ok)."""
    quote = comment = False
    space = 0
    out: list[str] = []
    while True:
        c = r.next()
        if c == "\n":
            return "".join(out), not quote
        if comment:
            continue
        if c in _SPACE and not quote:
            if out:
                space += 1
            continue
        if not quote and c in "#;":
            comment = True
            continue
        if space:
            out.append(" " * space)
            space = 0
        if c == "\\":
            c = r.next()
            if c == "\n":
                if r.eof:
                    return "".join(out), False
                continue
            if c not in _ESCAPES:
                return "".join(out), False
            out.append(_ESCAPES[c])
            continue
        if c == '"':
            quote = not quote
            continue
        out.append(c)


def parse_git_config(data: bytes) -> ParsedConfig:
    """Entries of a git config file, read the way git 2.39's config.c reads them.

    Where git would stop with "bad config line N", the line is recorded in ``errors`` and parsing
    resumes on the next line (git would not get that far; reporting more is the safe side).
    Values are decoded as UTF-8 with replacement characters.
    """
    text = data.decode("latin-1")
    if text.startswith("\xef\xbb\xbf"):
        text = text[3:]
    r = _Reader(text)
    result = ParsedConfig()
    base = ""
    comment = False

    def fail(line: int) -> None:
        result.errors.append(line)
        r.skip_line()

    while True:
        c = r.next()
        if c == "\n":
            if r.eof:
                return result
            comment = False
            continue
        if comment or c in _SPACE:
            continue
        if c in "#;":
            comment = True
            continue
        line = r.line
        if c == "[":
            header = _base_var(r)
            if not header:
                base = ""
                fail(line)
                continue
            base = header + "."
            continue
        if c not in _ALPHA:
            fail(line)
            continue
        name = [c.lower()]
        while True:
            c = r.next()
            if r.eof or c not in _KEYCHAR:
                break
            name.append(c.lower())
        while c in " \t":
            c = r.next()
        # git hands names and values on as C strings: a NUL ends them
        full = (base + "".join(name)).split("\x00", 1)[0].encode("latin-1").decode("utf-8", "replace")
        if c == "\n":
            result.entries.append(ConfigEntry(full, None, line))
            continue
        if c != "=":
            fail(line)
            continue
        value, ok = _parse_value(r)
        shown = value.split("\x00", 1)[0].encode("latin-1").decode("utf-8", "replace")
        result.entries.append(ConfigEntry(full, shown, line))
        if not ok:
            fail(line)


# -- which keys matter ----------------------------------------------------------------------------

_ATTR = "for files whose .gitattributes name the driver (the agent writes .gitattributes too)"
# (section, key) without a subsection -> why
_EXEC2: dict[tuple[str, str], str] = {
    ("core", "fsmonitor"): "git runs it on every git status, diff, add, commit",
    ("core", "sshcommand"): "git runs it on fetch/push/clone over ssh",
    ("core", "pager"): "git runs it on log/diff/show/branch in a terminal",
    ("core", "editor"): "git runs it on commit, rebase -i, tag -a, merge",
    ("core", "askpass"): "git runs it when it needs a password",
    ("core", "gitproxy"): "git runs it on git:// fetches",
    ("core", "alternaterefscommand"): "git runs it on fetch/push with alternates",
    ("sequence", "editor"): "git runs it on rebase -i",
    ("diff", "external"): "git runs it on git diff",
    ("credential", "helper"): "git runs it on fetch/push that needs credentials",
    ("gpg", "program"): "git runs it on signing and on verifying (log --show-signature, commit -S)",
    ("uploadpack", "packobjectshook"): "runs on upload-pack (git ignores it in repository config; reported anyway)",
    ("interactive", "difffilter"): "git runs it on add -p",
    ("imap", "tunnel"): "git runs it on imap-send",
    ("sendemail", "tocmd"): "git runs it on send-email",
    ("sendemail", "cccmd"): "git runs it on send-email",
    ("sendemail", "headercmd"): "git runs it on send-email",
}
# (section, key) with any subsection -> why
_EXEC3: dict[tuple[str, str], str] = {
    ("diff", "textconv"): "git runs it on diff/log -p/blame/grep " + _ATTR,
    ("diff", "command"): "git runs it on diff " + _ATTR,
    ("merge", "driver"): "git runs it on merges " + _ATTR,
    ("filter", "clean"): "git runs it on status/add/diff " + _ATTR,
    ("filter", "smudge"): "git runs it on checkout/switch/reset " + _ATTR,
    ("filter", "process"): "git runs it on status/add/checkout " + _ATTR,
    ("credential", "helper"): "git runs it on fetch/push that needs credentials",
    ("gpg", "program"): "git runs it on signing and on verifying",
    ("gpg", "defaultkeycommand"): "git runs it on ssh signing",
    ("difftool", "cmd"): "git runs it on difftool",
    ("difftool", "path"): "git runs it on difftool",
    ("mergetool", "cmd"): "git runs it on mergetool",
    ("mergetool", "path"): "git runs it on mergetool",
    ("remote", "uploadpack"): "git runs it on fetch (locally, for a path or file:// remote)",
    ("remote", "receivepack"): "git runs it on push (locally, for a path or file:// remote)",
    ("browser", "cmd"): "git runs it on help --web / web--browse",
    ("browser", "path"): "git runs it on help --web / web--browse",
    ("man", "cmd"): "git runs it on help",
    ("man", "path"): "git runs it on help",
    ("guitool", "cmd"): "git gui runs it",
    ("sendemail", "tocmd"): "git runs it on send-email",
    ("sendemail", "cccmd"): "git runs it on send-email",
    ("sendemail", "headercmd"): "git runs it on send-email",
}
# Distinctive names: seen in the text of a config but not parsed as a key, git may read them
# differently from sandman (a parser differential), so they are reported.
_SWEEP = re.compile(
    rb"fsmonitor|hookspath|sshcommand|askpass|gitproxy|textconv|smudge|packobjectshook"
    rb"|alternaterefscommand|difffilter|uploadpack|receivepack|defaultkeycommand",
    re.IGNORECASE,
)
_FALSE = frozenset({"", "false", "no", "off"})
_TRUE = frozenset({"true", "yes", "on"})
NOT_FLAGGED = (
    "remote.*.url/pushurl (except ext::), remote.*.vcs, core.excludesFile, core.attributesFile, "
    "http.proxy and other network settings, trace2.* (git reads them from system/global config only), "
    "safe.directory (ignored in repository config)"
)


def _git_bool(value: str | None) -> bool:
    """Whether git's maybe_bool reads ``value`` as a boolean (then it is not a command)."""
    if value is None:
        return True
    v = value.strip().lower()
    return v in _FALSE or v in _TRUE or re.fullmatch(r"[-+]?\d+[kmg]?", v) is not None


def _classify(e: ConfigEntry) -> tuple[Kind, str] | None:
    sec, sub, key, v = e.section, e.subsection, e.key, e.value
    text = (v or "").strip()
    if sub is None:
        if (sec, key) == ("core", "hookspath"):
            return ("redirect", "git runs hooks from this directory instead of .git/hooks") if text else None
        if (sec, key) in (("core", "fsmonitor"),) and _git_bool(v):
            return None  # true/false: git's own daemon, not a command
        if sec == "pager" and key:
            return None if _git_bool(v) else ("exec", f"git runs it as the pager of git {key}")
        if sec == "alias" and text.startswith("!"):
            return "exec", f"`git {key}` runs it in a shell"
        if (sec, key) == ("include", "path"):
            return "include", "git reads this file as more config"
        if sec == "protocol" and key == "allow" and text.lower() == "always":
            return "exec", "allows every transport, including ext:: (which runs commands)"
        if (sec, key) == ("sendemail", "smtpserver") and text.startswith("/"):
            return "exec", "git send-email runs it"
        if (sec, key) in _EXEC2 and text:
            return "exec", _EXEC2[(sec, key)]
        return None
    if sec == "includeif" and key == "path":
        return "include", "git reads this file as more config (when the condition holds)"
    if sec == "remote" and key in ("url", "pushurl") and text.lower().startswith("ext::"):
        return "exec", "the ext:: transport runs a command on fetch/push"
    if sec == "url" and key in ("insteadof", "pushinsteadof") and sub.lower().startswith("ext::"):
        return "exec", "rewrites URLs to the ext:: transport, which runs a command"
    if sec == "protocol" and key == "allow" and sub.lower() == "ext" and text.lower() != "never":
        return "exec", "enables the ext:: transport, which runs commands"
    if sec == "submodule" and key == "update" and text.startswith("!"):
        return "exec", "git submodule update runs it"
    if sec == "http" and key == "cookiefile" and text:
        return "redirect", "git reads this host file on HTTP fetch/push, and writes it with http.saveCookies"
    if sec == "core" and key == "fsmonitor":  # `[core "x"] fsmonitor` is not core.fsmonitor
        return None
    if (sec, key) in _EXEC3 and text:
        return "exec", _EXEC3[(sec, key)]
    return None


_HOOK_EVENTS = {
    "pre-commit": "git commit",
    "prepare-commit-msg": "git commit",
    "commit-msg": "git commit",
    "post-commit": "git commit",
    "pre-merge-commit": "git merge",
    "post-merge": "git merge and git pull",
    "pre-rebase": "git rebase",
    "post-rewrite": "git commit --amend and git rebase",
    "post-checkout": "git checkout/switch/clone/worktree add",
    "pre-push": "git push",
    "pre-auto-gc": "git gc --auto (after commits and fetches)",
    "reference-transaction": "every ref update (commit, fetch, checkout, branch)",
    "post-index-change": "every index write, which git status can do",
    "applypatch-msg": "git am",
    "pre-applypatch": "git am",
    "post-applypatch": "git am",
    "fsmonitor-watchman": "git status when core.fsmonitor names it",
    "push-to-checkout": "a push into this repository",
    "pre-receive": "a push into this repository",
    "update": "a push into this repository",
    "post-receive": "a push into this repository",
    "post-update": "a push into this repository",
    "proc-receive": "a push into this repository",
    "sendemail-validate": "git send-email",
}

_AUTORUN_SETTINGS = re.compile(
    rb'"([^"\n]{0,120}?(?:path|executable|command|interpreter|terminal\.integrated[^"\n]*|runtime|cmd))"\s*:',
    re.IGNORECASE,
)


# -- the scanner ----------------------------------------------------------------------------------


@dataclass
class _File:
    data: bytes = b""
    size: int = 0
    mode: int = 0
    digest: str = ""
    regular: bool = False
    too_big: bool = False
    error: str | None = None


@dataclass
class _Result:
    findings: list[Finding]
    digests: dict[str, str]
    gitdirs: dict[str, str]
    truncated: bool


class _Stop(Exception):
    pass


class _Scanner:
    def __init__(self, workspace: Path, limit: int, max_seconds: float) -> None:
        self.root = os.path.realpath(os.fspath(workspace))
        self.root_parts = tuple(p for p in self.root.split("/") if p)
        self.root_fd = os.open(self.root, _O_DIR)
        self.limit = limit
        self.deadline = time.monotonic() + max_seconds
        self.entries = 0
        self.read_total = 0
        self.findings: list[Finding] = []
        self.seen: set[tuple[str, str, str, str]] = set()
        self.digests: dict[str, str] = {}
        self.gitdirs: dict[str, str] = {}
        self.scanned_git: set[tuple[str, ...]] = set()
        self.pending_git: dict[tuple[str, ...], str] = {}
        self.pending_hooks: set[tuple[str, ...]] = set()
        self.parsed_configs: set[tuple[str, ...]] = set()
        self.truncated: str | None = None

    def close(self) -> None:
        os.close(self.root_fd)

    # findings -----------------------------------------------------------------------------
    def add(self, parts: tuple[str, ...], key: str, kind: Kind, detail: str, value: str = "") -> None:
        f = Finding(path=_rel(parts), key=_printable(key, 200), kind=kind, value=_printable(value), detail=detail)
        ident = (f.path, f.key, f.kind, f.value)
        if ident in self.seen:
            return
        if len(self.findings) >= MAX_FINDINGS:
            self.stop(f"more than {MAX_FINDINGS} findings")
        self.seen.add(ident)
        self.findings.append(f)

    def stop(self, why: str) -> None:
        self.truncated = self.truncated or why
        raise _Stop

    def tick(self, n: int = 1) -> None:
        self.entries += n
        if self.entries > self.limit:
            self.stop(f"more than {self.limit} directory entries")
        if time.monotonic() > self.deadline:
            self.stop("out of time")

    # descriptors --------------------------------------------------------------------------
    def listdir(self, dfd: int) -> list[tuple[str, str]]:
        out = []
        with os.scandir(dfd) as it:
            for e in it:
                try:
                    if e.is_symlink():
                        t = "link"
                    elif e.is_dir(follow_symlinks=False):
                        t = "dir"
                    elif e.is_file(follow_symlinks=False):
                        t = "file"
                    else:
                        t = "other"
                except OSError:
                    t = "other"
                out.append((e.name, t))
                self.tick()
        self.tick()
        return out

    def open_dir(self, parts: tuple[str, ...]) -> int:
        """A descriptor of the workspace directory ``parts``, no symlink followed on the way."""
        fd = os.dup(self.root_fd)
        try:
            for name in parts:
                nfd = os.open(name, _O_DIR, dir_fd=fd)
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read(self, dfd: int, name: str, cap: int = MAX_FILE_BYTES) -> _File:
        try:
            fd = os.open(name, _O_FILE, dir_fd=dfd)
        except OSError as exc:
            return _File(error="a symlink" if exc.errno == errno.ELOOP else (exc.strerror or str(exc)))
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return _File(mode=st.st_mode, error="not a regular file")
            h = hashlib.sha256()
            chunks: list[bytes] = []
            n = 0
            while n < cap:
                b = os.read(fd, min(1 << 16, cap - n))
                if not b:
                    break
                chunks.append(b)
                h.update(b)
                n += len(b)
            self.read_total += n
            too_big = n >= cap and (st.st_size > cap or bool(os.read(fd, 1)))
            if self.read_total > MAX_TOTAL_BYTES:
                self.stop(f"more than {MAX_TOTAL_BYTES >> 20} MiB read")
            return _File(b"".join(chunks), max(st.st_size, n), st.st_mode, h.hexdigest(), True, too_big)
        finally:
            os.close(fd)

    def readlink(self, dfd: int, name: str) -> str:
        try:
            return os.readlink(name, dir_fd=dfd)
        except OSError:
            return ""

    # path arithmetic (git resolves pointers; we do it lexically but never past a symlink) ---
    def resolve(self, base: tuple[str, ...], value: str) -> tuple[str, ...] | None:
        """Workspace parts that ``value`` (relative to ``base``) names, or None when it is
        outside the workspace or reached through a symlink: then git would read host files."""
        if not value or "\x00" in value or value.startswith("~"):
            return None
        if value.startswith("/"):
            comps = [c for c in value.split("/") if c]
            if tuple(comps[: len(self.root_parts)]) != self.root_parts:
                return None
            comps, parts = comps[len(self.root_parts) :], []
        else:
            comps, parts = value.split("/"), list(base)
        for c in comps:
            if c in ("", "."):
                continue
            if c == "..":
                if not parts or not self.is_real_dir(tuple(parts)):
                    return None
                parts.pop()
            else:
                parts.append(c)
        return tuple(parts)

    def is_real_dir(self, parts: tuple[str, ...]) -> bool:
        try:
            os.close(self.open_dir(parts))
            return True
        except OSError:
            return False

    # the walk -----------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self.walk(os.dup(self.root_fd), (), in_git=False, vendor=False, force_git=False)
            for _ in range(1000):  # pointer targets not yet read as git directories
                todo = [p for p in self.pending_git if p not in self.scanned_git]
                if not todo:
                    break
                for parts in todo:
                    if not self._walk_target(parts):
                        self.scanned_git.add(parts)
            for parts in sorted(self.pending_hooks):
                self._hooks_at(parts)
        except _Stop:
            pass
        if self.truncated:
            self.findings.append(
                Finding(
                    path=".",
                    key="scan",
                    kind="truncated",
                    value=str(self.entries),
                    detail=f"the scan stopped early ({self.truncated}); what lies past it was not checked",
                )
            )

    def _walk_target(self, parts: tuple[str, ...]) -> bool:
        try:
            fd = self.open_dir(parts)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                self.add(
                    parts,
                    "gitdir",
                    "redirect",
                    f"{self.pending_git.get(parts, 'a pointer')} names this path, which is not a directory "
                    "reached without symlinks: git would follow them",
                )
            return False
        self.walk(fd, parts, in_git=True, vendor=False, force_git=True)
        return True

    def walk(self, dfd: int, parts: tuple[str, ...], *, in_git: bool, vendor: bool, force_git: bool) -> None:
        try:
            self._walk(dfd, parts, in_git=in_git, vendor=vendor, force_git=force_git)
        finally:
            os.close(dfd)

    def _walk(self, dfd: int, parts: tuple[str, ...], *, in_git: bool, vendor: bool, force_git: bool) -> None:
        if len(parts) > MAX_DEPTH:  # skip this subtree, go on with the rest, and say so at the end
            self.truncated = self.truncated or f"deeper than {MAX_DEPTH} directories at {_printable(_rel(parts), 80)}"
            return
        try:
            listing = self.listdir(dfd)
        except OSError as exc:
            self.add(
                parts, "unreadable", "special", f"a directory sandman could not list ({exc.strerror}): not checked"
            )
            return
        types = dict(listing)
        is_git = force_git or _looks_like_gitdir(types)
        if is_git:
            if parts in self.scanned_git:
                return
            self.scanned_git.add(parts)
            if not force_git and (not parts or parts[-1] != ".git"):
                expected = in_git and (len(parts) >= 2 and (parts[-2] == "worktrees" or "modules" in parts))
                if not expected:
                    self.gitdirs[_rel(parts)] = "lookalike"
                    self.add(
                        parts,
                        "gitdir",
                        "lookalike",
                        "git accepts this directory as a repository (HEAD, objects, refs) and obeys "
                        "its config in it and below it; `.git` renamed?",
                    )
            self._gitdir(dfd, parts, types)
            in_git = True
        order = sorted(listing, key=lambda nt: (nt[0] != ".git", nt[1] == "dir", nt[0]))
        for name, typ in order:
            child = (*parts, name)
            if in_git:
                if is_git and name in _GITDIR_HANDLED:
                    continue
                if typ == "link":
                    self.add(
                        child,
                        name,
                        "redirect",
                        "a symlink inside a git directory: git follows it to files outside",
                        "-> " + self.readlink(dfd, name),
                    )
                elif typ == "other":
                    self.add(child, name, "special", "a FIFO, socket or device inside a git directory")
                elif typ == "dir":
                    self._descend(dfd, name, child, in_git=True, vendor=vendor, force_git=name == ".git")
                continue
            if name == ".git":
                self._dot_git(dfd, child, typ)
                if typ == "dir":
                    self._descend(dfd, name, child, in_git=False, vendor=vendor, force_git=True)
                continue
            if not vendor:
                self._autorun(dfd, child, typ)
            if typ == "dir":
                self._descend(dfd, name, child, in_git=False, vendor=vendor or name == "node_modules", force_git=False)

    def _descend(self, dfd: int, name: str, child: tuple[str, ...], **kw: Any) -> None:
        try:
            fd = os.open(name, _O_DIR, dir_fd=dfd)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM):
                self.add(
                    child, "unreadable", "special", f"a directory sandman could not open ({exc.strerror}): not checked"
                )
            return  # else replaced by a symlink or gone since the listing: nothing git would use there
        self.walk(fd, child, **kw)

    # .git entries -------------------------------------------------------------------------
    def _dot_git(self, dfd: int, child: tuple[str, ...], typ: str) -> None:
        parent = child[:-1]
        if typ == "link":
            self.gitdirs[_rel(child)] = "symlink"
            target = self.readlink(dfd, ".git")
            self.add(
                child, "gitdir", "gitdir", "`.git` is a symlink: git uses the repository it points at", "-> " + target
            )
            return
        if typ == "other":
            self.gitdirs[_rel(child)] = "special"
            self.add(child, "gitdir", "special", "`.git` is a FIFO, socket or device")
            return
        if typ == "dir":
            self.gitdirs[_rel(child)] = "dir"
            if parent:
                self.add(
                    child,
                    "gitdir",
                    "nested-repo",
                    "a nested repository: git run in this directory or below obeys its config and hooks",
                )
            return
        self.gitdirs[_rel(child)] = "file"
        f = self.read(dfd, ".git", 4096)
        if f.error or f.too_big:
            self.add(child, "gitdir", "gitdir", f"a `.git` file that could not be read ({f.error or 'too large'})")
            return
        self.digests[_rel(child)] = f.digest
        text = f.data.decode("utf-8", "replace").rstrip("\r\n")
        if not text.startswith("gitdir: "):
            self.add(child, "gitdir", "gitdir", "a `.git` file git does not accept (no `gitdir: `)", text)
            return
        target = text[8:]
        parts = self.resolve(parent, target)
        if parts is None:
            why = "a `.git` file pointing outside the workspace (or through a symlink): git uses that repository"
        else:
            self.pending_git.setdefault(parts, _rel(child))
            why = f"a `.git` file: git uses the repository at {_rel(parts)} (checked too)"
        self.add(child, "gitdir", "gitdir", why, target)

    # inside a git directory ---------------------------------------------------------------
    def _gitdir(self, dfd: int, parts: tuple[str, ...], types: dict[str, str]) -> None:
        for name in ("config", "config.worktree"):
            if name in types:
                self._config(dfd, parts, name, types[name], gitdir=parts, depth=0)
        for name in ("commondir", "gitdir"):
            if name in types:
                self._pointer(dfd, parts, name, types[name])
        typ = types.get("hooks")
        if typ == "link":
            target = self.readlink(dfd, "hooks")
            self.add(
                (*parts, "hooks"),
                "hooks",
                "redirect",
                "the hooks directory is a symlink: git runs what is there",
                "-> " + target,
            )
        elif typ == "dir":
            self._hooks_at((*parts, "hooks"), dfd)
        elif typ:
            self.add((*parts, "hooks"), "hooks", "special", "`hooks` is not a directory")
        if types.get("objects") == "link":
            self.add(
                (*parts, "objects"),
                "objects",
                "redirect",
                "the object store is a symlink",
                "-> " + self.readlink(dfd, "objects"),
            )
        elif types.get("objects") == "dir":
            self._alternates(dfd, parts)
        if types.get("HEAD") == "link":
            self.add((*parts, "HEAD"), "HEAD", "redirect", "HEAD is a symlink", "-> " + self.readlink(dfd, "HEAD"))
        elif types.get("HEAD") == "other":
            self.add((*parts, "HEAD"), "HEAD", "special", "HEAD is a FIFO, socket or device")

    def _config(
        self, dfd: int, dirparts: tuple[str, ...], name: str, typ: str, *, gitdir: tuple[str, ...], depth: int
    ) -> None:
        parts = (*dirparts, name)
        if parts in self.parsed_configs:
            return
        self.parsed_configs.add(parts)
        if typ == "link":
            self.add(
                parts,
                "config",
                "redirect",
                "a config that is a symlink: git reads the file it points at",
                "-> " + self.readlink(dfd, name),
            )
            return
        if typ != "file":
            self.add(parts, "config", "special", "a config that is not a regular file (a FIFO hangs git)")
            return
        f = self.read(dfd, name)
        if f.error:
            if f.error == "a symlink":
                self.add(parts, "config", "redirect", "a config that is a symlink: git reads the file it points at")
            elif f.error == "not a regular file":
                self.add(parts, "config", "special", "a config that is not a regular file (a FIFO hangs git)")
            else:
                self.add(parts, "config", "special", f"a config sandman could not read ({f.error}): not checked")
            return
        rel = _rel(parts)
        self.digests[rel] = f.digest
        if f.too_big:
            self.add(
                parts, "config", "special", f"a config larger than {MAX_FILE_BYTES} bytes: only its start was checked"
            )
        parsed = parse_git_config(f.data)
        keys_seen = set()
        for e in parsed.entries:
            keys_seen.add(e.key)
            hit = _classify(e)
            if (e.section, e.subsection, e.key) == ("core", None, "worktree") and e.value:
                target = self.resolve(gitdir, e.value.strip())
                if target is None or not self.is_real_dir(target):  # outside, via a symlink, or absent
                    self.add(
                        parts,
                        e.name,
                        "redirect",
                        "the work tree is outside the workspace or reached through a symlink: "
                        "git status/checkout act on host files",
                        e.value,
                    )
                continue
            if hit is None:
                continue
            kind, why = hit
            self.add(parts, e.name, kind, why, e.value or "")
            if kind == "include" and e.value:
                self._include(dirparts, e.value.strip(), gitdir=gitdir, depth=depth, source=parts, key=e.name)
            if e.name == "core.hookspath" and e.value:
                worktree = gitdir[:-1] if gitdir and gitdir[-1] == ".git" else gitdir
                target = self.resolve(worktree, e.value.strip())
                if target is not None:
                    self.pending_hooks.add(target)
        if parsed.errors:
            self.add(
                parts,
                "syntax",
                "unparsed",
                "lines git refuses ('bad config line'); sandman read past them, git stops there",
                "line " + ", ".join(map(str, parsed.errors[:5])),
            )
        for word in sorted({m.group(0).decode().lower() for m in _SWEEP.finditer(f.data)}):
            if word not in keys_seen:
                self.add(
                    parts,
                    f"text:{word}",
                    "unparsed",
                    "this key name appears in the file but not as a key sandman's parser read; git may read it",
                )

    def _include(
        self,
        dirparts: tuple[str, ...],
        value: str,
        *,
        gitdir: tuple[str, ...],
        depth: int,
        source: tuple[str, ...],
        key: str,
    ) -> None:
        target = self.resolve(dirparts, value)
        if target is None or not target:
            return  # outside the workspace: the include finding itself says where
        if depth + 1 > MAX_INCLUDE_DEPTH:
            return
        try:
            pfd = self.open_dir(target[:-1])
        except OSError:
            self.add(source, key, "redirect", "the included file is reached through a symlink", value)
            return
        try:
            try:
                st = os.stat(target[-1], dir_fd=pfd, follow_symlinks=False)
            except OSError:
                return  # missing: git skips a missing include
            typ = "link" if stat.S_ISLNK(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else "other"
            if stat.S_ISDIR(st.st_mode):
                return
            self._config(pfd, target[:-1], target[-1], typ, gitdir=gitdir, depth=depth + 1)
        finally:
            os.close(pfd)

    def _pointer(self, dfd: int, parts: tuple[str, ...], name: str, typ: str) -> None:
        child = (*parts, name)
        if typ == "link":
            self.add(child, name, "redirect", f"`{name}` is a symlink", "-> " + self.readlink(dfd, name))
            return
        if typ != "file":
            self.add(child, name, "special", f"`{name}` is not a regular file")
            return
        f = self.read(dfd, name, 4096)
        if f.error or f.too_big:
            self.add(child, name, "gitdir", f"`{name}` could not be read ({f.error or 'too large'})")
            return
        self.digests[_rel(child)] = f.digest
        value = f.data.decode("utf-8", "replace").rstrip("\r\n")
        if name == "gitdir":
            self.add(
                child,
                "gitdir",
                "gitdir",
                "a linked worktree's back-pointer: git worktree repair/prune act on that path",
                value,
            )
            return
        if len(parts) >= 2 and parts[-2] == "worktrees" and value == "../..":
            return  # the standard linked worktree
        target = self.resolve(parts, value)
        if target is None:
            why = "git reads config, hooks, objects and refs from this directory, outside the workspace"
        else:
            self.pending_git.setdefault(target, _rel(child))
            why = f"git reads config, hooks, objects and refs from {_rel(target)} (checked too)"
        self.add(child, "commondir", "gitdir", why, value)

    def _alternates(self, dfd: int, parts: tuple[str, ...]) -> None:
        try:
            ofd = os.open("objects", _O_DIR, dir_fd=dfd)
        except OSError:
            return
        try:
            try:
                ifd = os.open("info", _O_DIR, dir_fd=ofd)
            except OSError:
                return
            try:
                for name in ("alternates", "http-alternates"):
                    child = (*parts, "objects", "info", name)
                    try:
                        st = os.stat(name, dir_fd=ifd, follow_symlinks=False)
                    except OSError:
                        continue
                    if stat.S_ISLNK(st.st_mode):
                        self.add(child, name, "redirect", f"`{name}` is a symlink", "-> " + self.readlink(ifd, name))
                        continue
                    f = self.read(ifd, name, 1 << 16)
                    if f.error:
                        self.add(child, name, "special", f"`{name}` is not a regular file")
                        continue
                    self.digests[_rel(child)] = f.digest
                    lines = [ln.strip() for ln in f.data.decode("utf-8", "replace").splitlines()]
                    lines = [ln for ln in lines if ln and not ln.startswith("#")]
                    self.add(
                        child,
                        name,
                        "redirect",
                        "git reads objects from these paths (host repositories too)",
                        "; ".join(lines)[:400],
                    )
            finally:
                os.close(ifd)
        finally:
            os.close(ofd)

    def _hooks_at(self, parts: tuple[str, ...], parent_fd: int | None = None) -> None:
        try:
            hfd = os.open(parts[-1], _O_DIR, dir_fd=parent_fd) if parent_fd is not None else self.open_dir(parts)
        except OSError as exc:
            if parent_fd is None and exc.errno in (errno.ELOOP, errno.ENOTDIR):
                self.add(parts, "hooks", "redirect", "core.hooksPath names a directory reached through a symlink")
            return
        try:
            for name, typ in self.listdir(hfd):
                if name.endswith(".sample") or typ == "dir":
                    continue
                child = (*parts, name)
                event = _HOOK_EVENTS.get(name)
                why = (
                    f"git runs it on {event}"
                    if event
                    else "not a hook name git 2.39 runs (reported: a rename makes it one)"
                )
                if typ == "link":
                    self.add(
                        child, f"hook:{name}", "hook", f"a symlinked hook: {why}", "-> " + self.readlink(hfd, name)
                    )
                    continue
                if typ == "other":
                    self.add(child, f"hook:{name}", "special", "a FIFO, socket or device in a hooks directory")
                    continue
                f = self.read(hfd, name)
                if f.error:
                    self.add(child, f"hook:{name}", "hook", f"{why} (sandman could not read it: {f.error})")
                    continue
                self.digests[_rel(child)] = f.digest
                executable = bool(f.mode & 0o111)
                value = f"{'executable' if executable else 'not executable'} sha256:{f.digest[:16]} {f.size}B"
                self.add(child, f"hook:{name}", "hook", why + ("" if executable else " once made executable"), value)
        finally:
            os.close(hfd)

    # editors and shells -------------------------------------------------------------------
    def _autorun(self, dfd: int, child: tuple[str, ...], typ: str) -> None:
        name = child[-1]
        if name == ".envrc" and typ in ("file", "link"):
            self.add(child, "direnv", "autorun", "direnv runs it on cd into this directory once allowed")
        elif name == ".devcontainer.json" and typ == "file":
            self._devcontainer(dfd, child)
        elif name in (".vscode", ".devcontainer") and typ == "dir":
            try:
                sub = os.open(name, _O_DIR, dir_fd=dfd)
            except OSError:
                return
            try:
                if name == ".devcontainer":
                    self._devcontainer(sub, (*child, "devcontainer.json"))
                    return
                tasks = self.read(sub, "tasks.json")
                if tasks.regular and re.search(rb'"runOn"\s*:\s*"folderOpen"', tasks.data, re.IGNORECASE):
                    self.add(
                        (*child, "tasks.json"),
                        "vscode:folderOpen",
                        "autorun",
                        "VS Code runs this task when the folder is opened",
                    )
                    self.digests[_rel((*child, "tasks.json"))] = tasks.digest
                settings = self.read(sub, "settings.json")
                if settings.regular:
                    keys = sorted(
                        {m.group(1).decode("utf-8", "replace") for m in _AUTORUN_SETTINGS.finditer(settings.data)}
                    )
                    if keys:
                        self.digests[_rel((*child, "settings.json"))] = settings.digest
                        self.add(
                            (*child, "settings.json"),
                            "vscode:settings",
                            "autorun",
                            "VS Code settings naming programs it runs (interpreters, tool paths, terminal)",
                            ", ".join(keys[:8]),
                        )
            finally:
                os.close(sub)

    def _devcontainer(self, dfd: int, child: tuple[str, ...]) -> None:
        f = self.read(dfd, child[-1])
        if f.regular and re.search(rb'"initializeCommand"\s*:', f.data):
            self.digests[_rel(child)] = f.digest
            self.add(
                child,
                "devcontainer:initializeCommand",
                "autorun",
                "Dev Containers run it on the host when the folder is reopened in a container",
            )


# Names in a git directory that _gitdir() handles itself, so the walk skips them.
_GITDIR_HANDLED = frozenset({"config", "config.worktree", "commondir", "gitdir", "hooks", "objects", "HEAD", "lfs"})


def _looks_like_gitdir(types: dict[str, str]) -> bool:
    """git's is_git_directory(), minus reading HEAD: HEAD, and objects and refs here or via commondir."""
    return types.get("HEAD") in ("file", "link") and ("commondir" in types or ("objects" in types and "refs" in types))


def _scan(workspace: Path, limit: int, max_seconds: float) -> _Result:
    s = _Scanner(workspace, limit, max_seconds)
    try:
        s.run()
    finally:
        s.close()
    return _Result(s.findings, s.digests, s.gitdirs, bool(s.truncated))


def _error(exc: BaseException) -> Finding:
    return Finding(
        path=".",
        key="scan",
        kind="error",
        detail=f"the scan failed ({type(exc).__name__}: {_printable(str(exc), 200)}); nothing after it was checked",
    )


# -- public API -----------------------------------------------------------------------------------


def take_baseline(workspace: Path, *, limit: int = MAX_ENTRIES, max_seconds: float = MAX_SECONDS) -> Baseline:
    """What a later :func:`scan_workspace` compares with. Never raises: a failure is recorded in
    ``error`` and the later scan then reports everything."""
    try:
        r = _scan(workspace, limit, max_seconds)
        return Baseline(
            workspace=os.path.realpath(os.fspath(workspace)),
            taken=time.time(),
            findings=r.findings,
            digests=r.digests,
            gitdirs=r.gitdirs,
            truncated=r.truncated,
        )
    except Exception as exc:
        return Baseline(workspace=os.fspath(workspace), taken=time.time(), error=f"{type(exc).__name__}: {exc}")


def scan_workspace(
    workspace: Path, baseline: Baseline | None = None, *, limit: int = MAX_ENTRIES, max_seconds: float = MAX_SECONDS
) -> list[Finding]:
    """Everything in ``workspace`` that can make the host user's git (or editor, or shell) run or
    read what the agent chose; with a ``baseline``, only what is new or changed since it.

    Never raises and never runs git; a failed or truncated scan is itself a finding.
    """
    try:
        r = _scan(workspace, limit, max_seconds)
    except Exception as exc:
        return [_error(exc)]
    if baseline is None or baseline.error:
        return r.findings
    old = {f.fingerprint() for f in baseline.findings}
    old_keys = {(f.path, f.key) for f in baseline.findings}
    out: list[Finding] = []
    for f in r.findings:
        if f.kind in _ALWAYS:
            out.append(f)
        elif f.fingerprint() not in old:
            changed = (f.path, f.key) in old_keys or f.path in baseline.digests
            out.append(f.model_copy(update={"status": "changed" if changed else "new"}))
    for path, typ in baseline.gitdirs.items():
        if path not in r.gitdirs:
            out.append(
                Finding(
                    path=path,
                    key="gitdir",
                    kind="missing",
                    value=typ,
                    status="changed",
                    detail="a repository that was here before the session is gone: renamed or removed "
                    "(a directory holding HEAD, objects and refs under another name is reported separately)",
                )
            )
    return out


def quarantine_dir(state_dir: Path, label: str) -> Path:
    """Where a session's quarantined files go: ``<state_dir>/quarantine/<label>``."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", label)[:100].lstrip(".") or "quarantine"
    return Path(state_dir) / "quarantine" / safe


_NOT_FILES = frozenset({"missing", "truncated", "error", "nested-repo", "lookalike"})


def quarantine(workspace: Path, findings: Iterable[Finding], dest_dir: Path) -> QuarantineReport:
    """Move every flagged file (whole config files, hooks, ``.git`` files and symlinks, commondir,
    gitdir and alternates files, flagged editor files) out of ``workspace`` into
    ``dest_dir/files/<same path>``, and write ``dest_dir/manifest.json``.

    Every step works from directory descriptors with ``O_NOFOLLOW``: a symlink is moved as the
    link, never followed; directories are never moved. A rename is used where the destination is
    on the same filesystem, else the file is copied, synced and unlinked. Never raises for one
    file: its entry says what failed.
    """
    by_path: dict[str, list[str]] = {}
    for f in findings:
        if f.kind in _NOT_FILES or f.path in ("", "."):
            continue
        by_path.setdefault(f.path, [])
        if f.key not in by_path[f.path]:
            by_path[f.path].append(f.key)
    dest_dir = Path(dest_dir)
    report = QuarantineReport(dest_dir=str(dest_dir))
    if not by_path:
        return report
    os.makedirs(dest_dir, mode=0o700, exist_ok=True)
    dest_fd = os.open(dest_dir, _O_DIR)
    root_fd = os.open(os.path.realpath(os.fspath(workspace)), _O_DIR)
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir("files", 0o700, dir_fd=dest_fd)
        files_fd = os.open("files", _O_DIR, dir_fd=dest_fd)
        try:
            for path, keys in by_path.items():
                report.files.append(_quarantine_one(root_fd, files_fd, dest_dir / "files", path, keys))
        finally:
            os.close(files_fd)
        report.manifest = _write_manifest(dest_fd, dest_dir, workspace, report)
    finally:
        os.close(root_fd)
        os.close(dest_fd)
    return report


def _open_parts(root_fd: int, parts: Iterable[str], create: bool = False) -> int:
    fd = os.dup(root_fd)
    try:
        for name in parts:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o700, dir_fd=fd)
            nfd = os.open(name, _O_DIR, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def _quarantine_one(root_fd: int, files_fd: int, files_dir: Path, path: str, keys: list[str]) -> QuarantinedFile:
    entry = QuarantinedFile(path=path, keys=keys, method="failed")
    try:
        parts = _parts_of(path)
        if not parts:
            raise ValueError("the workspace itself")
        name = parts[-1]
        pfd = _open_parts(root_fd, parts[:-1])
    except (OSError, ValueError) as exc:
        entry.error = f"cannot reach it without following a symlink: {exc}"
        return entry
    try:
        try:
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            entry.method, entry.error = "skipped", "already gone"
            return entry
        if stat.S_ISDIR(st.st_mode):
            entry.method, entry.error = "skipped", "a directory (only its flagged files are moved)"
            return entry
        dfd = _open_parts(files_fd, parts[:-1], create=True)
        try:
            dname = name
            for i in range(1, 1000):
                try:
                    os.stat(dname, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    break
                dname = f"{name}.{i}"
            entry.dest = str(files_dir.joinpath(*parts[:-1], dname))
            if stat.S_ISREG(st.st_mode):
                entry.size = st.st_size
                entry.sha256 = _digest_at(pfd, name)
            try:
                os.rename(name, dname, src_dir_fd=pfd, dst_dir_fd=dfd)
                entry.method = "rename"
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
                _copy_then_unlink(pfd, name, dfd, dname, st)
                entry.method = "copy"
            with contextlib.suppress(FileNotFoundError):
                os.stat(name, dir_fd=pfd, follow_symlinks=False)
                entry.error = "something was written at the same path again after the move"
        finally:
            os.close(dfd)
    except OSError as exc:
        entry.method, entry.error = "failed", f"{exc.strerror or exc}"
    finally:
        os.close(pfd)
    return entry


def _digest_at(dfd: int, name: str) -> str | None:
    try:
        fd = os.open(name, _O_FILE, dir_fd=dfd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        h = hashlib.sha256()
        while b := os.read(fd, 1 << 20):
            h.update(b)
        return h.hexdigest()
    finally:
        os.close(fd)


def _copy_then_unlink(sfd: int, name: str, dfd: int, dname: str, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(name, dir_fd=sfd), dname, dir_fd=dfd)
    elif stat.S_ISREG(st.st_mode):
        src = os.open(name, _O_FILE, dir_fd=sfd)
        try:
            now = os.fstat(src)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(now.st_mode):
                raise OSError(errno.EAGAIN, "the file was replaced while being quarantined")
            dst = os.open(dname, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            try:
                while b := os.read(src, 1 << 20):
                    os.write(dst, b)
                os.fsync(dst)
            finally:
                os.close(dst)
        finally:
            os.close(src)
    else:
        raise OSError(errno.EXDEV, "a FIFO, socket or device on another filesystem: not copied")
    os.unlink(name, dir_fd=sfd)


def _write_manifest(dest_fd: int, dest_dir: Path, workspace: Path, report: QuarantineReport) -> str:
    data = {
        "workspace": os.path.realpath(os.fspath(workspace)),
        "time": time.time(),
        "note": report.note,
        "files": [f.model_dump() for f in report.files],
    }
    name = "manifest.json"
    for i in range(2, 1000):
        try:
            fd = os.open(
                name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dest_fd
            )
            break
        except FileExistsError:
            name = f"manifest-{i}.json"
    else:
        raise OSError(errno.EEXIST, "too many manifests")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
        fh.write("\n")
    return str(dest_dir / name)


def audit(store: Any, session: str | None, findings: list[Finding], report: QuarantineReport | None = None) -> None:
    """Record a scan in the audit log (``sandman.core.state.StateStore``); never raises."""
    with contextlib.suppress(Exception):
        store.audit(
            session,
            "workspace.poison",
            verdict=("quarantined" if report and report.moved else "found") if findings else "clean",
            findings=[f.model_dump() for f in findings[:200]],
            quarantine=report.model_dump() if report else None,
        )
