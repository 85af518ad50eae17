"""Benchmark: Docker sandboxes held and kept busy on one engine against two.

Run:  python benchmarks/bench_engines.py --engines unix:///run/a/docker.sock,unix:///run/b/docker.sock
      [--hold 1000] [--busy 256] [--seconds 10] [--json benchmarks/results/bench_engines.json]

For the first engine alone, then for all engines given, it
- starts `--hold` sandboxes through one SandboxPool (placement spreads them; at most 16 starting per engine)
  and reports the start rate, how they were spread, and the memory they hold (MemAvailable before/after);
- keeps `--busy` of them running a loop of trivial commands (`exec true` through the resident executor) for
  `--seconds`, and reports calls per second with the latency p50/p95 under that load;
- closes them all and reports how long that took, and that nothing of ours is left on any engine.
Targets (issue 21): >= 1,000 sandboxes held, >= 256 busy, >= 1,500 calls/s.

A second engine on the same machine (what the tests use; as root):
  dockerd --data-root /tmp/e2/data --exec-root /tmp/e2/exec --pidfile /tmp/e2/docker.pid \\
      --host unix:///tmp/e2/docker.sock --bridge=none --iptables=false --ip6tables=false &
The image is copied to an engine that lacks it when the pool opens.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import anyio
from bench_sandboxes import mem_available_mb  # benchmarks/ is the script's directory, so on sys.path

from sandboxes import placement
from sandboxes.base import RUN_ID, Limits, SandboxSpec
from sandboxes.engine import LABELS, docker_client, engine_name
from sandboxes.pool import SandboxPool


def percentile_ms(samples_s: list[float], q: float) -> float:
    ordered = sorted(samples_s)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3


def our_containers(url: str) -> int:
    client = docker_client(url)
    return len(client.api.containers(all=True, filters={"label": f"{LABELS['run_id']}={RUN_ID}"}))


async def measure(engines: tuple[str, ...], hold: int, busy: int, seconds: float) -> dict[str, Any]:
    spec = SandboxSpec(
        backend="docker",
        docker_engines=engines,
        limits=Limits(memory_mb=128, pids=64, disk_mb=16),
        engine_max_starting=16,
        start_timeout_s=300,
    )
    figures: dict[str, Any] = {"engines": [engine_name(url) for url in engines], "held": hold, "busy": busy}
    async with SandboxPool(spec, max_total=hold, max_starting=16 * len(engines)) as pool:
        before_mb = mem_available_mb()
        sandboxes: list[Any] = []
        started = time.perf_counter()

        async def take() -> None:
            sandboxes.append(await pool.acquire())

        async with anyio.create_task_group() as group:
            for _ in range(hold):
                group.start_soon(take)
        start_s = time.perf_counter() - started
        await anyio.sleep(2)
        figures["start_s"] = round(start_s, 1)
        figures["starts_per_s"] = round(hold / start_s, 1)
        figures["memory_held_mb"] = round(before_mb - mem_available_mb())
        figures["spread"] = {
            engine_name(url): sum(sandbox.engine_url == url for sandbox in sandboxes) for url in engines
        }

        latencies: list[float] = []
        deadline = time.perf_counter() + seconds

        async def loop(sandbox: Any) -> None:
            while time.perf_counter() < deadline:
                began = time.perf_counter()
                result = await sandbox.exec(["true"])
                assert result.ok, result
                latencies.append(time.perf_counter() - began)

        began = time.perf_counter()
        async with anyio.create_task_group() as group:
            for sandbox in sandboxes[:busy]:
                group.start_soon(loop, sandbox)
        elapsed = time.perf_counter() - began
        figures["calls_per_s"] = round(len(latencies) / elapsed)
        figures["latency_p50_ms"] = round(percentile_ms(latencies, 0.5), 2)
        figures["latency_p95_ms"] = round(percentile_ms(latencies, 0.95), 2)
        closing = time.perf_counter()
    figures["close_s"] = round(time.perf_counter() - closing, 1)
    figures["left_on_engines"] = sum(our_containers(url) for url in engines)
    figures["engines_lost"] = sum(placement.engine(url).num_lost for url in engines)
    return figures


def report(figures: dict[str, Any]) -> None:
    print(
        f"{len(figures['engines'])} engine(s): {figures['held']} held, started in {figures['start_s']} s "
        f"({figures['starts_per_s']}/s), spread {figures['spread']}, {figures['memory_held_mb']} MB held; "
        f"{figures['busy']} busy: {figures['calls_per_s']} calls/s, p50 {figures['latency_p50_ms']} ms, "
        f"p95 {figures['latency_p95_ms']} ms; closed in {figures['close_s']} s, "
        f"{figures['left_on_engines']} left on the engines"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    second = os.environ.get("HARNESS_SECOND_ENGINE")
    parser.add_argument(
        "--engines",
        default=f",{second}" if second else "",
        help="engine URLs separated by commas; an empty entry is DOCKER_HOST's (default: DOCKER_HOST's and "
        "HARNESS_SECOND_ENGINE)",
    )
    parser.add_argument("--hold", type=int, default=1000, help="sandboxes held at once")
    parser.add_argument("--busy", type=int, default=256, help="of those, how many run commands")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long the busy ones run")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    engines = tuple(args.engines.split(",")) if args.engines else ("",)
    runs = [engines[:1]] + ([engines] if len(engines) > 1 else [])
    results = {"cores": os.cpu_count(), "runs": []}
    for chosen in runs:
        figures = anyio.run(measure, chosen, args.hold, args.busy, args.seconds)
        report(figures)
        results["runs"].append(figures)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
