"""Generate a large git repository quickly with ``git fast-import``, for benchmarking history scans.

The repository has ``--files`` files spread over 100 directories (the first commit adds them all),
then ``--commits`` commits in all, each changing ``--churn`` files. A ``.env`` holding
``API_KEY=<secret>`` is added in commit 10 and removed at the middle commit, so it lives only in
the history. Deterministic (random.Random(seed)).

Usage: .venv/bin/python scripts/make_big_repo.py DEST [--commits N] [--files N] [--churn N]
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
from pathlib import Path

SECRET = "sk-live-bench-0123456789abcdef"
ENV_TEXT = f"# local settings\nAPI_KEY={SECRET}\nDEBUG=1\n"


def _data(out: list[bytes], payload: bytes) -> None:
    out.append(b"data %d\n" % len(payload))
    out.append(payload)
    out.append(b"\n")


def fast_import_stream(commits: int, files: int, churn: int, seed: int = 20240501) -> bytes:
    """The fast-import input: ``commits`` commits on refs/heads/main, ``.env`` in a few of them."""
    if commits < 2 or files < 1:
        raise ValueError("need at least 2 commits and 1 file")
    rnd = random.Random(seed)
    paths = [f"pkg{i % 100:02d}/module_{i:05d}.py" for i in range(files)]
    env_added, env_removed = min(10, commits - 1), max(commits // 2, min(10, commits - 1) + 1)
    out: list[bytes] = []
    for n in range(1, commits + 1):
        out.append(b"commit refs/heads/main\n")
        out.append(b"mark :%d\n" % n)
        out.append(b"committer Bench <bench@example.invalid> %d +0000\n" % (1_600_000_000 + n * 60))
        _data(out, b"commit %d\n" % n)
        if n > 1:
            out.append(b"from :%d\n" % (n - 1))
        changed = paths if n == 1 else rnd.sample(paths, min(churn, len(paths)))
        for path in changed:
            out.append(b"M 100644 inline %s\n" % path.encode())
            _data(out, f"# {path} revision {n}\nVALUE = {rnd.getrandbits(64)}\n".encode())
        if n == env_added:
            out.append(b"M 100644 inline .env\n")
            _data(out, ENV_TEXT.encode())
        if n == env_removed:
            out.append(b"D .env\n")
    out.append(b"done\n")
    return b"".join(out)


def make_big_repo(dest: Path, commits: int = 10_000, files: int = 5_000, churn: int = 3) -> Path:
    """A repository at ``dest`` (created; must not exist or be empty), its work tree checked out."""
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "init", "-q", "-b", "main", str(dest)], check=True)
    subprocess.run(
        ["git", "-C", str(dest), "fast-import", "--quiet", "--done"],
        input=fast_import_stream(commits, files, churn),
        check=True,
    )
    subprocess.run(["git", "-C", str(dest), "checkout", "-q", "-f", "main"], check=True)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path)
    parser.add_argument("--commits", type=int, default=10_000)
    parser.add_argument("--files", type=int, default=5_000)
    parser.add_argument("--churn", type=int, default=3, help="files changed per commit")
    args = parser.parse_args(argv)
    if args.dest.exists() and any(args.dest.iterdir()):
        print(f"{args.dest} exists and is not empty", file=sys.stderr)
        return 2
    make_big_repo(args.dest, args.commits, args.files, args.churn)
    print(args.dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
