"""The controller's wire format, shared by the controller and its stdlib-only client.

A request is one JSON line. The controller answers with frames: one type byte, a 4-byte
big-endian length, the payload. The client may send ``cancel <signum>`` lines; closing its end
also cancels (so a killed CLI never leaves a sandbox behind).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
from pathlib import Path
from typing import Any

import sandman

STDOUT, STDERR, PROGRESS, RESULT, ERROR = b"o", b"e", b"p", b"r", b"x"
HEADER = struct.Struct(">cI")
MAX_REQUEST = 1 << 20
# What the controller's settings depend on: a different value means a different controller.
_ENV_KEYS = ("DOCKER_HOST", "HOME", "XDG_CONFIG_HOME", "XDG_STATE_HOME", "XDG_RUNTIME_DIR")


def runtime_root() -> Path:
    """Mirror of Settings.runtime_dir's default, computed without importing pydantic."""
    explicit = os.environ.get("SANDMAN_RUNTIME_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "sandman" if xdg else Path("/tmp") / f"sandman-{os.getuid()}"


def controller_key() -> str:
    """Identifies a controller compatible with this client: same code, same environment."""
    package = Path(sandman.__file__).parent
    # Every module of the package, subpackages included: a controller running older code of any
    # layer is not this client's (about 70 files: well under a millisecond).
    stamp = max(
        (
            os.stat(os.path.join(root, name)).st_mtime_ns
            for root, _dirs, files in os.walk(package)
            for name in files
            if name.endswith(".py")
        ),
        default=0,
    )
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("SANDMAN_") or k in _ENV_KEYS)
    h = hashlib.sha256(f"{sandman.__version__}\0{package}\0{stamp}\0{os.getuid()}".encode())
    h.update(json.dumps(env).encode())
    return h.hexdigest()[:16]


def socket_path() -> Path:
    return runtime_root() / f"controller-{controller_key()}.sock"


def send_frame(sock: socket.socket, kind: bytes, payload: bytes) -> None:
    sock.sendall(HEADER.pack(kind, len(payload)) + payload)


def send_json(sock: socket.socket, kind: bytes, data: Any) -> None:
    send_frame(sock, kind, json.dumps(data).encode())


def recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ConnectionError("the other end closed the connection")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket) -> tuple[bytes, bytes]:
    kind, length = HEADER.unpack(recv_exact(sock, HEADER.size))
    return kind, recv_exact(sock, length)
