"""git's config syntax, read the way git's own ``config.c`` reads it, and which of its keys (and
hook names) make git run a command or read elsewhere."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from sandman.core.poison.model import Kind

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
