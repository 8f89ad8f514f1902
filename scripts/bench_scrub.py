"""Throughput of sandman.secrets.scrub on realistic command output, against a copy of the same stream.

The input is generated deterministically (random.Random(seed)): log lines with timestamps, Python
and JavaScript code, JSON blobs, base64 data and hashes, with a few secrets sprinkled in (known
ones plain and encoded, and pattern-shaped tokens). It is fed in 4 KiB and 64 KiB chunks to

  baseline   the chunks appended to an output buffer, unscrubbed
  exact      Scrubber(20 known secrets, patterns=False): known secrets in all their encodings
  full       Scrubber(20 known secrets): plus every leak pattern, plain and encoded

and each figure is given in MB/s (10^6 bytes) and as a ratio to the baseline. ``engines`` times
the literal search alone (the part an engine choice decides) on the exact-mode needles;
``worst`` times full mode, 4 KiB chunks, on inputs that hit its slow paths: a base64 dump
(``base64`` of random bytes, 76 columns: every line break is one the wrapped-base64 view joins),
a hex dump, text dense with false ``sk-`` anchors, a colour-coded log (ANSI SGR codes around
every few words: the terminal-code view) and a JSON log with ``\\uXXXX`` and ``\\/`` escapes (the
JSON-escape view). ``idle`` times the same stream with ``release()`` after every 4 KiB chunk, as
an idle pause would.

``--module FILE`` benchmarks the ``Scrubber`` of another copy of sandman/secrets/scrub.py (e.g. an older
version: ``git show HEAD:sandman/secrets/scrub.py > /tmp/old_scrub.py``), in the same process conditions.

Usage: .venv/bin/python scripts/bench_scrub.py [--size MIB] [--json FILE] [--module FILE]
"""

from __future__ import annotations

import argparse
import base64
import functools
import json
import random
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

from sandman.secrets.scrub import Scrubber as _Scrubber

Scrubber = _Scrubber  # --module replaces it

SEED = 20240501
CHUNKS = {"4k": 4 << 10, "64k": 64 << 10}
_ALNUM = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
_WORDS = [
    "request",
    "failed",
    "retrying",
    "connection",
    "timeout",
    "user",
    "session",
    "token",
    "handler",
    "process",
    "worker",
    "queue",
    "database",
    "cache",
    "build",
    "test",
    "module",
    "import",
    "error",
    "warning",
    "value",
    "result",
    "config",
    "path",
    "file",
    "open",
    "close",
    "read",
    "write",
    "commit",
    "branch",
    "merge",
    "deploy",
    "service",
    "health",
    "check",
    "latency",
    "upstream",
    "response",
]
_IDENTS = [
    "get_user",
    "parseConfig",
    "self.client",
    "response.json",
    "os.path.join",
    "fetchData",
    "max_retries",
]


def make_secrets(rng: random.Random, count: int = 20) -> dict[str, str]:
    return {
        f"secret_{i}": "".join(rng.choice(_ALNUM + "-_.") for _ in range(rng.randint(16, 64))) for i in range(count)
    }


def _token(rng: random.Random) -> str:
    """A pattern-shaped credential nobody told the scrubber about."""
    kind = rng.randrange(6)
    body = "".join(rng.choice(_ALNUM) for _ in range(48))
    if kind == 0:
        return "sk-proj-" + body
    if kind == 1:
        return "ghp_" + body[:36]
    if kind == 2:
        return "AKIA" + "".join(rng.choice(_ALNUM[:26] + "0123456789") for _ in range(16))
    if kind == 3:
        return "xoxb-" + body[:24]
    if kind == 4:
        return f"{rng.randint(10**8, 10**9 - 1)}:AA{body[:33]}"
    return "glpat-" + body[:20]


def generate(size: int, seed: int = SEED, secrets: dict[str, str] | None = None) -> bytes:
    """``size`` bytes of realistic output; about one line in 500 carries a secret."""
    rng = random.Random(seed)
    values = list((secrets or {}).values())
    parts: list[str] = []
    n = 0
    while n < size:
        k = rng.random()
        if k < 0.45:
            line = (
                f"2024-05-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:"
                f"{rng.randint(0, 59):02d}.{rng.randint(0, 999):03d}Z {rng.choice(['INFO', 'DEBUG', 'WARN'])}"
                " "
                f"[{rng.choice(_WORDS)}] {' '.join(rng.choices(_WORDS, k=rng.randint(4, 14)))} "
                f"id={rng.getrandbits(64):016x} took {rng.randint(1, 5000)}ms\n"
            )
        elif k < 0.62:
            fn, arg = rng.choice(_IDENTS).replace(".", "_"), rng.choice(_WORDS)
            line = (
                f"    def {fn}(self, {arg}: int = {rng.randint(0, 99)}) -> dict[str, object]:\n"
                f"        return {{'{rng.choice(_WORDS)}': {rng.choice(_IDENTS)}({arg})}}  "
                f"# {' '.join(rng.choices(_WORDS, k=5))}\n"
            )
        elif k < 0.75:
            line = (
                f"  const {rng.choice(_WORDS)}{rng.randint(1, 9)} = await fetch(`/api/v1/{rng.choice(_WORDS)}"
                f"/${{id}}`, {{ method: 'POST', headers: {{ 'Content-Type': 'application/json' }} }});\n"
            )
        elif k < 0.96:
            blob: dict[str, object] = {w: rng.choice(_WORDS) for w in rng.choices(_WORDS, k=rng.randint(2, 8))}
            blob |= {"id": rng.getrandbits(32), "sha": f"{rng.getrandbits(160):040x}"}
            blob["path"] = f"/usr/lib/python3/dist-packages/{rng.choice(_WORDS)}/{rng.choice(_IDENTS)}.py"
            line = json.dumps(blob) + "\n"
        elif k < 0.998:
            raw = bytes(rng.getrandbits(8) for _ in range(rng.choice([24, 48, 96, 300])))
            line = f"data: {base64.b64encode(raw).decode()}\n"
        else:
            line = _secret_line(rng, values)
        parts.append(line)
        n += len(line)
    return "".join(parts).encode()[:size]


def _secret_line(rng: random.Random, values: list[str]) -> str:
    choice = rng.randrange(4)
    if choice == 0 and values:
        return f"export API_TOKEN={rng.choice(values)}\n"
    if choice == 1 and values:
        auth = base64.b64encode(f"user:{rng.choice(values)}".encode()).decode()
        return f"Authorization: Basic {auth}\n"
    if choice == 2 and values:
        return f"debug: token bytes {rng.choice(values).encode().hex()}\n"
    return f"Authorization: Bearer {_token(rng)}\n"


def _throughput(size: int, fn: Callable[[], object], repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return size / best / 1e6


def _copy(chunks: list[bytes]) -> bytes:
    out = bytearray()
    for c in chunks:
        out += c
    return bytes(out)


def _scrub(scrubber: Scrubber, chunks: list[bytes]) -> bytes:
    stream = scrubber.stream()
    out = bytearray()
    for c in chunks:
        out += stream.feed(c)
    out += stream.flush()
    return bytes(out)


def _scrub_idle(scrubber: Scrubber, chunks: list[bytes]) -> bytes:
    """Each chunk followed by an idle release (the consumers call it after 50 ms of quiet)."""
    stream = scrubber.stream()
    out = bytearray()
    for c in chunks:
        out += stream.feed(c)
        out += stream.release()
    out += stream.flush()
    return bytes(out)


def _engines(data: bytes, secrets: dict[str, str]) -> dict[str, float]:
    """MB/s of the literal search alone over the exact-mode needles, per candidate engine."""
    needles = Scrubber(secrets, patterns=False)._needles
    out: dict[str, float] = {}
    try:
        import ahocorasick_rs

        dfa = ahocorasick_rs.BytesAhoCorasick(needles, implementation=ahocorasick_rs.Implementation.DFA)
        out["ahocorasick_rs (DFA)"] = _throughput(len(data), lambda: dfa.find_matches_as_indexes(data, True))
    except ImportError:
        pass
    try:
        import ahocorasick  # type: ignore[import-not-found, unused-ignore]  # pyahocorasick

        auto = ahocorasick.Automaton()
        for i, n in enumerate(needles):
            auto.add_word(n.decode("latin-1"), i)
        auto.make_automaton()
        text = data.decode("latin-1")
        out["pyahocorasick"] = _throughput(len(data), lambda: list(auto.iter(text)), repeat=1)
    except ImportError:
        pass
    part = data[: 8 << 20]  # the regex is slow: 8 MiB tell enough
    rx = re.compile(b"|".join(re.escape(n) for n in sorted(needles, key=len, reverse=True)))
    out["re alternation"] = _throughput(len(part), lambda: list(rx.finditer(part)), repeat=1)
    return out


def worst_cases(size: int, seed: int = SEED) -> dict[str, bytes]:
    rng = random.Random(seed)
    noise = bytes(rng.getrandbits(8) for _ in range(size * 3 // 4))
    lines = [b"%064x" % rng.getrandbits(256) for _ in range(size // 65)]
    tasks = [b"task-%d-runner disk-usage ok on desk-%d\n" % (i, i * 7) for i in range(size // 40)]
    colours = [b"\x1b[32m", b"\x1b[1;31m", b"\x1b[0m", b"\x1b[38;5;208m", b"\x1b[2m"]
    coloured: list[bytes] = []
    while sum(map(len, coloured)) < size:
        words = rng.choices(_WORDS, k=rng.randint(4, 12))
        coloured.append(b" ".join(rng.choice(colours) + w.encode() for w in words) + b"\x1b[0m\n")
    logs: list[bytes] = []
    while sum(map(len, logs)) < size:
        msg = " ".join(rng.choices(_WORDS, k=rng.randint(3, 9)))
        entry = {"msg": f"{msg} \u00e9\u2192 ok", "path": f"/srv/{rng.choice(_WORDS)}/{rng.choice(_IDENTS)}"}
        logs.append(json.dumps(entry).replace("/", "\\/").encode() + b"\n")  # PHP-style: \/ and \uXXXX
    return {
        "base64 dump": base64.encodebytes(noise)[:size],
        "hex dump": b"\n".join(lines)[:size],
        "sk- dense text": b"".join(tasks)[:size],
        "ANSI colour log": b"".join(coloured)[:size],
        "JSON escaped log": b"".join(logs)[:size],
    }


def bench_scrub(size_mib: int = 64) -> dict[str, object]:
    """Measure; returns {"size_mib", "engine", "baseline": {chunk: MB/s}, "exact"/"full":
    {chunk: {"mb_s", "ratio"}}, "engines": {name: MB/s}, "worst": {case: MB/s},
    "findings": {kind/encoding: count}}."""
    rng = random.Random(SEED)
    secrets = make_secrets(rng)
    data = generate(size_mib << 20, SEED, secrets)
    size = len(data)
    exact, full = Scrubber(secrets, patterns=False), Scrubber(secrets)
    result: dict[str, object] = {"size_mib": size_mib, "engine": full.engine}
    baseline: dict[str, float] = {}
    modes: dict[str, dict[str, dict[str, float]]] = {"exact": {}, "full": {}}
    for label, n in CHUNKS.items():
        chunks = [data[i : i + n] for i in range(0, size, n)]
        baseline[label] = _throughput(size, functools.partial(_copy, chunks))
        for mode, sc in (("exact", exact), ("full", full)):
            speed = _throughput(size, functools.partial(_scrub, sc, chunks), repeat=2)
            modes[mode][label] = {"mb_s": round(speed, 1), "ratio": round(speed / baseline[label], 4)}
    small = [data[i : i + 4096] for i in range(0, min(size, 16 << 20), 4096)]
    idle = round(_throughput(sum(map(len, small)), functools.partial(_scrub_idle, full, small), repeat=2), 1)
    # Sanity: the stream is really scrubbed, and chunking changes nothing.
    one, findings = full.scrub_bytes(data)
    streamed = _scrub(full, [data[i : i + 4096] for i in range(0, size, 4096)])
    assert streamed == one, "streamed output differs from one-shot output"
    assert not any(v.encode() in one for v in secrets.values()), "a known secret survived"
    kinds: dict[str, int] = {}
    for f in findings:
        key = "known" if f.kind.startswith("secret_") else f.kind
        kinds[f"{key}/{f.encoding}"] = kinds.get(f"{key}/{f.encoding}", 0) + 1
    worst = {}
    for name, case in worst_cases(min(size, 8 << 20)).items():
        chunks = [case[i : i + 4096] for i in range(0, len(case), 4096)]
        worst[name] = round(_throughput(len(case), functools.partial(_scrub, full, chunks), repeat=2), 1)
    result |= {
        "baseline": {k: round(v, 1) for k, v in baseline.items()},
        **modes,
        "engines": {k: round(v, 1) for k, v in _engines(data, secrets).items()},
        "worst": worst,
        "idle": idle,
        "findings": dict(sorted(kinds.items())),
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=64, help="MiB of generated output (default 64)")
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument("--module", type=Path, help="benchmark the Scrubber of this copy of scrub.py")
    args = parser.parse_args()
    if args.module:
        import importlib.util

        spec = importlib.util.spec_from_file_location("scrub_under_test", args.module)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
        global Scrubber
        Scrubber = module.Scrubber
        print(f"Scrubber from {args.module}")
    res = bench_scrub(args.size)
    print(f"scrub benchmark: {res['size_mib']} MiB of generated output, literal search: {res['engine']}")
    baseline = res["baseline"]
    assert isinstance(baseline, dict)
    for label in CHUNKS:
        print(f"  chunks of {label:>3}: baseline copy {baseline[label]:>9.1f} MB/s")
        for mode in ("exact", "full"):
            m = res[mode][label]  # type: ignore[index]
            print(f"    {mode:<5} {m['mb_s']:>9.1f} MB/s   ratio to baseline {m['ratio']:.4f}")
    print("  literal search alone (exact-mode needles):")
    for name, speed in res["engines"].items():  # type: ignore[attr-defined]
        print(f"    {name:<22} {speed:>9.1f} MB/s")
    print("  worst cases (full, 4 KiB chunks, 8 MiB each):")
    for name, speed in res["worst"].items():  # type: ignore[attr-defined]
        print(f"    {name:<22} {speed:>9.1f} MB/s")
    print(f"  full, 4 KiB chunks, release() after each (16 MiB): {res['idle']:.1f} MB/s")
    print(f"  findings (one-shot, full): {res['findings']}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
