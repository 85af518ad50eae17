"""Benchmark: what the GenerationRouter adds per request, over one and two generation servers.

Run:  python benchmarks/bench_routing.py [--requests 20000] [--concurrency 1,256] [--group-size 8]

Against in-process generation doubles that answer at once (`FakeGenerationServer`, so only the routing and
the double's own bookkeeping are timed), in one process, it times `generate` called
- on the double directly (the floor),
- through a router of that one server,
- through a router of two servers, each group's requests with its route_key (one in `--group-size` places the
  group; the rest follow it), and with no key at all (each request placed by load),
with 1 and 256 requests in flight, and prints microseconds per request and the router's overhead over the
floor. Placement reads the loads of the last /metrics poll, which the rollout loop refreshes every few
seconds: that poll is not in these figures (one HTTP GET per server per 5 s).
"""

from __future__ import annotations

import argparse
import itertools
import time

import anyio

from harness.generation.protocol import SamplingConfig
from harness.generation.router import GenerationRouter
from harness.testing.fake_server import FakeGenerationServer

PROMPT = list(range(100, 164))


def fake() -> FakeGenerationServer:
    return FakeGenerationServer(lambda prompt, call: [7, 8, 9])


async def time_requests(target, num_requests: int, concurrency: int, group_size: int | None) -> float:
    """Seconds per request of `target.generate`, `concurrency` at a time; route keys by groups if given."""
    sampling = SamplingConfig(max_tokens=3)
    counter = itertools.count()
    limiter = anyio.Semaphore(concurrency)

    async def one(index: int) -> None:
        async with limiter:
            if group_size is None:
                await target.generate(PROMPT, sampling)
            else:
                await target.generate(PROMPT, sampling, route_key=index // group_size)

    started = time.perf_counter()
    async with anyio.create_task_group() as group:
        for _ in range(num_requests):
            group.start_soon(one, next(counter))
    return (time.perf_counter() - started) / num_requests


async def bench(num_requests: int, concurrencies: list[int], group_size: int) -> None:
    for concurrency in concurrencies:
        direct = fake()
        await time_requests(direct, 200, concurrency, None)
        floor = await time_requests(direct, num_requests, concurrency, None)
        cases = {
            "router of 1 server": (GenerationRouter([fake()], urls=["a"]), None),
            f"router of 2, groups of {group_size}": (
                GenerationRouter([fake(), fake()], urls=["a", "b"]),
                group_size,
            ),
            "router of 2, no route key": (GenerationRouter([fake(), fake()], urls=["a", "b"]), None),
        }
        print(f"\n{concurrency} in flight, {num_requests} requests: direct {floor * 1e6:6.1f} us/request")
        for label, (router, keys) in cases.items():
            await time_requests(router, 200, concurrency, keys)  # first calls (the model's name) out of it
            per_request = await time_requests(router, num_requests, concurrency, keys)
            split = [server.num_requests for server in router.servers]
            overhead_us = (per_request - floor) * 1e6
            print(
                f"  {label:<28} {per_request * 1e6:6.1f} us/request, overhead {overhead_us:5.1f} us; "
                f"requests per server {split}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--concurrency", default="1,256", help="requests in flight, comma-separated")
    parser.add_argument("--group-size", type=int, default=8, help="requests that share a route key")
    args = parser.parse_args()
    anyio.run(bench, args.requests, [int(c) for c in args.concurrency.split(",")], args.group_size)


if __name__ == "__main__":
    main()
