"""Layer 1: the one function that decides the container's hardening, pinned on its exact output."""

from __future__ import annotations

import pytest

from sandman import __version__
from sandman.backends.base import ContainerSpec
from sandman.backends.docker import container_kwargs
from sandman.policy import Resources, Runtime


def spec(**changes: object) -> ContainerSpec:
    base: dict[str, object] = dict(
        image="sandman/base:abc",
        command=["/usr/bin/tini", "--", "bwrap", "true"],
        session_id="sm-123",
        campaign="demo",
        workspace="/home/u/proj",
        runtime_dir="/run/user/1000/sandman/sm-123",
        uid=1000,
        gid=1000,
        resources=Resources(
            cpus=1.5,
            memory="1g",
            pids=256,
            tmpfs_size="64m",
            tmpfs_inodes=4096,
            max_file_size="512m",
            open_files=2048,
        ),
        seccomp_profile='{"defaultAction": "SCMP_ACT_ERRNO"}',
        state_id="0123abcd4567",
        trusted_dir="/run/user/1000/sandman/lib-x",
    )
    base.update(changes)
    return ContainerSpec(**base)  # type: ignore[arg-type]


def test_container_kwargs_exact_output() -> None:
    assert container_kwargs(spec()) == {
        "image": "sandman/base:abc",
        "command": ["/usr/bin/tini", "--", "bwrap", "true"],
        "user": "1000:1000",
        "environment": {
            "PATH": "/opt/sandman/tools/bin:/usr/local/bin:/usr/bin:/bin",
            "HOME": "/home/agent",
            "LANG": "C.UTF-8",
        },
        "working_dir": "/workspace",
        "labels": {
            "io.sandman.session": "sm-123",
            "io.sandman.campaign": "demo",
            "io.sandman.version": __version__,
            "io.sandman.kind": "sandbox",
            "io.sandman.state": "0123abcd4567",
        },
        "hostname": "sandman",
        "stdin_open": False,
        "tty": False,
        "host_config": {
            "NetworkMode": "none",
            "NanoCpus": 1_500_000_000,
            "Memory": 1 << 30,
            "MemorySwap": 1 << 30,
            "PidsLimit": 256,
            "ReadonlyRootfs": True,
            "Tmpfs": {
                "/tmp": f"rw,nosuid,nodev,size={64 << 20},nr_inodes=4096,mode=1777",
                "/home/agent": f"rw,nosuid,nodev,size={64 << 20},nr_inodes=4096,mode=1777",
            },
            "CapDrop": ["ALL"],
            "SecurityOpt": ["no-new-privileges", 'seccomp={"defaultAction": "SCMP_ACT_ERRNO"}'],
            "MaskedPaths": [],
            "ReadonlyPaths": [],
            "Ulimits": [
                {"Name": "fsize", "Soft": 512 << 20, "Hard": 512 << 20},
                {"Name": "nofile", "Soft": 2048, "Hard": 2048},
                {"Name": "core", "Soft": 0, "Hard": 0},
                {"Name": "msgqueue", "Soft": 0, "Hard": 0},
            ],
            "LogConfig": {"Type": "json-file", "Config": {"max-size": "10m", "max-file": "2"}},
            "Mounts": [
                {"Target": "/workspace", "Source": "/home/u/proj", "Type": "bind", "ReadOnly": False},
                # The host's runtime dir is read-only inside, but for the supervisor's socket dir;
                # sandman's own programs come from the host, read-only, over the image's copy.
                {
                    "Target": "/run/sandman",
                    "Source": "/run/user/1000/sandman/sm-123",
                    "Type": "bind",
                    "ReadOnly": True,
                },
                {
                    "Target": "/run/sandman/control",
                    "Source": "/run/user/1000/sandman/sm-123/control",
                    "Type": "bind",
                    "ReadOnly": False,
                },
                {
                    "Target": "/usr/lib/sandman",
                    "Source": "/run/user/1000/sandman/lib-x",
                    "Type": "bind",
                    "ReadOnly": True,
                },
            ],
            "IpcMode": "private",
            "Runtime": "runc",
        },
    }


def test_uid_zero_is_refused_because_proc_is_unmasked() -> None:
    with pytest.raises(ValueError, match="never runs as uid 0"):
        container_kwargs(spec(uid=0))


def test_gvisor_runtime_is_passed_through() -> None:
    assert container_kwargs(spec(runtime=Runtime.RUNSC))["host_config"]["Runtime"] == "runsc"


def test_tmpfs_must_stay_below_half_the_memory() -> None:
    with pytest.raises(ValueError, match="tmpfs_size"):
        Resources(memory="128m", tmpfs_size="64m")  # /tmp and HOME full: all of the memory
    Resources(memory="128m", tmpfs_size="63m")
