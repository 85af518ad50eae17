"""The built-in engine's own host work per decode step, with the model taken out: what its Python costs
between two graph replays, on any machine.

    python benchmarks/bench_host_step.py                      # 64 and 256 rows, 128 new tokens each
    python benchmarks/bench_host_step.py --rows 512 --profile  # and the heaviest functions (cProfile)

The engine runs the path it takes on a GPU (`StepGraphs` replays, sampling recorded in the step, each
step launched before the previous one is read: async scheduling), on the CPU, with the forward replaced
by a stub that writes random tokens into the graph's output buffers. So each step's time is the host's
alone: copying the inputs in, drawing each row's uniform, reading the step before, appending tokens and
log-probs, the stop checks, finishing requests and handing them out. `--rows` requests of
`--prompt-len` tokens (temperature 1, logprobs=1, exactly `--max-tokens` new tokens) are submitted to a
started engine, which prefills them and decodes them to the end on its own thread, `--repeats` times. The
wall time of that, less the prefills and idle waits the engine counts (`Engine.stats()`), per decode step,
is the host's time per step; printed per row count: the median in milliseconds, and the range.
What it answers: whether a GPU's decode step (bench_decode_step.py) or the engine's Python bounds the
server; with async scheduling the two overlap, so the step takes the longer of them. On the dev machine
(2 cores, idle; `--repeats 5`, two runs): medians of 0.20 / 0.22 ms per step at 64 rows and 0.67 / 0.74 ms
at 256, where a graphed step takes 3.3-4.3 ms at 64 rows and 6.0-7.9 ms at 256 on an H100
(bench_decode_step.py, with or without its sampling, projections fused or not): the engine's own Python
is not what bounds a step there.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.server.cuda_graphs import StepGraphs
from harness.server.engine import Engine
from harness.server.sampling import SamplingParams
from harness.testing.models import build_tiny_qwen3


class StubGraphs(StepGraphs):
    """The engine's graphs with no model behind them: a sampled step writes random tokens and zeroed
    log-probs into the buffers a replay would fill; everything the host does around it is unchanged."""

    def _run_model(self, batch, token_ids, positions, rows):  # type: ignore[no-untyped-def]
        pass

    def _decode_forward(self, rows: int, key_positions: int, *, sampled: bool = False) -> None:
        if sampled:
            self._tokens_R[:rows].random_(10, 1000)
            self._packed_R4[:rows].zero_()


def host_ms_per_step(rows: int, prompt_len: int, max_tokens: int, profile: bool) -> float:
    """One run: the engine's thread prefills `rows` requests and decodes them to the end; the wall time of
    that, less its prefills and idle waits (from `Engine.stats()`), per decode step, in milliseconds."""
    model = build_tiny_qwen3(num_hidden_layers=1)
    length = prompt_len + max_tokens + 1
    engine = Engine(
        model,
        max_model_len=length,
        eos_token_ids=[],
        max_num_seqs=rows,
        kv_cache_tokens=(rows + 1) * length,
        async_scheduling=True,
    )
    engine.graphs = StubGraphs(model, engine.cache, capture=False)
    finished: list[object] = []
    all_done = threading.Event()

    def on_done(output: object) -> None:  # on the engine thread, after the stats of its step are published
        finished.append(output)
        if len(finished) == rows:
            all_done.set()

    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True, num_logprobs=1)
    rng = random.Random(rows)
    for _ in range(rows):
        engine.submit([rng.randint(10, 1000) for _ in range(prompt_len)], params, on_done)
    profiler = cProfile.Profile() if profile else None
    if profiler is not None:  # the engine thread profiles itself from its first Python call on
        threading.setprofile(lambda *_: (sys.setprofile(None), profiler.enable()))
    try:
        started = time.perf_counter()
        engine.start()
        if not all_done.wait(timeout=600):
            raise RuntimeError(f"{len(finished)} of {rows} requests finished in 600 s: {engine.error!r}")
        elapsed = time.perf_counter() - started
        stats = engine.stats()
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
        engine.close()
    if engine.num_steps_ahead == 0:
        raise RuntimeError("no decode step went ahead: this is not the async graph path")
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
    return (elapsed - stats.prefill_s - stats.idle_s) / stats.num_decode_steps * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="runs per row count; their median is printed")
    parser.add_argument("--profile", action="store_true", help="also print cProfile's heaviest functions")
    args = parser.parse_args(argv)
    if min(args.rows) < 1 or args.prompt_len < 1 or args.max_tokens < 2 or args.repeats < 1:
        parser.error("--rows, --prompt-len and --repeats must be at least 1, --max-tokens at least 2")
    torch.set_num_threads(1)
    for rows in args.rows:
        runs = [
            host_ms_per_step(rows, args.prompt_len, args.max_tokens, args.profile)
            for _ in range(args.repeats)
        ]
        print(
            f"rows {rows}: {statistics.median(runs):.3f} ms of host time per decode step "
            f"(median of {len(runs)}: {min(runs):.3f}-{max(runs):.3f})",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
