"""Running the tool calls of an assistant turn: validated, bounded in time and output, never raising.

    executor = ToolExecutor(max_workers=64, timeout_s=30.0, max_output_chars=8192)
    results = await executor.run(calls, toolset)     # one ToolResult per call, in call order
    ...
    executor.close()

Every call ends in a `ToolResult` with a status (ok, invalid_arguments, unknown_tool, error, timeout) and
text the model can act on; a failing tool is data for the rollout, never an exception that ends it.

Async tools are awaited on the caller's event loop. Sync tools run on one thread pool of `max_workers`
threads shared by every rollout (the trainer sizes it to max_concurrent_rollouts), so a slow tool never
blocks the event loop or the other rollouts. By default the calls of one turn run one after another, in the
order the model wrote them (a later call may depend on an earlier one's side effects); `parallel=True` runs
them concurrently, results still in call order.

Timeouts. An async tool that runs past its timeout is cancelled. A sync tool cannot be: Python has no way to
stop a thread. The rollout still gets its timeout result on time, and the thread is abandoned: it keeps its
pool slot until the function returns, and `hung_threads` counts such threads. The threads are daemons
(tools/threads.py), so a tool that never returns does not hold the process open at exit. Because the pool
never grows past `max_workers`, hung tools can slow tool calls down but cannot exhaust the process; the
timeout covers the wait for a free thread too, so a pool full of hung threads shows up as timeouts ("no free
worker thread"), not as a stalled run. Code that may truly hang belongs in a sandbox process, which can be
killed. Whatever a sync tool raises (KeyboardInterrupt and SystemExit included) is its error result.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import difflib
import json
import threading
import time
from collections.abc import Sequence
from typing import Any

import anyio

from tools.calls import ToolCall, ToolResult, ToolStatus
from tools.errors import InvalidToolArguments
from tools.parsers.json_calls import MAX_JSON_DEPTH
from tools.schema import Tool
from tools.threads import DaemonThreadPool
from tools.toolset import Toolset
from tools.validation import bind_arguments, value_depth


class _ToolRaised(Exception):
    """Carries what a sync tool raised out of the thread, so a KeyboardInterrupt of the tool's own is not
    taken for the caller's."""

    def __init__(self, exception: BaseException) -> None:
        super().__init__(exception)
        self.exception = exception


class ToolExecutor:
    """Runs tool calls with argument validation, per-call timeouts and an output cap.

    Args:
        max_workers: Threads for sync tools, shared by every rollout using this executor.
        timeout_s: Per-call timeout in seconds (a tool's own `timeout_s` overrides it); None for no timeout.
        max_output_chars: Longest tool output the model reads; longer output keeps its head and tail with a
            marker saying how much was cut. A tool's own `max_output_chars` overrides it; None for no cap.
        parallel: Run the calls of one turn concurrently instead of in order.
        infrastructure_errors: Exception types that mean the infrastructure failed, not the model (e.g.
            sandboxes.SandboxError); their results, and timeouts, are flagged `infrastructure`.
    """

    def __init__(
        self,
        *,
        max_workers: int = 512,
        timeout_s: float | None = 60.0,
        max_output_chars: int | None = 16_384,
        parallel: bool = False,
        infrastructure_errors: tuple[type[BaseException], ...] = (),
    ):
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive or None, got {timeout_s}")
        if max_output_chars is not None and max_output_chars < 64:
            raise ValueError(f"max_output_chars must be at least 64 or None, got {max_output_chars}")
        self.max_workers = max_workers
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self.parallel = parallel
        self.infrastructure_errors = infrastructure_errors
        self._pool = DaemonThreadPool(max_workers, name="tool")
        self._lock = threading.Lock()
        self._hung = 0

    @property
    def hung_threads(self) -> int:
        """Sync calls that timed out and whose threads are still running."""
        return self._hung

    async def run(self, calls: Sequence[ToolCall], toolset: Toolset) -> list[ToolResult]:
        """Run the calls of one assistant turn; one result per call, in call order."""
        if not self.parallel or len(calls) < 2:
            return [await self.run_one(call, toolset) for call in calls]
        results: list[ToolResult | None] = [None] * len(calls)

        async def run_at(index: int) -> None:
            results[index] = await self.run_one(calls[index], toolset)

        async with anyio.create_task_group() as group:
            for index in range(len(calls)):
                group.start_soon(run_at, index)
        return [result for result in results if result is not None]

    async def run_one(self, call: ToolCall, toolset: Toolset) -> ToolResult:
        """Run one call; never raises (but for cancellation of the caller)."""
        started = time.perf_counter()
        tool = toolset.get(call.name)
        if tool is None:
            return self._result(
                call, ToolStatus.UNKNOWN_TOOL, _unknown_tool_message(call.name, toolset), started
            )
        if value_depth(call.arguments) > MAX_JSON_DEPTH:  # parsers cap it; a call built in code may not
            message = (
                f"Error: the arguments are nested more than {MAX_JSON_DEPTH} levels deep; pass flatter values"
            )
            return self._result(call, ToolStatus.INVALID_ARGUMENTS, message, started)
        try:
            kwargs = bind_arguments(tool, call.arguments)
        except InvalidToolArguments as exc:
            return self._result(call, ToolStatus.INVALID_ARGUMENTS, f"Error: {exc}", started)

        timeout_s = tool.timeout_s if tool.timeout_s is not None else self.timeout_s
        try:
            if tool.is_async:
                outcome = await _await_within(tool.fn(**kwargs), timeout_s)
            else:
                outcome = await self._run_in_thread(tool, kwargs, timeout_s)
        except _ToolRaised as raised:  # a sync tool's exception, whatever it is (KeyboardInterrupt too)
            return self._error(call, raised.exception, started, tool)
        except (Exception, SystemExit) as exc:  # SystemExit: a tool calling sys.exit() must not end the run
            return self._error(call, exc, started, tool)
        if isinstance(outcome, _TimedOut):
            message = outcome.message(tool.name, timeout_s)
            return self._result(call, ToolStatus.TIMEOUT, message, started, tool, infrastructure=True)
        return self._result(call, ToolStatus.OK, render_output(outcome), started, tool)

    def _error(self, call: ToolCall, exc: BaseException, started: float, tool: Tool) -> ToolResult:
        message = f"Error: {type(exc).__name__}: {exc}"
        infrastructure = isinstance(exc, self.infrastructure_errors)
        return self._result(call, ToolStatus.ERROR, message, started, tool, exc, infrastructure)

    def close(self) -> None:
        """Stop the thread pool: queued calls are dropped, running (maybe hung) threads are not waited for."""
        self._pool.shutdown()

    def __enter__(self) -> ToolExecutor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- internals -----------------------------------------------------------------------------------

    async def _run_in_thread(self, tool: Tool, kwargs: dict[str, Any], timeout_s: float | None) -> Any:
        running = threading.Event()

        def call() -> Any:
            running.set()
            return tool.fn(**kwargs)

        future = self._pool.submit(call)
        with anyio.move_on_after(timeout_s) as scope:
            try:
                return await asyncio.wrap_future(future)
            except BaseException as exc:
                if future.done() and not future.cancelled() and future.exception() is exc:
                    raise _ToolRaised(exc) from exc
                raise
        if not scope.cancelled_caught:  # cancelled from outside: not our timeout
            raise anyio.get_cancelled_exc_class()
        if future.cancel():  # still queued: it will never run
            return _TimedOut(queued=True, busy_threads=self.max_workers)
        self._mark_hung(future)
        return _TimedOut(queued=not running.is_set(), busy_threads=self.max_workers)

    def _mark_hung(self, future: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._hung += 1

        def released(_: concurrent.futures.Future[Any]) -> None:
            with self._lock:
                self._hung -= 1

        future.add_done_callback(released)

    def _result(
        self,
        call: ToolCall,
        status: ToolStatus,
        content: str,
        started: float,
        tool: Tool | None = None,
        error: BaseException | None = None,
        infrastructure: bool = False,
    ) -> ToolResult:
        cap = tool.max_output_chars if tool is not None and tool.max_output_chars is not None else None
        cap = cap if cap is not None else self.max_output_chars
        content, truncated = truncate(content, cap)
        error_type = type(error).__name__ if error is not None else None
        latency_s = time.perf_counter() - started
        return ToolResult(call, status, content, latency_s, truncated, error_type, infrastructure)


class _TimedOut:
    def __init__(self, *, queued: bool, busy_threads: int = 0):
        self.queued = queued
        self.busy_threads = busy_threads

    def message(self, tool: str, timeout_s: float | None) -> str:
        if self.queued:
            return (
                f"Error: tool '{tool}' timed out after {timeout_s:g} s waiting for a free worker thread "
                f"(all {self.busy_threads} are busy)"
            )
        return f"Error: tool '{tool}' timed out after {timeout_s:g} s"


async def _await_within(awaitable: Any, timeout_s: float | None) -> Any:
    with anyio.move_on_after(timeout_s) as scope:
        return await awaitable
    if not scope.cancelled_caught:
        raise anyio.get_cancelled_exc_class()
    return _TimedOut(queued=False)


def render_output(value: Any) -> str:
    """The text the model reads for a tool's return value."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", errors="replace")
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


def truncate(text: str, max_chars: int | None) -> tuple[str, bool]:
    """Cut `text` to at most `max_chars`, keeping head and tail around a marker saying how much went."""
    if max_chars is None or len(text) <= max_chars:
        return text, False
    # The marker's own length depends on the count it prints; reserve room for the widest count.
    marker_room = len(f"\n[... {len(text)} characters truncated ...]\n")
    keep = max(max_chars - marker_room, 0)
    head, tail = keep - keep // 3, keep // 3
    dropped = len(text) - head - tail
    marker = f"\n[... {dropped} characters truncated ...]\n"
    return f"{text[:head]}{marker}{text[len(text) - tail :] if tail else ''}", True


def _unknown_tool_message(name: str, toolset: Toolset) -> str:
    available = toolset.names()
    if not available:
        return f"Error: there is no tool named '{name}'; no tools are available here"
    close = difflib.get_close_matches(name, available, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return f"Error: there is no tool named '{name}'.{hint} Available tools: {', '.join(available)}"
