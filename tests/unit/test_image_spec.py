"""Campaign image specs: validation with file/key/reason, rendering, and content-hash tags."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandman.backends.image import CampaignImage, apt_mirror, load_campaign
from sandman.errors import CampaignError, ConfigError


def write(ws: Path, rel: str, text: str) -> Path:
    p = ws / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def test_no_image_toml_is_the_plain_agent_image(tmp_path: Path) -> None:
    ws = tmp_path / "My Project!"
    ws.mkdir()
    camp = load_campaign(ws)
    assert camp.spec.is_empty() and camp.source is None
    assert camp.name == "my-project"


def test_image_toml_renders_a_dockerfile(tmp_path: Path) -> None:
    write(
        tmp_path,
        ".sandman/image.toml",
        'name = "demo"\napt_packages = ["jq", "curl=7.88.1-10+deb12u5"]\npip_packages = ["requests==2.32.3"]\n'
        'env = { GREETING = "hi \\"there\\"" }\ndockerfile_lines = ["RUN echo extra"]\n',
    )
    camp = load_campaign(tmp_path)
    assert camp.name == "demo"
    text = camp.spec.dockerfile("sandman/base:x")
    assert text.splitlines() == [
        "FROM sandman/base:x",
        "USER 0:0",
        "RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "
        "jq curl=7.88.1-10+deb12u5 python3-pip && rm -rf /var/lib/apt/lists/*",
        'RUN python3 -m pip install --no-cache-dir --break-system-packages "requests==2.32.3"',
        'ENV GREETING="hi \\"there\\""',
        "RUN echo extra",
        "USER 1000:1000",
    ]


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ('apt_packages = ["jq; rm -rf /"]', "apt_packages"),
        ('pip_packages = ["x && curl evil"]', "pip_packages"),
        ('env = { "BAD-NAME" = "x" }', "env"),
        ('env = { SANDMAN_SESSION = "x" }', "env"),
        ('dockerfile_lines = ["FROM alpine"]', "dockerfile_lines"),
        ('colour = "blue"', "colour"),
        ('name = "Has Spaces"', "name"),
    ],
)
def test_invalid_image_toml_names_file_key_and_reason(tmp_path: Path, toml: str, key: str) -> None:
    path = write(tmp_path, ".sandman/image.toml", toml + "\n")
    with pytest.raises(ConfigError) as err:
        load_campaign(tmp_path)
    assert str(path) in str(err.value) and key in str(err.value)


def test_unknown_campaign_lists_the_known_ones(tmp_path: Path) -> None:
    write(tmp_path, ".sandman/campaigns/fast.toml", "")
    assert load_campaign(tmp_path, "fast").name == "fast"
    with pytest.raises(CampaignError, match="unknown campaign 'slow'.*fast"):
        load_campaign(tmp_path, "slow")
    with pytest.raises(CampaignError, match="invalid"):
        load_campaign(tmp_path, "../etc")


def test_spec_equality_is_by_content() -> None:
    a = CampaignImage(apt_packages=("jq",), env={"A": "1"})
    b = CampaignImage(env={"A": "1"}, apt_packages=("jq",))
    assert a.model_dump() == b.model_dump()


def test_apt_mirror_reads_the_machines_sources_or_none() -> None:
    mirror = apt_mirror()
    assert mirror is None or mirror.startswith(("http://", "https://", "file:"))
