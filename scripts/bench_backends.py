"""Per-backend benchmarks (``scripts/bench --backend B``): cold `sandman run -- true` and a session
exec of `true`, each against that backend's own raw baseline measured in the same run, runs
interleaved so drift hits both alike:

  backend          cold-run baseline                              exec baseline
  docker           docker run --rm --network=none IMAGE true      docker-py exec_run in a bare container
  gvisor           the same with --runtime=runsc                  exec_run in a bare runsc container
  podman           podman run --rm --network=none IMAGE true      exec_run via podman's compat API
  podman-rootless  the same as the podman user                    exec_run via the rootless socket
  local            bare bwrap (the same host view) true           the same bare bwrap

Writes bench-results/backends.json, a Markdown table (backends.md) and a PNG of the latency
distributions (backends.png) beside it.
"""

from __future__ import annotations

import json
import os
import pwd
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SANDMAN = [str(ROOT / ".venv" / "bin" / "sandman")]


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    res = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if res.returncode != 0:
        sys.exit(f"bench: {' '.join(cmd)} failed ({res.returncode}): {res.stderr.decode()[-500:]}")


def summary(samples: list[float]) -> dict[str, Any]:
    ordered = sorted(samples)
    return {
        "median_s": round(statistics.median(ordered), 6),
        "p90_s": round(ordered[int(0.9 * (len(ordered) - 1))], 6),
        "n": len(ordered),
        "samples": [round(s, 6) for s in samples],
    }


def _podman_user() -> pwd.struct_passwd:
    from sandman.settings import Settings

    return pwd.getpwnam(Settings.load().podman_user)


def _raw_run(backend: str, image: str) -> list[str]:
    if backend == "docker":
        return ["docker", "run", "--rm", "--network=none", image, "true"]
    if backend == "gvisor":
        return ["docker", "run", "--rm", "--runtime=runsc", "--network=none", image, "true"]
    if backend == "podman":
        # Explicit nofile/nproc: this host lacks CAP_SYS_RESOURCE, and podman's defaults exceed its limits.
        return ["podman", "run", "--rm", "--network=none", "--ulimit", "nofile=1024:1024",
                "--ulimit", "nproc=4096:4096", image, "true"]  # fmt: skip
    if backend == "podman-rootless":
        user = _podman_user()
        return [
            "runuser", "-u", user.pw_name, "--", "env", "-i", "-C", "/", f"HOME={user.pw_dir}",
            f"XDG_RUNTIME_DIR=/run/user/{user.pw_uid}", "PATH=/usr/bin:/bin",
            "podman", "run", "--rm", "--network=none", image, "true",
        ]  # fmt: skip
    # local: a bare bwrap with the same host view as the backend's layer 1, as the workspace uid
    return [
        "setpriv", "--reuid", "1000", "--regid", "1000", "--clear-groups", "bwrap", "--unshare-all",
        "--die-with-parent", "--new-session", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin",
        "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev",
        "--tmpfs", "/tmp", "--", "/usr/bin/true",
    ]  # fmt: skip


def _bare_exec(backend: str, image: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """(exec `true` once, clean up) for the backend's raw exec baseline."""
    if backend == "local":
        cmd = _raw_run("local", image)
        return (lambda: _run(cmd)), (lambda: None)
    import docker

    from sandman import backends
    from sandman.settings import Settings

    url = getattr(backends.get(backend, Settings.load()), "base_url", lambda: None)()
    client = docker.DockerClient(base_url=url, version="auto")
    kwargs: dict[str, Any] = {"network_mode": "none", "labels": {"io.sandman.bench": "1"}}
    if backend == "gvisor":
        kwargs["runtime"] = "runsc"
    if backend == "podman":  # as for `podman run`: within this host's limits
        kwargs["ulimits"] = [
            docker.types.Ulimit(name="nofile", soft=1024, hard=1024),
            docker.types.Ulimit(name="nproc", soft=4096, hard=4096),
        ]
    bare = client.containers.run(image, ["sleep", "infinity"], detach=True, **kwargs)

    def one() -> None:
        code, _ = bare.exec_run(["true"])
        assert code == 0

    def done() -> None:
        bare.remove(force=True)
        client.close()

    return one, done


def workspace(base: Path, backend: str) -> Path:
    from sandman import backends
    from sandman.settings import Settings

    ws = base / f"ws-{backend}"
    ws.mkdir()
    owner = backends.backend_class(backend).workspace_owner(Settings.load()) or (1000, 1000)
    if os.geteuid() == 0:
        os.chown(ws, *owner)
    return ws


def bench_backend(backend: str, base: Path, env: dict[str, str], runs: int) -> dict[str, Any]:
    from sandman import backends
    from sandman.backends.image import load_campaign
    from sandman.core.session import Sandbox
    from sandman.settings import Settings

    avail = backends.backend_class(backend).availability(Settings.load())
    if not avail.available:
        return {"available": False, "reason": avail.reason, "fix": avail.fix}
    ws = workspace(base, backend)
    image = backends.get(backend, Settings.load()).images().ensure(load_campaign(ws, None))
    ours_cmd = [*SANDMAN, "run", "--backend", backend, "--workspace", str(ws), "--", "true"]
    raw_cmd = _raw_run(backend, image)
    _run(ours_cmd, env)  # warm the controller and the probe marker
    _run(raw_cmd)
    ours, raw = [], []
    for _ in range(runs):
        ours.append(_timed(lambda: _run(ours_cmd, env)))
        raw.append(_timed(lambda: _run(raw_cmd)))
    exec_ours, exec_raw = [], []
    one, done = _bare_exec(backend, image)
    try:
        with Sandbox(ws, backend=backend) as sb:
            for _ in range(5):
                sb.exec(["true"])
                one()
            for _ in range(runs * 3):
                t0 = time.perf_counter()
                assert sb.exec(["true"]).exit_code == 0
                exec_ours.append(time.perf_counter() - t0)
                exec_raw.append(_timed(one))
    finally:
        done()
    run_s, run_b, ex_s, ex_b = summary(ours), summary(raw), summary(exec_ours), summary(exec_raw)
    return {
        "available": True,
        "baseline_run": " ".join(raw_cmd[raw_cmd.index("podman") if "podman" in raw_cmd else 0 :]),
        "run_cold": {
            "sandman": run_s,
            "baseline": run_b,
            "ratio_median": round(run_s["median_s"] / run_b["median_s"], 3),
        },
        "exec": {"sandman": ex_s, "baseline": ex_b, "ratio_median": round(ex_s["median_s"] / ex_b["median_s"], 3)},
    }


def table(results: dict[str, Any]) -> str:
    lines = [
        "| backend | cold run: sandman | raw baseline | ratio | exec: sandman | raw baseline | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if not r.get("available"):
            lines.append(f"| {name} | unavailable: {r.get('reason')} | | | | | |")
            continue
        rc, ex = r["run_cold"], r["exec"]
        lines.append(
            f"| {name} | {rc['sandman']['median_s']:.3f} s | {rc['baseline']['median_s']:.3f} s | "
            f"{rc['ratio_median']:.2f} | {ex['sandman']['median_s'] * 1000:.1f} ms | "
            f"{ex['baseline']['median_s'] * 1000:.1f} ms | {ex['ratio_median']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, r in results.items() if r.get("available")]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, unit, scale in ((axes[0], "run_cold", "s", 1.0), (axes[1], "exec", "ms", 1000.0)):
        data, labels, colors = [], [], []
        for n in names:
            data += [
                [s * scale for s in results[n][key]["sandman"]["samples"]],
                [s * scale for s in results[n][key]["baseline"]["samples"]],
            ]
            labels += [f"{n}\nsandman", f"{n}\nraw"]
            colors += ["tab:blue", "tab:gray"]
        parts = ax.boxplot(data, patch_artist=True, showfliers=True)
        for patch, color in zip(parts["boxes"], colors, strict=True):
            patch.set_facecolor(color)
            patch.set_alpha(0.6)
        ax.set_xticks(range(1, len(labels) + 1), labels, fontsize=7, rotation=30, ha="right")
        ax.set_ylabel(unit)
        ax.set_title("cold `run -- true`" if key == "run_cold" else "session exec `true`")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("sandman per backend vs that backend's raw baseline (same run)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(names: list[str], runs: int, out_dir: Path) -> int:
    from bench import private_env, stop_controller  # scripts/ is on the path: bench.py runs us

    from sandman import backends

    chosen = backends.names() if names == ["all"] else names
    for n in chosen:
        backends.backend_class(n)  # an unknown name lists the known ones
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="sandman-bench-backends-") as tmp_s:
        tmp = Path(tmp_s)
        os.chmod(tmp, 0o755)
        env = private_env(tmp)
        os.environ.update({k: env[k] for k in ("SANDMAN_RUNTIME_DIR", "SANDMAN_STATE_DIR")})
        for n in chosen:
            print(f"bench: backend {n}, {runs} runs", file=sys.stderr)
            results[n] = r = bench_backend(n, tmp, env, runs)
            if r.get("available"):
                print(
                    f"{n:<16} run {r['run_cold']['sandman']['median_s']:.3f}s vs raw "
                    f"{r['run_cold']['baseline']['median_s']:.3f}s ({r['run_cold']['ratio_median']:.2f})  "
                    f"exec {r['exec']['sandman']['median_s'] * 1000:.1f}ms vs raw "
                    f"{r['exec']['baseline']['median_s'] * 1000:.1f}ms ({r['exec']['ratio_median']:.2f})"
                )
            else:
                print(f"{n:<16} unavailable: {r['reason']}")
        stop_controller(tmp)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "backends.json").write_text(json.dumps(results, indent=2) + "\n")
    (out_dir / "backends.md").write_text(table(results))
    plot(results, out_dir / "backends.png")
    print(table(results))
    print(f"bench: {out_dir / 'backends.json'}, backends.md and backends.png", file=sys.stderr)
    return 0
