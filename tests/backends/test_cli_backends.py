"""`sandman backends [--json]` and `--backend NAME`: every backend listed with the exact reason
and fix when unavailable; an unknown name lists the known ones, with no traceback."""

from __future__ import annotations

import json
from pathlib import Path

from sandman import backends
from tests.conftest import sandman


def test_backends_json_lists_every_backend_with_walls_and_reason() -> None:
    done = sandman("backends", "--json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [r["name"] for r in rows] == backends.names()
    for r in rows:
        assert {"name", "available", "walls", "reason"} <= r.keys()
        assert r["walls"], r  # never an empty claim: each backend names its walls
        if not r["available"]:
            assert r["reason"] and r["fix"], r  # why not, and what to do
    by_name = {r["name"]: r for r in rows}
    assert by_name["docker"]["walls"] == ["container", "bubblewrap"]
    assert by_name["local"]["walls"] == ["bubblewrap"]  # one wall, said so


def test_backends_text_names_each_backend() -> None:
    done = sandman("backends")
    assert done.returncode == 0
    for name in backends.names():
        assert name in done.stdout


def test_an_unknown_backend_lists_the_known_ones(tmp_path: Path) -> None:
    import os

    env = {**os.environ, "SANDMAN_STATE_DIR": str(tmp_path / "state"), "SANDMAN_RUNTIME_DIR": str(tmp_path / "run")}
    for args in (
        ["run", "--backend", "nope", "-w", ".", "--", "true"],
        ["session", "create", "--backend", "nope", "-w", "."],
        ["doctor", "--backend", "nope"],
    ):
        done = sandman(*args, env=env)
        assert done.returncode != 0
        assert "unknown backend 'nope'" in done.stderr and "docker" in done.stderr and "local" in done.stderr
        assert "Traceback" not in done.stderr


def test_the_backend_setting_is_checked(monkeypatch: object) -> None:
    import os

    env = {**os.environ, "SANDMAN_BACKEND": "nope"}
    done = sandman("backends", env=env)
    assert done.returncode != 0 and "unknown backend 'nope'" in done.stderr and "Traceback" not in done.stderr
