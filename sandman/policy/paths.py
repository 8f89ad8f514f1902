"""Host-side path rules: every host access to a workspace file goes through ``validate_path``.

It resolves symlinks before anything else, keeps the result inside the real workspace root and
applies the deny list; ``find_denied`` lists what the sandbox must mask (a file or directory it
must not see even though the workspace is mounted).

Globs are gitignore-like and case-insensitive (``.ENV`` and ``KEY.PEM`` are the same secrets on
any filesystem an agent can copy them to), matched against ``/``-separated paths relative to
the workspace root:

- a pattern without ``/`` matches the name of a path component at any depth: ``.env``,
  ``id_rsa``, ``*.pem`` match ``.env``, ``a/b/.env``, ``certs/server.pem``;
- a pattern with ``/`` is anchored at the root (``.git/config`` matches only the top-level one),
  except that a leading ``**/`` matches at any depth; ``**`` as a whole component matches zero or
  more components, and ``*``, ``?``, ``[...]`` never cross a ``/``;
- a leading ``/`` only anchors, a trailing ``/`` is ignored (a rule cannot tell files from
  directories before the walk);
- a match on a directory denies everything under it;
- an allow glob wins over the deny globs for the path it matches, but it does not un-deny
  anything under a denied directory (like gitignore: a parent excluded cannot be re-included),
  nor the children of the path it allows.

These checks are time-of-check: a sandboxed process can swap a file for a symlink afterwards.
Host code should open what ``validate_path`` returns promptly and without following symlinks
where it can; the mount layout, not this module, is what keeps the sandbox itself in.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from fnmatch import translate
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

from sandman.errors import ConfigError, UsageError, WorkspaceError

# Secrets by file name. The red team's list (keys, cloud and registry credentials, Terraform state)
# cross-checked against public sensitive-file lists such as crashappsec/zero's
# rag/devops/git-history-security/sensitive-files.md (environment files, .aws/credentials,
# .docker/config.json, .kube/config, .npmrc, .pypirc, .netrc, .git-credentials, *.p12/*.pfx/*.jks,
# *.tfstate, SSH private keys).
DEFAULT_DENY: tuple[str, ...] = (
    ".env",
    ".env.*",
    ".envrc",
    "**/credentials.json",
    "**/*secret*",
    "**/*password*",
    "**/*.pem",
    "**/*.key",
    "**/*.p12",
    "**/*.pfx",
    "**/*.jks",
    "**/*.keystore",
    "**/*.ppk",
    "**/*.tfstate",
    "**/*.tfstate.*",
    ".ssh",
    ".gnupg",
    "id_rsa",
    "id_dsa",
    "id_ecdsa",
    "id_ed25519",
    "id_ecdsa_sk",
    "id_ed25519_sk",
    "**/.aws/credentials",
    "**/.docker/config.json",
    "**/.kube/config",
    ".git-credentials",
    ".npmrc",
    ".netrc",
    "_netrc",
    ".pypirc",
    ".pgpass",
    ".htpasswd",
    ".git/config",
)
DEFAULT_ALLOW: tuple[str, ...] = (".env.example", ".env.sample", ".env.template")
# Read-only inside the sandbox: what git (the host user's, on their next command) executes or
# obeys — hooks, configs (top-level, submodules', nested repositories'), info/attributes, linked
# worktrees' admin files — and the campaign's own image and policy files.
DEFAULT_PROTECTED: tuple[str, ...] = (
    ".git/hooks",
    ".git/config",
    ".git/config.worktree",
    ".git/commondir",
    ".git/info",
    ".git/worktrees",
    ".git/modules/**/config",
    ".git/modules/**/hooks",
    "**/.git/config",
    "**/.git/hooks",
    ".sandman",
)
# Bound onto themselves read-write: a mount point cannot be renamed, removed or replaced, so the
# agent cannot move the repository away and put one of its own in its place.
PINNED: tuple[str, ...] = (".git",)

# Never walked: only object files (hex names) live there.
_SKIP_DESCENT_AT = frozenset({(".git", "objects")})


class PathDenied(UsageError):
    """A host-side access to a workspace path was refused (escape, symlink out, deny rule)."""

    exit_code = 5


@dataclass(frozen=True)
class _Glob:
    text: str
    name: re.Pattern[str] | None  # set: matches the last component's name at any depth
    parts: tuple[re.Pattern[str] | None, ...]  # anchored components; None stands for "**"

    def matches(self, parts: Sequence[str]) -> bool:
        if not parts:
            return False
        if self.name is not None:
            return self.name.match(parts[-1]) is not None
        return _match_parts(self.parts, 0, parts, 0)


def _match_parts(pats: tuple[re.Pattern[str] | None, ...], i: int, parts: Sequence[str], j: int) -> bool:
    if i == len(pats):
        return j == len(parts)
    pat = pats[i]
    if pat is None:
        return any(_match_parts(pats, i + 1, parts, k) for k in range(j, len(parts) + 1))
    return j < len(parts) and pat.match(parts[j]) is not None and _match_parts(pats, i + 1, parts, j + 1)


@lru_cache(maxsize=1024)
def _compile(text: str) -> _Glob:
    body = text.rstrip("/")
    anchored = body.startswith("/")
    body = body.lstrip("/")
    if not body or "\x00" in body:
        raise ConfigError(f"path glob {text!r} is empty or contains a NUL byte: write e.g. '.env' or 'secrets/**'")
    parts = body.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ConfigError(f"path glob {text!r} has an empty, '.' or '..' component: write it relative to the root")
    collapsed: list[str] = []
    for p in parts:
        if not (p == "**" and collapsed and collapsed[-1] == "**"):
            collapsed.append(p)
    if not anchored and len(collapsed) == 1 and collapsed[0] != "**":
        return _Glob(text, re.compile(translate(collapsed[0]), re.IGNORECASE), ())
    if len(collapsed) == 2 and collapsed[0] == "**" and collapsed[1] != "**":
        return _Glob(text, re.compile(translate(collapsed[1]), re.IGNORECASE), ())
    pats = tuple(None if p == "**" else re.compile(translate(p), re.IGNORECASE) for p in collapsed)
    return _Glob(text, None, pats)


def _globs(patterns: Iterable[str]) -> tuple[_Glob, ...]:
    if isinstance(patterns, str):
        # A bare string would be iterated character by character and deny almost nothing.
        raise TypeError("deny/allow must be a sequence of globs, not a single string")
    return tuple(_compile(p) for p in patterns)


def _split(rel_posix_path: str) -> tuple[str, ...]:
    parts = tuple(p for p in rel_posix_path.split("/") if p not in ("", "."))
    if ".." in parts:
        raise ValueError(f"{rel_posix_path!r} is not a normalised path relative to the workspace")
    return parts


def _self_denied(parts: Sequence[str], deny: Sequence[_Glob], allow: Sequence[_Glob]) -> str | None:
    """The deny glob matching exactly ``parts``, unless an allow glob matches it too; ancestors unchecked."""
    for glob in deny:
        if glob.matches(parts):
            return None if any(a.matches(parts) for a in allow) else glob.text
    return None


def denied_by(
    rel_posix_path: str, deny: Sequence[str] = DEFAULT_DENY, allow: Sequence[str] = DEFAULT_ALLOW
) -> str | None:
    """The deny glob that covers ``rel_posix_path`` (the path or one of its ancestors), or None."""
    parts = _split(rel_posix_path)
    deny_globs, allow_globs = _globs(deny), _globs(allow)
    for k in range(1, len(parts) + 1):
        if rule := _self_denied(parts[:k], deny_globs, allow_globs):
            return rule
    return None


def validate_path(
    workspace: Path,
    path: str | os.PathLike[str],
    *,
    deny: Sequence[str] = DEFAULT_DENY,
    allow: Sequence[str] = DEFAULT_ALLOW,
    must_exist: bool = False,
) -> Path:
    """The real path of ``path`` (relative ones are relative to ``workspace``), or PathDenied.

    Raises UsageError (not PathDenied) when ``must_exist`` and the path does not exist.
    """
    text = os.fspath(path)
    if not text:
        raise PathDenied("path is empty: name a file inside the workspace")
    if "\x00" in text:
        raise PathDenied(f"path {text!r} contains a NUL byte")
    ws_abs = os.path.abspath(workspace)
    root = Path(os.path.realpath(ws_abs))
    if not root.is_dir():
        raise WorkspaceError(f"workspace {os.fspath(workspace)!r} is not an existing directory")
    candidate = os.path.join(ws_abs, text)  # an absolute ``text`` replaces ws_abs
    lexical = Path(os.path.normpath(candidate))
    # realpath(strict=False) resolves the deepest existing prefix and appends the rest.
    real = Path(os.path.realpath(candidate))
    try:
        os.stat(real)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PathDenied(f"{text!r} is a symlink loop") from None

    if not real.is_relative_to(root):
        if lexical.is_relative_to(ws_abs) or lexical.is_relative_to(root):
            raise PathDenied(f"{text!r} is a symlink that points outside the workspace (-> {real})")
        raise PathDenied(f"{text!r} escapes the workspace {str(root)!r}")

    # The name as given counts too: a symlink called .env is refused whatever it points at.
    for base in (Path(ws_abs), root):
        if lexical.is_relative_to(base):
            rel_given = lexical.relative_to(base).as_posix()
            if rule := denied_by(rel_given, deny, allow):
                raise PathDenied(f"{text!r} is denied by rule {rule!r}: it stays out of the sandbox's reach")
            break
    rel_real = real.relative_to(root).as_posix()
    if rule := denied_by(rel_real, deny, allow):
        raise PathDenied(
            f"{text!r} resolves to {rel_real!r}, which is denied by rule {rule!r}: it stays out of the sandbox's reach"
        )
    if must_exist and not real.exists():
        raise UsageError(f"{text!r} does not exist in the workspace")
    return real


class Denied(NamedTuple):
    path: Path  # under DenyScan.root
    is_dir: bool  # True: mask with an empty tmpfs; False (files, symlinks, others): bind an empty file
    is_link: bool = False  # the name itself is a symlink
    nlink: int = 1  # hard links of a regular file


@dataclass(frozen=True)
class DenyScan:
    root: Path  # the real workspace root the paths are under
    paths: tuple[Denied, ...]
    truncated: bool  # the limit stopped the walk: the result is incomplete (callers fail closed)
    scanned: int  # directory entries looked at
    unreadable: tuple[Path, ...] = ()  # directories the walk could not list
    protected: tuple[Denied, ...] = ()  # paths matching the protected globs (not denied)
    pinned: tuple[Denied, ...] = ()  # PINNED names present at the root
    failed: tuple[str, ...] = ()  # directories that could not be walked: the result is incomplete


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_RACY_NS = 2_000_000_000  # a directory changed this recently may change again within its mtime tick


class WorkspaceScanner:
    """Denied, protected and pinned paths of one workspace, rescanned cheaply.

    The walk opens every directory beneath the workspace's descriptor with O_NOFOLLOW (a symlink
    is reported by its own name, never followed, whatever the agent swaps in), does not descend
    into denied directories nor ``.git/objects``, and remembers each directory's listing by its
    identity and change times: a rescan lists again only the directories that changed (and
    those changed too recently for their timestamps to be trusted), so every exec can afford a
    current, complete list. A walk cut short by ``limit`` says so (``truncated``)."""

    def __init__(
        self,
        workspace: Path,
        deny: Sequence[str] = DEFAULT_DENY,
        allow: Sequence[str] = DEFAULT_ALLOW,
        protected: Sequence[str] = (),
        limit: int = 1_000_000,
    ) -> None:
        if limit < 1:
            raise ValueError("limit must be positive")
        self.root = Path(os.path.realpath(workspace))
        self._deny, self._allow, self._protected = _globs(deny), _globs(allow), _globs(protected)
        self.limit = limit
        self._listings: dict[tuple[str, ...], tuple[tuple[int, int, int, int], _Listing]] = {}

    def scan(self) -> DenyScan:
        """One walk; a directory swapped under the walk (the agent runs concurrently) restarts it,
        and one that keeps changing, or that cannot be opened, is reported in ``failed``."""
        for _ in range(3):
            try:
                return self._scan_once()
            except _Changed:
                continue
        return DenyScan(self.root, (), False, 0, failed=("the workspace kept changing during the deny-list scan",))

    def _scan_once(self) -> DenyScan:
        found: list[Denied] = []
        protected: list[Denied] = []
        pinned: list[Denied] = []
        unreadable: list[Path] = []
        failed: list[str] = []
        scanned = 0
        now = time.time_ns()
        seen: set[tuple[str, ...]] = set()
        try:
            root_fd = os.open(self.root, _DIR_FLAGS)
        except OSError as exc:
            return DenyScan(self.root, (), False, 0, (self.root,), failed=(f"{self.root}: {exc.strerror}",))
        # Depth-first, holding one descriptor per level (never one per pending directory: a
        # directory with thousands of subdirectories must not run the walk out of descriptors).
        stack: list[tuple[int, tuple[str, ...], list[tuple[str, int]]]] = []
        try:
            fd = root_fd
            prefix: tuple[str, ...] = ()
            while True:
                if fd >= 0:
                    try:
                        listing = self._listing(fd, prefix, now)
                    except OSError as exc:
                        failed.append(f"{self.root.joinpath(*prefix)}: {exc.strerror}")
                        os.close(fd)
                        fd = -1
                        listing = _Listing()
                    seen.add(prefix)
                    scanned += listing.count
                    if scanned > self.limit:
                        os.close(fd)
                        fd = -1
                        return DenyScan(self.root, tuple(found), True, scanned, tuple(unreadable))
                    for name, is_dir, _ in listing.pinned:
                        pinned.append(Denied(self.root / name, is_dir))
                    for name, is_dir, is_link in listing.denied:
                        found.append(self._entry(fd, name, (*prefix, name), is_dir, is_link))
                    for name, is_dir, is_link in listing.protected:
                        protected.append(self._entry(fd, name, (*prefix, name), is_dir, is_link))
                    if fd >= 0:
                        stack.append((fd, prefix, list(reversed(listing.subdirs))))
                    fd = -1
                if not stack:
                    break
                parent, prefix, todo = stack[-1]
                if not todo:
                    os.close(parent)
                    stack.pop()
                    continue
                name, ino = todo.pop()
                try:
                    child = os.open(name, _DIR_FLAGS, dir_fd=parent)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
                        raise _Changed from None  # swapped for a symlink or a file, or renamed away
                    path = self.root.joinpath(*prefix, name)
                    if exc.errno in (errno.EACCES, errno.EPERM) and os.geteuid() != 0:
                        unreadable.append(path)  # the sandbox, the same uid, cannot read it either
                    else:
                        failed.append(f"{path}: {exc.strerror}")
                    continue
                if os.fstat(child).st_ino != ino:
                    os.close(child)
                    raise _Changed  # the name now holds another directory than the one listed
                fd, prefix = child, (*prefix, name)
        finally:
            if fd >= 0:
                os.close(fd)
            for parent, _, _ in stack:
                os.close(parent)
        for key in [k for k in self._listings if k not in seen]:
            del self._listings[key]  # directories gone since the last scan
        return DenyScan(
            self.root, tuple(found), False, scanned, tuple(unreadable), tuple(protected), tuple(pinned), tuple(failed)
        )

    def _entry(self, fd: int, name: str, parts: tuple[str, ...], is_dir: bool, is_link: bool) -> Denied:
        nlink = 1
        if not is_dir and not is_link:
            with contextlib.suppress(OSError):
                nlink = os.stat(name, dir_fd=fd, follow_symlinks=False).st_nlink
        return Denied(self.root.joinpath(*parts), is_dir and not is_link, is_link, nlink)

    def _listing(self, fd: int, prefix: tuple[str, ...], now: int) -> _Listing:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
        cached = self._listings.get(prefix)
        if cached is not None and cached[0] == key:
            return cached[1]
        listing = _Listing()
        with os.scandir(fd) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            listing.count += 1
            try:
                is_link = entry.is_symlink()
                is_dir = not is_link and entry.is_dir(follow_symlinks=False)
            except OSError:
                is_link, is_dir = False, False
            item = (entry.name, is_dir, is_link)
            parts = (*prefix, entry.name)
            if not prefix and entry.name in PINNED and not is_link:
                listing.pinned.append(item)
            if _self_denied(parts, self._deny, self._allow):
                listing.denied.append(item)
                continue
            if self._protected and _self_denied(parts, self._protected, ()):
                listing.protected.append(item)
            if is_dir and parts not in _SKIP_DESCENT_AT:
                listing.subdirs.append((entry.name, entry.inode()))
        if now - max(st.st_mtime_ns, st.st_ctime_ns) > _RACY_NS:
            self._listings[prefix] = (key, listing)
        else:
            self._listings.pop(prefix, None)
        return listing


class _Changed(Exception):
    """A directory was swapped while the walk looked at it."""


@dataclass
class _Listing:
    """One directory's entries, classified once."""

    count: int = 0
    denied: list[tuple[str, bool, bool]] = field(default_factory=list)
    protected: list[tuple[str, bool, bool]] = field(default_factory=list)
    pinned: list[tuple[str, bool, bool]] = field(default_factory=list)
    subdirs: list[tuple[str, int]] = field(default_factory=list)  # (name, inode when listed)


def find_denied(
    workspace: Path,
    deny: Sequence[str] = DEFAULT_DENY,
    allow: Sequence[str] = DEFAULT_ALLOW,
    limit: int = 1_000_000,
) -> DenyScan:
    """Existing denied paths under ``workspace`` (a one-off WorkspaceScanner walk)."""
    return WorkspaceScanner(workspace, deny, allow, (), limit).scan()
