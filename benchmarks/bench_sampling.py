"""The built-in server's sampling step alone: milliseconds per call of `sample_next_tokens`.

    python benchmarks/bench_sampling.py                     # CUDA if present, else CPU
    python benchmarks/bench_sampling.py --device cpu --rows 64 256 --logprobs 1 8
    python benchmarks/bench_sampling.py --search blocks rows   # both searches, side by side

Random bf16 logits (`--dtype float32`: a float32 model's, as the server's on a CPU) over Qwen's vocabulary
(151,936), every row sampled at temperature 1 (the RL default) with `--logprobs` top log-probs, and an
all-greedy batch for comparison. Each figure is the median of
`--iters` calls after 3 warm-up calls, with a device synchronisation after each call (the step's own
device-to-host copy is one anyway). What it isolates: the part of a server step after the forward, which
bench_engine.py reports as `_sample`. On a GPU it also prints a sampled call's GPU time alone (its kernels
and copies summed by torch.profiler), which is what a call adds to a decode step when async scheduling
launches it ahead of the GPU.

`--search` picks the inverse-CDF search: the device's own (auto), two levels of 1,024-token blocks (a
CPU's), or one scan over each row (a GPU's). On the dev machine's CPU (idle, `--device cpu --iters 10
--search blocks rows`), sampled ms per call with blocks / whole rows: 64 rows 32 / 74 with logprobs 1,
41 / 85 with 8; 256 rows 130 / 308 and 168 / 368; greedy batches (no draw) 29 / 39 / 116-121 / 150-157
either way. On an H100 (`--search auto blocks rows`, median of 20): 64 rows 0.84 / 1.17 / 0.82 with
logprobs 1, 1.16 / 1.48 / 1.17 with 8; 256 rows 1.90 / 1.94 / 1.89 and 3.02 / 2.99 / 3.00; greedy 0.43 /
0.72 / 1.04-1.06 / 2.04-2.94. With float32 logits (a CPU server's; `--device cpu --dtype float32 --rows
64 256 --logprobs 1`, idle, the middle of three rounds run in turn), sampled / greedy ms: 64 rows 25.2 /
22.1 before the step's weights went into a buffer reused per thread and 14.5 / 12.4 after; 256 rows 92.8
/ 84.8 and 57.8 / 47.1.
On an H200 the code before `--search` existed (blocks, and top log-probs
block by block) took 1.45 ms at 64 rows, logprobs 1, where the one scan it had replaced took 0.89.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.server import sampling
from harness.server.sampling import RequestRandom, SamplingParams, sample_next_tokens
from harness.testing.models import QWEN_VOCAB_SIZE


def time_call(device: torch.device, logits: torch.Tensor, params: list[SamplingParams], iters: int) -> float:
    randoms = [RequestRandom(seed) for seed in range(len(params))]
    seen: list[list[int]] = [[] for _ in params]
    times = []
    for index in range(iters + 3):
        start = time.perf_counter()
        sample_next_tokens(logits, params, randoms, seen)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if index >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def kernel_ms(logits: torch.Tensor, params: list[SamplingParams], iters: int) -> tuple[float, int]:
    """GPU time per call summed over its kernels and copies (torch.profiler), and how many there are: what a
    call adds to a decode step when the host launches it ahead of the GPU, as the server's async scheduling
    does."""
    randoms = [RequestRandom(seed) for seed in range(len(params))]
    seen: list[list[int]] = [[] for _ in params]
    sample_next_tokens(logits, params, randoms, seen)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(iters):
            sample_next_tokens(logits, params, randoms, seen)
        torch.cuda.synchronize(logits.device)
    kernels = [e for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in kernels) / 1000 / iters, len(kernels) // iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--logprobs", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--vocab-size", type=int, default=QWEN_VOCAB_SIZE)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument(
        "--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="of the logits (the model's)"
    )
    parser.add_argument(
        "--search",
        nargs="+",
        choices=sampling.SEARCH_CHOICES,
        default=["auto"],
        help="inverse-CDF and top-k search: the device's own (auto), two-level by blocks, or whole rows",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    generator = torch.Generator(device=device).manual_seed(0)
    dtype = getattr(torch, args.dtype)
    print(f"device {device}, {args.dtype} logits, vocabulary {args.vocab_size}, median of {args.iters} (ms)")
    for rows in args.rows:
        logits = torch.randn(rows, args.vocab_size, generator=generator, device=device).to(dtype)
        for logprobs in args.logprobs:
            sampled = [SamplingParams(temperature=1.0, num_logprobs=logprobs)] * rows
            greedy = [SamplingParams(temperature=0.0, num_logprobs=logprobs)] * rows
            for search in args.search:
                sampling.SEARCH = search
                sampled_ms = time_call(device, logits, sampled, args.iters)
                greedy_ms = time_call(device, logits, greedy, args.iters)
                line = (
                    f"rows {rows:4d}  logprobs {logprobs}  search {search:6s}:  "
                    f"sampled {sampled_ms:8.2f}  greedy {greedy_ms:8.2f}"
                )
                if device.type == "cuda":
                    gpu_ms, count = kernel_ms(logits, sampled, args.iters)
                    line += f"  sampled GPU time {gpu_ms:6.3f} ({count} kernels and copies)"
                print(line)


if __name__ == "__main__":
    main()
