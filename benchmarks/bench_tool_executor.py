"""Benchmark: the executor's overhead per call for a trivial sync and a trivial async tool.

Run:  python benchmarks/bench_tool_executor.py [--calls 20000]

Each figure is calls per second through `ToolExecutor.run` (validation, dispatch, timeout scope, output
rendering and the result record included), for one rollout calling in a loop and for many rollouts at
once sharing one executor, as in training. The tools do nothing, so this is the executor's own cost.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import anyio

from tools import ToolCall, ToolExecutor, Toolset


def add_sync(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


async def add_async(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


async def measure(name: str, calls: int, rollouts: int, executor: ToolExecutor, toolset: Toolset) -> float:
    per_rollout = calls // rollouts
    call = ToolCall(name, {"a": 2, "b": "3"})  # one coercion, as a model's string argument would need

    async def rollout() -> None:
        for _ in range(per_rollout):
            (result,) = await executor.run([call], toolset)
            assert result.ok, result

    started = time.perf_counter()
    async with anyio.create_task_group() as group:
        for _ in range(rollouts):
            group.start_soon(rollout)
    return per_rollout * rollouts / (time.perf_counter() - started)


async def main(calls: int) -> None:
    toolset = Toolset([add_sync, add_async])
    print(
        f"# tool executor overhead ({platform.python_version()}, {os.cpu_count()} cores, {calls} calls each)"
    )
    print(f"{'tool':<10} {'rollouts':>8} {'calls/s':>10} {'us/call':>8}")
    with ToolExecutor(max_workers=512, timeout_s=60.0) as executor:
        await measure("add_sync", 500, 1, executor, toolset)  # warm up threads and caches
        for name in ("add_sync", "add_async"):
            for rollouts in (1, 64, 512):
                rate = await measure(name, calls, rollouts, executor, toolset)
                print(f"{name:<10} {rollouts:>8} {rate:>10,.0f} {1e6 / rate:>8.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=20_000, help="calls per measurement")
    anyio.run(main, parser.parse_args().calls)
