"""The CLI's other faces: bad input gets one line and a distinct exit code; doctor, config, images."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import make_workspace, sandman

pytestmark = pytest.mark.docker


def one_line_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["run", "--workspace", "/nonexistent-dir", "--", "true"], 3, "does not exist"),
        (["run", "--workspace", "/", "--", "true"], 3, "never the whole filesystem"),
        (["run", "--workspace", "/usr/share", "--", "true"], 3, "owned by root"),
        (["run", "--workspace", "{ws}", "--memory", "lots", "--", "true"], 2, "--memory"),
        (["run", "--workspace", "{ws}", "--campaign", "nope", "--", "true"], 4, "unknown campaign 'nope'"),
        (
            ["run", "--workspace", "{ws}", "--policy", "{ws}/missing.toml", "--", "true"],
            4,
            "is neither a built-in policy",
        ),
        (["run", "--workspace", "{ws}", "--", "true", "a\x00b"], 2, None),
    ],
)
def test_bad_input_gets_one_line_and_a_distinct_code(
    engine: object, workspace: Path, cli_env: dict[str, str], args: list[str], code: int, needle: str | None
) -> None:
    args = [a.replace("{ws}", str(workspace)) for a in args]
    try:
        res = sandman(*args, env=cli_env)
    except ValueError:  # the OS itself refuses NUL in argv: nothing to test past that
        assert "\x00" in "".join(args)
        return
    assert res.returncode == code, res.stderr
    line = one_line_error(res.stderr)
    if needle:
        assert needle in line


def test_home_itself_is_refused(engine: object, cli_env: dict[str, str]) -> None:
    res = sandman("run", "--workspace", os.path.expanduser("~"), "--", "true", env=cli_env)
    assert res.returncode == 3 and "home directory itself" in one_line_error(res.stderr)


def test_invalid_image_toml_names_file_key_and_reason(engine: object, workspace: Path, cli_env: dict[str, str]) -> None:
    (workspace / ".sandman").mkdir()
    (workspace / ".sandman" / "image.toml").write_text('apt_packages = ["ok", "bad;name"]\n')
    res = sandman("run", "--workspace", str(workspace), "--", "true", env=cli_env)
    assert res.returncode == 4
    line = one_line_error(res.stderr)
    assert "image.toml" in line and "apt_packages" in line and "bad;name" in line


def test_no_engine_says_how_to_start_one(workspace: Path, cli_env: dict[str, str], tmp_path: Path) -> None:
    env = {**cli_env, "DOCKER_HOST": f"unix://{tmp_path}/no-docker.sock"}
    res = sandman("run", "--workspace", str(workspace), "--", "true", env=env, timeout=120)
    assert res.returncode == 69
    line = one_line_error(res.stderr)
    assert "docker engine not reachable" in line and "scripts/setup" in line


def test_no_command(engine: object, workspace: Path, cli_env: dict[str, str]) -> None:
    res = sandman("run", "--workspace", str(workspace), env=cli_env)
    assert res.returncode == 2 and "Missing argument" in res.stderr


def test_doctor_passes_here_with_the_bwrap_probe(engine: object, agent_image: str, cli_env: dict[str, str]) -> None:
    res = sandman("doctor", "--json", env=cli_env)
    report = json.loads(res.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert res.returncode == 0 and report["ok"], res.stdout
    assert checks["bwrap probe"]["ok"] and checks["engine"]["ok"] and checks["seccomp"]["ok"]
    text = sandman("doctor", env=cli_env)
    assert "[pass] bwrap probe" in text.stdout


def test_config_show_masks_secrets_and_names_sources(tmp_path: Path, cli_env: dict[str, str]) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text('base_image = "debian:bookworm-slim"\n[secrets]\nOPENAI_API_KEY = "sk-do-not-print"\n')
    env = {**cli_env, "SANDMAN_CONFIG": str(cfg), "SANDMAN_ENGINE_TIMEOUT_S": "30"}
    res = sandman("config", "show", "--json", env=env)
    assert res.returncode == 0, res.stderr
    views = {v["name"]: v for v in json.loads(res.stdout)["settings"]}
    assert views["base_image"]["source"] == f"file {cfg}"
    assert views["engine_timeout_s"]["source"] == "env SANDMAN_ENGINE_TIMEOUT_S"
    assert "sk-do-not-print" not in res.stdout
    assert "sk-do-not-print" not in sandman("config", "show", env=env).stdout


def test_campaign_image_is_cached_by_content_and_rebuilt_on_change(
    engine: object, agent_image: str, tmp_path: Path, cli_env: dict[str, str], unique: str
) -> None:
    ws = make_workspace(tmp_path / f"camp-{unique}")
    (ws / ".sandman").mkdir()
    toml = ws / ".sandman" / "image.toml"
    toml.write_text(f'name = "t-{unique}"\nenv = {{ GREETING = "hello" }}\n')
    first = sandman("image", "build", "--workspace", str(ws), "--json", env=cli_env)
    assert first.returncode == 0, first.stderr
    tag1 = json.loads(first.stdout)["image"]
    assert "building campaign image" in first.stderr
    again = sandman("image", "build", "--workspace", str(ws), "--json", env=cli_env)
    assert json.loads(again.stdout)["image"] == tag1 and "building" not in again.stderr
    res = sandman("run", "--workspace", str(ws), "--", "sh", "-c", "echo $GREETING", env=cli_env)
    assert res.stdout == "hello\n", res.stderr
    toml.write_text(f'name = "t-{unique}"\nenv = {{ GREETING = "changed" }}\n')
    changed = sandman("image", "build", "--workspace", str(ws), "--json", env=cli_env)
    tag2 = json.loads(changed.stdout)["image"]
    assert tag2 != tag1 and "building campaign image" in changed.stderr
    listed = json.loads(sandman("image", "ls", "--json", env=cli_env).stdout)
    assert any(tag2 in row["tags"] for row in listed)
    for tag in (tag1, tag2):
        engine.remove_image(tag)  # type: ignore[attr-defined]


def test_prune_never_touches_unlabelled_images(
    engine: object, agent_image: str, cli_env: dict[str, str], unique: str
) -> None:
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("hello.txt")
        data = unique.encode()
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    repo = f"not-sandman/bystander-{unique}"
    engine.import_image_from_data(buf.getvalue(), repository=repo, tag="1")  # type: ignore[attr-defined]
    try:
        res = sandman("image", "prune", "--json", env=cli_env)
        assert res.returncode == 0, res.stderr
        assert engine.images(name=repo)  # type: ignore[attr-defined]
        assert all("not-sandman" not in r for r in json.loads(res.stdout)["removed"])
    finally:
        engine.remove_image(f"{repo}:1")  # type: ignore[attr-defined]
