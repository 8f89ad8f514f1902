"""Host-side path rules: every host access to a workspace file goes through ``validate_path``.

It resolves symlinks before anything else, keeps the result inside the real workspace root and
applies the deny list; ``find_denied`` lists what the sandbox must mask (a file or directory it
must not see even though the workspace is mounted).

Globs are gitignore-like and case-sensitive, matched against ``/``-separated paths relative to
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

import errno
import os
import re
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fnmatch import translate
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

from sandman.errors import ConfigError, UsageError, WorkspaceError

DEFAULT_DENY: tuple[str, ...] = (
    ".env",
    ".env.*",
    "**/credentials.json",
    "**/*secret*",
    "**/*password*",
    "**/*.pem",
    "**/*.key",
    ".ssh",
    "id_rsa",
    "id_ed25519",
    ".git/config",
)
DEFAULT_ALLOW: tuple[str, ...] = (".env.example", ".env.sample", ".env.template")
# Read-only inside the sandbox: hooks and config run code on the host's next git command.
DEFAULT_PROTECTED: tuple[str, ...] = (".git/hooks", ".git/config")

# Directories that are huge and never hold secrets worth a walk; their own names are still checked.
_SKIP_DESCENT_ANYWHERE = frozenset({"node_modules"})
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
        return _Glob(text, re.compile(translate(collapsed[0])), ())
    if len(collapsed) == 2 and collapsed[0] == "**" and collapsed[1] != "**":
        return _Glob(text, re.compile(translate(collapsed[1])), ())
    pats = tuple(None if p == "**" else re.compile(translate(p)) for p in collapsed)
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


@dataclass(frozen=True)
class DenyScan:
    root: Path  # the real workspace root the paths are under
    paths: tuple[Denied, ...]
    truncated: bool  # the limit stopped the walk: deeper denied paths may be missing
    scanned: int  # directory entries looked at
    unreadable: tuple[Path, ...] = ()  # directories the walk could not list


def find_denied(
    workspace: Path,
    deny: Sequence[str] = DEFAULT_DENY,
    allow: Sequence[str] = DEFAULT_ALLOW,
    limit: int = 20000,
) -> DenyScan:
    """Existing denied paths under ``workspace``, for masking inside the sandbox.

    Never follows symlinks (a symlink is reported by its own name, as a file), does not descend
    into a denied directory, nor into ``.git/objects`` or ``node_modules``. Breadth-first, so a
    walk cut short by ``limit`` has still seen the shallow paths where secrets usually live.
    """
    if limit < 1:
        raise ValueError("limit must be positive")
    deny_globs, allow_globs = _globs(deny), _globs(allow)
    root = Path(os.path.realpath(workspace))
    found: list[Denied] = []
    unreadable: list[Path] = []
    scanned = 0
    truncated = False
    queue: deque[tuple[Path, tuple[str, ...]]] = deque([(root, ())])
    while queue and not truncated:
        directory, prefix = queue.popleft()
        try:
            with os.scandir(directory) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError:
            unreadable.append(directory)
            continue
        for entry in entries:
            if scanned >= limit:
                truncated = True
                break
            scanned += 1
            parts = (*prefix, entry.name)
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                is_dir = False
            if _self_denied(parts, deny_globs, allow_globs):
                found.append(Denied(Path(entry.path), is_dir))
            elif is_dir and entry.name not in _SKIP_DESCENT_ANYWHERE and parts not in _SKIP_DESCENT_AT:
                queue.append((Path(entry.path), parts))
    return DenyScan(root, tuple(found), truncated, scanned, tuple(unreadable))
