"""The server benchmarks' CPU smoke commands, as their docstrings give them, run whole: each must finish and
print figures that add up. A benchmark is only run by hand, on a GPU, and a broken one costs the device
time it was given (bench_engine.py --http failed with an AttributeError for a session before anyone ran it).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(*argv: str) -> str:
    """Run benchmarks/ARGV[0] with the rest as arguments; its output (stdout and stderr), after it exits 0."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / argv[0]), *argv[1:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return output


def test_bench_engine_in_process_and_over_http():
    output = run_benchmark(
        "bench_engine.py", "--device", "cpu", "--preset", "tiny", "--concurrency", "8", "--max-tokens", "16"
    )
    waves = re.findall(r"C=8 wave (\d): (\d+) tok/s", output)
    assert [wave for wave, _ in waves] == ["0", "1", "2"], output[-2000:]
    assert all(int(rate) > 0 for _, rate in waves)
    output = run_benchmark(
        "bench_engine.py",
        *("--device", "cpu", "--preset", "tiny", "--concurrency", "8", "--max-tokens", "16", "--http"),
    )
    rate = re.search(r"HTTP .* C=8: (\d+) tok/s over", output)
    assert rate is not None and int(rate.group(1)) > 0, output[-2000:]


def test_bench_serving_counts_every_token_the_timed_waves_asked_for(tmp_path):
    out = tmp_path / "serving.json"
    run_benchmark(
        "bench_serving.py",
        *("--servers", "builtin", "--device", "cpu", "--preset", "tiny", "--concurrency", "8"),
        *("--waves", "2", "--max-tokens", "16", "--client-processes", "2", "--out", str(out)),
    )
    (row,) = json.loads(out.read_text())["results"]
    assert row["server"] == "builtin" and row["concurrency"] == 8
    assert row["tokens"] == 2 * 8 * 16  # waves x requests x exactly max_tokens (ignore_eos)
    assert row["tokens_per_s"] > 0 and len(row["client_cpu_per_wall_s"]) == 2
    engine = row["engine"]  # the server's own counters over the timed waves
    assert engine["decode_steps_per_s"] > 0 and 0 <= engine["idle_share"] <= 1


def test_bench_decode_step_measures_each_search_with_and_without_sampling():
    output = run_benchmark(
        "bench_decode_step.py",
        *("--device", "cpu", "--preset", "tiny", "--rows", "8", "--length", "64", "--iters", "2"),
        *("--search", "auto", "blocks", "rows"),
    )
    assert re.findall(r"sampling search: (\w+)", output) == ["auto", "blocks", "rows"]
    steps = re.findall(r"rows 8, 64 keys: .*?(, sampled in it)? ([\d.]+) ms per step", output)
    assert len(steps) == 6 and all(float(ms) > 0 for _, ms in steps), output[-2000:]


def test_bench_prefill_times_each_shape_under_each_attention_choice():
    output = run_benchmark(
        "bench_prefill.py",
        *("--device", "cpu", "--preset", "tiny", "--shapes", "2x16", "3x40", "--iters", "2"),
        *("--prefill-attention", "server", "math"),
    )
    assert re.findall(r"prefill attention: (\w+)", output) == ["server", "math"]
    timed = re.findall(r"^(\d+x\d+): .* ([\d.]+) ms per prefill", output, flags=re.MULTILINE)
    assert [shape for shape, _ in timed] == ["2x16", "3x40"] * 2 and all(float(ms) > 0 for _, ms in timed)


def test_bench_sampling_times_each_search():
    output = run_benchmark(
        "bench_sampling.py", "--device", "cpu", "--rows", "8", "--logprobs", "1", "--iters", "2",
        "--search", "blocks", "rows",
    )  # fmt: skip
    timed = re.findall(r"search (\w+)\s*:\s*sampled\s+([\d.]+)\s+greedy\s+([\d.]+)", output)
    assert [search for search, _, _ in timed] == ["blocks", "rows"], output[-2000:]


def test_bench_weight_sync_gathers_under_fsdp2_and_checks_what_it_read():
    # Two gloo processes; the benchmark compares every way's tensors with one process's before timing them.
    output = run_benchmark("bench_weight_sync.py", "--gather", "--repeats", "1")
    ways = re.findall(r"^  (.+?)\s+gather\s+([\d.]+) ms\s+file\s+([\d.]+) ms", output, flags=re.MULTILINE)
    assert len(ways) == 6 and ways[0][0] == "one process (reference)", output[-2000:]


def test_bench_weight_deltas_sends_less_than_whole_after_the_first_sync():
    output = run_benchmark("bench_weight_deltas.py", "--preset", "small", "--steps", "2", "--lr", "1e-6")
    shares = re.findall(r"lr 1e-06, (.+?): +([\d.]+)% of elements changed, .*\( *([\d.]+)%\)", output)
    assert [label for label, _, _ in shares] == ["first sync (whole)", "after step 1", "after step 2"], output
    assert float(shares[0][1]) == float(shares[0][2]) == 100.0
    assert all(0 < float(changed) < 50 and 0 < float(sent) < 100 for _, changed, sent in shares[1:]), output


def test_bench_host_step_takes_the_async_graph_path():
    # The benchmark refuses to report a run in which no decode step went ahead (not the GPU's path).
    output = run_benchmark("bench_host_step.py", "--rows", "8", "--max-tokens", "8", "--repeats", "1")
    timed = re.search(r"rows 8: ([\d.]+) ms of host time per decode step", output)
    assert timed is not None and float(timed.group(1)) > 0, output[-2000:]


def test_bench_trainer_ab_runs_both_arms_and_reports_their_ratio(tmp_path):
    # The trainer's async-against-sync A/B (issue 19's third target), both arms whole on CPU.
    out = tmp_path / "ab.json"
    run_benchmark(
        "bench_trainer.py", "--ab", "--preset", "tiny", "--steps", "2", "--device", "cpu", "--out", str(out)
    )
    result = json.loads(out.read_text())
    arms = result["summaries"]
    assert arms["async"]["max_staleness"] == 2 and arms["sync"]["max_staleness"] == 0
    assert arms["sync"]["staleness_mean"] == 0  # a sync step trains samples of the current policy alone
    for arm in arms.values():
        assert 0 < arm["trained_tokens_per_step_mean"] <= arm["forwarded_tokens_per_step_mean"]
        assert arm["forwarded_tokens_per_step_mean"] <= arm["token_budget"]
    ratio = arms["async"]["trained_tokens_per_s"] / arms["sync"]["trained_tokens_per_s"]
    assert result["speedup_async_over_sync"] == pytest.approx(ratio)
    assert [len(result["logs"][name]) for name in ("async", "sync")] == [2, 2]  # one log row per step
