"""Policy and settings files: values, sources, and one-line errors naming file, key and reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandman.errors import ConfigError, UsageError
from sandman.policy import cli_size, load_policy, parse_size
from sandman.settings import Settings, describe


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512m", 512 << 20),
        ("2g", 2 << 30),
        ("1.5GiB", int(1.5 * (1 << 30))),
        ("4096", 4096),
        (1024, 1024),
        ("64k", 64 << 10),
        ("1T", 1 << 40),
    ],
)
def test_sizes_parse_like_docker(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["12x", "", "-1m", "m", True, 0])
def test_bad_sizes_name_the_flag(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_size(bad)
    if isinstance(bad, str):
        with pytest.raises(UsageError, match="--memory"):
            cli_size(bad, "--memory")


def test_shipped_policies_load() -> None:
    root = Path(__file__).resolve().parents[2] / "policies"
    for name in ("default", "strict"):
        policy = load_policy(root / f"{name}.toml")
        assert policy.name == name and policy.network == "none"
    assert load_policy().resources.memory == 2 << 30


def test_unknown_key_names_file_and_key(tmp_path: Path) -> None:
    f = tmp_path / "p.toml"
    f.write_text("[resources]\ncpus = 1\nmemroy = '1g'\n")
    with pytest.raises(ConfigError) as err:
        load_policy(f)
    assert str(f) in str(err.value) and "resources.memroy" in str(err.value)
    assert "\n" not in str(err.value)


def test_invalid_value_gives_the_reason(tmp_path: Path) -> None:
    f = tmp_path / "p.toml"
    f.write_text("[resources]\nmemory = '128m'\ntmpfs_size = '256m'\n")
    with pytest.raises(ConfigError, match="tmpfs_size .* must be below half of memory"):
        load_policy(f)


def test_broken_toml_and_missing_file(tmp_path: Path) -> None:
    f = tmp_path / "p.toml"
    f.write_text("[resources\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_policy(f)
    with pytest.raises(ConfigError, match="not found"):
        load_policy(tmp_path / "missing.toml")


def test_settings_come_from_env_over_file_and_describe_says_where(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text('base_image = "debian:trixie-slim"\nstate_dir = "/srv/state"\n[secrets]\nAPI_KEY = "s3cr3t"\n')
    monkeypatch.setenv("SANDMAN_CONFIG", str(cfg))
    monkeypatch.setenv("SANDMAN_STATE_DIR", "/from/env")
    settings = Settings.load()
    assert settings.base_image == "debian:trixie-slim"
    assert settings.state_dir == Path("/from/env")
    views = {v.name: v for v in describe(settings)}
    assert views["base_image"].source == f"file {cfg}"
    assert views["state_dir"].source == "env SANDMAN_STATE_DIR"
    assert views["engine_timeout_s"].source == "default"
    assert "s3cr3t" not in views["secrets"].value and "API_KEY" in views["secrets"].value


def test_bad_setting_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDMAN_CONFIG", str(tmp_path / "none.toml"))
    monkeypatch.setenv("SANDMAN_ENGINE_TIMEOUT_S", "soon")
    with pytest.raises(ConfigError, match="SANDMAN_ENGINE_TIMEOUT_S.*engine_timeout_s"):
        Settings.load()


def test_a_lower_memory_cap_alone_shrinks_the_tmpfs() -> None:
    policy = load_policy().with_resources(memory="512m")
    assert policy.resources.memory == 512 << 20 and policy.resources.tmpfs_size == 128 << 20
    with pytest.raises(UsageError, match="tmpfs_size"):
        load_policy().with_resources(memory="512m", tmpfs_size="300m")
