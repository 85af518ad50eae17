"""A bounded pool of daemon threads for sync code that may never return (tools, environment hooks).

    pool = DaemonThreadPool(max_workers=64, name="tool")
    value = await pool.run(function, *args)      # cancelling the caller abandons the thread, at once
    pool.shutdown()                              # queued calls are cancelled; running ones are left

Python cannot stop a thread. `concurrent.futures.ThreadPoolExecutor` and anyio's worker threads are joined
when the interpreter exits, so one call stuck forever holds the whole process open. These threads are
daemons: an abandoned call keeps its thread (and its slot, so the pool stays bounded) until it returns,
and ends with the process. A call that raises anything, KeyboardInterrupt and SystemExit included, hands
that exception to its caller: it is the called code's failure, never the pool's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class DaemonThreadPool:
    """At most `max_workers` daemon threads, started as calls need them and kept for the next."""

    def __init__(self, max_workers: int, name: str = "worker") -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}")
        self.max_workers = max_workers
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0
        self._closed = False

    def submit(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        """Queue a call; its future. Runs in a copy of the caller's context (contextvars)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        context = contextvars.copy_context()
        call = functools.partial(context.run, function, *args, **kwargs)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the {self.name} thread pool is shut down")
            self._jobs.put((future, call))
            if self._idle:
                self._idle -= 1
            elif self._threads < self.max_workers:
                self._threads += 1
                threading.Thread(target=self._work, name=f"{self.name}-{self._threads}", daemon=True).start()
        return future

    async def run(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a call on the pool and await it; cancelling the caller abandons the call."""
        return await asyncio.wrap_future(self.submit(function, *args, **kwargs))

    def shutdown(self) -> None:
        """No more calls: queued ones are cancelled, idle threads end, running ones are left to finish."""
        with self._lock:
            self._closed = True
            threads = self._threads
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        for _ in range(threads):
            self._jobs.put(None)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, call = job
            if future.set_running_or_notify_cancel():
                try:
                    result = call()
                except BaseException as exc:  # the called code's failure, handed to its caller
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            with self._lock:
                self._idle += 1


__all__ = ["DaemonThreadPool"]
