"""Campaign acceptance: a campaign change the agent could have made never takes effect silently.

A workspace's ``.sandman/`` (image.toml, policy.toml, campaigns/*.toml) decides what the next
sandbox is built from and which policy it gets. It is read-only inside the sandbox, but a
workspace that had no ``.sandman/`` lets the agent create one, and a protection can fail; so
sandman records the content of the campaign files it last built or accepted, per workspace, and
refuses to start on anything else until the operator accepts the change (``sandman campaign
accept`` or ``--accept-campaign``), shown as a diff. The first use of a workspace records what
is there (nothing, often): a file appearing later is a change like any other.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from sandman.errors import CampaignError

CAMPAIGN_DIR = ".sandman"
MAX_FILE = 256 << 10  # a campaign file larger than this is refused, not read whole
MAX_FILES = 64


class CampaignChanged(CampaignError):
    """The campaign files differ from the ones the operator last accepted."""

    exit_code = 4


@dataclass(frozen=True)
class Snapshot:
    """The campaign files of a workspace: relative path -> text (None: unreadable / too big)."""

    files: dict[str, str]

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.files, sort_keys=True).encode()).hexdigest()


def _read_beneath(dir_fd: int, name: str, rel: str) -> str:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        raise CampaignError(f"{rel}: cannot open it without following a link ({exc.strerror}): remove it") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CampaignError(f"{rel}: not a regular file: remove it")
        if st.st_size > MAX_FILE:
            raise CampaignError(f"{rel}: larger than {MAX_FILE} bytes: a campaign file is a short TOML file")
        data = os.read(fd, MAX_FILE + 1)
    finally:
        os.close(fd)
    return data.decode("utf-8", errors="replace")


def snapshot(workspace: Path) -> Snapshot:
    """Every campaign file under ``workspace/.sandman``, read without following symlinks."""
    files: dict[str, str] = {}
    try:
        top = os.open(workspace / CAMPAIGN_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return Snapshot(files)
    except OSError as exc:
        raise CampaignError(f"{workspace / CAMPAIGN_DIR}: not a plain directory ({exc.strerror}): remove it") from None
    try:
        for name in ("image.toml", "policy.toml"):
            try:
                files[name] = _read_beneath(top, name, f"{CAMPAIGN_DIR}/{name}")
            except CampaignError:
                if os.path.lexists(workspace / CAMPAIGN_DIR / name):
                    raise
        try:
            sub = os.open("campaigns", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=top)
        except FileNotFoundError:
            return Snapshot(files)
        except OSError as exc:
            raise CampaignError(f"{CAMPAIGN_DIR}/campaigns: not a plain directory ({exc.strerror})") from None
        try:
            names = sorted(n for n in os.listdir(sub) if n.endswith(".toml"))
            if len(names) > MAX_FILES:
                raise CampaignError(f"{CAMPAIGN_DIR}/campaigns holds more than {MAX_FILES} campaigns")
            for name in names:
                files[f"campaigns/{name}"] = _read_beneath(sub, name, f"{CAMPAIGN_DIR}/campaigns/{name}")
        finally:
            os.close(sub)
    finally:
        os.close(top)
    return Snapshot(files)


# The snapshot each workspace's check passed, by real path: what the image build and the policy
# merge read, so nothing the agent swaps in between the check and the build is ever used.
_CHECKED: dict[str, Snapshot] = {}


def read(workspace: Path, rel: str) -> str | None:
    """The text of ``.sandman/<rel>`` (None: absent): from the snapshot the last check of this
    workspace accepted, else read now without following symlinks."""
    snap = _CHECKED.get(os.path.realpath(workspace))
    if snap is None:
        snap = snapshot(workspace)
    return snap.files.get(rel)


def names(workspace: Path, prefix: str) -> list[str]:
    """Campaign files under ``.sandman/<prefix>`` (e.g. "campaigns/"), as ``read`` sees them."""
    snap = _CHECKED.get(os.path.realpath(workspace)) or snapshot(workspace)
    return sorted(n for n in snap.files if n.startswith(prefix))


def _record_path(state_dir: Path, workspace: Path) -> Path:
    key = hashlib.sha256(os.fsencode(os.path.realpath(workspace))).hexdigest()[:24]
    return state_dir / "campaigns" / f"{key}.json"


def accepted(state_dir: Path, workspace: Path) -> Snapshot | None:
    """What the operator last accepted for ``workspace`` (None: never used)."""
    try:
        data = json.loads(_record_path(state_dir, workspace).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return Snapshot({str(k): str(v) for k, v in (data.get("files") or {}).items()})


def record(state_dir: Path, workspace: Path, snap: Snapshot) -> None:
    """Remember ``snap`` as the accepted campaign of ``workspace`` (atomically)."""
    path = _record_path(state_dir, workspace)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(f".{os.getpid()}.{secrets.token_hex(4)}.tmp")
    tmp.write_text(
        json.dumps({"workspace": str(workspace), "accepted": time.time(), "digest": snap.digest, "files": snap.files}),
        encoding="utf-8",
    )
    os.replace(tmp, path)


def diff(old: Snapshot, new: Snapshot) -> str:
    """A unified diff of the campaign files, one file after another."""
    out: list[str] = []
    for name in sorted(set(old.files) | set(new.files)):
        before, after = old.files.get(name), new.files.get(name)
        if before == after:
            continue
        out.extend(
            difflib.unified_diff(
                (before or "").splitlines(keepends=True),
                (after or "").splitlines(keepends=True),
                fromfile=f"accepted/.sandman/{name}" if before is not None else "/dev/null",
                tofile=f"workspace/.sandman/{name}" if after is not None else "/dev/null",
            )
        )
    return "".join(line if line.endswith("\n") else line + "\n" for line in out)


def check(state_dir: Path, workspace: Path, *, accept: bool = False) -> tuple[str, Snapshot]:
    """Compare the workspace's campaign with the accepted one: ("first-use" | "same" |
    "accepted", snapshot), or CampaignChanged with the diff and the way to accept it."""
    now = snapshot(workspace)
    before = accepted(state_dir, workspace)
    key = os.path.realpath(workspace)
    if before is None:
        record(state_dir, workspace, now)
        _CHECKED[key] = now
        return "first-use", now
    if before.digest == now.digest:
        _CHECKED[key] = now
        return "same", now
    if accept:
        record(state_dir, workspace, now)
        _CHECKED[key] = now
        return "accepted", now
    _CHECKED.pop(key, None)
    raise CampaignChanged(
        f"the campaign files of {workspace} changed since they were last accepted (the sandbox could "
        "have written them), so nothing was started. Review the change:\n"
        f"{diff(before, now)}"
        f"then accept it with `sandman campaign accept -w {workspace}` (or --accept-campaign), or undo it"
    )
