"""A CI job's view: run an untrusted build step inside a sandman sandbox and check its result.

Uses only the `sandman_sandbox` fixture from sandman's pytest plugin. Run with:
    pytest examples/ci/
"""

import shutil
import tarfile
from pathlib import Path

import pytest

PROJECT = Path(__file__).parent / "project"


def copy_project(box) -> Path:
    """Put the sources into the sandbox's workspace (it belongs to the sandbox's user)."""
    ws = box.workspace
    shutil.copytree(PROJECT, ws, dirs_exist_ok=True)
    for path in [ws, *ws.rglob("*")]:
        shutil.chown(path, ws.stat().st_uid, ws.stat().st_gid)
    return ws


def test_build_step_produces_its_artifact(sandman_sandbox) -> None:
    ws = copy_project(sandman_sandbox)
    result = sandman_sandbox.exec(["sh", "build.sh"], timeout=120)
    assert result.exit_code == 0, result.stderr.decode()
    assert result.stdout.decode().strip().endswith("build ok")
    with tarfile.open(ws / "dist" / "greet.tar.gz") as tar:
        assert "src/greet.py" in tar.getnames()


def test_the_build_has_no_network(sandman_sandbox) -> None:
    script = (
        "import socket, os\n"
        "print(sorted(os.listdir('/sys/class/net')))\n"
        "try:\n"
        "    socket.create_connection(('1.1.1.1', 53), timeout=2); print('connected')\n"
        "except OSError as e:\n"
        "    print('refused', e.errno)\n"
    )
    out = sandman_sandbox.exec(["python3", "-c", script]).stdout.decode().splitlines()
    assert out[0] == "['lo']"
    assert out[1].startswith("refused")


@pytest.mark.sandman(memory="256m", pids=64)
def test_limits_come_from_the_marker(sandman_sandbox) -> None:
    hc = sandman_sandbox.get_wrapped_container().attrs["HostConfig"]
    assert (hc["Memory"], hc["PidsLimit"]) == (256 << 20, 64)
