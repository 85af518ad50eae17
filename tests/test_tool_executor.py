"""The tool executor: statuses, order, timeouts, output caps, and 1,000 concurrent calls of every kind."""

from __future__ import annotations

import math
import random
import sys
import threading
import time

import anyio
import pytest

from tools import Tool, ToolCall, ToolExecutor, ToolResult, Toolset, ToolStats, ToolStatus, truncate

pytestmark = pytest.mark.anyio

RELEASE = threading.Event()  # lets hung sync tools finish when a test is done with them


def fast_sync(x: int) -> int:
    """Echo a number.

    Args:
        x: The number.
    """
    return x


def slow_sync(x: int) -> int:
    """Echo a number after a short wait.

    Args:
        x: The number.
    """
    time.sleep(0.02)
    return x


def raising_sync(x: int) -> int:
    """Fail.

    Args:
        x: The number.
    """
    raise ValueError(f"bad value {x}")


def hanging_sync(x: int) -> int:
    """Block until released.

    Args:
        x: The number.
    """
    RELEASE.wait(timeout=30)
    return x


async def fast_async(x: int) -> int:
    """Echo a number.

    Args:
        x: The number.
    """
    return x


async def slow_async(x: int) -> int:
    """Echo a number after a short wait.

    Args:
        x: The number.
    """
    await anyio.sleep(0.02)
    return x


async def raising_async(x: int) -> int:
    """Fail.

    Args:
        x: The number.
    """
    raise KeyError(x)


async def hanging_async(x: int) -> int:
    """Never return.

    Args:
        x: The number.
    """
    await anyio.sleep_forever()
    return x


def exiting_sync(x: int) -> int:
    """Exit the interpreter.

    Args:
        x: The number.
    """
    sys.exit(x)


TOOLSET = Toolset(
    [fast_sync, slow_sync, raising_sync, hanging_sync, fast_async, slow_async, raising_async, hanging_async]
)
EXPECTED = {
    "fast_sync": ToolStatus.OK,
    "slow_sync": ToolStatus.OK,
    "raising_sync": ToolStatus.ERROR,
    "hanging_sync": ToolStatus.TIMEOUT,
    "fast_async": ToolStatus.OK,
    "slow_async": ToolStatus.OK,
    "raising_async": ToolStatus.ERROR,
    "hanging_async": ToolStatus.TIMEOUT,
    "no_such_tool": ToolStatus.UNKNOWN_TOOL,
    "bad_arguments": ToolStatus.INVALID_ARGUMENTS,
}


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(autouse=True)
def release_hung_threads():
    RELEASE.clear()
    yield
    RELEASE.set()


def make_call(kind: str, x: int) -> ToolCall:
    if kind == "bad_arguments":
        return ToolCall("fast_sync", {"x": "not a number"}, id=f"{kind}-{x}")
    return ToolCall(kind, {"x": x}, id=f"{kind}-{x}")


def check(result: ToolResult, call: ToolCall) -> None:
    kind = call.id.rsplit("-", 1)[0]
    x = int(call.id.rsplit("-", 1)[1])
    assert result.call is call
    assert result.status is EXPECTED[kind], (kind, result)
    assert result.latency_s >= 0
    if result.status is ToolStatus.OK:
        assert result.content == str(x)
    elif kind.startswith("raising_sync"):
        assert result.content == f"Error: ValueError: bad value {x}"
    elif kind.startswith("raising_async"):
        assert result.content == f"Error: KeyError: {x}"
    elif result.status is ToolStatus.TIMEOUT:
        assert result.content == f"Error: tool '{kind}' timed out after 0.5 s"
    elif result.status is ToolStatus.UNKNOWN_TOOL:
        assert "there is no tool named 'no_such_tool'" in result.content
        assert "Available tools: fast_sync, slow_sync" in result.content
    else:
        assert result.content.startswith("Error: invalid arguments for tool 'fast_sync': parameter 'x'")


async def test_one_thousand_concurrent_calls_of_every_kind():
    """1,000 calls in 250 concurrent turns (like 250 rollouts); nothing lost, nothing out of order."""
    rng = random.Random(0)
    kinds = list(EXPECTED)
    turns = [[make_call(rng.choice(kinds), 4 * t + i) for i in range(4)] for t in range(250)]
    assert sum(len(turn) for turn in turns) == 1000
    stats = ToolStats()
    outcomes: list[list[ToolResult]] = [[] for _ in turns]
    # Only the hanging tools have the short timeout: on a loaded 2-core CI machine a 20 ms tool, started
    # among 512 threads, once came back later than 0.5 s after its submission.
    hanging = {"hanging_sync", "hanging_async"}
    toolset = Toolset(
        [Tool.from_callable(t.fn, timeout_s=0.5) if t.name in hanging else t for t in TOOLSET.values()]
    )
    with ToolExecutor(max_workers=512, timeout_s=10.0) as executor:

        async def rollout(index: int) -> None:
            outcomes[index] = await executor.run(turns[index], toolset)
            stats.record(outcomes[index])

        async with anyio.create_task_group() as group:
            for index in range(len(turns)):
                group.start_soon(rollout, index)
        hung = executor.hung_threads
        RELEASE.set()

    num_hanging_sync = sum(call.name == "hanging_sync" for turn in turns for call in turn)
    assert hung == num_hanging_sync > 0
    for turn, results in zip(turns, outcomes, strict=True):
        assert len(results) == len(turn)
        for call, result in zip(turn, results, strict=True):
            check(result, call)

    summary = stats.summary()
    calls = [call for turn in turns for call in turn]
    failures = sum(EXPECTED[c.id.rsplit("-", 1)[0]] is not ToolStatus.OK for c in calls)
    assert summary["tools/failure_frequency"] == pytest.approx(failures / 1000)
    assert summary["tools/unknown_name_count"] == sum(c.name == "no_such_tool" for c in calls)
    assert summary["tools/timeout_count"] == sum(c.name.startswith("hanging") for c in calls)
    assert summary["tools/parallel_calls_mean"] == 4
    assert summary["tools/hanging_async/call_count"] == summary["tools/hanging_async/failure_count"]
    assert summary["tools/fast_sync/call_count"] == sum(c.name == "fast_sync" for c in calls)


async def test_a_turn_runs_its_calls_in_order_by_default():
    log: list[int] = []

    async def record(x: int) -> int:
        """Record a number.

        Args:
            x: The number.
        """
        await anyio.sleep(0.01 * (5 - x))  # later calls would finish first if they ran concurrently
        log.append(x)
        return x

    with ToolExecutor(max_workers=4) as executor:
        results = await executor.run([ToolCall("record", {"x": x}) for x in range(5)], Toolset([record]))
    assert log == [0, 1, 2, 3, 4]
    assert [r.content for r in results] == ["0", "1", "2", "3", "4"]


async def test_parallel_turn_runs_calls_concurrently_results_in_call_order():
    # Each call waits for the other: this only completes when both run at the same time.
    first, second = anyio.Event(), anyio.Event()

    async def ping(x: int) -> int:
        """Meet the other call.

        Args:
            x: Which side.
        """
        (first if x == 0 else second).set()
        await (second if x == 0 else first).wait()
        return x

    calls = [ToolCall("ping", {"x": 0}), ToolCall("ping", {"x": 1})]
    with ToolExecutor(timeout_s=2.0, parallel=True) as executor:
        results = await executor.run(calls, Toolset([ping]))
    assert [r.status for r in results] == [ToolStatus.OK, ToolStatus.OK]
    assert [r.call for r in results] == calls
    with ToolExecutor(timeout_s=0.2, parallel=False) as executor:
        first, second = anyio.Event(), anyio.Event()
        results = await executor.run(calls, Toolset([ping]))
    assert results[0].status is ToolStatus.TIMEOUT


async def test_full_pool_of_hung_threads_times_out_queued_calls_and_recovers():
    toolset = Toolset([hanging_sync, fast_sync])
    with ToolExecutor(max_workers=2, timeout_s=0.2) as executor:
        hung = await executor.run([make_call("hanging_sync", 1), make_call("hanging_sync", 2)], toolset)
        assert [r.status for r in hung] == [ToolStatus.TIMEOUT] * 2
        assert executor.hung_threads == 2
        queued = await executor.run_one(make_call("fast_sync", 3), toolset)
        assert queued.status is ToolStatus.TIMEOUT
        assert "waiting for a free worker thread (all 2 are busy)" in queued.content
        RELEASE.set()
        with anyio.fail_after(5):
            while executor.hung_threads:
                await anyio.sleep(0.01)
        recovered = await executor.run_one(make_call("fast_sync", 4), toolset)
        assert recovered.status is ToolStatus.OK


async def test_per_tool_timeout_and_output_cap_override_the_executor():
    def shout(n: int) -> str:
        """Return a long text.

        Args:
            n: Its length.
        """
        return "".join(chr(ord("a") + i % 26) for i in range(n))

    toolset = Toolset(
        [
            Tool.from_callable(shout, max_output_chars=100),
            Tool.from_callable(hanging_async, timeout_s=0.05),
        ]
    )
    with ToolExecutor(timeout_s=30.0, max_output_chars=1000) as executor:
        capped = await executor.run_one(ToolCall("shout", {"n": 5000}), toolset)
        timed_out = await executor.run_one(ToolCall("hanging_async", {"x": 1}), toolset)
    assert capped.truncated and len(capped.content) <= 100
    assert capped.content.startswith("abcdef")
    assert capped.content.endswith(shout(5000)[-10:])
    assert "characters truncated" in capped.content
    assert timed_out.status is ToolStatus.TIMEOUT and "after 0.05 s" in timed_out.content


async def test_a_tool_calling_sys_exit_is_an_error_not_the_end_of_the_run():
    with ToolExecutor() as executor:
        result = await executor.run_one(ToolCall("exiting_sync", {"x": 3}), Toolset([exiting_sync]))
    assert result.status is ToolStatus.ERROR
    assert result.content == "Error: SystemExit: 3"


async def test_cancelling_a_rollout_does_not_wait_for_its_sync_tool():
    with ToolExecutor(timeout_s=None) as executor:
        with anyio.move_on_after(0.1) as scope:
            await executor.run_one(make_call("hanging_sync", 1), TOOLSET)
        assert scope.cancelled_caught
        assert executor.hung_threads == 0  # a cancelled caller is not a timeout


async def test_return_values_are_rendered_as_text():
    def structured() -> dict:
        """Return a structure."""
        return {"a": [1, 2], "é": None}

    def raw() -> bytes:
        """Return bytes that are not all UTF-8."""
        return b"ok\xff"

    with ToolExecutor() as executor:
        results = await executor.run([ToolCall("structured"), ToolCall("raw")], Toolset([structured, raw]))
    assert results[0].content == '{"a": [1, 2], "é": null}'
    assert results[1].content == "ok\ufffd"


@pytest.mark.parametrize("length", [0, 99, 100, 101, 1000, 123_456])
def test_truncate_keeps_within_the_cap_and_marks_the_cut(length):
    text = "x" * length
    out, truncated = truncate(text, 100)
    assert truncated == (length > 100)
    assert len(out) <= 100
    if truncated:
        kept = out.count("x")
        dropped = int(out.split("[... ")[1].split(" ")[0])
        assert kept + dropped == length


def test_stats_on_known_results():
    def result(name: str, status: ToolStatus, latency_s: float) -> ToolResult:
        return ToolResult(ToolCall(name), status, "", latency_s)

    stats = ToolStats()
    assert math.isnan(stats.summary()["tools/failure_frequency"])
    stats.record([result("a", ToolStatus.OK, 1.0), result("a", ToolStatus.ERROR, 3.0)])
    stats.record([result("b", ToolStatus.TIMEOUT, 2.0)])
    stats.record([result("zzz", ToolStatus.UNKNOWN_TOOL, 0.0)])
    stats.record([])
    summary = stats.summary(hung_threads=1)
    assert summary["tools/a/call_count"] == 2
    assert summary["tools/a/failure_count"] == 1
    assert summary["tools/a/latency_s"] == 2.0
    assert summary["tools/b/failure_count"] == 1
    assert "tools/zzz/call_count" not in summary
    assert summary["tools/unknown_name_count"] == 1
    assert summary["tools/timeout_count"] == 1
    assert summary["tools/latency_s"] == 1.5
    assert summary["tools/parallel_calls_mean"] == 4 / 3
    assert summary["tools/failure_frequency"] == 3 / 4
    assert summary["tools/hung_threads"] == 1
    stats.reset()
    assert stats.summary()["tools/unknown_name_count"] == 0


def interrupting_sync(x: int) -> int:
    """Raise KeyboardInterrupt from the tool's own code.

    Args:
        x: Ignored.
    """
    raise KeyboardInterrupt("the tool's own")


async def test_a_keyboard_interrupt_raised_by_a_sync_tool_is_its_error_result():
    with ToolExecutor() as executor:
        result = await executor.run_one(ToolCall("interrupting_sync", {"x": 1}), Toolset([interrupting_sync]))
    assert result.status is ToolStatus.ERROR and "KeyboardInterrupt" in result.content


NEVER_RETURNS = """
import threading, time, anyio
from tools import ToolCall, ToolExecutor, Toolset

def stuck(x: int) -> int:
    '''Never return.

    Args:
        x: Ignored.
    '''
    threading.Event().wait()

async def main():
    with ToolExecutor(timeout_s=0.2) as executor:
        result = await executor.run_one(ToolCall("stuck", {"x": 1}), Toolset([stuck]))
    print(result.status.value, executor.hung_threads, flush=True)

anyio.run(main)
"""


def test_a_sync_tool_that_never_returns_does_not_hold_the_process_at_exit():
    import subprocess

    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", NEVER_RETURNS], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["timeout", "1"]
    assert time.monotonic() - started < 30  # it exited (it used to wait on the stuck thread forever)
