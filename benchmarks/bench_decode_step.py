"""One decode step of the built-in server on its own: the CUDA graph's time per step, and what the same
padded step launches when run eagerly (how many kernels, their summed GPU time, the heaviest), and the
graph of the same step with its sampling recorded in it (`StepGraphs.decode_and_sample`, what the server
replays when every row samples by temperature alone).

    python benchmarks/bench_decode_step.py                    # a GPU: random Qwen3-0.6B shape, bf16
    python benchmarks/bench_decode_step.py --compile-blocks   # norms and MLPs compiled, as the server does
    python benchmarks/bench_decode_step.py --compile-layers   # whole decoder layers but their attention
    python benchmarks/bench_decode_step.py --search auto blocks rows   # the in-graph sampling's two searches
    python benchmarks/bench_decode_step.py --compile-sampling # the in-graph sampling compiled by inductor
    python benchmarks/bench_decode_step.py --device cpu --preset tiny --rows 8   # smoke: no graphs on CPU

The engine first serves one wave of `max(--rows)` requests (128-token prompts, 128 new tokens), which sizes
its KV cache and captures its graphs; it is then paused, and each `--rows` count's decode step (every row at
each `--length` keys) is replayed `--iters` times between two device synchronisations. The kernels come from
torch.profiler over one eager run of the same padded step (`StepGraphs(capture=False)`). What it isolates:
the GPU side of bench_engine.py's `decode` part, which no host-side change can shorten.

One H100 run (random Qwen3-0.6B, bf16, 200 keys per row): 64 rows 6.05 ms per step (1,818 kernels, 5.61 ms
summed), with `--compile-blocks` 4.19 ms (999 kernels, 3.89 ms); 256 rows 9.07 against 6.74 ms. Of the
compiled 64-row step, the matmuls took 1.17 ms and attention (cuDNN) 1.07. A later H100 call ran this with
`--compile-blocks` on the tree before and after the attention function made its additive mask once per
forward and wrote decode keys without gathers: 64 rows 4.23 -> 3.79 ms per step (999 -> 834 kernels),
256 rows 7.14 -> 6.68 ms (971 -> 806); the write alone (mask still converted per layer) gave 3.95 / 6.84
ms (918 / 890 kernels). cuDNN's attention was then 1.06 of the 3.53 ms summed at 64 rows, 3.60 of 6.50 at
256. `--decode-attention server efficient` (graphs captured afresh for each choice) on a later H100: PyTorch's
choice (cuDNN) 3.75 / 6.68 ms at 64 / 256 rows, the memory-efficient backend alone 3.77 / 7.03, so the
server keeps PyTorch's choice for decode steps. With the projections fused (`--fuse-projections`, the
default where CUDA is, as the server does; harness/server/fused_projections.py), on another H100, 64 rows
over 200 keys took 3.51 ms against 3.79 with `--no-fuse-projections` (750 kernels against 834), 256 rows
6.33 against 6.62.
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).parent))

from bench_engine import add_model_flags, build_model, compile_as_asked, run_wave, synchronize

from harness.server import kv_cache, sampling
from harness.server.cuda_graphs import StepGraphs
from harness.server.engine import Engine

ATTENTION_BACKENDS = {
    "server": None,  # not set: the server's own choice (kv_cache.DECODE_SDPA_BACKENDS)
    "pytorch": None,
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "math": [SDPBackend.MATH],
    "flash-varlen": None,  # not SDPA: FlashAttention's varlen kernel over the cache in place (kv_cache.py)
}


@torch.inference_mode()
def measure(engine: Engine, rows: int, length: int, iters: int, fresh_graphs: bool = False) -> None:
    """Time `rows` rows' decode step replayed (from the engine's graphs, or from graphs captured afresh
    with the attention backends and sampling search now set), then profile its eager run's kernels."""
    device = engine.cache.device
    replayed = engine.graphs or StepGraphs(engine.model, engine.cache, capture=False)
    if fresh_graphs and engine.graphs is not None:
        replayed = StepGraphs(engine.model, engine.cache)
    eager = StepGraphs(engine.model, engine.cache, capture=False)
    rng = random.Random(rows)
    token_ids, lengths = [rng.randint(10, 30_000) for _ in range(rows)], [length] * rows
    temperatures, uniforms = [1.0] * rows, [rng.random() for _ in range(rows)]
    steps = {
        "": lambda: replayed.decode(token_ids, lengths),
        ", sampled in it": lambda: replayed.decode_and_sample(token_ids, lengths, temperatures, uniforms),
    }
    kind = "graph" if engine.graphs is not None else "padded eager forward (no graphs off a GPU)"
    for variant, step in steps.items():
        for _ in range(3):
            step()
        synchronize(device)
        start = time.perf_counter()
        for _ in range(iters):
            step()
        synchronize(device)
        step_ms = (time.perf_counter() - start) / iters * 1000
        print(f"rows {rows}, {length} keys: {kind}{variant} {step_ms:.2f} ms per step", flush=True)
    if device.type != "cuda":
        return
    eager.decode(token_ids, lengths)
    synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        eager.decode(token_ids, lengths)
        synchronize(device)
    kernels = [e for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    summed_ms = sum(e.device_time for e in kernels) / 1000
    print(f"  eager: {len(kernels)} kernels, {summed_ms:.2f} ms summed GPU time; heaviest operators:")
    print(profiler.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_flags(parser)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument(
        "--length", type=int, nargs="+", default=[200], help="keys each row attends to (<= 256), each in turn"
    )
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument(
        "--decode-attention",
        nargs="+",
        choices=sorted(ATTENTION_BACKENDS),
        default=["server"],
        help="SDPA backends of the decode step's attention, each measured in turn: server (the server's "
        "choice), pytorch (PyTorch's), or one backend; flash-varlen: FlashAttention's varlen kernel instead",
    )
    parser.add_argument(
        "--search",
        nargs="+",
        choices=sampling.SEARCH_CHOICES,
        default=["auto"],
        help="the sampling's inverse-CDF search in the graph, each measured in turn (graphs captured afresh "
        "for each but auto): the device's own, two levels of 1,024-token blocks, or one scan per row",
    )
    parser.add_argument(
        "--compile-sampling",
        action="store_true",
        help="the sampling recorded in the graph compiled by inductor first (StepGraphs.compile_sampling)",
    )
    args = parser.parse_args(argv)
    StepGraphs.compile_sampling = args.compile_sampling
    if not all(1 <= length <= 256 for length in args.length):
        parser.error("--length must be in [1, 256]: the warm-up wave sizes the cache to 256 positions")
    model = build_model(args.preset, args.device)
    compiled = compile_as_asked(model, args)
    engine = Engine(
        model, max_model_len=4096, eos_token_ids=[], max_num_seqs=max(args.rows), kv_cache_tokens=256 * 1024
    )
    engine.start()
    try:
        prompts = [[random.randint(10, 30_000) for _ in range(128)] for _ in range(max(args.rows))]
        run_wave(engine, prompts, 128)
        engine.pause().result()
        print(f"{args.preset} on {args.device}, {compiled or 'eager'}")
        server_choice = kv_cache.DECODE_SDPA_BACKENDS
        for choice, search in itertools.product(args.decode_attention, args.search):
            chosen = server_choice if choice == "server" else ATTENTION_BACKENDS[choice]
            kv_cache.DECODE_SDPA_BACKENDS = chosen
            kv_cache.DECODE_ATTENTION = "flash-varlen" if choice == "flash-varlen" else "sdpa"
            sampling.SEARCH = search
            print(
                f"decode attention: {choice} ({kv_cache.DECODE_SDPA_BACKENDS or 'any backend'}), "
                f"sampling search: {search}"
            )
            fresh = choice != "server" or search != "auto"
            for rows in args.rows:
                for length in args.length:
                    measure(engine, rows, length, args.iters, fresh_graphs=fresh)
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
