"""The gvisor backend's layer 2 (built by sandman's supervisor inside gVisor), attacked from a
normal exec of a session, as the agent would. Every probe has a positive control: the same
mechanism succeeding where it should (on the host, on an unmasked file, on the exec's own
process), so a probe that cannot fail proves nothing and fails the test."""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandman import backends
from sandman.core.session import ExecResult, Sandbox
from sandman.settings import Settings
from tests.conftest import IN_CI, make_workspace

pytestmark = pytest.mark.docker

PASS_NAME = "ATTACK_PASSTHROUGH"
PASS_VALUE = "passthrough-canary-5d1e7f"


@pytest.fixture(scope="module")
def sb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sandbox]:
    base = Path(tempfile.mkdtemp(prefix="sandman-gvattack-"))
    base.chmod(0o755)
    mp = pytest.MonkeyPatch()
    mp.setenv("SANDMAN_STATE_DIR", str(base / "state"))
    mp.setenv("SANDMAN_RUNTIME_DIR", str(base / "run"))
    mp.setenv("SANDMAN_IN_PROCESS", "1")
    avail = backends.backend_class("gvisor").availability(Settings.load())
    if not avail.available:
        mp.undo()
        if IN_CI:
            pytest.fail(f"gvisor unavailable: {avail.reason}", pytrace=False)
        pytest.skip(f"gvisor unavailable: {avail.reason}; fix: {avail.fix}")
    ws = base / "ws"
    ws.mkdir()
    (ws / ".env").write_text("API_TOKEN=attack-secret-91c2\n")
    (ws / "notes.txt").write_text("plain\n")
    make_workspace(ws)
    if os.geteuid() == 0:
        for p in [ws, *ws.rglob("*")]:
            os.lchown(p, 1000, 1000)
    policy = base / "policy.toml"
    policy.write_text(f'[environment]\npassthrough = ["{PASS_NAME}"]\n')
    with Sandbox(ws, backend="gvisor", policy=str(policy)) as sandbox:
        yield sandbox
    mp.undo()


def py(sb: Sandbox, code: str, host_env: dict[str, str] | None = None, timeout: float = 60) -> dict:
    """Run Python in an exec; it prints one JSON object last."""
    result = None
    for item in sb.stream(["python3", "-c", code], host_env=host_env or {}, timeout=timeout):
        if isinstance(item, ExecResult):
            result = item
    assert result is not None and result.exit_code == 0, result
    return json.loads(result.stdout.decode().strip().splitlines()[-1])


def background(sb: Sandbox, argv: list[str], host_env: dict[str, str] | None = None) -> threading.Thread:
    """An exec that keeps running while the test attacks it from another exec."""

    def run() -> None:
        for _ in sb.stream(argv, host_env=host_env or {}, timeout=20):
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def wait_for(path: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_control_env_and_views_are_not_in_the_exec(sb: Sandbox) -> None:
    got = py(
        sb,
        "import os,json;print(json.dumps({p: os.path.exists(p) for p in ('/run/sandman/control', "
        "'/run/sandman/env', '/run/sandman/wsro', '/run/sandman/roots', '/run/sandman/skel', "
        "'/run/sandman/upcall')} | {'run': sorted(os.listdir('/run/sandman'))}))",
    )
    assert got["run"] == ["upcall"]
    assert not any(got[p] for p in ("/run/sandman/control", "/run/sandman/env", "/run/sandman/wsro"))
    assert not got["/run/sandman/roots"] and not got["/run/sandman/skel"]
    # Control: the same check sees the one runtime subdir an exec is given; the host sees the socket.
    assert got["/run/sandman/upcall"]
    assert (Path(sb.record.runtime_dir) / "control" / "ctl.sock").exists()


def test_the_supervisor_socket_cannot_be_reached(sb: Sandbox) -> None:
    got = py(
        sb,
        "import os,json,socket,glob\n"
        "out={}\n"
        "for p in ['/run/sandman/control/ctl.sock', *glob.glob('/proc/*/root/run/sandman/control/ctl.sock')]:\n"
        "    s=socket.socket(socket.AF_UNIX)\n"
        "    try: s.connect(p); out[p]='CONNECTED'\n"
        "    except OSError as e: out[p]=e.strerror\n"
        "c=socket.socket(socket.AF_UNIX); c.bind('/tmp/mine.sock'); c.listen(1)\n"
        "d=socket.socket(socket.AF_UNIX); d.connect('/tmp/mine.sock')\n"
        "print(json.dumps({'tries': out, 'control': 'ok'}))",
    )
    assert got["tries"] and "CONNECTED" not in got["tries"].values(), got
    assert got["control"] == "ok"  # control: Unix sockets work inside
    assert "pid" in sb._control({"op": "ping"})  # control: the host reaches the supervisor


def test_other_execs_processes_are_invisible(sb: Sandbox) -> None:
    ws = sb.workspace.path
    (ws / "up-a").unlink(missing_ok=True)
    thread = background(sb, ["sh", "-c", "echo up > up-a; exec sleep 17.25"])
    wait_for(ws / "up-a")
    got = py(
        sb,
        "import os,json,subprocess,time\n"
        "mine=subprocess.Popen(['sleep','18.5']); time.sleep(0.3)\n"
        "def scan(word):\n"
        "    hits=[]\n"
        "    for p in os.listdir('/proc'):\n"
        "        if p.isdigit():\n"
        "            try: c=open(f'/proc/{p}/cmdline','rb').read()\n"
        "            except OSError: continue\n"
        "            if word in c: hits.append(int(p))\n"
        "    return hits\n"
        # (the needles are built at run time: this script's own cmdline must not match them)
        "print(json.dumps({'other': scan(b'17.'+b'25'), 'mine': scan(b'18.'+b'5'), 'pids': sorted(int(p) for p in "
        "os.listdir('/proc') if p.isdigit())})); mine.kill()",
    )
    assert got["other"] == [], got
    assert got["mine"], got  # control: the scan sees this exec's own child
    thread.join(30)


def test_masked_file_cannot_be_written_or_unmasked(sb: Sandbox) -> None:
    got = py(
        sb,
        "import os,json,ctypes,subprocess\n"
        "libc=ctypes.CDLL(None,use_errno=True)\n"
        "def w(p):\n"
        "    try: open(p,'a').write('x'); return 'WRITTEN'\n"
        "    except OSError as e: return e.strerror\n"
        "r={'read': open('/workspace/.env').read(), 'write': w('/workspace/.env'), 'notes': w('/workspace/notes.txt')}\n"
        "r['umount']=os.strerror(ctypes.get_errno()) if libc.umount2(b'/workspace/.env',2) else 'UNMOUNTED'\n"
        "try: os.rename('/workspace/.env','/workspace/moved'); r['rename']='RENAMED'\n"
        "except OSError as e: r['rename']=e.strerror\n"
        "r['userns']=subprocess.run(['unshare','-Urm','umount','/workspace/.env'],capture_output=True).returncode\n"
        "r['mounted']=any(l.split()[4]=='/workspace/.env' for l in open('/proc/self/mountinfo'))\n"
        "print(json.dumps(r))",
    )
    assert got["read"] == "" and got["write"] != "WRITTEN" and got["umount"] != "UNMOUNTED", got
    assert got["rename"] != "RENAMED" and got["userns"] != 0, got
    assert got["notes"] == "WRITTEN" and got["mounted"]  # controls: a plain file writes; the mask is a mount
    assert (sb.workspace.path / ".env").read_text() == "API_TOKEN=attack-secret-91c2\n"


def test_no_root_and_no_capabilities(sb: Sandbox) -> None:
    got = py(
        sb,
        "import os,json,ctypes\n"
        "libc=ctypes.CDLL(None,use_errno=True)\n"
        "r={'ids': [os.getresuid(), os.getresgid(), os.getgroups()]}\n"
        "st={l.split(':')[0]: l.split()[1] for l in open('/proc/self/status') if l.startswith('Cap')}\n"
        "r['caps']=st\n"
        "for name, f in (('setuid0', lambda: os.setuid(0)), ('setgid0', lambda: os.setgid(0)),\n"
        "                ('chroot', lambda: os.chroot('/tmp')), ('self', lambda: os.setresuid(os.getuid(),os.getuid(),os.getuid()))):\n"
        "    try: f(); r[name]='OK'\n"
        "    except OSError as e: r[name]=e.strerror\n"
        "r['bound']=[c for c in range(41) if libc.prctl(23,c,0,0,0)==1]\n"
        "print(json.dumps(r))",
    )
    (uids, gids, groups) = got["ids"]
    assert 0 not in uids and 0 not in gids and 0 not in groups, got
    assert all(int(v, 16) == 0 for v in got["caps"].values()) and got["bound"] == [], got
    assert got["setuid0"] != "OK" and got["setgid0"] != "OK" and got["chroot"] != "OK", got
    assert got["self"] == "OK"  # control: the same call with the exec's own uid works


def test_another_execs_env_file_is_out_of_reach(sb: Sandbox) -> None:
    ws = sb.workspace.path
    (ws / "up-b").unlink(missing_ok=True)
    thread = background(
        sb,
        ["sh", "-c", f'echo "${PASS_NAME}" > own-b; echo up > up-b; exec sleep 16.75'],
        host_env={PASS_NAME: PASS_VALUE},
    )
    wait_for(ws / "up-b")
    env_dir = Path(sb.record.runtime_dir) / "env"
    assert list(env_dir.iterdir()), "control: the running exec's env file exists on the host"
    got = py(
        sb,
        "import os,json,glob\n"
        f"needle=bytes.fromhex({PASS_VALUE.encode().hex()!r})\n"  # not the value itself: this cmdline
        "hits=[]\n"
        "for p in glob.glob('/proc/*/environ')+glob.glob('/proc/*/cmdline')+glob.glob('/run/sandman/**',recursive=True):\n"
        "    try: hits += [p] if needle in open(p,'rb').read() else []\n"
        "    except OSError: pass\n"
        "print(json.dumps({'hits': hits, 'env_dir': os.path.exists('/run/sandman/env')}))",
    )
    assert got == {"hits": [], "env_dir": False}, got
    assert (ws / "own-b").read_text().strip() == PASS_VALUE  # control: the exec itself has it
    thread.join(30)


def test_a_renamed_directory_under_a_bind_never_reaches_the_unmasked_workspace(sb: Sandbox) -> None:
    """A red-team round read a masked .env on gvisor: exec B (started before .git existed)
    made .git/x/y; exec A (started after, so .git was bound onto itself) sat in .git/x/y; B
    renamed .git/x away, and this gVisor let A's `..` climb past the bind's root to the
    workspace's root inside that second mount, where no mask was. Now no workspace directory
    is bound on its own: A climbs into the ordinary, masked workspace. Control: the same climb
    reads an ordinary file."""
    ws = sb.workspace.path
    for name in ("b_made", "a_ready", "b_done"):
        (ws / name).unlink(missing_ok=True)
    b_result: list[ExecResult] = []
    b = threading.Thread(
        target=lambda: b_result.append(
            sb.exec(
                [
                    "sh",
                    "-c",
                    "mkdir -p .git/x/y && touch b_made && "
                    "i=0; while [ ! -e a_ready ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done; "
                    "mv .git/x x_out && touch b_done",
                ],
                timeout=90,
            )
        )
    )
    b.start()
    deadline = time.monotonic() + 60
    while not (ws / "b_made").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (ws / "b_made").exists()
    a = py(
        sb,
        "import os, time, json\n"
        "os.chdir('.git/x/y'); open('/workspace/a_ready', 'w').close()\n"
        "t = time.time()\n"
        "while not os.path.exists('/workspace/b_done') and time.time() - t < 60: time.sleep(0.05)\n"
        "os.chdir('..'); os.chdir('..')\n"
        "def rd(n):\n"
        "    try: return open(n).read()\n"
        "    except OSError as e: return 'ERR ' + e.strerror\n"
        "print(json.dumps({'env': rd('.env'), 'notes': rd('notes.txt'), 'where': sorted(os.listdir('.'))[:20]}))\n",
        timeout=90,
    )
    b.join(90)
    assert b_result and b_result[0].exit_code == 0, b_result
    assert "attack-secret" not in a["env"], a  # the attack: the masked secret stays masked
    assert a["notes"].startswith("plain\n"), a  # control: the climb reached the workspace and reads files
    for p in (ws / "x_out", ws / ".git"):
        import shutil

        shutil.rmtree(p, ignore_errors=True)


def test_a_terminal_exec_finishes_when_its_shell_exits(sb: Sandbox) -> None:
    """A red-team round found `session shell` execs never finished under gVisor (no EOF on the
    pty's master): each leaked its root and private dirs and stopped the idle clock. The exec
    now ends when its command is reaped, with its output delivered; the supervisor's ping shows
    no exec left. Control: a pipe exec finishes the same way."""
    res = None
    for item in sb.stream(["sh", "-c", "echo from-the-pty; exit 3"], tty=(24, 80), timeout=30):
        if isinstance(item, ExecResult):
            res = item
    assert res is not None and res.exit_code == 3 and b"from-the-pty" in res.stdout, res
    control = sb.exec(["sh", "-c", "echo from-a-pipe; exit 4"], timeout=30)
    assert control.exit_code == 4 and control.stdout == b"from-a-pipe\n"
    deadline = time.monotonic() + 10
    while (execs := sb._control({"op": "ping"}).get("execs")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not execs, execs
