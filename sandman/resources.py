"""Where sandman's own files live: images/ and policies/ beside the package in a checkout, or
packaged under sandman/_data in a wheel."""

from __future__ import annotations

from functools import cache
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


@cache
def data_root() -> Path:
    """The directory holding ``images/`` and ``policies/``."""
    for candidate in (_PACKAGE / "_data", _PACKAGE.parent):
        if (candidate / "images").is_dir() and (candidate / "policies").is_dir():
            return candidate
    raise FileNotFoundError(f"sandman's data files (images/, policies/) are missing beside {_PACKAGE}")


def images_dir() -> Path:
    return data_root() / "images"


def policies_dir() -> Path:
    return data_root() / "policies"


def seccomp_profile_path() -> Path:
    return policies_dir() / "seccomp" / "sandman.json"
