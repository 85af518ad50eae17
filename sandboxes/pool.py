"""A warm pool of sandboxes of one spec, handed out as leases.

    async with SandboxPool(spec, min_idle=8, max_total=128, max_starting=8) as pool:
        async with pool.lease() as sandbox:       # a started, healthy sandbox
            await sandbox.exec("pytest -q")
        # on exit the sandbox is discarded (default) or wiped and kept for the next lease (reuse=True)

A background task keeps `min_idle` sandboxes started ahead of demand, so a rollout rarely waits for a
cold start. `max_total` caps the sandboxes that exist at once (idle, leased and starting), so a burst of
rollouts waits for a free one instead of exhausting the machine; `max_starting` caps how many start at
once, since starting is the expensive part for the engine. A lease hands out only a sandbox that answers
a ping; one that does not is discarded and replaced.

A pool of Docker sandboxes first probes the spec's engines and copies the image to those that lack it
(`placement.prepare`), so a missing image or a dead engine shows at the start, not at the first lease.

Closing the pool (leaving `async with`) stops the filler and closes every sandbox it made, leased ones
included. If the filler cannot start sandboxes (the engine is down), it logs, backs off, and keeps trying;
a lease that then has to start its own sandbox raises the typed start error.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio

from sandboxes import errors, placement
from sandboxes.backends import create_sandbox
from sandboxes.base import Sandbox, SandboxSpec

logger = logging.getLogger(__name__)


# Every place a lease may write: the working directory (the command's cwd), /tmp and /dev/shm.
_WIPE = 'for d in . /tmp /dev/shm; do if [ -d "$d" ]; then find "$d" -mindepth 1 -delete || exit 1; fi; done'


@dataclass
class PoolStats:
    """Counters since the pool opened."""

    started: int = 0
    start_failures: int = 0
    leased: int = 0
    reused: int = 0
    discarded: int = 0
    unhealthy: int = 0


class SandboxPool:
    """Warm sandboxes of one spec (see the module docstring).

    Args:
        spec: What every sandbox of the pool is.
        min_idle: Sandboxes kept started and waiting for a lease.
        max_total: Most sandboxes existing at once, idle, leased and starting together.
        max_starting: Most sandboxes starting at once.
        reuse: After a lease, kill the sandbox's processes, wipe its working directory and keep it,
            instead of discarding it. Faster; isolation between leases is then only as good as the wipe.
        health_timeout_s: How long a sandbox may take to answer the ping before a lease.
    """

    def __init__(
        self,
        spec: SandboxSpec,
        *,
        min_idle: int = 0,
        max_total: int = 64,
        max_starting: int = 8,
        reuse: bool = False,
        health_timeout_s: float = 5.0,
    ):
        if max_total < 1 or max_starting < 1 or min_idle < 0:
            raise errors.InvalidSandboxConfig(
                f"pool sizes must be max_total >= 1, max_starting >= 1, min_idle >= 0; got "
                f"max_total={max_total}, max_starting={max_starting}, min_idle={min_idle}"
            )
        if min_idle > max_total:
            raise errors.InvalidSandboxConfig(f"min_idle ({min_idle}) cannot exceed max_total ({max_total})")
        self.spec = spec
        self.min_idle = min_idle
        self.max_total = max_total
        self.reuse = reuse
        self.health_timeout_s = health_timeout_s
        self.stats = PoolStats()
        self._idle: deque[Sandbox] = deque()
        self._all: set[Sandbox] = set()
        self._reserved = 0  # slots counted in the total: sandboxes existing or being started
        self._starting = 0
        self._start_gate = anyio.Semaphore(max_starting)
        self._changed = anyio.Condition()
        self._task_group: Any = None
        self._closed = False
        self._docker = spec.backend == "docker"

    # --- lifecycle -----------------------------------------------------------------------------------

    async def __aenter__(self) -> SandboxPool:
        if self._docker:  # every engine probed and given the image before the first lease
            await placement.prepare(self.spec)
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        if self.min_idle:
            self._task_group.start_soon(self._keep_warm, name="sandbox-pool-filler")
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop the filler and close every sandbox of the pool. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._task_group is not None:
            self._task_group.cancel_scope.cancel()
            with contextlib.suppress(anyio.get_cancelled_exc_class()):
                await self._task_group.__aexit__(None, None, None)
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as group:
                for sandbox in list(self._all):
                    group.start_soon(sandbox.close)
            if self._docker:
                await placement.settle(self.spec)
        self._all.clear()
        self._idle.clear()

    # --- leases --------------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lease(self) -> AsyncIterator[Sandbox]:
        """A started, healthy sandbox for the duration of the block."""
        sandbox = await self.acquire()
        try:
            yield sandbox
        finally:
            with anyio.CancelScope(shield=True):
                await self.release(sandbox)

    async def acquire(self) -> Sandbox:
        """Take an idle sandbox (checked alive) or start one, waiting while the pool is at max_total."""
        while True:
            self._check_open()
            sandbox = None
            async with self._changed:
                while not self._idle and self._reserved >= self.max_total:
                    await self._changed.wait()
                    self._check_open()
                if self._idle:
                    sandbox = self._idle.popleft()
                    self._changed.notify_all()  # the filler may need to start a replacement
                else:
                    self._reserved += 1
            if sandbox is None:
                sandbox = await self._start_reserved()
            elif not await sandbox.alive(self.health_timeout_s):
                self.stats.unhealthy += 1
                await self._discard(sandbox)
                continue
            self.stats.leased += 1
            return sandbox

    async def release(self, sandbox: Sandbox) -> None:
        """Give a leased sandbox back: wiped and kept when `reuse`, else closed."""
        if self.reuse and not self._closed and await self._wipe(sandbox):
            self.stats.reused += 1
            async with self._changed:
                self._idle.append(sandbox)
                self._changed.notify_all()
            return
        await self._discard(sandbox)

    @property
    def size(self) -> dict[str, int]:
        """Sandboxes by state right now."""
        idle = len(self._idle)
        return {
            "idle": idle,
            "starting": self._starting,
            "leased": self._reserved - idle - self._starting,
            "total": self._reserved,
        }

    # --- internals -----------------------------------------------------------------------------------

    async def _start_reserved(self) -> Sandbox:
        """Start a sandbox in a slot already reserved; on failure the slot is given back."""
        sandbox = create_sandbox(self.spec)
        self._all.add(sandbox)
        self._starting += 1
        try:
            async with self._start_gate:
                await sandbox.start()  # closes the sandbox itself when it fails
        except BaseException:
            self.stats.start_failures += 1
            self._starting -= 1
            self._all.discard(sandbox)
            with anyio.CancelScope(shield=True):
                await self._give_back_slot()
            raise
        self._starting -= 1
        self.stats.started += 1
        return sandbox

    async def _keep_warm(self) -> None:
        backoff_s = 1.0
        while True:
            async with self._changed:
                while len(self._idle) + self._starting >= self.min_idle or self._reserved >= self.max_total:
                    await self._changed.wait()
                self._reserved += 1
            try:
                sandbox = await self._start_reserved()
            except errors.SandboxError as exc:
                logger.warning(
                    "sandbox pool could not start a sandbox (retrying in %.0f s): %s", backoff_s, exc
                )
                await anyio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 30.0)
                continue
            backoff_s = 1.0
            async with self._changed:
                self._idle.append(sandbox)
                self._changed.notify_all()

    async def _wipe(self, sandbox: Sandbox) -> bool:
        """Kill what runs in the sandbox and empty its working directory, /tmp and /dev/shm; False if that
        failed (the sandbox is then discarded, never leased half-wiped)."""
        try:
            await sandbox.kill_all()
            result = await sandbox.exec(_WIPE, timeout_s=30)
        except errors.SandboxError:
            return False
        return result.ok

    async def _discard(self, sandbox: Sandbox) -> None:
        self.stats.discarded += 1
        self._all.discard(sandbox)
        with anyio.CancelScope(shield=True):
            await sandbox.close()
        await self._give_back_slot()

    async def _give_back_slot(self) -> None:
        async with self._changed:
            self._reserved -= 1
            self._changed.notify_all()

    def _check_open(self) -> None:
        if self._closed:
            raise errors.SandboxClosed("the sandbox pool is closed")
