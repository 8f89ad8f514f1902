"""The scanner: one walk of the workspace from directory descriptors, reading git directories,
``.git`` files and pointers, configs and their includes, hooks, alternates, and editor and shell
auto-run files.

One module on purpose: ``_Scanner`` is a single walk whose git-directory, pointer, config, hook
and editor checks share its descriptors, its entry, time and byte budgets, its pending targets and
its findings; splitting the class would scatter that state across modules.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandman.core.poison.gitconfig import _HOOK_EVENTS, _SWEEP, _classify, parse_git_config
from sandman.core.poison.model import (
    _O_DIR,
    _O_FILE,
    MAX_DEPTH,
    MAX_FILE_BYTES,
    MAX_FINDINGS,
    MAX_INCLUDE_DEPTH,
    MAX_TOTAL_BYTES,
    Finding,
    Kind,
    _printable,
    _rel,
)

_AUTORUN_SETTINGS = re.compile(
    rb'"([^"\n]{0,120}?(?:path|executable|command|interpreter|terminal\.integrated[^"\n]*|runtime|cmd))"\s*:',
    re.IGNORECASE,
)


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
