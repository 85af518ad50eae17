"""Benchmark: one rollout worker process against several (num_rollout_workers), generation and tools free.

Run:  python benchmarks/bench_rollout_workers.py [--workers 1 2] [--concurrency 64 256] [--rollouts 8192]
          [--group-size 8] [--latency-ms 0]

The trainer's real handle, RolloutWorker, spawns N worker processes that share the prompts and the token
allowance (harness/rollout/sharing.py); each runs the real AsyncRolloutLoop against bench_rollout.py's
generation double (two turns and one call of a trivial tool per rollout, answered at once), and this
process reads the one queue of results as the trainer does. `--concurrency` is the total of
max_concurrent_rollouts, split between the processes as the trainer splits it.

Printed per (concurrency, workers): rollouts and turns per second over the steady part of the run (from the
first group's result to the last; process start-up, about a second per process, is shown apart as
`start s`), and the CPU time of all the worker processes per turn (from /proc, so the parent's reading of
the queue is not in it). With one core per process and nothing else running, N processes approach N times
one process's rate; the machine's core count is printed in the header.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from bench_rollout import InstantServer, add, prepare, reward_of, workload

from harness.rollout.loop import AsyncRolloutLoop
from harness.rollout.sharing import share_of
from harness.rollout.worker import RolloutWorker


def process_cpu_s(pids: list[int]) -> float:
    """User plus system CPU seconds of processes that are running or not yet joined (/proc/<pid>/stat)."""
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def measure(
    tokenizer: Any,
    call_ids: list[int],
    answer_ids: list[int],
    workers: int,
    concurrency: int,
    rollouts: int,
    group_size: int,
    latency_s: float,
) -> dict[str, float]:
    # the total concurrency split as the trainer splits it; one pass over the dataset, then each process ends
    config, dataset = workload(share_of(concurrency, workers), rollouts, group_size)
    num_groups = len(dataset)
    server = InstantServer(
        call_ids, answer_ids, tokenizer.convert_tokens_to_ids("<tool_response>"), latency_s
    )
    loop_kwargs = {
        "config": config,
        "model_name": "instant",
        "dataset": dataset,
        "reward_funcs": [reward_of],
        "processing_class": tokenizer,
        "eos_token_ids": [tokenizer.convert_tokens_to_ids("<|im_end|>")],
        "tools": [add],
        "client": server,  # pickled into each process: every process has its own double
    }
    worker = RolloutWorker(AsyncRolloutLoop, loop_kwargs, num_processes=workers)
    launched = time.perf_counter()
    worker.start()
    pids = [process.pid for process in worker._processes]
    samples, first, last, cpu = 0, None, None, 0.0
    positions: set[int] = set()
    try:
        while not worker.finished:
            worker.check()
            result = worker.get(timeout_s=0.5)
            if result is None:
                continue
            now = time.perf_counter()
            if first is None:
                first, first_samples = now, len(result.samples)
                cpu_at_first = process_cpu_s(pids)
            last = now
            samples += len(result.samples)
            positions.add(result.position)
            if len(positions) == num_groups:  # a process that ended is not joined yet: /proc still has it
                cpu = process_cpu_s(pids) - cpu_at_first
    finally:
        worker.stop()
    assert first is not None and last is not None
    assert positions == set(range(num_groups)), "a prompt was lost or taken twice"
    assert samples == num_groups * group_size, samples  # one training sample per rollout: none lost
    steady = (samples - first_samples) / group_size  # groups after the first
    wall = last - first
    return {
        "workers": workers,
        "concurrency": concurrency,
        "rollouts": samples,
        "start_s": first - launched,
        "rollouts_per_s": steady * group_size / wall,
        "turns_per_s": 2 * steady * group_size / wall,
        "cpu_ms_per_turn": cpu / (2 * steady * group_size) * 1e3,
        "cpu_per_wall": cpu / wall,
    }


def main(
    workers: list[int], concurrencies: list[int], rollouts: int, group_size: int, latency_ms: float
) -> None:
    tokenizer, call_ids, answer_ids = prepare(
        "rollout worker processes",
        f"groups of {group_size}, {rollouts} rollouts per row, generation latency {latency_ms:g} ms",
    )
    columns = ("conc", "workers", "rollouts", "start s", "rollouts/s", "turns/s", "CPU ms/turn", "cpu/wall")
    widths = (5, 7, 8, 7, 10, 8, 11, 8)
    print(" ".join(f"{name:>{width}}" for name, width in zip(columns, widths, strict=True)))
    for concurrency in concurrencies:
        for count in workers:
            r = measure(
                tokenizer, call_ids, answer_ids, count, concurrency, rollouts, group_size, latency_ms / 1e3
            )
            values = (
                concurrency,
                count,
                r["rollouts"],
                f"{r['start_s']:.1f}",
                f"{r['rollouts_per_s']:,.0f}",
                f"{r['turns_per_s']:,.0f}",
                f"{r['cpu_ms_per_turn']:.3f}",
                f"{r['cpu_per_wall']:.2f}",
            )
            print(" ".join(f"{value:>{width}}" for value, width in zip(values, widths, strict=True)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="num_rollout_workers")
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[64, 256], help="max_concurrent_rollouts (total)"
    )
    parser.add_argument("--rollouts", type=int, default=8192, help="rollouts per measurement")
    parser.add_argument("--group-size", type=int, default=8, help="num_generations")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="generation latency of the double")
    args = parser.parse_args()
    main(args.workers, args.concurrency, args.rollouts, args.group_size, args.latency_ms)
