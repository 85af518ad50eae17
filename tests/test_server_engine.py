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
    }
