"""What a busy Python thread costs a model's eager forward in the same process.

    python benchmarks/bench_gil.py      # tiny Qwen3 on the CPU, switch intervals of 0.5 / 5 / 50 ms
    python benchmarks/bench_gil.py --device cuda --preset qwen3-0.6b --tokens 128

PyTorch releases the GIL around each operator; while another thread runs Python, a thread that wants the
GIL back waits for that thread's switch interval (`sys.setswitchinterval`). An eager forward is hundreds
of operators, so it pays that wait many times. In the built-in server the HTTP event loop shares the
engine's process: whenever it parses or writes, the engine's eager forwards (prefills of shapes not yet
captured) slow down this way, while a replayed CUDA graph, one call, barely does. Printed: ms per forward
alone, then beside a thread that loops in Python, at each switch interval.

On the dev machine of 2026-12-07 (2 cores, the tiny model, 8 tokens, one torch thread), four runs: 1.0-1.9 ms
alone; 48-82 / 561-893 / 4,203-9,132 ms beside a busy thread at 0.5 / 5 / 50 ms, about 100-180 waits of the
full interval per forward. How often the handoff waits depends on the machine: the dev machine of the day
before gave 2.5 / 5.0 / 20.4 ms at the same settings. On one H100 (random Qwen3-0.6B, bf16, eager, 128
tokens; the second command with `--switch-intervals-ms 0.1 0.5 5`): 19.5 ms alone; 373 / 1,454 / 15,293 ms
beside a busy thread. Whether the server's HTTP thread is busy enough for this to matter is what
bench_serving.py's `builtin-switch-MS` servers measure: on that H100 a shorter interval made it slower.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).parent))


def ms_per_forward(model: torch.nn.Module, input_ids: torch.Tensor, iters: int) -> float:
    with torch.inference_mode():
        model(input_ids)
        if input_ids.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            model(input_ids)
        if input_ids.is_cuda:
            torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1000


def spin(stop: threading.Event) -> None:
    """Run Python until `stop` is set: the thread that holds the GIL between the forward's operators."""
    while not stop.is_set():
        sum(range(1000))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--preset", default="tiny", help="tiny, or a bench_trainer.py preset (qwen3-0.6b, ...)"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--switch-intervals-ms", type=float, nargs="+", default=[0.5, 5.0, 50.0])
    args = parser.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)  # the operators' own threads would hide the handoff
    if args.preset == "tiny":
        from harness.testing import build_tiny_qwen3

        model = build_tiny_qwen3().to(args.device).eval()
    else:
        from bench_engine import build_model

        model = build_model(args.preset, args.device).eval()
    input_ids = torch.randint(0, 100, (1, args.tokens), device=args.device)
    alone_ms = ms_per_forward(model, input_ids, args.iters)
    print(f"{args.preset} on {args.device}, {args.tokens} tokens: alone {alone_ms:.2f} ms")
    default_interval = sys.getswitchinterval()
    for interval_ms in args.switch_intervals_ms:
        sys.setswitchinterval(interval_ms / 1000)
        stop = threading.Event()
        thread = threading.Thread(target=spin, args=(stop,), daemon=True)
        thread.start()
        try:
            ms = ms_per_forward(model, input_ids, args.iters)
        finally:
            stop.set()
            thread.join()
        print(f"  beside a busy Python thread, switch interval {interval_ms:g} ms: {ms:.2f} ms")
    sys.setswitchinterval(default_interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
