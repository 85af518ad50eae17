"""Benchmark: sandbox start-up, warm acquire, exec round trips, throughput under load, and memory held.

Run:  python benchmarks/bench_sandboxes.py [--backend local|docker|both] [--seconds 5]

Per backend it prints
- cold start: create + start + first answer of one sandbox, p50/p95 over 10 starts;
- warm-pool acquire: a lease from a pool whose sandboxes are already started (health ping included);
- exec round trip: one trivial command (`true`) on an idle sandbox, p50/p95 over 500 calls;
- throughput: trivial commands per second with 1, 16 and 128 sandboxes each running a loop of them,
  with the latency p50 under that load, raw (Sandbox.exec) and as a tool call (ToolExecutor + bash tool);
- memory: what holding 128 idle sandboxes costs the machine (MemAvailable before and after).
Docker is measured only when an engine answers (DOCKER_HOST) and the base image exists.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import anyio

from sandboxes.backends import create_sandbox
from sandboxes.base import SandboxSpec
from sandboxes.pool import SandboxPool
from tools import ToolCall, ToolExecutor
from tools.sandboxed import SandboxTools


def percentiles(samples_s: list[float]) -> str:
    ordered = sorted(samples_s)
    p50 = statistics.median(ordered) * 1e3
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))] * 1e3
    return f"p50 {p50:7.2f} ms  p95 {p95:7.2f} ms"


def mem_available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


async def cold_start(spec: SandboxSpec, count: int = 10) -> list[float]:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        sandbox = await create_sandbox(spec).start()
        times.append(time.perf_counter() - started)
        await sandbox.close()
    return times


async def warm_acquire(spec: SandboxSpec, count: int = 50) -> list[float]:
    times = []
    async with SandboxPool(spec, min_idle=8, max_total=16, reuse=True) as pool:
        with anyio.fail_after(120):
            while pool.size["idle"] < 8:
                await anyio.sleep(0.05)
        for _ in range(count):
            started = time.perf_counter()
            sandbox = await pool.acquire()
            times.append(time.perf_counter() - started)
            await pool.release(sandbox)
    return times


async def round_trips(spec: SandboxSpec, count: int = 500) -> list[float]:
    times = []
    async with create_sandbox(spec) as sandbox:
        for _ in range(count):
            started = time.perf_counter()
            await sandbox.exec(["true"])
            times.append(time.perf_counter() - started)
    return times


async def throughput(
    spec: SandboxSpec, num_sandboxes: int, seconds: float, as_tool: bool
) -> tuple[float, list[float]]:
    latencies: list[float] = []
    sandboxes = [create_sandbox(spec) for _ in range(num_sandboxes)]
    async with anyio.create_task_group() as group:
        for sandbox in sandboxes:
            group.start_soon(sandbox.start)
    executor = ToolExecutor(max_workers=max(num_sandboxes, 4))
    call = ToolCall("bash", {"command": "true"})
    deadline = 0.0

    async def loop(sandbox) -> None:
        toolset = SandboxTools(sandbox).toolset()
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            if as_tool:
                result = await executor.run_one(call, toolset)
                assert result.ok, result
            else:
                await sandbox.exec(["true"])
            latencies.append(time.perf_counter() - started)

    try:
        started = time.perf_counter()
        deadline = started + seconds
        async with anyio.create_task_group() as group:
            for sandbox in sandboxes:
                group.start_soon(loop, sandbox)
        elapsed = time.perf_counter() - started
    finally:
        executor.close()
        async with anyio.create_task_group() as group:
            for sandbox in sandboxes:
                group.start_soon(sandbox.close)
    return len(latencies) / elapsed, latencies


async def memory_held(spec: SandboxSpec, count: int = 128) -> float:
    before = mem_available_mb()
    sandboxes = [create_sandbox(spec) for _ in range(count)]
    limiter = anyio.Semaphore(16)

    async def start(sandbox) -> None:
        async with limiter:
            await sandbox.start()

    async with anyio.create_task_group() as group:
        for sandbox in sandboxes:
            group.start_soon(start, sandbox)
    await anyio.sleep(2)
    held = before - mem_available_mb()
    async with anyio.create_task_group() as group:
        for sandbox in sandboxes:
            group.start_soon(sandbox.close)
    return held


async def bench(backend: str, seconds: float) -> None:
    spec = SandboxSpec(backend=backend)  # type: ignore[arg-type]
    print(f"\n## backend {backend} ({os.cpu_count()} cores)")
    print(f"cold start          {percentiles(await cold_start(spec))}")
    print(f"warm-pool acquire   {percentiles(await warm_acquire(spec))}")
    print(f"exec round trip     {percentiles(await round_trips(spec))}")
    for as_tool in (False, True):
        label = "bash tool call" if as_tool else "exec `true`"
        for num_sandboxes in (1, 16, 128):
            rate, latencies = await throughput(spec, num_sandboxes, seconds, as_tool)
            figures = f"{rate:8.0f} calls/s  {percentiles(latencies)}"
            print(f"{label:<15} {num_sandboxes:>4} sandboxes busy: {figures}")
    print(f"memory held by 128 idle sandboxes: {await memory_held(spec):.0f} MB")


def engine_ready(image: str) -> bool:
    try:
        from sandboxes.engine import docker_client

        docker_client().images.get(image)
    except Exception as exc:
        print(f"\n## backend docker: skipped ({type(exc).__name__}: {exc})")
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=["local", "docker", "both"], default="both")
    parser.add_argument("--seconds", type=float, default=5.0, help="duration of each throughput run")
    args = parser.parse_args()
    backends = ["local", "docker"] if args.backend == "both" else [args.backend]
    for backend in backends:
        if backend == "docker" and not engine_ready(SandboxSpec().image):
            continue
        anyio.run(bench, backend, args.seconds)


if __name__ == "__main__":
    main()
