"""Deny-listed files in a workspace's git history: the mask hides ``.env`` in the work tree, but
``git show HEAD~1:.env`` inside the sandbox reads it from ``.git/objects``. This module finds every
such file version so sandbox start can scrub it (``secrets_from``), refuse, or audit it
(``filesystem.git_history``).

One module on purpose: it is one scan pipeline whose cache key, git listings and cache format must
change together, or a stale cache would hide a file.

What counts as "in the history" is everything the agent can reach with git in the sandbox:

* every commit reachable from any ref (branches, tags, ``refs/stash`` with its index and
  untracked-files parents, notes, ``refs/original``, ...) and from the reflogs;
* every *unreachable* commit still in the object store (an amended or reset commit whose reflog
  expired, a deleted branch's commits, a dropped stash): the agent reads ``.git/objects``
  directly, so "unreachable" is no protection until ``git gc --prune`` runs;
* the index of the repository and of each linked worktree (a staged ``.env`` that was never
  committed, ``git show :.env``).

A blob is matched by the path it has in a tree (the deny and allow globs of ``sandman.policy.paths``,
against paths relative to the repository root). Not matched: blobs in no commit's tree (``git
add`` then ``git reset`` leaves one behind; counted in ``HistoryScan.blobs_outside_commits``),
trees no commit holds (``git write-tree``) and tags pointing straight at a blob; a blob whose
content git first meets under another, not denied path (``git rev-list --objects`` names each
object once); submodules' repositories (``.git/modules``) and repositories nested in the work tree.

git never reads the agent's ``.git`` on the host: every call goes through ``gitjail.run_git``
(bubblewrap, nothing of the host visible, the agent's config replaced). A cold scan is one
``rev-list --objects --all --reflog``, one ``rev-list --objects --indexed-objects`` and one
``cat-file --batch-all-objects --batch-check`` (run in parallel), one more ``rev-list`` only when
unreachable commits exist, then one ``git show`` of the matched blobs. The answer (paths, blob ids
and sizes, never contents) is cached under ``cache_dir`` keyed by the object store's shape (pack
files' names, sizes and mtimes; loose object directories' mtimes) and, apart, by the index files'
stats: an unchanged repository costs a few hundred ``stat`` calls and one ``git show`` to read the
contents again (figures: ``scripts/bench_history.py``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import stat
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sandman.policy.paths import DEFAULT_ALLOW, DEFAULT_DENY, denied_by
from sandman.upcall import gitjail

CACHE_VERSION = 1
DEFAULT_MAX_BLOB = 1 << 20
DEFAULT_MAX_LISTING = 512 << 20  # bytes of git output one listing may produce; beyond, the scan fails
DEFAULT_TIMEOUT_S = 300.0
MIN_VALUE_LEN = 8  # KEY=VALUE values registered on their own from this length
_RACY_NS = 2_000_000_000  # a directory changed this recently may change again within its mtime tick
_ARGV_OIDS = 1000  # object ids per git argv (well under ARG_MAX)
_SHOW_BYTES = 64 << 20  # blob bytes per `git show`

Source = Literal["refs", "unreachable", "index"]
Runner = Callable[..., gitjail.JailResult]


@dataclass(frozen=True)
class HistoryBlob:
    """One version of a deny-listed file."""

    oid: str
    size: int
    content: bytes | None  # None: over max_blob, not read, so it cannot be scrubbed
    sources: tuple[Source, ...]  # where git reaches it: "refs" (incl. reflogs), "unreachable", "index"

    @property
    def too_large(self) -> bool:
        return self.content is None


@dataclass(frozen=True)
class HistoryFile:
    path: str  # relative to the repository root, "/"-separated
    rule: str  # the deny glob that matched
    blobs: tuple[HistoryBlob, ...]


@dataclass(frozen=True)
class HistoryScan:
    """What ``find_history_secrets`` found; ``error`` set means the history could not be scanned."""

    workspace: Path
    files: tuple[HistoryFile, ...] = ()
    error: str | None = None  # shown to the user as is: the repository was refused or git failed
    is_repository: bool = True  # False: no .git at all (nothing to scan, not an error)
    cached: bool = False  # the store part came from the cache (no listing ran)
    commits: int = 0  # commits looked at (reachable and unreachable)
    objects: int = 0  # objects in the store
    unreachable_commits: int = 0
    blobs_outside_commits: int = 0  # blobs in no commit's tree (index-only or dangling): not matched
    git_calls: int = 0
    elapsed_s: float = 0.0
    key: str = ""  # the cache key of the store part
    notes: tuple[str, ...] = field(default=())  # non-fatal: e.g. the cache could not be written

    @property
    def found(self) -> bool:
        return bool(self.files)

    @property
    def unscrubbable(self) -> tuple[tuple[str, HistoryBlob], ...]:
        """(path, blob) of versions over max_blob, whose content was not read."""
        return tuple((f.path, b) for f in self.files for b in f.blobs if b.content is None)


class _ScanFailed(Exception):
    """Internal: a git listing failed; the message becomes ``HistoryScan.error``."""


# -- the cache key: the object store's and the index's shape, read without git -------------------


def _open_dir(name: str, dir_fd: int) -> int | None:
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None


def _entries(fd: int) -> list[tuple[str, int, int, int, int]]:
    """(name, mode, size, mtime_ns, ino) of every entry of the directory ``fd``, not following links."""
    out = []
    with os.scandir(fd) as it:
        for entry in it:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            out.append((entry.name, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino))
    out.sort()
    return out


_FANOUT = re.compile(r"^[0-9a-f]{2}$")
_OID = re.compile(r"^(?:[0-9a-f]{40}|[0-9a-f]{64})\Z")


def _store_shape(git_fd: int) -> tuple[list[Any], int]:
    """The object store's shape and its newest mtime: packs (every file of ``objects/pack``: name,
    size, mtime, inode) and loose object directories (mtime, inode: adding or removing an object
    changes its directory's mtime). Objects are named by their content, so an unchanged shape is
    an unchanged set of objects."""
    st = os.stat(git_fd)
    shape: list[Any] = [st.st_dev, st.st_ino]
    newest = 0
    objects = _open_dir("objects", git_fd)
    if objects is None:
        return [*shape, "no objects dir"], newest
    try:
        top = os.fstat(objects)
        shape.append(top.st_mtime_ns)
        newest = top.st_mtime_ns
        for name, mode, _size, mtime, ino in _entries(objects):
            if _FANOUT.match(name) and stat.S_ISDIR(mode):
                shape.append((name, mtime, ino))
                newest = max(newest, mtime)
            elif name == "pack" and stat.S_ISDIR(mode):
                pack = _open_dir("pack", objects)
                if pack is None:
                    shape.append("pack unreadable")
                    continue
                try:
                    packs = _entries(pack)
                    shape.append(("pack", mtime, packs))
                    newest = max([newest, mtime, *(p[3] for p in packs)])
                finally:
                    os.close(pack)
            elif name not in ("info",):
                shape.append((name, mode, mtime))
    finally:
        os.close(objects)
    return shape, newest


def _index_shape(git_fd: int) -> tuple[list[Any], int]:
    """Stats of the index files git reads for ``--indexed-objects``: the repository's (and any
    split-index shared file) and each linked worktree's."""
    shape: list[Any] = []
    newest = 0
    top = _open_dir(".", git_fd)  # git_fd may be O_PATH, which cannot be listed
    if top is None:
        raise OSError(f"cannot list {git_fd}")
    try:
        for name, mode, size, mtime, ino in _entries(top):
            if name == "index" or name.startswith("sharedindex."):
                shape.append((name, mode, size, mtime, ino))
                newest = max(newest, mtime)
    finally:
        os.close(top)
    worktrees = _open_dir("worktrees", git_fd)
    if worktrees is not None:
        try:
            for name, mode, _size, _mtime, _ino in _entries(worktrees):
                sub = _open_dir(name, worktrees) if stat.S_ISDIR(mode) else None
                if sub is None:
                    continue
                try:
                    for iname, imode, isize, imtime, iino in _entries(sub):
                        if iname == "index" or iname.startswith("sharedindex."):
                            shape.append((name, iname, imode, isize, imtime, iino))
                            newest = max(newest, imtime)
                finally:
                    os.close(sub)
        finally:
            os.close(worktrees)
    return shape, newest


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


# -- running git in the jail ------------------------------------------------------------------------


@dataclass
class _Git:
    git_dir: Path
    runner: Runner
    timeout: float
    max_listing: int
    calls: int = 0

    def run(self, args: Sequence[str], max_output: int | None = None) -> bytes:
        self.calls += 1
        limit = self.max_listing if max_output is None else max_output
        result = self.runner(self.git_dir, list(args), timeout=self.timeout, max_output=limit)
        if result.exit_code != 0:
            err = result.stderr.strip().splitlines()
            raise _ScanFailed(f"git {args[0]} failed ({result.exit_code}): {err[-1] if err else 'no message'}")
        if len(result.stdout) >= limit and max_output is None:
            raise _ScanFailed(
                f"git {args[0]} listed more than {limit} bytes: the repository is too large to scan "
                "(raise max_listing, or set filesystem.git_history)"
            )
        return result.stdout


# -- the listings -------------------------------------------------------------------------------------


def _last_part(glob: str) -> str | None:
    """The pattern a glob's last path component must match (by sandman.policy.paths' rules every glob
    ends with one, which matches the path's last component), or None for a ``**`` ending, which
    matches any name."""
    last = glob.strip("/").rsplit("/", 1)[-1]
    return None if last in ("", "**") else last


class _Matcher:
    """``denied_by``, exactly, at a fraction of its cost over a whole repository's paths.

    ``denied_by(p)`` tries every glob on every prefix of ``p``. Here a directory's answer is
    remembered; when the directory is not denied, ``p`` can only be denied by a glob matching
    ``p`` itself, and a glob matches ``p`` only if its last component matches ``p``'s name. So
    the name is tried against those last components alone (remembered per name: ``index.js``,
    ``__init__.py`` repeat), and only a name that matches one is given to ``denied_by``, allow
    globs included. A glob ending in ``**`` matches any name: with one, every path not under a
    denied directory goes to ``denied_by``. A controller keeps the memo for its next scan.
    """

    MAX_MEMO = 1 << 20

    def __init__(self, deny: tuple[str, ...], allow: tuple[str, ...]) -> None:
        self.deny, self.allow = list(deny), list(allow)
        lasts = [_last_part(g) for g in deny]
        self._lasts = [last for last in lasts if last is not None]
        self._any_name = any(last is None for last in lasts)
        self._memo: dict[str, str | None] = {}
        self._name_memo: dict[str, bool] = {}

    def __call__(self, path: str) -> str | None:
        try:
            return self._memo[path]
        except KeyError:
            pass
        if len(self._memo) >= self.MAX_MEMO:
            self._memo.clear()
            self._name_memo.clear()
        try:
            # A ".." component: git refuses such trees, and the path is no workspace path.
            rule = None if "/../" in f"/{path}/" else self._decide(path)
        except ValueError:
            rule = None
        self._memo[path] = rule
        return rule

    def _decide(self, path: str) -> str | None:
        parent, _, name = path.rpartition("/")
        if not name or (parent and not parent.strip("/")):
            return denied_by(path, self.deny, self.allow) if path.strip("/") else None
        if parent and (rule := self(parent)):
            return rule
        if not self._any_name:
            maybe = self._name_memo.get(name)
            if maybe is None:
                maybe = self._name_memo[name] = name in (".", "..") or denied_by(name, self._lasts, ()) is not None
            if not maybe:
                return None
        return denied_by(path, self.deny, self.allow)


@functools.lru_cache(maxsize=8)
def _matcher(deny: tuple[str, ...], allow: tuple[str, ...]) -> _Matcher:
    return _Matcher(deny, allow)


def _parse_listing(
    out: bytes, match: _Matcher, source: Source, found: dict[tuple[str, str], set[str]], seen: set[str]
) -> set[str]:
    """Lines of ``rev-list --objects``: ``<oid>`` for a commit, ``<oid> <path>`` for a tree or
    blob. Records matched (path, oid) pairs in ``found`` and every tree/blob id in ``seen``;
    returns the commit ids."""
    commits: set[str] = set()
    for line in out.decode("utf-8", "surrogateescape").split("\n"):
        if not line:
            continue
        oid, sep, path = line.partition(" ")
        if not sep:
            commits.add(oid)
            continue
        seen.add(oid)
        if rule := match(path):
            found.setdefault((path, oid), set()).add(source)
            found[(path, oid)].add("rule:" + rule)
    return commits


def _parse_catalogue(out: bytes) -> tuple[set[str], dict[str, int], int]:
    """``cat-file --batch-all-objects --batch-check='%(objectname) %(objecttype) %(objectsize)'``:
    the commit ids, each blob's size, and the number of objects."""
    commits: set[str] = set()
    blobs: dict[str, int] = {}
    count = 0
    for line in out.split(b"\n"):
        parts = line.split(b" ")
        if len(parts) != 3:
            continue
        count += 1
        if parts[1] == b"commit":
            commits.add(parts[0].decode())
        elif parts[1] == b"blob":
            blobs[parts[0].decode()] = int(parts[2])
    return commits, blobs, count


_CATALOGUE = [
    "cat-file",
    "--batch-all-objects",
    "--unordered",
    "--batch-check=%(objectname) %(objecttype) %(objectsize)",
]
_HISTORY = ["rev-list", "--objects", "--all", "--reflog", "--missing=allow-any"]
_INDEX = ["rev-list", "--objects", "--indexed-objects", "--missing=allow-any"]


def _rows(found: Mapping[tuple[str, str], set[str]], sizes: Mapping[str, int]) -> list[list[Any]]:
    """Cache rows [path, rule, oid, size, sources] for the matched pairs that are blobs."""
    rows = []
    for (path, oid), tags in sorted(found.items()):
        size = sizes.get(oid)
        if size is None:
            continue  # a tree (a denied directory: its blobs are matched by their own paths)
        rule = sorted(t[5:] for t in tags if t.startswith("rule:"))[0]
        sources = sorted(t for t in tags if not t.startswith("rule:"))
        rows.append([path, rule, oid, size, sources])
    return rows


def _scan_store(git: _Git, match: _Matcher) -> dict[str, Any]:
    """The cold path: every commit's (reachable or not) deny-listed blobs, and the index's."""
    with ThreadPoolExecutor(3) as pool:
        history = pool.submit(git.run, _HISTORY)
        catalogue = pool.submit(git.run, _CATALOGUE)
        index = pool.submit(git.run, _INDEX)
        history_out, catalogue_out, index_out = history.result(), catalogue.result(), index.result()
    found: dict[tuple[str, str], set[str]] = {}
    seen: set[str] = set()
    reachable = _parse_listing(history_out, match, "refs", found, seen)
    del history_out
    all_commits, sizes, count = _parse_catalogue(catalogue_out)
    del catalogue_out
    unreachable = sorted(all_commits - reachable)
    for i in range(0, len(unreachable), _ARGV_OIDS):
        out = git.run(["rev-list", "--objects", "--no-walk", "--missing=allow-any", *unreachable[i : i + _ARGV_OIDS]])
        _parse_listing(out, match, "unreachable", found, seen)
    outside = sum(1 for oid in sizes if oid not in seen)
    index_found: dict[tuple[str, str], set[str]] = {}
    _parse_listing(index_out, match, "index", index_found, set())
    matched_sizes = {oid: sizes[oid] for (_p, oid) in [*found, *index_found] if oid in sizes}
    return {
        "history": _rows(found, sizes),
        "index": _rows(index_found, sizes),
        "sizes": matched_sizes,
        "commits": len(all_commits | reachable),
        "objects": count,
        "unreachable_commits": len(unreachable),
        "blobs_outside_commits": outside,
    }


def _scan_index(git: _Git, match: _Matcher, known_sizes: Mapping[str, int]) -> tuple[list[list[Any]], dict[str, int]]:
    """Only the index changed: list it again; sizes of blobs not met before come from the store."""
    index_found: dict[tuple[str, str], set[str]] = {}
    _parse_listing(git.run(_INDEX), match, "index", index_found, set())
    sizes = dict(known_sizes)
    if any(oid not in sizes for (_p, oid) in index_found):
        _commits, all_sizes, _count = _parse_catalogue(git.run(_CATALOGUE))
        sizes.update({oid: all_sizes[oid] for (_p, oid) in index_found if oid in all_sizes})
    return _rows(index_found, sizes), sizes


def _read_blobs(git: _Git, sizes: Mapping[str, int]) -> dict[str, bytes]:
    """Contents of the given blobs: ``git show`` prints each blob's bytes back to back, unchanged
    (no path, so no attributes or textconv), and the sizes split them."""
    contents: dict[str, bytes] = {}
    batch: list[str] = []
    total = 0

    def flush() -> None:
        nonlocal total
        if not batch:
            return
        out = git.run(["show", *batch], max_output=total + 1)
        if len(out) != total:
            raise _ScanFailed(f"git show printed {len(out)} bytes for blobs of {total} bytes: the store changed")
        pos = 0
        for oid in batch:
            contents[oid] = out[pos : pos + sizes[oid]]
            pos += sizes[oid]
        batch.clear()
        total = 0

    for oid in sorted(sizes):
        if not _OID.match(oid):  # from git's own listing or our cache: never an option
            raise _ScanFailed(f"{oid!r} is not an object id")
        if len(batch) >= _ARGV_OIDS or (batch and total + sizes[oid] > _SHOW_BYTES):
            flush()
        batch.append(oid)
        total += sizes[oid]
    flush()
    return contents


# -- the cache ------------------------------------------------------------------------------------------


def _cache_file(cache_dir: Path, git_dir: Path) -> Path:
    return cache_dir / f"{hashlib.sha256(os.fsencode(os.path.realpath(git_dir))).hexdigest()[:32]}.json"


def _load_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    return data if _well_formed(data) else {}


def _well_formed(data: Any) -> bool:
    """A cache file as _save_cache writes it (any other: scanned again, then overwritten)."""
    if not isinstance(data, dict) or data.get("v") != CACHE_VERSION:
        return False
    if not all(isinstance(data.get(k), int) for k in ("commits", "objects", "unreachable_commits")):
        return False
    if not isinstance(data.get("blobs_outside_commits"), int) or not isinstance(data.get("sizes"), dict):
        return False
    for rows in (data.get("history"), data.get("index")):
        if not isinstance(rows, list):
            return False
        for row in rows:
            if not (
                isinstance(row, list)
                and len(row) == 5
                and all(isinstance(x, str) for x in row[:3])
                and isinstance(row[3], int)
                and isinstance(row[4], list)
            ):
                return False
    return True


def _save_cache(path: Path, data: dict[str, Any]) -> None:
    """Atomically, mode 0600 in a 0700 directory: paths and blob ids only, no contents."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".githistory-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, separators=(",", ":"))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# -- the scan -------------------------------------------------------------------------------------------


def find_history_secrets(
    workspace: Path,
    deny: Sequence[str] = DEFAULT_DENY,
    allow: Sequence[str] = DEFAULT_ALLOW,
    *,
    cache_dir: Path,
    max_blob: int = DEFAULT_MAX_BLOB,
    max_listing: int = DEFAULT_MAX_LISTING,
    timeout: float = DEFAULT_TIMEOUT_S,
    runner: Runner | None = None,
) -> HistoryScan:
    """Every deny-listed path anywhere in ``workspace``'s git history, with each distinct version.

    ``max_blob``: contents over this many bytes are not read (``HistoryBlob.too_large``).
    ``runner``: ``gitjail.run_git`` or a stand-in with its signature (tests count calls with it).
    Never raises for a refused or broken repository: ``HistoryScan.error`` says why.
    """
    if isinstance(deny, str) or isinstance(allow, str):
        raise TypeError("deny/allow must be sequences of globs, not a single string")
    started = time.perf_counter()
    workspace = Path(workspace)
    git_dir = workspace / ".git"
    git = _Git(git_dir, runner or gitjail.run_git, timeout, max_listing)

    def done(**kw: Any) -> HistoryScan:
        return HistoryScan(workspace, git_calls=git.calls, elapsed_s=time.perf_counter() - started, **kw)

    try:
        os.lstat(git_dir)
    except FileNotFoundError:
        return done(is_repository=False)
    except OSError as exc:
        return done(error=f"{git_dir}: cannot be read ({exc.strerror})")
    try:
        fd = gitjail.open_git_dir(git_dir)  # plain directory, no commondir, no alternates
    except gitjail.GitJailError as exc:
        return done(error=f"{workspace}: {exc}")
    try:
        store_shape, store_newest = _store_shape(fd)
        index_shape, index_newest = _index_shape(fd)
    except OSError as exc:
        return done(error=f"{git_dir}: cannot be read ({exc.strerror or exc})")
    finally:
        os.close(fd)
    # Capture time before anything is listed: a change after it but within the same mtime tick
    # would leave the shape as it was, so a shape that recent is not trusted (not cached).
    now = time.time_ns()
    match = _matcher(tuple(deny), tuple(allow))
    store_key = _digest(CACHE_VERSION, "store", match.deny, match.allow, store_shape)
    index_key = _digest(CACHE_VERSION, "index", match.deny, match.allow, store_key, index_shape)
    cache_path = _cache_file(Path(cache_dir), git_dir)
    cache = _load_cache(cache_path)
    notes: list[str] = []
    try:
        if cache.get("store_key") == store_key:
            data = cache
            cached = True
            if cache.get("index_key") != index_key:
                data = dict(cache)
                data["index"], data["sizes"] = _scan_index(git, match, cache.get("sizes", {}))
        else:
            data = _scan_store(git, match)
            cached = False
        data = {**data, "v": CACHE_VERSION, "store_key": store_key, "index_key": index_key}
        if data != cache:
            if now - max(store_newest, index_newest) < _RACY_NS:
                notes.append("repository changed within the last 2s: scan not cached")
            else:
                try:
                    _save_cache(cache_path, data)
                except OSError as exc:
                    notes.append(f"cache not written: {exc}")
        rows = [*data["history"], *data["index"]]
        wanted = {oid: size for (_p, _r, oid, size, _s) in rows if size <= max_blob}
        contents = _read_blobs(git, wanted) if wanted else {}
    except _ScanFailed as exc:
        return done(error=f"{workspace}: cannot scan the git history: {exc}", key=store_key)
    except gitjail.GitJailError as exc:
        return done(error=f"{workspace}: {exc}", key=store_key)

    by_path: dict[str, tuple[str, dict[str, HistoryBlob]]] = {}
    for path, rule, oid, size, sources in rows:
        _rule, blobs = by_path.setdefault(path, (rule, {}))
        prev = blobs.get(oid)
        merged = tuple(sorted({*sources, *(prev.sources if prev else ())}))
        blobs[oid] = HistoryBlob(oid, size, contents.get(oid), merged)
    files = tuple(
        HistoryFile(path, rule, tuple(sorted(blobs.values(), key=lambda b: b.oid)))
        for path, (rule, blobs) in sorted(by_path.items())
    )
    return done(
        files=files,
        cached=cached,
        commits=data["commits"],
        objects=data["objects"],
        unreachable_commits=data["unreachable_commits"],
        blobs_outside_commits=data["blobs_outside_commits"],
        key=store_key,
        notes=tuple(notes),
    )


# -- what the caller does with it ----------------------------------------------------------------------

_TRIVIAL = frozenset(
    {
        *("true", "false", "yes", "no", "on", "off", "null", "none", "nil", "undefined", "default"),
        *("production", "development", "staging", "testing", "localhost"),
        *("debug", "info", "warning", "error", "enabled", "disabled"),
    }
)
_ASSIGNMENT = re.compile(
    r"""^\s*(?:export\s+)?["']?(?P<key>[A-Za-z_][A-Za-z0-9_.\-]*)["']?\s*(?:=|:)\s*(?P<value>.*?)\s*,?\s*$"""
)
_PLAIN_URL = re.compile(r"^https?://[^@/\s]+(?:/\S*)?$")


def _values(text: str) -> Iterable[tuple[str, str]]:
    """(key, value) of each ``KEY=VALUE`` / ``key: value`` / ``"key": "value"`` line whose value
    may be a secret: at least MIN_VALUE_LEN characters, not a plain word like ``production`` nor
    a URL without credentials. Quoted values are unquoted; an unquoted value with a
    `` #`` comment is registered with and without it."""
    for line in text.splitlines():
        m = _ASSIGNMENT.match(line)
        if not m or line.lstrip().startswith("#"):
            continue
        key, value = m.group("key"), m.group("value")
        candidates = [value]
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'`":
            candidates = [value[1:-1]]
        elif " #" in value:
            candidates.append(value.split(" #", 1)[0].rstrip())
        for v in candidates:
            if len(v) >= MIN_VALUE_LEN and v.lower() not in _TRIVIAL and not _PLAIN_URL.match(v):
                yield key, v


def secrets_from(scan: HistoryScan) -> dict[str, str]:
    """Known secrets for the output scrubber: each readable version of each file, whole (text,
    stripped of surrounding blank space), named ``history:<path>@<blob8>``, and each non-trivial
    ``KEY=VALUE`` value in it, named ``history:<path>@<blob8>:<KEY>``. A version that is not
    UTF-8 text is left out (the scrubber matches text): ``describe`` names it."""
    known: dict[str, str] = {}
    for f in scan.files:
        for blob in f.blobs:
            if blob.content is None:
                continue
            try:
                text = blob.content.decode("utf-8")
            except UnicodeDecodeError:
                continue
            name = f"history:{_printable(f.path)}@{blob.oid[:8]}"
            if whole := text.strip():
                known[name] = whole
            for key, value in _values(text):
                if value != whole:
                    known.setdefault(f"{name}:{key}", value)
    return known


def _printable(path: str) -> str:
    """A path the agent may have named, fit for a terminal: no control or unencodable characters."""
    return "".join(c if c.isprintable() and not 0xD800 <= ord(c) <= 0xDFFF else "?" for c in path)


def _shell_quote(path: str) -> str:
    path = _printable(path)
    return path if re.fullmatch(r"[\w./@%+=:,-]+", path) else "'" + path.replace("'", "'\\''") + "'"


def describe(scan: HistoryScan, limit: int = 5) -> str:
    """One line: which deny-listed files the sandbox can read through git, and the fix; or why the
    history could not be scanned. Empty when there is nothing to say."""
    if scan.error:
        return f"git history not scanned: {scan.error}"
    if not scan.files:
        return ""
    parts = []
    for f in scan.files[:limit]:
        n = len(f.blobs)
        what = [f"{n} version{'s' if n != 1 else ''}"]
        if all(b.sources == ("index",) for b in f.blobs):
            what.append("staged only")
        elif all("refs" not in b.sources for b in f.blobs):
            what.append("unreachable commits only")
        big = sum(1 for b in f.blobs if b.content is None)
        binary = sum(1 for b in f.blobs if b.content is not None and not _is_text(b.content))
        if big:
            what.append(f"{big} too large to scrub")
        if binary:
            what.append(f"{binary} binary, not scrubbed")
        parts.append(f"{_printable(f.path)} ({', '.join(what)})")
    more = f" and {len(scan.files) - limit} more" if len(scan.files) > limit else ""
    paths = " ".join(f"--path {_shell_quote(f.path)}" for f in scan.files)
    fix = f"rotate those secrets, or rewrite the history (git filter-repo --invert-paths {paths}"
    if any("unreachable" in b.sources for f in scan.files for b in f.blobs):
        fix += "; then git reflog expire --expire-unreachable=now --all && git gc --prune=now"
    if any("index" in b.sources for f in scan.files for b in f.blobs):
        fix += "; unstage with git rm --cached"
    return (
        f"{scan.workspace}: the git history holds deny-listed files the sandbox can read with git: "
        f"{', '.join(parts)}{more}; {fix})"
    )


def _is_text(content: bytes) -> bool:
    try:
        content.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
