"""Environment instances for rollouts: built once, reset per rollout, closed when discarded.

    pool = EnvironmentPool(routed, threads=threads)  # one per environment of the run
    async with pool.instance() as env:               # an idle instance, or a new one
        prompt = await call_hook(env.reset, threads=threads, **row)   # inside the rollout's own task
        ...
    await pool.close()                               # close() on every instance

Construction and the sync hooks (reset, get_reward, close) run on the loop's daemon threads
(tools.threads.DaemonThreadPool), so a slow environment delays its own rollout, never the event loop; the
rollout's episode_timeout_s abandons a hook that never returns, and such a thread never holds the process
at exit. An instance whose episode raised is discarded (closed), not reused: its state is unknown.
`max_concurrent` (the manifest's) caps live instances.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio

from environments.routing import RoutedEnvironment
from tools.threads import DaemonThreadPool


async def call_hook(hook: Callable[..., Any], *args: Any, threads: DaemonThreadPool, **kwargs: Any) -> Any:
    """Await an async hook, or run a sync one on one of `threads` (cancelling the caller abandons it)."""
    if inspect.iscoroutinefunction(hook):
        return await hook(*args, **kwargs)
    result = await threads.run(hook, *args, **kwargs)
    if inspect.isawaitable(result):  # a sync callable that returned a coroutine
        return await result
    return result


class EnvironmentPool:
    """Reusable instances of one environment."""

    def __init__(self, routed: RoutedEnvironment, *, threads: DaemonThreadPool):
        self.routed = routed
        self._threads = threads
        self._idle: list[Any] = []
        self._live = 0
        cap = routed.manifest.max_concurrent
        self._slots = anyio.Semaphore(cap) if cap else None
        self.created = 0
        self.discarded = 0

    @contextlib.asynccontextmanager
    async def instance(self) -> AsyncIterator[Any]:
        """An instance for one episode; discarded instead of reused if the block raises."""
        if self._slots is not None:
            await self._slots.acquire()
        try:
            env = self._idle.pop() if self._idle else await self._create()
            try:
                yield env
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self._discard(env)
                raise
            self._idle.append(env)
        finally:
            if self._slots is not None:
                self._slots.release()

    async def close(self) -> None:
        """Close every idle instance (leased ones are closed when their episode ends)."""
        idle, self._idle = self._idle, []
        for env in idle:
            await self._discard(env)

    async def _create(self) -> Any:
        env = await self._threads.run(self.routed.factory)
        self.created += 1
        self._live += 1
        return env

    async def _discard(self, env: Any) -> None:
        self.discarded += 1
        self._live -= 1
        close = getattr(env, "close", None)
        if callable(close):
            with contextlib.suppress(Exception):  # a failing close must not hide why the episode ended
                await call_hook(close, threads=self._threads)
