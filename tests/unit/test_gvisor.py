"""The gvisor backend's pure parts: its deltas to ``container_kwargs``, the plan the host sends
the supervisor in gVisor mode, the layer-2 filter, and what it declares it cannot do."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from sandman.backends import REGISTRY, backend_class
from sandman.backends.base import WALL_GVISOR
from sandman.backends.docker import container_kwargs
from sandman.backends.gvisor import SENTRY_CAPS, GVisorBackend, gvisor_adjust, host_pids
from sandman.core import bwrap
from sandman.core.runner import launcher_argv, layer2_request
from sandman.core.workspace import Workspace
from sandman.errors import UsageError
from sandman.policy import enforce, load_policy, seccomp
from sandman.settings import Settings
from tests.unit.test_container_kwargs import spec


def test_registered_with_one_line() -> None:
    assert REGISTRY["gvisor"] == "sandman.backends.gvisor:GVisorBackend"
    assert backend_class("gvisor") is GVisorBackend


def test_kwargs_deltas_are_exactly_these() -> None:
    """Everything else is the docker backend's, byte for byte."""
    s = spec()
    base = container_kwargs(s)
    got = gvisor_adjust(base, s)
    hc, bhc = got["host_config"], base["host_config"]
    assert hc["Runtime"] == "runsc"
    assert hc["PidsLimit"] == host_pids(256) == 100 + 10 * 256
    assert {"Name": "nproc", "Soft": 256, "Hard": 256} in hc["Ulimits"]
    assert [u for u in hc["Ulimits"] if u["Name"] != "nproc"] == bhc["Ulimits"]
    assert got["user"] == "0:0" and base["user"] == "1000:1000"
    assert hc["CapAdd"] == SENTRY_CAPS == ["SYS_ADMIN", "SYS_CHROOT", "SETUID", "SETGID", "CHOWN", "SETPCAP"]
    assert hc["CapDrop"] == ["ALL"]
    assert hc["Mounts"][:-1] == bhc["Mounts"]
    assert hc["Mounts"][-1] == {
        "Target": "/run/sandman/wsro",
        "Source": "/home/u/proj",
        "Type": "bind",
        "ReadOnly": True,
    }
    assert "MaskedPaths" not in hc and "ReadonlyPaths" not in hc
    changed = {"Runtime", "PidsLimit", "Ulimits", "CapAdd", "Mounts", "MaskedPaths", "ReadonlyPaths"}
    assert {k: v for k, v in hc.items() if k not in changed} == {k: v for k, v in bhc.items() if k not in changed}
    assert {k: v for k, v in got.items() if k not in ("user", "host_config")} == {
        k: v for k, v in base.items() if k not in ("user", "host_config")
    }


def test_the_docker_backend_still_refuses_uid_0() -> None:
    with pytest.raises(ValueError, match="uid 0"):
        container_kwargs(spec(uid=0))


def test_capabilities_say_what_it_gives_and_not() -> None:
    caps = GVisorBackend(Settings.load()).capabilities()
    assert caps.walls == (WALL_GVISOR,) and not caps.layer2 and not caps.live_update
    text = " ".join(caps.notes)
    for needle in ("One wall", "not a second wall", "Landlock", "seccomp", "OOM", "statx", "nr_inodes", "update"):
        assert needle in text, needle
    assert GVisorBackend.layer2_mode == "gvisor"


def test_update_limits_is_a_clear_usage_error() -> None:
    backend = GVisorBackend(Settings.load(), api=object())  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="runsc has no `update`"):
        backend.update_limits("cid", memory=1 << 30)
    backend.update_limits("cid")  # nothing asked: nothing to refuse


def _spec(**changes: object) -> bwrap.BwrapSpec:
    base: dict[str, object] = dict(
        command=["sh", "-c", "true"],
        env={"PATH": bwrap.SANDBOX_PATH, "SANDMAN_EXEC_ALLOW": "git:sh"},
        masks=(("/workspace/.env", False), ("/workspace/secrets", True)),
        read_only=("/workspace/.git/hooks",),
        pinned=("/workspace/.git",),
        env_file="/run/sandman/env/abc.env",
        tmp_source="/tmp/.sandman-exec-1",
        home_source="/home/agent/.sandman-exec-1",
    )
    base.update(changes)
    return bwrap.BwrapSpec(**base)  # type: ignore[arg-type]


def test_the_plan_is_the_same_spec_as_bwraps() -> None:
    plan = bwrap.supervisor_plan(_spec(), 1000, 1001, seccomp_bpf=b"\x06\x00\x00\x00\x00\x00\xff\x7f")
    ns = plan["ns"]
    assert isinstance(ns, dict)
    assert plan["guard"] == bwrap.guard_request(_spec())
    assert (ns["uid"], ns["gid"], ns["command"], ns["cwd"]) == (1000, 1001, ["sh", "-c", "true"], "/workspace")
    assert ns["masks"] == [["/workspace/.env", False], ["/workspace/secrets", True]]
    assert ns["env_file"] == "/run/sandman/env/abc.env"
    # bwrap's layout, bound into a root of the exec's own (never the control or env dirs).
    assert ns["skeleton"] == "/run/sandman/skel" and ns["root"].startswith("/run/sandman/roots/")
    assert ns["binds"] == [
        ["/usr", "/usr", False],
        ["/usr/lib/sandman", "/usr/lib/sandman", False],
        ["/etc", "/etc", False],
        ["/etc/hosts", "/etc/hosts", True],
        ["/etc/hostname", "/etc/hostname", True],
        ["/etc/resolv.conf", "/etc/resolv.conf", True],
        ["/sys", "/sys", False],
        ["/dev", "/dev", False],
        ["/dev/pts", "/dev/pts", False],
        ["/tmp/.sandman-exec-1", "/tmp", False],
        ["/home/agent/.sandman-exec-1", "/home/agent", False],
        ["/workspace", "/workspace", False],
        ["/opt/sandman/tools", "/opt/sandman/tools", True],
        ["/run/sandman/upcall", "/run/sandman/upcall", True],
    ]
    assert not any(b[0].startswith(("/run/sandman/control", "/run/sandman/env")) for b in ns["binds"])
    assert base64.b64decode(ns["seccomp"]) == b"\x06\x00\x00\x00\x00\x00\xff\x7f"
    # No Landlock in gVisor: the allowlist is never half-applied by the shim.
    assert "SANDMAN_EXEC_ALLOW" not in ns["env"]
    assert ns["env"]["SANDMAN_GUARD"] == bwrap.GUARD_PLACEHOLDER
    assert "argv" not in plan  # no bwrap: the supervisor refuses a mixed request


def test_no_guard_without_guarded_paths() -> None:
    plan = bwrap.supervisor_plan(_spec(masks=(), read_only=(), pinned=()), 1000, 1000)
    assert "SANDMAN_GUARD" not in plan["ns"]["env"]  # type: ignore[index]


def test_layer2_request_by_mode() -> None:
    ws = Workspace(Path("/srv/ws"), 1000, 1000)
    assert set(layer2_request(_spec(), ws, "bwrap")) == {"argv", "guard"}
    gv = layer2_request(_spec(), ws, "gvisor")
    assert set(gv) == {"ns", "guard"} and len(base64.b64decode(gv["ns"]["seccomp"])) % 8 == 0
    argv = launcher_argv(_spec(), ws, "gvisor")
    assert argv[5:8] == ["/usr/lib/sandman/supervisor.py", "--gvisor", "--launch"]
    assert json.loads(argv[8])["ns"]["uid"] == 1000
    assert "--gvisor" not in launcher_argv(_spec())


def test_the_exec_filter_has_no_relaxation() -> None:
    """What the supervisor loads on every command: Docker-default-like, no userns, no mount."""
    names = {n for rule in seccomp.exec_profile(False)["syscalls"] for n in rule["names"]}
    assert not names & {"mount", "umount2", "pivot_root", "unshare", "setns"}
    newuser = [r for r in seccomp.exec_profile(False)["syscalls"] if "clone" in r["names"]]
    assert all(a["valueTwo"] == 0 for r in newuser for a in r["args"])  # no CLONE_NEW* at all
    assert "memfd_create" not in {n for r in seccomp.exec_profile(True)["syscalls"] for n in r["names"]}


def test_allowlist_is_advisory_on_gvisor() -> None:
    policy = load_policy().model_copy(update={"commands": load_policy().commands.model_copy(update={"allow": ["git"]})})
    (warning,) = enforce.advisory_warnings(policy, landlock=False)
    assert "gVisor has no Landlock" in warning and "advisory" in warning
    assert enforce.advisory_warnings(load_policy(), landlock=False) == []
