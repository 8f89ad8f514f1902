"""Warm pools: N fresh, never-used sandboxes kept ready for one campaign.

Acquiring takes the oldest ready sandbox out of the pool (an atomic claim in the state store, so
any process can acquire) and a replacement starts in the background; a released sandbox is
destroyed, never reused. Pooled sandboxes are owned by the pool's process: if it dies, the next
reconcile reaps them.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from sandman.backends.image import load_campaign
from sandman.core.runner import Runner, process_start
from sandman.core.session import Sandbox, _as_policy
from sandman.core.state import SessionState, StateStore
from sandman.core.workspace import resolve_workspace
from sandman.errors import SandmanError, UsageError
from sandman.policy import Policy, enforce
from sandman.settings import Settings


def pool_key(workspace: Path, campaign: str, policy: Policy, backend: str = "docker") -> str:
    key = f"{workspace}|{campaign}|{policy.digest()}"
    return key if backend == "docker" else f"{key}|{backend}"


class Pool:
    """``with Pool(workspace=ws, size=2) as pool: sb = pool.acquire()``."""

    def __init__(
        self,
        workspace: str | os.PathLike[str],
        size: int,
        *,
        policy: Policy | str | os.PathLike[str] | None = None,
        campaign: str | None = None,
        settings: Settings | None = None,
        backend: str | None = None,
    ) -> None:
        if size < 1:
            raise UsageError("a pool needs a size of at least 1")
        self.size = size
        self.settings = settings or Settings.load()
        self._runner = Runner(self.settings, backend=backend)
        self.workspace = resolve_workspace(workspace)
        self.campaign = campaign
        self.policy = (
            self._runner.policy(None, self.workspace.path)
            if policy is None
            else _as_policy(self._runner, policy, self.workspace.path)
        )
        camp = load_campaign(self.workspace.path, campaign)
        self.key = pool_key(self.workspace.path, camp.name, self.policy, self._runner.backend_name)
        self.state = StateStore(self.settings.state_dir, scrub=enforce.text_scrubber(self.settings))
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._errors: list[str] = []
        self._thread: threading.Thread | None = None

    def ready(self) -> int:
        return sum(
            1
            for r in self.state.sessions(live_only=True, kind="pool")
            if r.pool == self.key and r.state == SessionState.POOLED.value
        )

    def start(self, wait: bool = True, timeout: float = 120.0) -> Pool:
        """Fill the pool and keep it full in a background thread."""
        self._thread = threading.Thread(target=self._maintain, name="sandman-pool", daemon=True)
        self._thread.start()
        if wait:
            deadline = time.monotonic() + timeout
            while self.ready() < self.size and time.monotonic() < deadline:
                if self._errors:
                    raise SandmanError(f"the pool could not start a sandbox: {self._errors[-1]}")
                time.sleep(0.05)
        return self

    def _maintain(self) -> None:
        while not self._stop.is_set():
            if self.ready() < self.size:
                try:
                    self._add_one()
                    continue
                except SandmanError as exc:
                    self._errors.append(str(exc))
                    self._stop.wait(2.0)  # back off; the cause is in pool.errors
            self._wake.wait(0.5)
            self._wake.clear()

    def _add_one(self) -> None:
        sb = Sandbox(
            self.workspace.path,
            policy=self.policy,
            campaign=self.campaign,
            settings=self.settings,
            _runner=self._runner,
            kind="pool",
        )
        self.state.update_session(sb.id, state=SessionState.POOLED.value, pool=self.key)
        self.state.audit(sb.id, "pool.add", pool=self.key)

    @property
    def errors(self) -> list[str]:
        return list(self._errors)

    def acquire(self, timeout: float = 60.0, owned: bool = True) -> Sandbox:
        """Take a ready sandbox out of the pool (waiting up to ``timeout`` for one)."""
        return acquire(self.key, self.settings, timeout=timeout, owned=owned, wake=self._wake, runner=self._runner)

    def release(self, sandbox: Sandbox) -> None:
        """Destroy a sandbox taken from the pool; it is never reused."""
        sandbox.close()

    def close(self) -> None:
        """Stop refilling and destroy every sandbox still waiting in the pool."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        for rec in self.state.sessions(live_only=True, kind="pool"):
            if rec.pool == self.key and rec.state == SessionState.POOLED.value:
                Sandbox(settings=self.settings, _record=rec, _runner=self._runner)._teardown(
                    rec, SessionState.STOPPED, "pool closed"
                )

    def __enter__(self) -> Pool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def acquire(
    key: str,
    settings: Settings,
    *,
    timeout: float = 60.0,
    owned: bool = True,
    wake: threading.Event | None = None,
    runner: Runner | None = None,
) -> Sandbox:
    """Claim a pooled sandbox by pool key, from any process."""
    store = StateStore(settings.state_dir)
    deadline = time.monotonic() + timeout
    pid = os.getpid() if owned else None
    start = process_start(os.getpid()) if owned else None
    while True:
        rec = store.claim_pooled(key, pid, start)
        if wake is not None:
            wake.set()
        if rec is not None:
            store.audit(rec.id, "pool.acquire", pool=key)
            return Sandbox(settings=settings, _record=rec, _runner=runner)
        if time.monotonic() >= deadline:
            raise SandmanError(f"no sandbox ready in pool within {timeout:.0f}s: is `sandman pool start` running?")
        time.sleep(0.02)
