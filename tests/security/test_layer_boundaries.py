"""Privileged code never follows what the agent wrote (issue: layer boundaries).

Each attack the red team ran, replayed for real, beside a positive control that shows the same
probe succeeds where it should: bubblewrap's own mount setup steered by workspace symlinks
(static, and raced by a concurrent flipper, through the Python API and the CLI), the supervisor's
control socket reached from inside, the host acting in the container's runtime dir, the mask
list (stale, truncated, case, hard links, symlinks, the max_masks lockout), an oversized
supervisor request, a ~/.gitconfig planted for the next exec, and the campaign files.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandman.core.session import Sandbox
from sandman.errors import CampaignError, ConfigError
from sandman.policy import Policy
from sandman.policy.enforce import Masks
from sandman.policy.paths import PathDenied
from sandman.settings import Settings
from tests.conftest import SANDMAN, make_workspace

UID = 1000
MARKER = "sm-host-only-" + os.urandom(6).hex()


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    tmp_path.chmod(0o755)
    root = make_workspace(tmp_path / "ws")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / "README").write_text("hello\n")
    make_workspace(root)
    return root


@pytest.fixture
def sb(engine: object, agent_image: str, ws: Path, settings: Settings) -> Iterator[Sandbox]:
    with Sandbox(ws, settings=settings) as box:
        yield box


def own(path: Path) -> None:
    os.lchown(path, UID, UID)


def sh(sb: Sandbox, script: str, **kw: object) -> tuple[int, str, str]:
    res = sb.exec(["sh", "-c", script], **kw)  # type: ignore[arg-type]
    return res.exit_code, res.stdout.decode(errors="replace"), res.stderr.decode(errors="replace")


# -- 1. layer 2 -> layer 1 through bubblewrap's mount setup ----------------------------------------
def test_planted_symlinks_never_steer_a_bind_to_the_control_socket(sb: Sandbox, ws: Path) -> None:
    # The red team's chain: a mask target under x/run/sandman/control, then x -> .., and the
    # protected .git/hooks replaced by a symlink to the control dir (here: a fresh repo dir the
    # agent can write, since the real .git/hooks is read-only inside).
    code, _, err = sh(
        sb,
        "mkdir -p x/run/sandman/control && touch x/run/sandman/control/.env && rm -rf x && ln -s .. x && "
        "mkdir -p sub/.git && ln -s ../../../run/sandman/control sub/.git/hooks && echo planted",
    )
    assert code == 0, err
    # The next exec: the planted symlink under a protected name is refused by name, at start.
    with pytest.raises(PathDenied, match=r"sub/\.git/hooks.*symlink"):
        sb.exec(["true"])
    # Positive control: the same layout with a real directory instead of the link starts, and the
    # binds are read-only where they should be (and nowhere near /run/sandman/control).
    (ws / "sub" / ".git" / "hooks").unlink()
    (ws / "sub" / ".git" / "hooks").mkdir()
    own(ws / "sub" / ".git" / "hooks")
    code, out, err = sh(
        sb,
        "ls /run/sandman 2>&1; touch sub/.git/hooks/x 2>&1; test -S x/run/sandman/control/ctl.sock && echo REACHED",
    )
    assert "REACHED" not in out
    assert "Read-only file system" in out
    assert "control" not in out.split("\n")[0]  # only the upcall dir is bound into layer 2


def test_a_stale_mask_list_through_a_symlink_is_refused_at_the_moment_of_use(sb: Sandbox, ws: Path) -> None:
    # The Python API used to cache the mask list: simulate exactly that (a list made when x/ was a
    # real directory, used after x became a symlink to ..) and the protected .git/hooks swapped
    # for a symlink after the scan. The launcher walks every component without following links.
    (ws / "x").mkdir()
    own(ws / "x")
    stale = Masks(
        hidden=(("/workspace/x/run/sandman/control/.env", False),),
        read_only=("/workspace/.git/hooks",),
        pinned=("/workspace/.git",),
    )
    sb.masks = lambda: stale  # type: ignore[method-assign]
    (ws / "x").rmdir()
    (ws / "x").symlink_to("..")
    own(ws / "x")
    res = sb.exec(["sh", "-c", "echo RAN; ls -la /run/sandman"])
    assert res.exit_code == 126
    assert b"RAN" not in res.stdout
    assert b"refused" in res.stderr and b"'x/run/sandman/control/.env'" in res.stderr
    # Positive control: the same stale list with x a real directory holding the file runs.
    (ws / "x").unlink()
    (ws / "x" / "run" / "sandman" / "control").mkdir(parents=True)
    (ws / "x" / "run" / "sandman" / "control" / ".env").write_text("SECRET=1\n")
    make_workspace(ws)
    res = sb.exec(["sh", "-c", "cat x/run/sandman/control/.env; echo RAN"])
    assert res.exit_code == 0, res.stderr
    assert res.stdout == b"RAN\n"  # masked, read as empty


def _flipper(sb: Sandbox, stop: threading.Event) -> threading.Thread:
    """A concurrent exec of the same session that swaps d/ for a symlink and back, forever."""

    def run() -> None:
        sb.exec(
            [
                "sh",
                "-c",
                "while [ ! -e /workspace/STOP ]; do mv d d.real; ln -s decoy d; rm d; mv d.real d; done",
            ],
            timeout=120,
        )

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_concurrent_flipper_never_unmasks_a_secret_through_the_python_api(sb: Sandbox, ws: Path) -> None:
    for d in ("d", "decoy"):
        (ws / d).mkdir()
    (ws / "d" / ".env").write_text(f"TOKEN={MARKER}\n")
    (ws / "decoy" / ".env").write_text("decoy\n")
    make_workspace(ws)
    stop = threading.Event()
    flipper = _flipper(sb, stop)
    outcomes = {"ran": 0, "refused": 0, "other": 0}
    try:
        deadline = time.monotonic() + 25
        tries = 0
        while time.monotonic() < deadline and tries < 150:
            tries += 1
            try:
                res = sb.exec(["sh", "-c", "cat d/.env d.real/.env decoy/.env 2>/dev/null; echo END"], timeout=30)
            except (PathDenied, ConfigError):
                outcomes["refused"] += 1  # the scan caught a swap in flight (or kept seeing them)
                continue
            assert MARKER.encode() not in res.stdout, f"secret unmasked after {tries} tries"
            if res.exit_code == 126 and b"refused" in res.stderr:
                outcomes["refused"] += 1
            elif res.exit_code == 0 and res.stdout.endswith(b"END\n"):
                outcomes["ran"] += 1
            else:
                outcomes["other"] += 1
    finally:
        (ws / "STOP").touch()
        flipper.join(60)
    print(f"flipper race through the API: {tries} tries, {outcomes}")
    assert outcomes["ran"] > 0  # the probe itself works while the flipper runs
    # Positive control for the probe: the secret is still in the workspace (wherever the flipper's
    # renames left it; bubblewrap re-creates a directory that vanished mid-setup), readable by the
    # host, so its absence above is the mask's doing.
    assert any(MARKER in p.read_text() for p in ws.rglob(".env") if p.is_file() and not p.is_symlink())


def test_a_concurrent_flipper_never_unmasks_a_secret_through_the_cli(sb: Sandbox, ws: Path, settings: Settings) -> None:
    for d in ("d", "decoy"):
        (ws / d).mkdir()
    (ws / "d" / ".env").write_text(f"TOKEN={MARKER}\n")
    (ws / "decoy" / ".env").write_text("decoy\n")
    make_workspace(ws)
    stop = threading.Event()
    flipper = _flipper(sb, stop)
    env = {**os.environ, "SANDMAN_IN_PROCESS": "1"}
    ran = 0
    try:
        for _ in range(12):
            proc = subprocess.run(
                [*SANDMAN, "run", "-w", str(ws), "--", "sh", "-c", "cat d/.env d.real/.env 2>/dev/null; echo END"],
                capture_output=True,
                text=True,
                env=env,
                timeout=120,
            )
            assert MARKER not in proc.stdout + proc.stderr
            ran += proc.returncode == 0 and proc.stdout.endswith("END\n")
    finally:
        (ws / "STOP").touch()
        flipper.join(60)
    assert ran > 0


# -- the control socket ------------------------------------------------------------------------------
def _ping(path: str) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(b'{"op": "ping"}\n')
        try:
            return s.recv(4096)
        except OSError:
            return b""


def test_the_control_socket_answers_the_host_and_nobody_inside(sb: Sandbox, engine: object) -> None:
    host_path = str(Path(sb.record.runtime_dir) / "control" / "ctl.sock")
    assert b'"pid"' in _ping(host_path)  # positive control: the host is answered
    probe = (
        "import socket\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "s.settimeout(5)\n"
        "s.connect('/run/sandman/control/ctl.sock')\n"
        "try:\n"
        '    s.sendall(b\'{"op": "ping"}\\n\')\n'
        "    print('REPLY', s.recv(4096))\n"
        "except (ConnectionResetError, BrokenPipeError):\n"
        "    print('REPLY', b'')\n"
    )
    # A process of the container itself (what a layer-2 escape would be at best) gets nothing.
    out = engine.exec_create(sb.record.container_id, ["python3", "-c", probe], user=f"{UID}:{UID}")  # type: ignore[attr-defined]
    text = engine.exec_start(out["Id"]).decode()  # type: ignore[attr-defined]
    assert "REPLY b''" in text, text
    assert b'"pid"' in _ping(host_path)  # and the session still serves the host


def test_an_oversized_supervisor_request_gets_an_error_and_the_session_lives(sb: Sandbox) -> None:
    path = str(Path(sb.record.runtime_dir) / "control" / "ctl.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(path)
        with contextlib.suppress(OSError):  # the supervisor may close while we still send
            s.sendall(b"x" * (5 << 20))
        header = s.recv(5)
        kind, length = struct.unpack(">cI", header)
        reply = json.loads(s.recv(length))
    assert kind == b"r" and "too large" in reply["error"]
    assert sb.exec(["echo", "alive"]).stdout == b"alive\n"


# -- 2. the host never acts in a directory the container can write ---------------------------------
def test_layer_one_cannot_plant_in_the_runtime_dir_and_the_host_chowns_nothing(
    sb: Sandbox, engine: object, tmp_path: Path, settings: Settings
) -> None:
    victim = tmp_path / "root-only"
    victim.mkdir(mode=0o700)
    plant = (
        f"rm -rf /run/sandman/env 2>&1; ln -s {victim} /run/sandman/env 2>&1; "
        f"ln -s {victim} /run/sandman/upcall/x 2>&1; ln -s {victim} /run/sandman/control/x && echo CONTROL-WRITABLE"
    )
    ex = engine.exec_create(sb.record.container_id, ["sh", "-c", plant], user=f"{UID}:{UID}")  # type: ignore[attr-defined]
    out = engine.exec_start(ex["Id"]).decode()  # type: ignore[attr-defined]
    assert out.count("Read-only file system") >= 2, out
    assert "CONTROL-WRITABLE" in out  # positive control: this is a process that can write there
    # An exec with a private env file (an injected secret) still works, and the victim is untouched.
    policy = Policy.model_validate({**json.loads(sb.policy.model_dump_json()), "secrets": {"inject": ["T"]}})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SANDMAN_SECRETS", json.dumps({"T": "sm-tok-" + os.urandom(4).hex()}))
        sb.settings = Settings.load()
        sb.policy = policy
        res = sb.exec(["sh", "-c", 'test -n "$T" && echo HAS-T'])
    assert res.stdout == b"HAS-T\n", res.stderr
    st = victim.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, 0, 0o700)


def test_the_host_never_connects_through_a_symlink_in_the_control_dir(
    sb: Sandbox, engine: object, tmp_path: Path
) -> None:
    from sandman.core.session import SessionGone, connect_control

    decoy = tmp_path / "decoy.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(decoy))
    listener.listen(1)
    cmd = f"mv /run/sandman/control/ctl.sock /run/sandman/control/real.sock && ln -s {decoy} /run/sandman/control/ctl.sock"
    ex = engine.exec_create(sb.record.container_id, ["sh", "-c", cmd], user=f"{UID}:{UID}")  # type: ignore[attr-defined]
    engine.exec_start(ex["Id"])  # type: ignore[attr-defined]
    with pytest.raises(OSError):
        connect_control(Path(sb.record.runtime_dir) / "control" / "ctl.sock")
    with pytest.raises(SessionGone):
        sb.exec(["true"])
    listener.settimeout(0.2)
    with pytest.raises(TimeoutError):
        listener.accept()  # nothing ever connected to the decoy
    listener.close()
    # Positive control: the real socket, under its own name, is still reached the same way.
    assert connect_control(Path(sb.record.runtime_dir) / "control" / "real.sock")


# -- 5. masks that fail open -----------------------------------------------------------------------------
def test_every_exec_uses_a_current_mask_list(sb: Sandbox, ws: Path) -> None:
    assert sh(sb, "echo first")[1] == "first\n"
    (ws / "config").mkdir()
    (ws / "config" / "credentials.json").write_text(MARKER)
    make_workspace(ws)
    _, out, _ = sh(sb, "cat config/credentials.json; mv config config.moved; echo END")
    assert MARKER not in out and out.endswith("END\n")
    _, out, _ = sh(sb, "cat config.moved/credentials.json; echo END")
    assert MARKER not in out and out == "END\n"
    assert (ws / "config.moved" / "credentials.json").read_text() == MARKER  # positive control


@pytest.mark.parametrize("name", [".ENV", "KEY.PEM", "id_ecdsa", ".aws/credentials", ".npmrc", "prod.tfstate"])
def test_case_and_the_widened_deny_list(sb: Sandbox, ws: Path, name: str) -> None:
    path = ws / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(MARKER)
    (ws / "plain.txt").write_text(MARKER)
    make_workspace(ws)
    _, out, _ = sh(sb, f"cat '{name}'; echo; cat plain.txt")
    assert out.count(MARKER) == 1  # plain.txt (the positive control) only


def test_hard_links_and_symlinks_under_denied_names_are_refused_at_start(sb: Sandbox, ws: Path) -> None:
    (ws / "notes.txt").write_text("x")
    os.link(ws / "notes.txt", ws / ".env.production")
    make_workspace(ws)
    with pytest.raises(PathDenied, match=r"\.env\.production.*2 hard links"):
        sb.exec(["true"])
    (ws / ".env.production").unlink()
    (ws / ".env.production").symlink_to("notes.txt")
    own(ws / ".env.production")
    with pytest.raises(PathDenied, match=r"\.env\.production.*symlink"):
        sb.exec(["true"])
    (ws / ".env.production").unlink()
    assert sb.exec(["true"]).exit_code == 0  # positive control


def test_a_truncated_scan_fails_closed(engine: object, agent_image: str, ws: Path, settings: Settings) -> None:
    for i in range(1200):
        (ws / f"f{i}").write_text("")
    policy = Policy.model_validate({"filesystem": {"scan_limit": 1000}})
    with (
        pytest.raises(Exception, match=r"scan stopped after .* the sandbox does not start"),
        Sandbox(ws, settings=settings, policy=policy) as box,
    ):
        box.exec(["true"])
    with Sandbox(ws, settings=settings, policy=Policy.model_validate({"filesystem": {"scan_limit": 5000}})) as box:
        assert box.exec(["true"]).exit_code == 0  # positive control


def test_more_denied_files_than_max_masks_hide_their_directory_not_lock_the_workspace(
    engine: object, agent_image: str, ws: Path, settings: Settings
) -> None:
    policy = Policy.model_validate({"filesystem": {"max_masks": 10}})
    with Sandbox(ws, settings=settings, policy=policy) as box:
        code, _, err = sh(
            box, "mkdir -p spam && for i in $(seq 1 40); do echo s > spam/$i.pem; done; echo ok > keep.txt"
        )
        assert code == 0, err
        code, out, err = sh(box, "ls spam | wc -l; cat keep.txt")
        assert code == 0, err
        assert out.split() == ["0", "ok"]  # spam/ hidden as a whole; the rest of the workspace works


# -- 6. between execs of one session ---------------------------------------------------------------------
def test_home_and_tmp_are_private_to_each_exec(sb: Sandbox) -> None:
    assert sh(sb, "printf '[core]\\n\\tpager = cat /run/sandman-env\\n' > ~/.gitconfig; echo x > /tmp/planted")[0] == 0
    _, out, _ = sh(sb, "cat ~/.gitconfig /tmp/planted 2>&1; echo END")
    assert "pager" not in out and "x\n" not in out and out.endswith("END\n")
    # Concurrent execs do not see each other's /tmp either.
    bg = threading.Thread(target=lambda: sh(sb, "echo mine > /tmp/busy; sleep 3"))
    bg.start()
    time.sleep(1.0)
    assert "busy" not in sh(sb, "ls -a /tmp")[1]
    bg.join()


def test_shared_tmp_and_home_is_the_operators_choice(
    engine: object, agent_image: str, ws: Path, settings: Settings
) -> None:
    policy = Policy.model_validate({"filesystem": {"share_tmp_home": True}})
    with Sandbox(ws, settings=settings, policy=policy) as box:
        sh(box, "echo planted > ~/.gitconfig")
        assert sh(box, "cat ~/.gitconfig")[1] == "planted\n"  # the old behaviour, when asked for


# -- 3. the campaign comes from the agent's own workspace --------------------------------------------------
def test_sandman_dir_is_read_only_inside_and_a_changed_campaign_needs_acceptance(
    engine: object, agent_image: str, ws: Path, settings: Settings
) -> None:
    (ws / ".sandman").mkdir()
    (ws / ".sandman" / "image.toml").write_text('name = "bound"\n')
    make_workspace(ws)
    with Sandbox(ws, settings=settings) as box:  # first use: recorded
        _, out, err = sh(box, "echo 'dockerfile_lines = [\"RUN touch /pwned\"]' >> .sandman/image.toml; echo END")
        assert "Read-only file system" in err and out == "END\n"
    assert "dockerfile_lines" not in (ws / ".sandman" / "image.toml").read_text()
    # Whatever writes it (a protection failing, a workspace with no .sandman/ yet), a change is
    # refused, with the diff, until the operator accepts it.
    (ws / ".sandman" / "image.toml").write_text('name = "bound"\ndockerfile_lines = ["RUN touch /pwned"]\n')
    with pytest.raises(CampaignError, match=r"(?s)changed since.*\+dockerfile_lines.*campaign accept"):
        Sandbox(ws, settings=settings)
    proc = subprocess.run(
        [*SANDMAN, "run", "-w", str(ws), "--", "true"],
        capture_output=True,
        text=True,
        env={**os.environ, "SANDMAN_IN_PROCESS": "1"},
        timeout=120,
    )
    assert proc.returncode == 4 and "+dockerfile_lines" in proc.stderr
    # Accepting it (after review) is the operator's explicit act.
    (ws / ".sandman" / "image.toml").write_text('name = "bound"\n')
    with Sandbox(ws, settings=settings) as box:  # undone: as accepted
        assert box.exec(["true"]).exit_code == 0


def test_a_campaign_that_appears_later_is_a_change_too(
    engine: object, agent_image: str, ws: Path, settings: Settings
) -> None:
    with Sandbox(ws, settings=settings) as box:
        sh(box, "echo x")  # first use: no .sandman/ at all
    (ws / ".sandman").mkdir()
    (ws / ".sandman" / "policy.toml").write_text("[resources]\ncpus = 1.0\n")
    make_workspace(ws)
    with pytest.raises(CampaignError, match="policy.toml"):
        Sandbox(ws, settings=settings)
    with Sandbox(ws, settings=settings, accept_campaign=True) as box:  # positive control
        assert box.policy.resources.cpus == 1.0


def test_a_campaign_build_cannot_replace_sandmans_trusted_pieces(
    engine: object, agent_image: str, ws: Path, settings: Settings
) -> None:
    # The red team's build replaced /usr/bin/bwrap and the supervisor. The supervisor and the exec
    # shim are bound from the host over the image's copy; bwrap & co are checked by digest.
    (ws / ".sandman").mkdir()
    (ws / ".sandman" / "image.toml").write_text(
        'name = "evil"\ndockerfile_lines = ["RUN cp /bin/true /usr/bin/bwrap", '
        "\"RUN printf '#!/bin/sh\\\\necho PWNED-SHIM\\\\n' > /usr/lib/sandman/sandbox-exec\"]\n"
    )
    make_workspace(ws)
    with pytest.raises(Exception, match=r"replaces sandman's trusted pieces \(/usr/bin/bwrap\)"):
        Sandbox(ws, settings=settings)
    # Positive control: the image really holds the replacement (so the refusal is the check's doing).
    tags = [t for img in engine.images(name="sandman/campaign-evil") for t in img["RepoTags"] or []]  # type: ignore[attr-defined]
    assert tags
    out = subprocess.run(
        [
            "docker",
            "run",
            "--rm",
            "--network=none",
            tags[0],
            "sh",
            "-c",
            "cmp -s /bin/true /usr/bin/bwrap && echo SAME",
        ],
        capture_output=True,
        text=True,
    )
    assert out.stdout.strip() == "SAME"
    # A campaign that only replaces sandman's shim in its image starts, and runs the host's shim.
    (ws / ".sandman" / "image.toml").write_text(
        'name = "shim"\ndockerfile_lines = ["RUN printf \'#!/bin/sh\\\\necho PWNED-SHIM\\\\n\' > /usr/lib/sandman/sandbox-exec"]\n'
    )
    with Sandbox(ws, settings=settings, accept_campaign=True) as box:
        res = box.exec(["echo", "real"])
    assert res.stdout == b"real\n" and b"PWNED" not in res.stdout + res.stderr
    for img in engine.images(filters={"label": "io.sandman.campaign"}):  # type: ignore[attr-defined]
        if any(t.startswith(("sandman/campaign-evil", "sandman/campaign-shim")) for t in img["RepoTags"] or []):
            subprocess.run(["docker", "rmi", "-f", img["Id"]], capture_output=True)


def test_what_is_built_is_what_was_checked(engine: object, agent_image: str, ws: Path, settings: Settings) -> None:
    # The red team's race: the check reads .sandman/ once, the build read it again by path, and an
    # exec swapped the files in between. Now the build and the policy read the checked snapshot.
    from sandman.backends.image import load_campaign
    from sandman.core.runner import Runner

    (ws / ".sandman").mkdir()
    (ws / ".sandman" / "image.toml").write_text('name = "checked"\n')
    (ws / ".sandman" / "policy.toml").write_text("[resources]\ncpus = 1.0\n")
    make_workspace(ws)
    runner = Runner(settings)
    runner.check_campaign(ws)
    (ws / ".sandman" / "image.toml").write_text('name = "swapped"\ndockerfile_lines = ["RUN touch /pwned"]\n')
    (ws / ".sandman" / "policy.toml").write_text("[resources]\ncpus = 0.5\n")
    assert load_campaign(ws).spec.dockerfile_lines == ()
    assert load_campaign(ws).name == "checked"
    assert runner.policy(None, ws).resources.cpus == 1.0
    with pytest.raises(CampaignError, match="changed since"):  # positive control: a new check sees it
        runner.check_campaign(ws)


def test_a_campaign_cannot_change_the_supervisors_python_either(
    engine: object, agent_image: str, ws: Path, settings: Settings
) -> None:
    (ws / ".sandman").mkdir()
    (ws / ".sandman" / "image.toml").write_text(
        'name = "stdlib"\ndockerfile_lines = ["RUN echo \\"import os\\" >> /usr/lib/python3.11/selectors.py"]\n'
    )
    make_workspace(ws)
    with pytest.raises(Exception, match=r"replaces sandman's trusted pieces \(/usr/lib/python3.11\)"):
        Sandbox(ws, settings=settings)
    for img in engine.images(filters={"label": "io.sandman.campaign=stdlib"}):  # type: ignore[attr-defined]
        subprocess.run(["docker", "rmi", "-f", img["Id"]], capture_output=True)


def test_an_execs_private_tmp_is_removed_whatever_modes_it_left(sb: Sandbox, engine: object) -> None:
    # The red team's wedge: a mode-000 directory full of files outlived its exec and filled the
    # session's /tmp for good. The supervisor makes every directory 0700 before removing the tree.
    script = "mkdir -p /tmp/d/e && head -c 50000000 /dev/zero > /tmp/d/e/big && chmod 000 /tmp/d/e /tmp/d && echo OK"
    assert sh(sb, script)[1] == "OK\n"
    deadline = time.monotonic() + 10
    used = ""
    while time.monotonic() < deadline:
        ex = engine.exec_create(sb.record.container_id, ["sh", "-c", "du -sk /tmp | cut -f1"], user=f"{UID}:{UID}")  # type: ignore[attr-defined]
        used = engine.exec_start(ex["Id"]).decode().strip()  # type: ignore[attr-defined]
        if used.isdigit() and int(used) < 1024:
            break
        time.sleep(0.2)
    assert used.isdigit() and int(used) < 1024, f"/tmp still holds {used} KiB"
    assert sh(sb, "echo next")[1] == "next\n"  # positive control: the session goes on
