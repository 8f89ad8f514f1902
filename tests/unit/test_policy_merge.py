"""Merging a campaign's policy onto the operator's: tighten freely, loosen only where granted."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandman.errors import ConfigError
from sandman.policy import Runtime, effective_policy


@pytest.fixture
def operator(tmp_path: Path) -> Path:
    path = tmp_path / "operator.toml"
    path.write_text(
        'runtime = "runc"\n'
        '[commands]\nallow = ["git", "make", "sh"]\n'
        '[environment]\npassthrough = ["NPM_CONFIG_REGISTRY", "MODE"]\n'
        '[secrets]\ninject = ["OPENAI_API_KEY"]\n'
        '[upcalls.helpers.noop]\n[upcalls.helpers.git-push]\nremote = "/srv/remote.git"\n'
    )
    return path


def campaign(tmp_path: Path, text: str) -> Path:
    ws = tmp_path / "ws"
    (ws / ".sandman").mkdir(parents=True, exist_ok=True)
    (ws / ".sandman" / "policy.toml").write_text(text)
    return ws


def test_no_campaign_policy_is_the_operators(operator: Path, tmp_path: Path) -> None:
    eff = effective_policy(operator, tmp_path)
    assert eff.policy.commands.allow == ["git", "make", "sh"] and eff.files == (operator,)
    assert eff.sources["commands.allow"] == f"operator {operator}"
    assert eff.sources["resources.cpus"] == "built-in default"


def test_tightening_is_free_and_recorded_as_the_campaigns(operator: Path, tmp_path: Path) -> None:
    ws = campaign(
        tmp_path,
        'runtime = "runsc"\n[resources]\nmemory = "512m"\npids = 64\n[commands]\nallow = ["git"]\n'
        '[environment]\npassthrough = ["MODE"]\n[filesystem]\ndeny = ["*.sqlite"]\n'
        "[upcalls.helpers.noop]\n",
    )
    eff = effective_policy(operator, ws)
    p = eff.policy
    assert (p.resources.memory, p.resources.pids, p.runtime) == (512 << 20, 64, Runtime.RUNSC)
    assert p.commands.allow == ["git"] and p.environment.passthrough == ["MODE"]
    assert p.filesystem.deny[-1] == "*.sqlite" and ".env" in p.filesystem.deny  # added to, not replaced
    assert list(p.upcalls.helpers) == ["noop"]  # a helper may be dropped
    assert p.commands.rules["git"].blocked  # the operator's git rules stay
    assert eff.sources["resources.memory"].startswith("campaign ")


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('[resources]\nmemory = "64g"\n', "resources.memory"),
        ("[resources]\nexec_timeout_s = 999999\n", "resources.exec_timeout_s"),
        ('[commands]\nallow = ["git", "curl"]\n', "commands.allow"),
        ('[environment]\npassthrough = ["HOME_TOKEN_X"]\n', "environment.passthrough"),
        ('[secrets]\ninject = ["AWS_ROOT"]\n', "secrets.inject"),
        ('[filesystem]\nallow = [".env"]\n', "filesystem.allow"),
        ('[filesystem]\nwritable = ["/etc"]\n', "filesystem.writable"),
        ('[filesystem]\ntools_dir = "/usr/local/bin"\n', "filesystem.tools_dir"),
        ('[upcalls.helpers.gh]\nmode = "draft-prs"\n', "upcalls.helpers"),
        ('[upcalls.helpers.git-push]\nremote = "/elsewhere.git"\n', "upcalls.helpers"),
    ],
)
def test_loosening_is_refused_naming_file_key_and_how_to_grant(
    operator: Path, tmp_path: Path, text: str, key: str
) -> None:
    ws = campaign(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        effective_policy(operator, ws)
    message = str(err.value)
    assert str(ws / ".sandman" / "policy.toml") in message and repr(key) in message
    assert "may only tighten" in message and "may_loosen" in message


def test_gvisor_cannot_be_dropped(tmp_path: Path) -> None:
    op = tmp_path / "op.toml"
    op.write_text('runtime = "runsc"\n')
    with pytest.raises(ConfigError, match="gVisor cannot be dropped"):
        effective_policy(op, campaign(tmp_path, 'runtime = "runc"\n'))


def test_a_campaign_cannot_grant_itself_anything(operator: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="only the operator's policy can grant"):
        effective_policy(operator, campaign(tmp_path, '[campaign]\nmay_loosen = ["resources"]\n'))


def test_the_operator_can_grant_a_section(tmp_path: Path) -> None:
    op = tmp_path / "op.toml"
    op.write_text('[campaign]\nmay_loosen = ["resources"]\n')
    eff = effective_policy(op, campaign(tmp_path, '[resources]\nmemory = "8g"\n'))
    assert eff.policy.resources.memory == 8 << 30
    with pytest.raises(ConfigError, match="commands.allow"):
        op.write_text('[campaign]\nmay_loosen = ["resources"]\n[commands]\nallow = ["git"]\n')
        effective_policy(op, campaign(tmp_path, '[commands]\nallow = ["git", "rm"]\n'))
