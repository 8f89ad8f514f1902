"""Cost of sandman.secrets.githistory's scan of a large repository, cold and cached.

Builds (scripts/make_big_repo.py, git fast-import) a repository with ``--commits`` commits and
``--files`` files where ``.env`` was committed early and removed at the middle commit, then times:

  cold        find_history_secrets with an empty cache (every listing runs, in the git jail), in
              a fresh process (no path matched against the deny list yet) and in a warm one
  cached      the same again: the cache key matches, only the .env versions are read back
  index       after the index file changed (its mtime): the index alone is listed again
  python      the cold scan again with git's answers replayed from memory: sandman's own share
  baseline    `git rev-list --all --count` through the same jail (gitjail.run_git), and unjailed

Every figure is the median of ``--runs`` runs, and the scans are also given as a ratio to the
jailed baseline. As root, the repository is given to ``--uid`` (the jail never runs git as root).

Usage: .venv/bin/python scripts/bench_history.py [--commits N] [--files N] [--runs N] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_big_repo import SECRET, make_big_repo

from sandman.secrets import githistory
from sandman.secrets.githistory import HistoryScan, find_history_secrets, secrets_from
from sandman.upcall import gitjail


def _median_ms(fn: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def _age(git_dir: Path, seconds: int = 60) -> None:
    """Move every mtime back: a repository written this very second is not cached (racy)."""
    past = time.time() - seconds
    for root, dirs, files in os.walk(git_dir):
        for name in dirs + files:
            os.utime(os.path.join(root, name), (past, past), follow_symlinks=False)
    os.utime(git_dir, (past, past))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", type=int, default=10_000)
    parser.add_argument("--files", type=int, default=5_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--uid", type=int, default=1000, help="owner of the repository when run as root")
    parser.add_argument("--keep", type=Path, help="build the repository here and keep it (reused if present)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="bench-history-"))
    try:
        repo = args.keep or tmp / "repo"
        if not (repo / ".git").is_dir():
            t = time.perf_counter()
            make_big_repo(repo, args.commits, args.files)
            print(f"built {args.commits} commits x {args.files} files in {time.perf_counter() - t:.1f}s: {repo}")
        if os.geteuid() == 0:
            subprocess.run(["chown", "-R", f"{args.uid}:{args.uid}", str(repo)], check=True)
        git_dir = repo / ".git"
        _age(git_dir)
        cache = tmp / "cache"

        def scan() -> HistoryScan:
            return find_history_secrets(repo, cache_dir=cache)

        colds, warms = [], []
        for _ in range(args.runs):
            shutil.rmtree(cache, ignore_errors=True)
            githistory._matcher.cache_clear()  # as in a fresh process
            t = time.perf_counter()
            first = scan()
            colds.append((time.perf_counter() - t) * 1000)
            shutil.rmtree(cache, ignore_errors=True)  # a controller that has matched these paths before
            t = time.perf_counter()
            scan()
            warms.append((time.perf_counter() - t) * 1000)
        if first.error:
            print(f"scan failed: {first.error}", file=sys.stderr)
            return 1
        assert not first.cached and [f.path for f in first.files] == [".env"], first
        assert SECRET in secrets_from(first).values()
        cold, warm = statistics.median(colds), statistics.median(warms)
        again = scan()
        assert again.cached and again.git_calls == 1, again
        cached = _median_ms(scan, args.runs)

        def index_changed() -> None:
            os.utime(git_dir / "index", None)  # now: newer than the cached shape
            _age(git_dir / "index")  # but not racy
            s = scan()
            assert s.cached and s.git_calls == 2, s

        index = _median_ms(index_changed, args.runs)

        recorded: dict[tuple[str, ...], gitjail.JailResult] = {}

        def record(git_dir: Path, argv: list[str], **kw: object) -> gitjail.JailResult:
            recorded[tuple(argv)] = result = gitjail.run_git(git_dir, argv, **kw)  # type: ignore[arg-type]
            return result

        shutil.rmtree(cache, ignore_errors=True)
        find_history_secrets(repo, cache_dir=cache, runner=record)

        def replayed() -> None:
            shutil.rmtree(cache, ignore_errors=True)
            githistory._matcher.cache_clear()  # as in a fresh process: no path matched yet
            find_history_secrets(repo, cache_dir=cache, runner=lambda _g, argv, **_kw: recorded[tuple(argv)])

        python = _median_ms(replayed, args.runs)
        jailed = _median_ms(lambda: gitjail.run_git(git_dir, ["rev-list", "--all", "--count"]), args.runs)
        env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1"}
        count_cmd = ["git", "-c", "safe.directory=*", "--git-dir", str(git_dir), "rev-list", "--all", "--count"]
        plain = _median_ms(lambda: subprocess.run(count_cmd, check=True, capture_output=True, env=env), args.runs)
        figures = {
            "commits": first.commits,
            "objects": first.objects,
            "cold_ms": round(cold, 1),
            "cold_git_calls": first.git_calls,
            "cold_warm_process_ms": round(warm, 1),
            "cached_ms": round(cached, 1),
            "cached_git_calls": again.git_calls,
            "index_changed_ms": round(index, 1),
            "cold_python_only_ms": round(python, 1),
            "baseline_jailed_count_ms": round(jailed, 1),
            "baseline_unjailed_count_ms": round(plain, 1),
            "cold_vs_jailed_count": round(cold / jailed, 1),
            "cached_vs_jailed_count": round(cached / jailed, 2),
        }
        print(f"repository: {first.commits} commits, {first.objects} objects, .env in the history")
        print(f"cold scan      {cold:8.1f} ms  ({first.git_calls} git calls)  = {cold / jailed:5.1f} x baseline")
        print(f"cold, warm     {warm:8.1f} ms  (empty cache, paths already matched by this process)")
        print(f"cached scan    {cached:8.1f} ms  ({again.git_calls} git call)   = {cached / jailed:5.2f} x baseline")
        print(f"index changed  {index:8.1f} ms  (2 git calls)")
        print(f"cold, python   {python:8.1f} ms  (the cold scan with git's output replayed: matching and parsing)")
        print(f"baseline       {jailed:8.1f} ms  git rev-list --all --count in the jail ({plain:.1f} ms unjailed)")
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2) + "\n")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
