"""Images: the base image (pulled, or built offline with debootstrap), sandman's agent layer, and
the per-campaign layer from ``<workspace>/.sandman/image.toml``.

Tags are content hashes (base image id + campaign spec + sandman's image files), so an unchanged
campaign never rebuilds. Every image sandman makes carries ``io.sandman.*`` labels; prune removes
only those.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from sandman import __version__, resources
from sandman.backends.base import LABEL_CAMPAIGN, LABEL_KIND, LABEL_VERSION
from sandman.backends.docker import engine_retry
from sandman.core.workspace import campaign_slug
from sandman.errors import CampaignError, ConfigError, ImageError

if TYPE_CHECKING:
    import docker

Progress = Callable[[str], None]
LABEL_HASH = "io.sandman.hash"
LABEL_BASE = "io.sandman.base"
BASE_REPO = "sandman/base"
CAMPAIGN_REPO = "sandman/campaign"
OFFLINE_PACKAGES = ("bubblewrap", "tini", "python3", "git", "ca-certificates")
_CAMPAIGN_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
_APT_NAME = re.compile(r"^[a-z0-9][a-z0-9+.-]*(=[A-Za-z0-9.+:~-]+)?$")
_PIP_REQ = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,-]+\])?([<>=!~]=?[A-Za-z0-9.*+!-]+,?)*$")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
ENSURE_TTL_S = 60.0
_ENSURED: dict[tuple[str, str, str, str], tuple[str, float]] = {}
# What starts and carries the sandbox inside the container and must be exactly what sandman's base
# image has, whatever a campaign layer ran as root: bubblewrap, tini, the Python that runs the
# supervisor, the libraries they load, and no preload. (supervisor.py and the exec shim are not
# here: they are bound read-only from the host over the image's copy.)
TRUSTED_PATHS = (
    "/usr/bin/bwrap",
    "/usr/bin/tini",
    "/usr/bin/python3",
    "/usr/bin/python3.11",
    "/usr/lib/python3.11",  # the supervisor's standard library (a directory: every file in it)
    "/etc/ld.so.preload",
    "/lib64/ld-linux-x86-64.so.2",
    "/lib/ld-linux-aarch64.so.1",
    *(
        f"/lib/{arch}-linux-gnu/{lib}"
        for arch in ("x86_64", "aarch64")
        for lib in (
            "libc.so.6", "libm.so.6", "libz.so.1", "libexpat.so.1", "libselinux.so.1", "libcap.so.2",
            "libpcre2-8.so.0",
        )
    ),
)  # fmt: skip
_VERIFIED: set[str] = set()
_PRINTS: dict[str, dict[str, str | None]] = {}  # image id -> fingerprint (images never change)


def _quiet(_: str) -> None:
    pass


class CampaignImage(BaseModel):
    """``image.toml``: what a campaign adds to sandman's agent image."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = Field(default=None, description="campaign name; default: the workspace dir name")
    apt_packages: tuple[str, ...] = ()
    pip_packages: tuple[str, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)
    dockerfile_lines: tuple[str, ...] = Field(default=(), description="escape hatch, appended verbatim")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is not None and not _CAMPAIGN_NAME.match(v):
            raise ValueError("must be lowercase letters, digits, '.', '_' or '-', at most 63 characters")
        return v

    @field_validator("apt_packages")
    @classmethod
    def _apt(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for pkg in v:
            if not _APT_NAME.match(pkg):
                raise ValueError(f"{pkg!r} is not a Debian package name (optionally =version)")
        return v

    @field_validator("pip_packages")
    @classmethod
    def _pip(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for req in v:
            if not _PIP_REQ.match(req):
                raise ValueError(f"{req!r} is not a plain requirement such as 'requests==2.32.3'")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not _ENV_KEY.match(key) or key.startswith("SANDMAN_"):
                raise ValueError(f"{key!r} is not a valid variable name (SANDMAN_* is reserved)")
            if "\n" in value or "\x00" in value:
                raise ValueError(f"value of {key!r} contains a newline or NUL")
        return v

    @field_validator("dockerfile_lines")
    @classmethod
    def _lines(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for line in v:
            if "\n" in line or line.strip().upper().startswith("FROM "):
                raise ValueError(f"{line!r}: one instruction per entry, and no FROM")
        return v

    def is_empty(self) -> bool:
        return not (self.apt_packages or self.pip_packages or self.env or self.dockerfile_lines)

    def dockerfile(self, parent: str) -> str:
        lines = [f"FROM {parent}", "USER 0:0"]
        apt = list(self.apt_packages) + (["python3-pip"] if self.pip_packages else [])
        if apt:
            lines.append(
                "RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y "
                f"--no-install-recommends {' '.join(apt)} && rm -rf /var/lib/apt/lists/*"
            )
        if self.pip_packages:
            reqs = " ".join(json.dumps(r) for r in self.pip_packages)
            lines.append(f"RUN python3 -m pip install --no-cache-dir --break-system-packages {reqs}")
        for key, value in sorted(self.env.items()):
            lines.append(f"ENV {key}={json.dumps(value)}")
        lines.extend(self.dockerfile_lines)
        lines.append("USER 1000:1000")
        return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Campaign:
    name: str
    spec: CampaignImage
    source: Path | None  # the image.toml it came from, if any


def load_campaign(workspace: Path, name: str | None = None) -> Campaign:
    """The campaign for ``workspace``: ``.sandman/image.toml``, or ``.sandman/campaigns/NAME.toml``,
    read from the snapshot the campaign check accepted (never re-read by path: see campaign.py)."""
    from sandman.policy import campaign

    sandman_dir = workspace / ".sandman"
    if name is None:
        path = sandman_dir / "image.toml"
        text = campaign.read(workspace, "image.toml")
        spec = _parse_campaign(path, text) if text is not None else CampaignImage()
        return Campaign(spec.name or campaign_slug(workspace.name), spec, path if text is not None else None)
    if not _CAMPAIGN_NAME.match(name):
        raise CampaignError(f"campaign name {name!r} is invalid: use lowercase letters, digits, '.', '_', '-'")
    path = sandman_dir / "campaigns" / f"{name}.toml"
    text = campaign.read(workspace, f"campaigns/{name}.toml")
    if text is None:
        known = [Path(n).stem for n in campaign.names(workspace, "campaigns/")]
        default = campaign.read(workspace, "image.toml") is not None
        hint = ", ".join(known) if known else "none"
        raise CampaignError(
            f"unknown campaign {name!r} in {workspace}: known campaigns: {hint}"
            f"{' (plus the default, .sandman/image.toml)' if default else ''}; "
            f"create {path} or omit --campaign"
        )
    return Campaign(name, _parse_campaign(path, text), path)


def _parse_campaign(path: Path, text: str) -> CampaignImage:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    try:
        return CampaignImage.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "(top level)"
        raise ConfigError(f"{path}: key {key!r}: {str(err['msg']).removeprefix('Value error, ')}") from None


def _hash(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return h.hexdigest()


def _dir_digest(path: Path) -> bytes:
    h = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = file.relative_to(path).as_posix().encode()
        h.update(rel + b"\0" + file.read_bytes() + b"\0" + bytes([file.stat().st_mode & 0o111 != 0]))
    return h.digest()


def _context_tar(files: dict[str, tuple[bytes, int]]) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, (data, mode) in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, 0
            tar.addfile(info, io.BytesIO(data))
    buf.seek(0)
    return buf


def _image_id(api: docker.APIClient, ref: str) -> str | None:
    import docker.errors

    try:
        return str(engine_retry(api.inspect_image)(ref)["Id"])
    except docker.errors.ImageNotFound:
        return None


class ImageManager:
    """Resolves and builds sandman's images on one engine."""

    def __init__(
        self, api: docker.APIClient, base_image: str, offline_base_image: str, state_dir: Path | None = None
    ) -> None:
        self.api = api
        self.base_image = base_image
        self.offline_base_image = offline_base_image
        self.state_dir = state_dir  # where verified campaign images are remembered

    # -- the base image -------------------------------------------------------------------
    def resolve_base(self, progress: Progress = _quiet, allow_build: bool = True) -> str:
        """The base to build FROM: the configured one if present or pullable, else the offline one."""
        if _image_id(self.api, self.base_image):
            return self.base_image
        if _image_id(self.api, self.offline_base_image):
            return self.offline_base_image
        progress(f"base image {self.base_image} not present: trying to pull it")
        if self._try_pull(self.base_image):
            return self.base_image
        if not allow_build:
            raise ImageError(f"base image {self.base_image} is missing and cannot be pulled: run `sandman image build`")
        progress(f"pull failed: building {self.offline_base_image} offline with debootstrap")
        build_offline_base(self.api, self.offline_base_image, progress)
        return self.offline_base_image

    def _try_pull(self, ref: str) -> bool:
        import docker.errors
        import requests

        repo, _, tag = ref.rpartition(":") if ":" in ref.split("/")[-1] else (ref, "", "latest")
        try:
            for _ in self.api.pull(repo, tag=tag or "latest", stream=True, decode=True):
                pass
        except (docker.errors.APIError, requests.exceptions.RequestException):
            return False
        return _image_id(self.api, ref) is not None

    # -- sandman's agent image and the campaign layer -------------------------------------
    def base_tag(self, base_ref: str) -> str:
        base_id = _image_id(self.api, base_ref) or ""
        digest = _hash(base_id.encode(), _dir_digest(resources.images_dir() / "base"))
        return f"{BASE_REPO}:{digest[:16]}"

    def campaign_tag(self, campaign: Campaign, parent_id: str) -> str:
        spec = json.dumps(campaign.spec.model_dump(mode="json", exclude={"name"}), sort_keys=True)
        digest = _hash(parent_id.encode(), spec.encode(), campaign.name.encode())
        return f"{CAMPAIGN_REPO}-{campaign.name}:{digest[:16]}"

    def ensure(self, campaign: Campaign, progress: Progress = _quiet, rebuild: bool = False) -> str:
        """The image tag to run for ``campaign``, building only what is missing.

        A resolved tag is remembered for a minute (checked with one inspect): resolving from
        scratch costs several engine calls, a noticeable share of a one-shot run."""
        key = (
            self.base_image,
            self.offline_base_image,
            campaign.name,
            json.dumps(campaign.spec.model_dump(mode="json"), sort_keys=True),
        )
        cached = _ENSURED.get(key)
        if not rebuild and cached and cached[1] > time.monotonic() and _image_id(self.api, cached[0]):
            return cached[0]
        tag = self._ensure(campaign, progress, rebuild)
        _ENSURED[key] = (tag, time.monotonic() + ENSURE_TTL_S)
        return tag

    def _ensure(self, campaign: Campaign, progress: Progress, rebuild: bool) -> str:
        base_ref = self.resolve_base(progress)
        base_tag = self.base_tag(base_ref)
        if rebuild or not _image_id(self.api, base_tag):
            self._build_base(base_ref, base_tag, progress)
        if campaign.spec.is_empty():
            return base_tag
        parent_id = _image_id(self.api, base_tag) or ""
        tag = self.campaign_tag(campaign, parent_id)
        if rebuild or not _image_id(self.api, tag):
            progress(f"building campaign image {tag}")
            context = _context_tar({"Dockerfile": (campaign.spec.dockerfile(base_tag).encode(), 0o644)})
            self._build(context, tag, {LABEL_KIND: "campaign", LABEL_CAMPAIGN: campaign.name}, {}, progress)
        self.verify_trusted(tag, base_tag)
        return tag

    # -- sandman's trusted pieces ----------------------------------------------------------
    def fingerprint(self, image: str) -> dict[str, str | None]:
        """sha256 of each TRUSTED_PATHS entry in ``image`` (symlinks by target), read by the engine
        from a created, never started container: nothing of the image runs."""
        import docker.errors

        image_id = _image_id(self.api, image) or image
        if image_id in _PRINTS:
            return _PRINTS[image_id]
        cid = engine_retry(self.api.create_container)(
            image, command=["true"], labels={LABEL_KIND: "verify"}, network_disabled=True
        )["Id"]
        prints: dict[str, str | None] = {}
        try:
            for path in TRUSTED_PATHS:
                try:
                    stream, _ = self.api.get_archive(cid, path)
                except docker.errors.NotFound:
                    prints[path] = None
                    continue
                h = hashlib.sha256()
                with tarfile.open(fileobj=io.BytesIO(b"".join(stream)), mode="r:") as tar:
                    for member in sorted(tar.getmembers(), key=lambda m: m.name):
                        h.update(f"{member.name}\0{member.type!r} {member.mode:o} {member.linkname}\0".encode())
                        data = tar.extractfile(member) if member.isfile() else None
                        if data is not None:
                            h.update(data.read())
                    prints[path] = h.hexdigest()
        finally:
            with contextlib.suppress(docker.errors.APIError):
                self.api.remove_container(cid, force=True)
        _PRINTS[image_id] = prints
        return prints

    def verify_trusted(self, image: str, base: str) -> None:
        """Refuse a campaign image whose layers replaced any of sandman's trusted pieces; once per
        image id (an image never changes), remembered under the state dir."""
        image_id = _image_id(self.api, image) or image
        marker = self.state_dir / "verified-images" / image_id.replace(":", "-") if self.state_dir else None
        if image_id in _VERIFIED or (marker is not None and marker.exists()):
            return
        ours, theirs = self.fingerprint(base), self.fingerprint(image)
        changed = [p for p in TRUSTED_PATHS if ours.get(p) != theirs.get(p)]
        if changed:
            raise ImageError(
                f"campaign image {image} replaces sandman's trusted pieces ({', '.join(changed)}): "
                "bubblewrap, tini, the supervisor's Python and their libraries must be exactly those of "
                "sandman's base image, so nothing was started. Remove the image.toml lines that change "
                "them (a dockerfile line, or a package upgrading them: pin it), then build again"
            )
        _VERIFIED.add(image_id)
        if marker is not None:
            marker.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            marker.touch()

    def _build_base(self, base_ref: str, tag: str, progress: Progress) -> None:
        progress(f"building sandman's agent image {tag} from {base_ref}")
        root = resources.images_dir() / "base"
        files = {
            p.relative_to(root).as_posix(): (p.read_bytes(), 0o755 if os.access(p, os.X_OK) else 0o644)
            for p in root.rglob("*")
            if p.is_file()
        }
        labels = {LABEL_KIND: "base", LABEL_BASE: base_ref}
        self._build(_context_tar(files), tag, labels, {"BASE_IMAGE": base_ref}, progress)

    def _build(
        self,
        context: io.BytesIO,
        tag: str,
        labels: dict[str, str],
        buildargs: dict[str, str],
        progress: Progress,
    ) -> None:
        import docker.errors

        labels = {**labels, LABEL_VERSION: __version__, LABEL_HASH: tag.rpartition(":")[2]}
        try:
            stream = self.api.build(
                fileobj=context,
                custom_context=True,
                tag=tag,
                labels=labels,
                buildargs=buildargs,
                rm=True,
                forcerm=True,
                decode=True,
            )
            for chunk in _build_lines(stream):
                progress(chunk)
        except docker.errors.APIError as exc:
            raise ImageError(f"building {tag} failed: {exc.explanation or exc}") from None

    # -- listing and pruning ---------------------------------------------------------------
    def list_images(self) -> list[dict[str, Any]]:
        images = self.api.images(filters={"label": LABEL_KIND})
        rows = []
        for img in images:
            labels = img.get("Labels") or {}
            rows.append(
                {
                    "id": img["Id"].removeprefix("sha256:")[:12],
                    "tags": img.get("RepoTags") or [],
                    "kind": labels.get(LABEL_KIND, ""),
                    "campaign": labels.get(LABEL_CAMPAIGN, ""),
                    "size_mb": round(img.get("Size", 0) / 1e6, 1),
                    "created": img.get("Created", 0),
                }
            )
        return sorted(rows, key=lambda r: (r["kind"], r["campaign"], -r["created"]))

    def prune(self, everything: bool = False) -> list[str]:
        """Remove stale sandman-labelled images: every one but the newest of each repository
        (``everything``: all of them, the offline base included). Images a container uses, and
        images without sandman's labels, are never touched."""
        import docker.errors

        used = {c["ImageID"] for c in self.api.containers(all=True)}
        images = self.api.images(filters={"label": LABEL_KIND})
        newest: dict[str, tuple[int, str]] = {}
        for img in images:
            for tag in img.get("RepoTags") or []:
                repo = tag.rpartition(":")[0]
                if img.get("Created", 0) >= newest.get(repo, (-1, ""))[0]:
                    newest[repo] = (img.get("Created", 0), img["Id"])
        keep = set() if everything else {image_id for _, image_id in newest.values()}
        order = {"campaign": 0, "base": 1, "offline-base": 2}  # children before their parents
        removed = []
        for img in sorted(images, key=lambda i: order.get((i.get("Labels") or {}).get(LABEL_KIND, ""), 3)):
            if img["Id"] in used or img["Id"] in keep:
                continue
            try:
                self.api.remove_image(img["Id"], force=False, noprune=False)
                removed.append(", ".join(img.get("RepoTags") or [img["Id"][:19]]))
            except docker.errors.APIError:
                continue  # still the parent of an image in use
        return removed


def _build_lines(stream: Iterator[dict[str, Any]]) -> Iterator[str]:
    for chunk in stream:
        if "error" in chunk:
            detail = chunk.get("errorDetail", {}).get("message") or chunk["error"]
            raise ImageError(f"image build failed: {detail.strip()}")
        text = str(chunk.get("stream", "")).strip()
        # One line per Dockerfile step keeps progress readable; RUN output is not shown.
        if text.startswith("Step "):
            yield text if len(text) <= 100 else text[:97] + "..."


def apt_mirror() -> str | None:
    """The Debian mirror this machine's own apt sources name (None: let debootstrap choose)."""
    candidates = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in candidates:
        try:
            text = path.read_text()
        except OSError:
            continue
        if path.suffix == ".sources":
            for stanza in text.split("\n\n"):
                fields = dict(
                    line.split(":", 1) for line in stanza.splitlines() if ":" in line and not line.startswith("#")
                )
                uris = fields.get("URIs", "").split()
                suites = fields.get("Suites", "").split()
                if uris and "bookworm" in suites and "main" in fields.get("Components", ""):
                    return uris[0].strip()
        else:
            for line in text.splitlines():
                parts = line.split()
                if len(parts) >= 4 and parts[0] == "deb" and parts[2] == "bookworm" and "main" in parts[3:]:
                    return parts[1] if not parts[1].startswith("[") else parts[2]
    return None


def build_offline_base(api: docker.APIClient, tag: str, progress: Progress = _quiet) -> None:
    """debootstrap --variant=minbase bookworm (with layer-2 packages) + docker import, as ``tag``."""
    if shutil.which("debootstrap") is None:
        raise ImageError(
            "the base image cannot be pulled and debootstrap is missing: `apt-get install debootstrap` "
            "(or make a registry reachable)"
        )
    if os.geteuid() != 0:
        raise ImageError("building the base image offline needs root (debootstrap): run scripts/setup as root")
    repo, _, version = tag.rpartition(":")
    with tempfile.TemporaryDirectory(prefix="sandman-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        cmd = [
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(OFFLINE_PACKAGES)}",
            "bookworm",
            str(rootfs),
        ]
        mirror = apt_mirror()
        if mirror:
            cmd.append(mirror)
        progress(f"debootstrap: {' '.join(cmd[1:4])} (this takes a minute)")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        tail: list[str] = []
        for line in proc.stdout:
            line = line.rstrip()
            tail = [*tail[-20:], line]
            if line.startswith(("I: Retrieving", "I: Extracting", "I: Installing", "I: Configuring", "I: Base")):
                if not line.startswith(("I: Retrieving ", "I: Extracting ")) or line.endswith("..."):
                    progress(line[3:])
        if proc.wait() != 0:
            raise ImageError("debootstrap failed:\n" + "\n".join(tail))
        for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (rootfs / leftover).glob("*"):
                if p.is_file():
                    p.unlink()
        progress(f"importing the root filesystem as {tag}")
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
        assert tar.stdout is not None
        try:
            api.import_image_from_stream(
                tar.stdout,
                repository=repo,
                tag=version,
                changes=[
                    f"LABEL {LABEL_KIND}=offline-base {LABEL_VERSION}={__version__}",
                    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                    'CMD ["/bin/bash"]',
                ],
            )
        finally:
            tar.stdout.close()
            tar.wait()
    if _image_id(api, tag) is None:
        raise ImageError(f"docker import did not produce {tag}")
