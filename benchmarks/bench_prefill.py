"""One prefill of the built-in server on its own: the CUDA graph's time per prefill of R requests of T new
tokens each, and what the same padded prefill launches when run eagerly (how many kernels, their summed GPU
time split into attention, matrix products and the rest, the heaviest operators).

    python benchmarks/bench_prefill.py                          # a GPU: random Qwen3-0.6B shape, bf16
    python benchmarks/bench_prefill.py --compile-layers         # whole decoder layers but their attention
    python benchmarks/bench_prefill.py --prefill-attention server efficient cudnn math
    python benchmarks/bench_prefill.py --device cpu --preset tiny --shapes 2x16   # smoke: no graphs on CPU

The engine first serves one wave (128-token prompts, 128 new tokens) so that its kernels are warm, is
paused, and its cache is made to hold the largest shape. Each `--shapes` entry RxT is then prefilled into
fresh cache rows through `StepGraphs.prefill`, as the engine does: captured at its third use, then replayed
`--iters` times between two device synchronisations (a prefill larger than one graph runs as several,
`cuda_graphs.MAX_PREFILL_GRAPH_TOKENS`). What it isolates: the GPU side of a prefill, which bench_engine.py
--http counts as replayed prefills' milliseconds; at 64 requests in flight over HTTP, groups of about 32
~128-token prompts arrive together, one such prefill per wave of them.
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).parent))

from bench_engine import add_model_flags, build_model, compile_as_asked, run_wave, synchronize

from harness.server import kv_cache
from harness.server.cuda_graphs import PREFILL_CAPTURE_AT_USE, StepGraphs
from harness.server.engine import Engine

ATTENTION_BACKENDS = {
    "server": None,  # the server's own list (kv_cache.PREFILL_SDPA_BACKENDS)
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "math": [SDPBackend.MATH],
}
# How a kernel's name says what it does (CUDA kernel names: cuBLAS / CUTLASS products, SDPA's backends).
ATTENTION_KERNELS = ("attention", "fmha", "flash", "cudnn")
PRODUCT_KERNELS = ("gemm", "cutlass", "nvjet", "sm90_xmma", "ampere_", "splitk")


def shape(text: str) -> tuple[int, int]:
    requests, _, tokens = text.partition("x")
    if not (requests.isdigit() and tokens.isdigit() and int(requests) > 0 and int(tokens) > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not REQUESTSxTOKENS, e.g. 8x160")
    return int(requests), int(tokens)


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    if any(part in lowered for part in ATTENTION_KERNELS):
        return "attention"
    if any(part in lowered for part in PRODUCT_KERNELS):
        return "matrix products"
    return "other"


@torch.inference_mode()
def measure(engine: Engine, requests: int, tokens: int, iters: int) -> None:
    """Time the prefill of `requests` fresh `tokens`-token prompts through the server's graphs, then profile
    its eager run's kernels."""
    device = engine.cache.device
    capture = device.type == "cuda"
    graphs = StepGraphs(engine.model, engine.cache, capture=capture)
    rng = random.Random(requests * tokens)
    rows = list(range(requests))
    prompts = [[rng.randint(10, 30_000) for _ in range(tokens)] for _ in range(requests)]
    starts = [0] * requests
    for _ in range(PREFILL_CAPTURE_AT_USE + 1):  # eager until captured, then one replay
        if graphs.prefill(rows, prompts, starts) is None:
            print(f"{requests}x{tokens}: more tokens or keys than a graph holds (the engine runs it eagerly)")
            return
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        graphs.prefill(rows, prompts, starts)
    synchronize(device)
    prefill_ms = (time.perf_counter() - start) / iters * 1000
    kind = f"{graphs.num_captures} graph(s)" if capture else "padded eager forward (no graphs off a GPU)"
    print(
        f"{requests}x{tokens}: {kind} {prefill_ms:.2f} ms per prefill, "
        f"{requests * tokens / prefill_ms * 1000:,.0f} prompt tokens/s",
        flush=True,
    )
    if not capture:
        return
    eager = StepGraphs(engine.model, engine.cache, capture=False)
    eager.prefill(rows, prompts, starts)
    synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        eager.prefill(rows, prompts, starts)
        synchronize(device)
    kernels = [e for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_kind: dict[str, float] = collections.defaultdict(float)
    for event in kernels:
        by_kind[kernel_kind(event.name)] += event.device_time / 1000
    parts = ", ".join(f"{name} {ms:.2f}" for name, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]))
    print(f"  eager: {len(kernels)} kernels, {sum(by_kind.values()):.2f} ms summed GPU time ({parts})")
    print(profiler.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=60))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_flags(parser)
    parser.add_argument(
        "--shapes", type=shape, nargs="+", default=[(8, 160), (16, 128), (32, 128)], help="REQUESTSxTOKENS"
    )
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument(
        "--prefill-attention",
        nargs="+",
        choices=sorted(ATTENTION_BACKENDS),
        default=["server"],
        help="SDPA backends of the prefill's attention, each measured in turn (graphs captured afresh)",
    )
    args = parser.parse_args(argv)
    model = build_model(args.preset, args.device)
    compiled = compile_as_asked(model, args)
    most_requests = max(requests for requests, _ in args.shapes)
    longest = max(tokens for _, tokens in args.shapes)
    engine = Engine(
        model,
        max_model_len=max(4096, longest),
        eos_token_ids=[],
        max_num_seqs=max(64, most_requests),
        kv_cache_tokens=max(64, most_requests) * max(256, longest),
    )
    engine.start()
    try:
        run_wave(engine, [[random.randint(10, 30_000) for _ in range(128)] for _ in range(16)], 128)
        engine.pause().result()
        engine.cache.reserve(most_requests, longest)
        print(f"{args.preset} on {args.device}, {compiled or 'eager'}")
        server_choice = kv_cache.PREFILL_SDPA_BACKENDS
        for choice in args.prefill_attention:
            chosen = ATTENTION_BACKENDS[choice]
            kv_cache.PREFILL_SDPA_BACKENDS = server_choice if chosen is None else chosen
            print(f"prefill attention: {choice} ({kv_cache.PREFILL_SDPA_BACKENDS})")
            for requests, tokens in args.shapes:
                measure(engine, requests, tokens, args.iters)
        kv_cache.PREFILL_SDPA_BACKENDS = server_choice
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
