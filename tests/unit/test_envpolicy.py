"""The sandbox environment: only what the policy names, nothing refused, never a value in a report."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sandman.errors import ConfigError
from sandman.policy.environment import (
    DEFAULT_REFUSED_NAMES,
    DEFAULT_REFUSED_PATTERNS,
    EnvironmentPolicy,
    EnvResult,
    build_env,
    refusal,
    validate_policy,
)

HOST = {
    "PATH": "/usr/bin",
    "HOME": "/home/me",
    "LANG": "C.UTF-8",
    "CI": "1",
    "AWS_SECRET_ACCESS_KEY": "aws-value",
    "GITHUB_TOKEN": "gh-value",
    "LD_PRELOAD": "/tmp/evil.so",
    "SANDMAN_SESSION": "host-forged",
    "DATABASE_URL": "postgres://u:pw@db/x",
}


def test_passthrough_arrives_and_nothing_else_is_inherited() -> None:
    policy = EnvironmentPolicy(allow={"LANG": "C", "TERM": "dumb"}, passthrough=["CI", "NOT_SET"])
    result = build_env(policy, HOST, {"SANDMAN_SESSION": "sm-1"})
    assert result.env == {"LANG": "C", "TERM": "dumb", "CI": "1", "SANDMAN_SESSION": "sm-1"}
    assert result.refused == []


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("LD_PRELOAD", "environment.passthrough: is refused by environment.refuse_names"),
        ("DATABASE_URL", "environment.passthrough: is refused by environment.refuse_names"),
        ("AWS_SECRET_ACCESS_KEY", "environment.passthrough: is refused by pattern 'AWS_*'"),
        ("GITHUB_TOKEN", "environment.passthrough: is refused by pattern '*_TOKEN'"),
        (
            "SANDMAN_SESSION",
            "environment.passthrough: is reserved: only the controller sets SANDMAN_* variables",
        ),
    ],
)
def test_refused_passthrough_is_reported_by_name_and_reason(name: str, reason: str) -> None:
    policy = EnvironmentPolicy(passthrough=["CI", name])
    result = build_env(policy, HOST, {})
    assert result.env == {"CI": "1"}
    assert result.refused == [(name, reason)]
    assert HOST[name] not in repr(result.refused)


def test_refused_passthrough_is_reported_even_when_the_host_lacks_it() -> None:
    result = build_env(EnvironmentPolicy(passthrough=["OPENAI_API_KEY"]), {}, {})
    assert result == EnvResult({}, [("OPENAI_API_KEY", "environment.passthrough: is refused by pattern '*_API_KEY'")])


@pytest.mark.parametrize(
    ("allow", "name"),
    [
        ({"LD_PRELOAD": "/x.so"}, "LD_PRELOAD"),
        ({"PYTHONPATH": "/workspace"}, "PYTHONPATH"),
        ({"MY_PASSWORD": "x"}, "MY_PASSWORD"),
        ({"SANDMAN_SESSION": "forged"}, "SANDMAN_SESSION"),
        ({"GIT_CONFIG_COUNT": "1"}, "GIT_CONFIG_COUNT"),
    ],
)
def test_refused_fixed_values_are_dropped(allow: dict[str, str], name: str) -> None:
    result = build_env(EnvironmentPolicy(allow=allow), HOST, {})
    assert result.env == {}
    assert [n for n, _ in result.refused] == [name]
    assert all(v not in r for v in allow.values() for _, r in result.refused)


@pytest.mark.parametrize(
    ("controller_env", "env", "refused"),
    [
        (
            {"SANDMAN_SESSION": "sm-1", "SANDMAN_CAMPAIGN": "x"},
            {"SANDMAN_SESSION": "sm-1", "SANDMAN_CAMPAIGN": "x"},
            [],
        ),
        ({"PATH": "/bin"}, {}, ["PATH"]),
        ({"sandman_lower": "x"}, {}, ["sandman_lower"]),
        ({"SANDMAN_BAD-NAME": "x"}, {}, ["SANDMAN_BAD-NAME"]),
        ({"SANDMAN_NUL": "a\x00b"}, {}, ["SANDMAN_NUL"]),
    ],
)
def test_sandman_variables_come_only_from_the_controller(
    controller_env: dict[str, str], env: dict[str, str], refused: list[str]
) -> None:
    result = build_env(EnvironmentPolicy(), HOST, controller_env)
    assert result.env == env
    assert [n for n, _ in result.refused] == refused


def test_controller_wins_over_policy_for_its_own_namespace() -> None:
    # SANDMAN_* in the policy is refused, so the controller's value is the only one.
    policy = EnvironmentPolicy.model_construct(allow={"SANDMAN_SESSION": "forged"}, passthrough=[])
    result = build_env(policy, HOST, {"SANDMAN_SESSION": "sm-1"})
    assert result.env == {"SANDMAN_SESSION": "sm-1"}


def test_host_values_with_nul_are_refused() -> None:
    result = build_env(EnvironmentPolicy(passthrough=["WEIRD"]), {"WEIRD": "a\x00b"}, {})
    assert result.env == {}
    assert result.refused == [("WEIRD", "environment.passthrough: its value contains a NUL byte")]


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("AWS_ACCESS_KEY_ID", "is refused by pattern 'AWS_*'"),
        ("aws_secret", "is refused by pattern 'AWS_*'"),  # matching ignores case
        ("GCP_PROJECT", "is refused by pattern 'GCP_*'"),
        ("GOOGLE_APPLICATION_CREDENTIALS", "is refused by pattern 'GOOGLE_APPLICATION_CREDENTIALS'"),
        ("AZURE_CLIENT_SECRET", "is refused by pattern 'AZURE_*'"),
        ("NPM_TOKEN", "is refused by pattern '*_TOKEN'"),
        ("CLIENT_SECRET", "is refused by pattern '*_SECRET'"),
        ("DB_PASSWORD", "is refused by pattern '*_PASSWORD'"),
        ("ANTHROPIC_API_KEY", "is refused by pattern '*_API_KEY'"),
        ("SSH_AUTH_SOCK", "is refused by environment.refuse_names"),
        ("ld_preload", "is refused by environment.refuse_names"),
        ("BASH_ENV", "is refused by environment.refuse_names"),
        ("ENV", "is refused by environment.refuse_names"),
        ("SANDMAN_ANYTHING", "is reserved: only the controller sets SANDMAN_* variables"),
        ("1BAD", "is not a valid variable name"),
        ("A-B", "is not a valid variable name"),
        ("", "is not a valid variable name"),
    ],
)
def test_refusal_reasons(name: str, why: str) -> None:
    assert refusal(name, EnvironmentPolicy()) == why


@pytest.mark.parametrize(
    "name",
    ["PATH", "HOME", "LANG", "TERM", "CI", "TOKENIZERS_PARALLELISM", "ENVIRONMENT", "MY_TOKEN_COUNT_X"],
)
def test_ordinary_names_pass(name: str) -> None:
    assert refusal(name, EnvironmentPolicy()) is None


def test_refusal_lists_are_the_policy_s_to_change() -> None:
    policy = EnvironmentPolicy(passthrough=["PYTHONPATH"], refuse_names=["LD_PRELOAD"], refuse_patterns=[])
    validate_policy(policy)
    assert build_env(policy, {"PYTHONPATH": "/src"}, {}).env == {"PYTHONPATH": "/src"}
    assert EnvironmentPolicy().refuse_names == list(DEFAULT_REFUSED_NAMES)
    assert EnvironmentPolicy().refuse_patterns == list(DEFAULT_REFUSED_PATTERNS)


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        (
            EnvironmentPolicy(passthrough=["AWS_SECRET_ACCESS_KEY"]),
            "environment.passthrough: 'AWS_SECRET_ACCESS_KEY' is refused by pattern 'AWS_*'",
        ),
        (
            EnvironmentPolicy(allow={"LD_PRELOAD": "/x"}),
            "environment.allow: 'LD_PRELOAD' is refused by environment.refuse_names",
        ),
        (EnvironmentPolicy(allow={"SANDMAN_X": "1"}), "environment.allow: 'SANDMAN_X' is reserved"),
        (EnvironmentPolicy(passthrough=["SANDMAN_X"]), "environment.passthrough: 'SANDMAN_X' is reserved"),
        (
            EnvironmentPolicy(allow={"CI": "1"}, passthrough=["CI"]),
            "environment.passthrough: 'CI' is also in environment.allow",
        ),
    ],
)
def test_validate_policy_names_the_key(policy: EnvironmentPolicy, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate_policy(policy)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)
    assert info.value.exit_code == 4


def test_validate_policy_accepts_a_clean_policy() -> None:
    validate_policy(EnvironmentPolicy(allow={"LANG": "C.UTF-8"}, passthrough=["CI", "TERM"]))
    validate_policy(EnvironmentPolicy())


@pytest.mark.parametrize(
    "data",
    [
        {"allow": {"1BAD": "x"}},
        {"allow": {"A-B": "x"}},
        {"allow": {"OK": "a\x00b"}},
        {"passthrough": ["has space"]},
        {"passthrough": [""]},
        {"refuse_patterns": [""]},
        {"inherit": True},
    ],
)
def test_malformed_policies_fail_validation(data: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        EnvironmentPolicy.model_validate(data)
