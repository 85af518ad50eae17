"""The engine without HTTP: preemption under a tight KV budget, the cache's storage within that budget, and
recompute after a weight change.

Both paths rebuild a request's cache from its tokens; the tests check the outputs still equal a direct
forward pass (greedy), so a recompute that dropped or shifted a position would show.
"""

from __future__ import annotations

import threading

import pytest
import torch
from engine_requests import run_requests

from harness.generation.server_load import parse_prometheus
from harness.server.engine import Engine, GenerationOutput
from harness.server.histograms import Histogram
from harness.server.kv_cache import RowKVCache
from harness.server.metrics import render_metrics
from harness.server.sampling import SamplingParams
from harness.testing import build_tiny_qwen3

MAX_MODEL_LEN = 64


def assert_greedy_matches(model: torch.nn.Module, output: GenerationOutput) -> None:
    tokens = output.prompt_ids + output.output_ids
    with torch.no_grad():
        logprobs = model(torch.tensor([tokens])).logits[0].log_softmax(-1)
    start = len(output.prompt_ids) - 1
    assert output.output_ids == logprobs[start:-1].argmax(-1).tolist()
    assert output.logprobs == pytest.approx(
        [logprobs[start + j, t].item() for j, t in enumerate(output.output_ids)], abs=1e-4
    )


def test_a_tight_kv_budget_preempts_and_recomputes_correctly():
    # Four requests growing to 60 tokens, a budget of two full rows: the newest must be preempted.
    engine = Engine(
        build_tiny_qwen3(),
        max_model_len=MAX_MODEL_LEN,
        eos_token_ids=[],
        max_num_seqs=4,
        kv_cache_tokens=2 * 64,
    )
    allocations = record_allocations(engine.cache)
    engine.start()
    try:
        prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
        outputs = run_requests(
            engine, prompts, SamplingParams(max_tokens=56, temperature=0.0, num_logprobs=0)
        )
        stats = engine.stats()
    finally:
        engine.close()
    reference = build_tiny_qwen3()
    for output in outputs:
        assert output.finish_reason == "length"
        assert_greedy_matches(reference, output)
    assert stats.num_preemptions > 0
    assert max(allocations) <= 2 * 64  # the scratch row counted
    assert engine.cache.allocated_bytes == 0  # released at close


def record_allocations(cache: RowKVCache) -> list[int]:
    """Positions allocated after each `reserve` of `cache` (the scratch row's included)."""
    allocations: list[int] = []
    reserve = cache.reserve

    def recording(num_rows: int, length: int) -> None:
        reserve(num_rows, length)
        allocations.append(cache.allocated_tokens)

    cache.reserve = recording  # type: ignore[method-assign]
    return allocations


def test_cache_storage_stays_within_its_budget_scratch_row_included():
    # 16,384 tokens at up to 128 positions, as the 256-request load test: the engine runs as many rows as
    # `rows_fitting` allows at each length, and the doubling never takes the storage past the budget.
    cache = RowKVCache(
        num_layers=1,
        num_kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_rows=256,
        max_length=128,
        capacity_tokens=16384,
    )
    for length in range(1, 129):
        rows = min(256, cache.rows_fitting(length))
        cache.reserve(rows, length)
        assert cache.allocated_rows >= rows and cache.allocated_length >= length
        assert cache.allocated_tokens <= 16384, (length, cache.allocated_rows, cache.allocated_length)
    assert cache.rows_fitting(70) == 233  # 234 rows of 70 and the scratch row would take 16,450
    assert cache.rows_fitting(16384) == 1  # one request always runs


def test_changed_weights_are_used_for_every_token_after_the_change():
    model = build_tiny_qwen3()
    new_weights = build_tiny_qwen3(seed=5).state_dict()
    engine = Engine(model, max_model_len=MAX_MODEL_LEN, eos_token_ids=[], max_num_seqs=4, kv_cache_tokens=256)
    engine.start()
    try:
        engine.pause("keep").result(10)

        def swap() -> None:
            model.load_state_dict(new_weights)
            engine.invalidate_cache()

        # Requests submitted while paused wait; the swap happens before any of their tokens.
        result: list[GenerationOutput] = []
        thread = threading.Thread(
            target=lambda: result.extend(
                run_requests(
                    engine, [[5, 6, 7]], SamplingParams(max_tokens=20, temperature=0.0, num_logprobs=0)
                )
            )
        )
        thread.start()
        engine.call(swap).result(10)
        engine.resume().result(10)
        thread.join(30)
    finally:
        engine.close()
    new_model = build_tiny_qwen3(seed=5)
    assert_greedy_matches(new_model, result[0])


def test_close_answers_pending_requests_with_abort():
    engine = Engine(build_tiny_qwen3(), max_model_len=MAX_MODEL_LEN, eos_token_ids=[], kv_cache_tokens=256)
    engine.start()
    engine.pause("keep").result(10)
    outputs: list[GenerationOutput | BaseException] = []
    engine.submit([1, 2, 3], SamplingParams(max_tokens=5), outputs.append)
    engine.close()
    assert len(outputs) == 1 and isinstance(outputs[0], GenerationOutput)
    assert outputs[0].finish_reason == "abort"
    engine.close()  # idempotent


def test_phase_counters_count_the_forwards_and_split_the_thread_time():
    """Four requests submitted together: one prefill of all four, then one decode step per token after the
    first (each request's first token comes from the prefill); the engine idles while paused before."""
    engine = Engine(build_tiny_qwen3(), max_model_len=MAX_MODEL_LEN, eos_token_ids=[], kv_cache_tokens=8 * 64)
    engine.start()
    try:
        prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
        run_requests(engine, prompts, SamplingParams(max_tokens=9, temperature=0.0), together=True)
        stats = engine.stats()
    finally:
        engine.close()
    assert (stats.num_prefill_steps, stats.num_prefill_requests) == (1, 4)
    assert stats.num_decode_steps == 8
    assert stats.prefill_s > 0 and stats.decode_s > 0 and stats.idle_s > 0
    samples = parse_prometheus(render_metrics(stats, model_name="m", max_model_len=MAX_MODEL_LEN))
    shown = {
        (s.name, s.labels.get("phase", s.labels.get("run"))): s.value
        for s in samples
        if s.name.startswith("harness:engine")
    }
    assert shown == {
        ("harness:engine_prefills_total", "replayed"): 0,  # no CUDA graphs on a CPU
        ("harness:engine_prefills_total", "captured"): 0,
        ("harness:engine_prefills_total", "eager"): 1,
        ("harness:engine_prefill_seconds_total", "replayed"): 0,
        ("harness:engine_prefill_seconds_total", "captured"): 0,
        ("harness:engine_prefill_seconds_total", "eager"): stats.prefill_s,
        ("harness:engine_seconds_total", "prefill"): stats.prefill_s,
        ("harness:engine_seconds_total", "decode"): stats.decode_s,
        ("harness:engine_seconds_total", "idle"): stats.idle_s,
        ("harness:engine_steps_total", "prefill"): 1,
        ("harness:engine_steps_total", "decode"): 8,
        ("harness:engine_prefill_requests_total", None): 4,
        ("harness:engine_prefills_ahead_total", None): 0,  # no async scheduling here
    }


def test_a_histogram_counts_each_observation_in_the_first_bucket_that_holds_it():
    histogram = Histogram((0.1, 0.5, 1.0))
    for value in (0.05, 0.1, 0.3, 1.0, 2.0):
        histogram.observe(value)
    snapshot = histogram.snapshot()
    assert snapshot.cumulative == (2, 3, 4)  # a value on a bound is in that bucket; 2.0 only in +Inf
    assert (snapshot.count, snapshot.sum) == (5, pytest.approx(3.45))
    with pytest.raises(ValueError, match="increase"):
        Histogram((1.0, 0.5))


def test_latency_histograms_follow_each_request_from_submission_to_its_end():
    """One row: the second of two requests submitted together waits in the queue while the first runs, so
    the queue time is about a third of the end-to-end times summed; an aborted request is not counted."""
    engine = Engine(
        build_tiny_qwen3(),
        max_model_len=MAX_MODEL_LEN,
        eos_token_ids=[],
        kv_cache_tokens=8 * 64,
        max_num_seqs=1,
    )
    engine.start()
    try:
        prompts = [[5, 6, 7], [8, 9, 10]]
        run_requests(engine, prompts, SamplingParams(max_tokens=40, temperature=0.0), together=True)
        engine.pause("keep").result(10)
        aborted = threading.Event()
        engine.submit([1, 2], SamplingParams(max_tokens=4), lambda output: aborted.set(), request_id="gone")
        engine.abort("gone")
        engine.resume().result(10)
        assert aborted.wait(10)
        stats = engine.stats()
    finally:
        engine.close()
    assert stats.num_finished["abort"] == 1
    queue, first, e2e = stats.queue_time, stats.time_to_first_token, stats.e2e_latency
    assert queue.count == first.count == e2e.count == 2
    assert 0 < queue.sum < first.sum < e2e.sum
    assert queue.sum > 0.2 * e2e.sum  # the second request queued through the first one's whole run
    samples = parse_prometheus(render_metrics(stats, model_name="m", max_model_len=MAX_MODEL_LEN))
    buckets = [s for s in samples if s.name == "vllm:e2e_request_latency_seconds_bucket"]
    counts = [s.value for s in buckets]
    assert buckets[-1].labels["le"] == "+Inf" and counts[-1] == 2 and counts == sorted(counts)
    shown = {s.name: s.value for s in samples if s.name.endswith(("_sum", "_count"))}
    assert shown["vllm:request_queue_time_seconds_count"] == 2
    assert shown["vllm:time_to_first_token_seconds_sum"] == pytest.approx(first.sum)
    assert shown["vllm:e2e_request_latency_seconds_sum"] == pytest.approx(e2e.sum)
