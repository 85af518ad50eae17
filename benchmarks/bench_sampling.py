"""The built-in server's sampling step alone: milliseconds per call of `sample_next_tokens`.

    python benchmarks/bench_sampling.py                     # CUDA if present, else CPU
    python benchmarks/bench_sampling.py --device cpu --rows 64 256 --logprobs 1 8

Random bf16 logits over Qwen's vocabulary (151,936), every row sampled at temperature 1 (the RL default)
with `--logprobs` top log-probs, and an all-greedy batch for comparison. Each figure is the median of
`--iters` calls after 3 warm-up calls, with a device synchronisation after each call (the step's own
device-to-host copy is one anyway). What it isolates: the part of a server step after the forward, which
bench_engine.py reports as `_sample`.

On the dev machine's CPU (idle, `--device cpu --iters 10`), sampled / greedy ms per call: 64 rows 35 / 23
with logprobs 1, 47 / 36 with 8; 256 rows 142 / 97 and 197 / 152. The single-level search it replaced took
65 / 65 at 64 rows and 256 / 258 at 256 (logprobs 1, measured right after on the same machine). Not yet run
on a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--logprobs", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--vocab-size", type=int, default=QWEN_VOCAB_SIZE)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    generator = torch.Generator(device=device).manual_seed(0)
    print(f"device {device}, vocabulary {args.vocab_size}, median of {args.iters} calls (ms)")
    for rows in args.rows:
        logits = torch.randn(rows, args.vocab_size, generator=generator, device=device).to(torch.bfloat16)
        for logprobs in args.logprobs:
            sampled = [SamplingParams(temperature=1.0, num_logprobs=logprobs)] * rows
            greedy = [SamplingParams(temperature=0.0, num_logprobs=logprobs)] * rows
            sampled_ms = time_call(device, logits, sampled, args.iters)
            greedy_ms = time_call(device, logits, greedy, args.iters)
            print(f"rows {rows:4d}  logprobs {logprobs}:  sampled {sampled_ms:8.2f}  greedy {greedy_ms:8.2f}")


if __name__ == "__main__":
    main()
