"""Poison's vocabulary: the limits of a scan, what a finding is, a baseline, a quarantine report,
and the printable, reversible form of workspace paths that findings carry."""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Literal

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
