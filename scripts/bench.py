"""sandman's benchmarks: every figure is a ratio against a baseline measured in the same run.

  run-cold     `sandman run -- true` (new sandbox each time, image cached, controller warm)
               vs `docker run --rm --network=none <same image> true`
  run-first    the same with a controller that has to start first (what a first call costs)
  teardown     SIGTERM to `sandman run` of a command that ignores SIGTERM -> sandman exited and
               the container gone
  exec         `true` through both layers in a live session (Sandbox.exec)
               vs docker-py `exec_run("true")` in a bare container of the same image
  create       Sandbox() (image cached) vs `docker run -d` of the same image
  pool         Pool.acquire() (target median <= 50 ms)
  concurrent   32 sessions created and used at once: all succeed; throughput and our memory
  scrub        secret scrubbing throughput on 64 MiB of realistic output, exact-match and full
               (patterns + encodings), 4 KiB and 64 KiB chunks, vs copying the stream unscrubbed
               (targets: >= 100 MB/s exact, >= 30 MB/s full); scripts/bench_scrub.py prints more
  upcall       a no-op upcall from inside the sandbox (JSON-RPC over the relay socket), median
               and p99 (target median <= 5 ms), against a bare `python3 -c pass`-free baseline:
               the same client loop against an echo server in the same sandbox

  --backend B  per backend (docker, gvisor, podman, podman-rootless, local, or all; repeatable):
               cold run and session exec against that backend's own raw baseline, with a PNG
               plot of the latency distributions (scripts/bench_backends.py)

Usage: scripts/bench [--runs N] [--json FILE] [--backend B ...]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SANDMAN = [str(ROOT / ".venv" / "bin" / "sandman")]


def timed(cmd: list[str], env: dict[str, str] | None = None) -> float:
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    elapsed = time.perf_counter() - t0
    if res.returncode != 0:
        sys.exit(f"bench: {' '.join(cmd)} failed ({res.returncode}): {res.stderr.decode()[-500:]}")
    return elapsed


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_s": round(statistics.median(ordered), 6),
        "p90_s": round(ordered[int(0.9 * (len(ordered) - 1))], 6),
        "min_s": round(ordered[0], 6),
        "max_s": round(ordered[-1], 6),
        "n": len(ordered),
    }


def private_env(tmp: Path) -> dict[str, str]:
    """The benchmark's own state and runtime dirs under ``tmp`` (and so its own controller)."""
    return {
        **os.environ,
        "SANDMAN_RUNTIME_DIR": str(tmp / "run"),
        "SANDMAN_STATE_DIR": str(tmp / "state"),
        "SANDMAN_CONTROLLER_IDLE_S": "60",
    }


def stop_controller(tmp: Path) -> None:
    """Shut down the controller that ``private_env(tmp)`` made."""
    import socket

    sock = next((tmp / "run").glob("controller-*.sock"), None)
    if sock:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(sock))
            s.sendall(b'{"op": "shutdown"}\n')
            s.recv(64)


def workspace(base: Path) -> Path:
    ws = base / "ws"
    ws.mkdir()
    if os.geteuid() == 0:
        os.chown(ws, 1000, 1000)
    return ws


def agent_image(env: dict[str, str], ws: Path) -> str:
    out = subprocess.run(
        [*SANDMAN, "image", "build", "--workspace", str(ws), "--json"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return str(json.loads(out.stdout)["image"])


def bench_run(env: dict[str, str], ws: Path, image: str, runs: int) -> dict[str, object]:
    ours, base = [], []
    sandman_cmd = [*SANDMAN, "run", "--workspace", str(ws), "--", "true"]
    docker_cmd = ["docker", "run", "--rm", "--network=none", image, "true"]
    timed(sandman_cmd, env)  # warm the controller and the probe marker
    timed(docker_cmd)
    for _ in range(runs):  # interleaved, so drift hits both alike
        ours.append(timed(sandman_cmd, env))
        base.append(timed(docker_cmd))
    s, b = summary(ours), summary(base)
    return {"sandman": s, "baseline_docker_run": b, "ratio_median": round(s["median_s"] / b["median_s"], 3)}


def bench_first(env: dict[str, str], ws: Path, tmp: Path, runs: int) -> dict[str, object]:
    samples = []
    for i in range(runs):
        fresh = {**env, "SANDMAN_RUNTIME_DIR": str(tmp / f"first-{i}"), "SANDMAN_CONTROLLER_IDLE_S": "5"}
        samples.append(timed([*SANDMAN, "run", "--workspace", str(ws), "--", "true"], fresh))
    return {"sandman_first_call": summary(samples)}


def bench_teardown(env: dict[str, str], ws: Path, runs: int) -> dict[str, object]:
    import docker

    api = docker.APIClient(version="auto")
    samples = []
    for i in range(runs):
        marker = ws / f"ready-{i}"
        proc = subprocess.Popen(
            [
                *SANDMAN,
                "run",
                "--workspace",
                str(ws),
                "--",
                "sh",
                "-c",
                f"trap '' TERM INT; touch {marker.name}; exec sleep 600",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        while not marker.exists():
            time.sleep(0.01)
        session = [
            c
            for c in api.containers(filters={"label": "io.sandman.session"})
            if any(m.get("Source") == str(ws) for m in c["Mounts"])
        ]
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        proc.wait()
        while any(api.containers(all=True, filters={"id": c["Id"]}) for c in session):
            time.sleep(0.005)
        samples.append(time.perf_counter() - t0)
    return {"teardown_sigterm_ignored": summary(samples), "target_s": 1.0}


def bench_exec(ws: Path, image: str, runs: int) -> dict[str, object]:
    import docker

    from sandman.core.session import Sandbox

    client = docker.from_env()
    bare = client.containers.run(
        image, ["sleep", "infinity"], detach=True, network_mode="none", labels={"io.sandman.bench": "1"}
    )
    ours, base = [], []
    try:
        with Sandbox(ws) as sb:
            for _ in range(5):  # warm both paths
                sb.exec(["true"])
                bare.exec_run(["true"])
            for _ in range(runs):
                t0 = time.perf_counter()
                res = sb.exec(["true"])
                ours.append(time.perf_counter() - t0)
                assert res.exit_code == 0
                t0 = time.perf_counter()
                bare.exec_run(["true"])
                base.append(time.perf_counter() - t0)
    finally:
        bare.remove(force=True)
    s, b = summary(ours), summary(base)
    return {
        "sandman_exec": s,
        "baseline_exec_run": b,
        "ratio_median": round(s["median_s"] / b["median_s"], 3),
    }


def bench_create(ws: Path, image: str, runs: int) -> dict[str, object]:
    from sandman.core.session import Sandbox

    ours, base = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        sb = Sandbox(ws)
        ours.append(time.perf_counter() - t0)
        sb.close()
        t0 = time.perf_counter()
        cid = subprocess.run(
            [
                "docker",
                "run",
                "-d",
                "--network=none",
                "--label",
                "io.sandman.bench=1",
                image,
                "sleep",
                "infinity",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        base.append(time.perf_counter() - t0)
        subprocess.run(["docker", "rm", "-f", cid], capture_output=True, check=True)
    s, b = summary(ours), summary(base)
    return {
        "sandman_session_create": s,
        "baseline_docker_run_d": b,
        "ratio_median": round(s["median_s"] / b["median_s"], 3),
    }


def bench_pool(ws: Path, runs: int) -> dict[str, object]:
    from sandman.core.pool import Pool

    samples = []
    with Pool(ws, size=2) as pool:
        for _ in range(runs):
            deadline = time.monotonic() + 60
            while pool.ready() < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            t0 = time.perf_counter()
            sb = pool.acquire()
            samples.append(time.perf_counter() - t0)
            pool.release(sb)
    return {"pool_acquire": summary(samples), "target_median_s": 0.05}


def bench_concurrent(ws: Path, n: int = 32) -> dict[str, object]:
    import resource
    from concurrent.futures import ThreadPoolExecutor

    from sandman.core.session import Sandbox

    def one(i: int) -> bool:
        with Sandbox(ws) as sb:
            return sb.exec(["sh", "-c", f"echo {i}"]).stdout == f"{i}\n".encode()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    elapsed = time.perf_counter() - t0
    return {
        "sessions": n,
        "succeeded": sum(results),
        "wall_s": round(elapsed, 2),
        "sessions_per_s": round(n / elapsed, 2),
        "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


UPCALL_LOOP = r"""
import json, socket, sys, time
def rt(path, msg):
    s = socket.socket(socket.AF_UNIX); s.connect(path); s.sendall(msg)
    buf = b""
    while not buf.endswith(b"\n"):
        buf += s.recv(65536)
    s.close(); return buf
path, n = sys.argv[1], int(sys.argv[2])
msg = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "upcall.exec", "params": {"helper": "noop", "args": []}})
msg = msg.encode() + b"\n"
if path == "echo":
    import os, threading
    path = "/tmp/echo.sock"
    srv = socket.socket(socket.AF_UNIX); srv.bind(path); srv.listen(64)
    def serve():
        while True:
            c, _ = srv.accept(); c.recv(65536); c.sendall(b'{"jsonrpc": "2.0", "id": 1, "result": {}}\n'); c.close()
    threading.Thread(target=serve, daemon=True).start()
for _ in range(20):
    rt(path, msg)
out = []
for _ in range(n):
    t0 = time.perf_counter(); reply = rt(path, msg); out.append(time.perf_counter() - t0)
    assert b'"result"' in reply, reply  # a refusal (rate limit) is not a round trip

print(json.dumps(out))
"""


def bench_upcall(ws: Path, runs: int) -> dict[str, object]:
    from sandman.core.session import Sandbox
    from sandman.policy import Policy
    from sandman.settings import Settings

    policy = Policy.model_validate({"upcalls": {"helpers": {"noop": {}}}})
    # The round trip itself, not the rate limiter: raise the session's rate for the measurement
    # (every reply is checked to be a result, not a refusal).
    os.environ["SANDMAN_UPCALL_RATE_PER_S"] = "100000"
    os.environ["SANDMAN_UPCALL_RATE_BURST"] = "100000"
    try:
        settings = Settings.load()
    finally:
        del os.environ["SANDMAN_UPCALL_RATE_PER_S"], os.environ["SANDMAN_UPCALL_RATE_BURST"]
    with Sandbox(ws, policy=policy, settings=settings) as sb:
        ours = json.loads(sb.exec(["python3", "-c", UPCALL_LOOP, "/run/sandman/upcall/upcall.sock", str(runs)]).stdout)
        base = json.loads(sb.exec(["python3", "-c", UPCALL_LOOP, "echo", str(runs)]).stdout)
    ordered = sorted(ours)
    s, b = summary(ours), summary(base)
    return {
        "upcall_noop": {**s, "p99_s": round(ordered[int(0.99 * (len(ordered) - 1))], 5)},
        "baseline_unix_echo_in_sandbox": b,
        "target_median_s": 0.005,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--json", type=Path, default=ROOT / "bench-results" / "latest.json")
    parser.add_argument(
        "--backend",
        action="append",
        metavar="NAME",
        help="benchmark these backends against their raw baselines (or 'all') instead of the full set",
    )
    ns = parser.parse_args()
    if ns.backend:
        sys.path.insert(0, str(ROOT / "scripts"))
        from bench_backends import main as backends_main

        return backends_main(ns.backend, ns.runs, ns.json.parent)
    with tempfile.TemporaryDirectory(prefix="sandman-bench-") as tmp_s:
        tmp = Path(tmp_s)
        os.chmod(tmp, 0o755)
        env = private_env(tmp)
        ws = workspace(tmp)
        image = agent_image(env, ws)
        results: dict[str, object] = {"image": image, "runs": ns.runs}
        print(f"bench: image {image}, {ns.runs} runs each", file=sys.stderr)
        results["run_cold"] = run = bench_run(env, ws, image, ns.runs)
        print(
            f"run-cold   sandman median {run['sandman']['median_s']:.3f}s  "
            f"docker run median {run['baseline_docker_run']['median_s']:.3f}s  "
            f"ratio {run['ratio_median']:.2f}  (target <= 1.5, goal <= 1.2)"
        )
        results["run_first"] = first = bench_first(env, ws, tmp, max(3, ns.runs // 5))
        print(
            f"run-first  sandman median {first['sandman_first_call']['median_s']:.3f}s "
            f"(controller starting; vs docker run {run['baseline_docker_run']['median_s']:.3f}s)"
        )
        results["teardown"] = td = bench_teardown(env, ws, max(5, ns.runs // 2))
        print(
            f"teardown   SIGTERM-ignoring command gone after median "
            f"{td['teardown_sigterm_ignored']['median_s']:.3f}s, "
            f"max {td['teardown_sigterm_ignored']['max_s']:.3f}s (target < 1 s)"
        )
        os.environ.update({k: env[k] for k in ("SANDMAN_RUNTIME_DIR", "SANDMAN_STATE_DIR")})
        results["exec"] = ex = bench_exec(ws, image, max(ns.runs * 4, 40))
        print(
            f"exec       sandman median {ex['sandman_exec']['median_s'] * 1000:.1f}ms  "
            f"docker-py exec_run median {ex['baseline_exec_run']['median_s'] * 1000:.1f}ms  "
            f"ratio {ex['ratio_median']:.2f}  (target <= 0.5)"
        )
        results["create"] = cr = bench_create(ws, image, max(5, ns.runs // 2))
        print(
            f"create     Sandbox() median {cr['sandman_session_create']['median_s']:.3f}s  "
            f"docker run -d median {cr['baseline_docker_run_d']['median_s']:.3f}s  "
            f"ratio {cr['ratio_median']:.2f}"
        )
        results["pool"] = po = bench_pool(ws, max(10, ns.runs))
        print(
            f"pool       acquire median {po['pool_acquire']['median_s'] * 1000:.1f}ms "
            f"p90 {po['pool_acquire']['p90_s'] * 1000:.1f}ms (target <= 50 ms; "
            f"baseline: a cold Sandbox() above)"
        )
        results["upcall"] = up = bench_upcall(ws, max(200, ns.runs * 20))
        print(
            f"upcall     no-op round trip from inside: median {up['upcall_noop']['median_s'] * 1000:.2f}ms "
            f"p99 {up['upcall_noop']['p99_s'] * 1000:.2f}ms (target median <= 5 ms); "
            f"baseline: a unix-socket echo in the same sandbox "
            f"{up['baseline_unix_echo_in_sandbox']['median_s'] * 1000:.2f}ms"
        )
        sys.path.insert(0, str(ROOT / "scripts"))
        from bench_scrub import CHUNKS, bench_scrub

        results["scrub"] = sc = bench_scrub(64)
        for label in CHUNKS:
            print(
                f"scrub      {label:>3} chunks: baseline copy {sc['baseline'][label]:.0f} MB/s, "
                f"exact {sc['exact'][label]['mb_s']:.0f} MB/s (target >= 100), "
                f"full {sc['full'][label]['mb_s']:.0f} MB/s (target >= 30)"
            )
        results["concurrent"] = co = bench_concurrent(ws)
        print(
            f"concurrent {co['succeeded']}/{co['sessions']} sessions ok in {co['wall_s']}s "
            f"({co['sessions_per_s']} sessions/s), bench process max RSS {co['max_rss_mb']} MB"
        )
        stop_controller(tmp)
    ns.json.parent.mkdir(parents=True, exist_ok=True)
    ns.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"bench: results in {ns.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
