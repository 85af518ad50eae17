"""The built-in server's engine alone (no HTTP): generated tokens/s and the time of each part of a step.

    python benchmarks/bench_engine.py                       # a GPU: random Qwen3-0.6B shape, bf16
    python benchmarks/bench_engine.py --eager               # the same with --enforce-eager's engine
    python benchmarks/bench_engine.py --no-async-scheduling # each decode step read before the next
    python benchmarks/bench_engine.py --device cpu --preset tiny --concurrency 8 --max-tokens 16  # smoke
    python benchmarks/bench_engine.py --http                # the same engine behind its HTTP server
    python benchmarks/bench_engine.py --compile-blocks      # norms and MLPs compiled (the trainer's default)
    python benchmarks/bench_engine.py --compile-layers      # whole decoder layers but their attention

Requests are submitted in-process, all C of a wave at once (each ~`--prompt-len` random tokens, exactly
`--max-tokens` new ones, temperature 1, logprobs=1), three waves per concurrency; the first includes the
CUDA graph captures. Each of the engine's step parts is timed: `_step` (a whole scheduling step),
`_prefill` and `_decode` (the forward and its sampling: with async scheduling a `_decode` only launches its
step), `_decode_ahead` (launch the next decode step, then read the one in flight), `_collect` (read a step's
tokens and end the finished requests), and the graphs' own `prefill` and `decode` (inputs copied in, the
replay launched). With `--no-async-scheduling` each part is timed with a device synchronisation around it
(which the engine itself does not do, so the parts cost a little more here than in a server); with async
scheduling (the default, as the server on a GPU) the times are host times, since a synchronisation would
undo the overlap being measured. Printed per wave: tokens/s and (calls, mean ms, total s) per part. What it
shows beside benchmarks/bench_serving.py: the engine's own ceiling, which the HTTP process then shares its
CPU with.

`--http` serves the engine instead through the built-in HTTP server on a thread of this process
(`EmbeddedServer`, as tests do) and loads it with bench_serving.py's client processes (4, each request its
own seed, logprobs=1; `--warmup-waves` untimed waves, 1 by default, then 4 timed waves); the step parts
are then counted without device synchronisation (which would slow the server), so their times are host
times. Comparing the two shows what serving over HTTP changes: how many prefills the staggered arrivals
cause, and what they cost.
`--compile-blocks` compiles the model's norms and MLPs first (harness/compiled_blocks.py; the server does by
default on a GPU, this benchmark only with the flag, in both modes);
`--scheduler-delay-factor F` gives the HTTP mode's engine that admission delay; `--no-sample-in-graph`
samples each decode step after its graph rather than inside it. `--profile` (a GPU) runs
torch.profiler over the last wave (with `--http`, the timed waves) and prints how busy the GPU was: its
summed kernel and copy time against the wall time, per decode step, and the heaviest kernels.

One H200 run (random Qwen3-0.6B, bf16, 128-token prompts, 128 new tokens, `--compile-blocks`), tokens/s of
the last two waves at 64 / 256 in flight: 12,688-12,830 / 21,766-23,633 with async scheduling (at 64 a
`_decode_ahead` took 4.6 ms, of which reading the step before it 3.9, mostly waiting for the GPU), and
8,080-10,780 / 17,848-21,165 with `--no-async-scheduling` (a graphed decode step 4.1 / 8.0 ms). An earlier
run of the `--http` mode (uncompiled, step by step) gave 4,250 / 7,939, where the warm-up and timed waves
made 19 / 34 prefills averaging 165 / 122 ms.
"""

from __future__ import annotations

import argparse
import collections
import functools
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).parent))

from bench_trainer import PRESETS  # the shapes every benchmark uses, "tiny" among them

from harness.server.engine import Engine
from harness.server.sampling import SamplingParams
from harness.testing.models import QWEN_VOCAB_SIZE


def build_model(preset: str, device: str) -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=QWEN_VOCAB_SIZE, **PRESETS[preset], max_position_embeddings=4096, tie_word_embeddings=True
    )
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    with torch.device(device):
        return Qwen3ForCausalLM(config).to(dtype).eval()


def compile_as_asked(model: Any, args: argparse.Namespace) -> str:
    """Fuse `model`'s projections as `--fuse-projections` asks (harness/server/fused_projections.py), then
    compile it in place as `--compile-layers` or `--compile-blocks` asks (harness/compiled_blocks.py); what
    was done, in words ("" for nothing)."""
    from harness.compiled_blocks import compile_blocks, compile_layers
    from harness.server.fused_projections import fuse_projections

    done = []
    if args.fuse_projections:
        fuse_projections(model)
        done.append("projections fused")
    if args.compile_layers:
        compile_layers(model)
        done.append("whole layers compiled")
    elif args.compile_blocks:
        compile_blocks(model)
        done.append("norms and MLPs compiled")
    return ", ".join(done)


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """The model these benchmarks build (`build_model`) and how it is prepared (`compile_as_asked`)."""
    parser.add_argument("--preset", default="qwen3-0.6b", help="qwen3-0.6b, qwen3-1.7b, ... or tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile-blocks", action="store_true", help="compile the norms and MLPs first")
    parser.add_argument(
        "--compile-layers", action="store_true", help="compile whole decoder layers but their attention first"
    )
    parser.add_argument(
        "--fuse-projections",
        action=argparse.BooleanOptionalAction,
        default=torch.cuda.is_available(),
        help="fuse each attention's q/k/v and each MLP's gate/up projections first, as the server does on "
        "a GPU (default: on where CUDA is)",
    )


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(obj: Any, name: str, timers: dict[str, list[float]], device: torch.device) -> None:
    """Replace obj.name with a wrapper that records each call's time (device synchronised) in timers."""
    function = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        synchronize(device)
        start = time.perf_counter()
        result = function(*args, **kwargs)
        synchronize(device)
        timers[name].append(time.perf_counter() - start)
        return result

    setattr(obj, name, wrapper)


def summary(timers: dict[str, list[float]]) -> dict[str, tuple[int, float, float]]:
    """(calls, mean ms, total s) per timed part."""
    return {
        k: (len(v), round(1000 * sum(v) / max(1, len(v)), 2), round(sum(v), 2)) for k, v in timers.items()
    }


class GpuProfile:
    """torch.profiler over a stretch of serving, CUDA activity only: how busy the GPU was, and with what.

    `start()` and `stop()` bound the stretch; `report()` prints the wall time, the GPU's summed kernel and
    copy time as a share of it (what is left is time the GPU waited for the host), the kernels per decode
    step, and the heaviest kernels by total time. Kernels replayed from CUDA graphs are counted one by one.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        self.wall_s = 0.0

    def start(self) -> None:
        synchronize(self.device)
        self.profiler.start()
        self._start = time.perf_counter()

    def stop(self) -> None:
        synchronize(self.device)
        self.wall_s = time.perf_counter() - self._start
        self.profiler.stop()

    def report(self, decode_steps: int) -> None:
        events = [e for e in self.profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy_s = sum(e.device_time for e in events) / 1e6
        by_name: dict[str, list[float]] = collections.defaultdict(list)
        for event in events:
            by_name[event.name].append(event.device_time / 1000)
        steps = max(1, decode_steps)
        print(
            f"GPU profile: {self.wall_s:.2f} s wall, {busy_s:.2f} s of kernels and copies "
            f"({busy_s / self.wall_s:.0%} busy), {len(events)} of them; per decode step ({decode_steps}): "
            f"{1000 * busy_s / steps:.2f} ms, {len(events) / steps:.0f} kernels and copies"
        )
        heaviest = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:15]
        for name, times in heaviest:
            mean_us = sum(times) / len(times) * 1000
            print(f"  {sum(times):8.1f} ms {len(times):7d} x {mean_us:7.1f} us  {name[:100]}")


def run_wave(engine: Engine, prompts: list[list[int]], max_tokens: int) -> float:
    """Submit every prompt at once and wait for all; the seconds it took."""
    done = threading.Event()
    finished: list[Any] = []

    def on_done(result: Any) -> None:
        finished.append(result)
        if len(finished) == len(prompts):
            done.set()

    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        params = SamplingParams(
            max_tokens=max_tokens, temperature=1.0, seed=index, num_logprobs=1, ignore_eos=True
        )
        engine.submit(prompt, params, on_done)
    assert done.wait(600), "the wave did not finish in 600 s"
    return time.perf_counter() - start


def run(model: Any, args: argparse.Namespace, concurrency: int) -> None:
    engine = Engine(
        model,
        max_model_len=4096,
        eos_token_ids=[],
        max_num_seqs=256,
        kv_cache_tokens=256 * 1024,
        enforce_eager=args.eager,
        async_scheduling=args.async_scheduling,
    )
    if engine.graphs is not None:
        engine.graphs.samples_in_graph = args.sample_in_graph
    timers: dict[str, list[float]] = collections.defaultdict(list)
    # A synchronisation around each part would undo the overlap of async scheduling: host times then.
    timing_device = torch.device("cpu") if args.async_scheduling else model.device
    for name in ("_prefill", "_decode", "_decode_ahead", "_collect", "_step"):
        timed(engine, name, timers, timing_device)
    if engine.graphs is not None:
        for name in ("decode", "prefill"):
            timed(engine.graphs, name, timers, timing_device)
    engine.start()
    rng = random.Random(0)
    try:
        for wave in range(3):
            for values in timers.values():
                values.clear()
            prompts = [[rng.randint(10, 30000) for _ in range(args.prompt_len)] for _ in range(concurrency)]
            profile = GpuProfile(model.device) if args.profile and wave == 2 else None
            steps_before = engine.stats().num_decode_steps
            if profile is not None:
                profile.start()
            seconds = run_wave(engine, prompts, args.max_tokens)
            if profile is not None:
                profile.stop()
                profile.report(engine.stats().num_decode_steps - steps_before)
            parts = summary(timers)
            print(
                f"eager={args.eager} ahead={args.async_scheduling} C={concurrency} wave {wave}: "
                f"{concurrency * args.max_tokens / seconds:.0f} tok/s, {seconds:.2f} s; "
                f"(calls, mean ms, total s): {parts}",
                flush=True,
            )
        if engine.graphs is not None:
            print(
                f"graphs: {engine.graphs.num_captures} captured, forwards {engine.graphs.num_forwards}, "
                f"{engine.num_steps_ahead} decode steps launched ahead"
            )
    finally:
        engine.close()
        model.set_attn_implementation("sdpa")


def timed_window(
    state: Any, timers: dict[str, list[float]], steps: list[int], profile: GpuProfile | None, *, start: bool
) -> None:
    """Open (the parts' timers cleared) or close the timed waves' window of `run_http`."""
    if start:
        for values in timers.values():
            values.clear()
    steps.append(state.engine.stats().num_decode_steps)
    if profile is not None:
        if start:
            profile.start()
        else:
            profile.stop()


def run_http(model: Any, args: argparse.Namespace) -> None:
    """The engine behind an in-process HTTP server, loaded by bench_serving.py's client processes."""
    import bench_serving

    from harness.server.app import EmbeddedServer
    from harness.server.state import ServerConfig, ServerState

    config = ServerConfig(
        model=bench_serving.SERVED_NAME,
        max_model_len=4096,
        max_num_seqs=256,
        kv_cache_tokens=256 * 1024,  # as run() gives the engine alone
        enforce_eager=args.eager,
        compile_blocks=False,  # main() compiled them already if --compile-blocks
        fuse_projections=False,  # and fused the projections if --fuse-projections
        scheduler_delay_factor=args.scheduler_delay_factor,
        async_scheduling=args.async_scheduling,
    )
    state = ServerState.from_model(model, config)
    if state.engine.graphs is not None:
        state.engine.graphs.samples_in_graph = args.sample_in_graph
    timers: dict[str, list[float]] = collections.defaultdict(list)
    for name in ("_prefill", "_decode", "_decode_ahead", "_collect", "_step"):
        timed(state.engine, name, timers, torch.device("cpu"))  # host times: no device synchronisation
    load = argparse.Namespace(
        client_processes=4,
        prompt_len=args.prompt_len,
        max_tokens=args.max_tokens,
        waves=4,
        warmup_waves=args.warmup_waves,
    )
    with EmbeddedServer(state) as server:
        for concurrency in args.concurrency:
            profile = GpuProfile(model.device) if args.profile else None
            steps: list[int] = []  # the engine's decode steps at the start and at the end of the timed waves
            row = bench_serving.measure(
                server.base_url,
                concurrency,
                load,
                on_timed_start=functools.partial(timed_window, state, timers, steps, profile, start=True),
                on_timed_end=functools.partial(timed_window, state, timers, steps, profile, start=False),
            )
            if profile is not None:
                profile.report(steps[1] - steps[0])
            parts = summary(timers)
            print(
                f"HTTP eager={args.eager} ahead={args.async_scheduling} delay={args.scheduler_delay_factor} "
                f"C={concurrency}: "
                f"{row['tokens_per_s']:.0f} tok/s over "
                f"{row['wall_s']:.1f} s (warm-up waves {row['first_wave_s']:.1f} s); "
                f"(calls, mean ms, total s) since the warm-up waves: {parts}",
                flush=True,
            )
    model.set_attn_implementation("sdpa")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_flags(parser)
    parser.add_argument("--eager", action="store_true", help="the engine with enforce_eager")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="launch each decode step before reading the previous one (default: on)",
    )
    parser.add_argument("--http", action="store_true", help="behind the HTTP server, with client processes")
    parser.add_argument(
        "--scheduler-delay-factor", type=float, default=0.0, help="the engine's (with --http)"
    )
    parser.add_argument(
        "--warmup-waves",
        type=int,
        default=1,
        help="with --http: untimed waves before the 4 timed ones (bench_serving.py's flag of that name)",
    )
    parser.add_argument(
        "--sample-in-graph",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="record a decode step's sampling in its CUDA graph where the rows allow it (default: on)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="torch.profiler over the last wave (with --http: the timed waves): GPU busy share, top kernels",
    )
    args = parser.parse_args(argv)
    if args.profile and not args.device.startswith("cuda"):
        parser.error("--profile reports GPU kernels: it needs --device cuda")
    if args.warmup_waves < 0:
        parser.error(f"--warmup-waves must be 0 or more (given {args.warmup_waves})")
    model = build_model(args.preset, args.device)
    compile_as_asked(model, args)
    if args.http:
        run_http(model, args)
        return 0
    for concurrency in args.concurrency:
        run(model, args, concurrency)
    return 0


if __name__ == "__main__":
    sys.exit(main())
