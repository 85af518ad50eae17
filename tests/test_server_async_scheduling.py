"""The engine's async scheduling: each decode step launched before the previous one is read.

On CPU the graphs' padded forwards run eagerly (`StepGraphs(capture=False)`), so the steps do not overlap in
time, but the engine takes the same path as on a GPU: the next step's tokens come from the sampled tensor
of the step before it (reordered on the device when rows finished), a request that ends is read one step
late and its token from the step ahead is dropped, requests admitted meanwhile are prefilled behind the step
in flight, and whatever else changes the rows (aborts, commands, a cache that must grow) first reads it.
Each test compares with the same engine scheduling step by step, and greedy outputs with a direct forward
of the model.
"""

from __future__ import annotations

import time

import pytest
import torch
from engine_requests import Outputs, run_requests

from harness.server.cuda_graphs import StepGraphs
from harness.server.engine import Engine, GenerationOutput
from harness.server.sampling import SamplingParams
from harness.testing import build_tiny_qwen3

PROMPTS = [[5, 6, 7], list(range(20, 61)), list(range(100, 170)), [9, 9, 2, 4]]


def make_engine(*, ahead: bool, **kwargs) -> Engine:
    options = {"max_model_len": 192, "eos_token_ids": [], "max_num_seqs": 8, "kv_cache_tokens": 8 * 192}
    options.update(kwargs)
    model = build_tiny_qwen3()
    engine = Engine(model, enforce_eager=True, async_scheduling=ahead, **options)
    engine.graphs = StepGraphs(model, engine.cache, capture=False)
    return engine


def generate(
    engine: Engine, prompts: list[list[int]], params: list[SamplingParams]
) -> list[GenerationOutput]:
    engine.start()
    try:
        return run_requests(engine, prompts, params, together=True)
    finally:
        engine.close()


def assert_same(left: list[GenerationOutput], right: list[GenerationOutput]) -> None:
    for a, b in zip(left, right, strict=True):
        assert a.output_ids == b.output_ids
        assert a.finish_reason == b.finish_reason and a.stop_reason == b.stop_reason
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert [[t for t, _ in top] for top in a.top_logprobs or []] == [
            [t for t, _ in top] for top in b.top_logprobs or []
        ]


def assert_greedy_matches(output: GenerationOutput) -> None:
    tokens = torch.tensor([output.prompt_ids + output.output_ids])
    with torch.no_grad():
        logprobs = build_tiny_qwen3()(tokens).logits[0].float().log_softmax(-1)
    start = len(output.prompt_ids) - 1
    assert output.output_ids == logprobs[start:-1].argmax(-1).tolist()


def mixed_params() -> list[SamplingParams]:
    """Greedy with top-3, seeded sampling, seeded top-k, greedy: four lengths, so rows end at four steps
    and the last rows move into the holes while steps run ahead."""
    return [
        SamplingParams(max_tokens=100, temperature=0.0, num_logprobs=3),
        SamplingParams(max_tokens=37, temperature=1.0, seed=11, num_logprobs=0),
        SamplingParams(max_tokens=80, temperature=0.8, top_k=20, seed=12, num_logprobs=2),
        SamplingParams(max_tokens=5, temperature=0.0, num_logprobs=1),
    ]


def test_decoding_ahead_gives_what_step_by_step_decoding_gives():
    step_by_step = generate(make_engine(ahead=False), PROMPTS, mixed_params())
    engine = make_engine(ahead=True)
    ahead = generate(engine, PROMPTS, mixed_params())
    assert_same(step_by_step, ahead)
    # Nearly every decode step went ahead: all but those after a prefill and across cache growth.
    assert engine.num_steps_ahead >= 90
    assert [len(o.output_ids) for o in ahead] == [100, 37, 80, 5]
    assert engine.stats().num_generation_tokens == 100 + 37 + 80 + 5  # the tokens past an end not counted
    assert_greedy_matches(ahead[0])
    assert_greedy_matches(ahead[3])


def test_a_stop_token_ends_a_request_read_a_step_late():
    # The greedy continuation of each prompt, then the same requests told to stop at one of its tokens (and
    # an EOS taken from the first): each ends at the first stop or EOS token of its continuation, though the
    # engine had already launched the step after it.
    free = generate(make_engine(ahead=False), PROMPTS, [SamplingParams(max_tokens=30, temperature=0.0)] * 4)
    eos = free[0].output_ids[20]
    stops = [output.output_ids[5 + 3 * i] for i, output in enumerate(free)]
    params = [SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=(stop,)) for stop in stops]
    engine = make_engine(ahead=True, eos_token_ids=[eos])
    ahead = generate(engine, PROMPTS, params)
    assert_same(generate(make_engine(ahead=False, eos_token_ids=[eos]), PROMPTS, params), ahead)
    for output, continuation, stop in zip(ahead, free, stops, strict=True):
        end = next(i for i, token in enumerate(continuation.output_ids) if token in (stop, eos))
        assert output.output_ids == continuation.output_ids[: end + 1]
        assert output.finish_reason == "stop"
        assert output.stop_reason == (stop if output.output_ids[-1] == stop else None)
    assert engine.num_steps_ahead > 0


def test_requests_arriving_while_steps_run_ahead_are_admitted_between_them():
    # A long request decodes ahead; two arrive (they are prefilled behind the step in flight, and decoding
    # goes on ahead with three rows), then one more after the first two have ended.
    engine = make_engine(ahead=True, max_num_seqs=4)
    params = SamplingParams(max_tokens=60, temperature=0.0, num_logprobs=0)
    short = SamplingParams(max_tokens=10, temperature=0.0, num_logprobs=0)
    outputs = Outputs(4)  # the on_done callback: outputs in the order they ended

    engine.start()
    try:
        engine.submit([9, 8, 7, 6], params, outputs, request_id="first")
        while engine.stats().num_generation_tokens < 5:
            time.sleep(0.002)
        engine.submit(list(range(30, 50)), short, outputs, request_id="second")
        engine.submit([4, 4, 4], short, outputs, request_id="third")
        while len(outputs) < 2:
            time.sleep(0.002)
        engine.submit(list(range(60, 75)), params, outputs, request_id="fourth")
        assert outputs.done.wait(60)
    finally:
        engine.close()
    assert engine.num_steps_ahead > 40
    # The arrivals joined the running request at once rather than after it ended.
    assert sorted(list(outputs)[:2]) == ["second", "third"]
    for output in outputs.values():
        assert len(output.output_ids) == (10 if output.request_id in ("second", "third") else 60)
        assert_greedy_matches(output)


def test_requests_arriving_while_a_step_is_in_flight_are_prefilled_behind_it():
    # A long request decodes ahead; four arrive: a seeded one, two twins (one prompt, two seeds)
    # and one whose prompt continues the running request's (a prefix hit on its row). They are prefilled
    # behind the step in flight, and the next step takes its tokens from both, still on the device; every
    # output equals what the same request gives when served alone, step by step.
    long_prompt = PROMPTS[2]
    prompts = [long_prompt, list(range(30, 70)), [9, 9, 2, 4], [9, 9, 2, 4], [*long_prompt, 3, 1, 4]]
    params = [
        SamplingParams(max_tokens=100, temperature=0.0, num_logprobs=3),
        SamplingParams(max_tokens=20, temperature=1.0, seed=21, num_logprobs=1),
        SamplingParams(max_tokens=1, temperature=1.0, seed=22, num_logprobs=0),  # ends at its first token
        SamplingParams(max_tokens=15, temperature=1.0, seed=23, num_logprobs=0),
        SamplingParams(max_tokens=25, temperature=0.0, num_logprobs=2),
    ]
    alone = [generate(make_engine(ahead=False), [p], [q])[0] for p, q in zip(prompts, params, strict=True)]
    engine = make_engine(ahead=True)
    outputs = Outputs(len(prompts))
    engine.start()
    try:
        engine.submit(prompts[0], params[0], outputs, request_id="0")
        while engine.num_steps_ahead < 3:
            time.sleep(0.002)
        for i in range(1, len(prompts)):  # (a pause would read the step in flight: they come as they come)
            engine.submit(prompts[i], params[i], outputs, request_id=str(i))
        assert outputs.done.wait(60)
    finally:
        engine.close()
    stats = engine.stats()
    assert stats.num_prefills_ahead >= 1
    assert stats.num_prefix_cache_hits >= len(long_prompt) // 16 * 16
    assert_same(alone, [outputs[str(i)] for i in range(len(prompts))])
    assert_greedy_matches(outputs["4"])


def test_aborts_and_commands_wait_for_the_step_in_flight():
    engine = make_engine(ahead=True)
    params = SamplingParams(max_tokens=100, temperature=0.0, num_logprobs=0)
    outputs = Outputs(3)  # the on_done callback: outputs in the order they ended

    engine.start()
    try:
        for i, prompt in enumerate(PROMPTS[:3]):
            engine.submit(prompt, params, outputs, request_id=str(i))
        while engine.num_steps_ahead < 5:
            time.sleep(0.002)
        # A command sees no step in flight, and every row's keys are all written (num_cached = tokens - 1).
        seen = engine.call(
            lambda: (engine._in_flight, [len(r.tokens) - r.num_cached for r in engine._running])
        )
        in_flight, gaps = seen.result(10)
        assert in_flight is None and gaps == [1, 1, 1]
        engine.abort("1")
        assert outputs.done.wait(60)
    finally:
        engine.close()
    assert outputs["1"].finish_reason == "abort" and 0 < len(outputs["1"].output_ids) < 100
    for key in ("0", "2"):
        assert len(outputs[key].output_ids) == 100
        assert_greedy_matches(outputs[key])


def test_the_repetition_penalty_keeps_decoding_step_by_step():
    # The penalty reads each row's tokens on the host, the token in flight among them: no step goes ahead.
    params = [SamplingParams(max_tokens=30, temperature=0.0, repetition_penalty=1.3)] * 2
    step_by_step = generate(make_engine(ahead=False), PROMPTS[:2], params)
    engine = make_engine(ahead=True)
    assert_same(step_by_step, generate(engine, PROMPTS[:2], params))
    assert engine.num_steps_ahead == 0


def test_a_cache_that_must_grow_stops_the_steps_ahead_first():
    # Rows grow past the allocated length (64, then 128 positions): the step in flight is read before the
    # cache reallocates, and the outputs still equal step-by-step decoding.
    engine = make_engine(ahead=True)
    versions = engine.cache.version
    params = [SamplingParams(max_tokens=150, temperature=0.0, num_logprobs=0)] * 2
    ahead = generate(engine, PROMPTS[:2], params)
    assert engine.cache.version >= versions + 3
    assert_same(generate(make_engine(ahead=False), PROMPTS[:2], params), ahead)
    assert_greedy_matches(ahead[1])


def test_the_server_schedules_ahead_by_default_where_decode_steps_are_graphed():
    import argparse

    from harness.server.cli import _configure_parser
    from harness.server.state import ServerConfig, ServerState

    for setting, expected in ((None, False), (True, True)):  # None: on a GPU without enforce_eager only
        state = ServerState.from_model(build_tiny_qwen3(), ServerConfig(model="m", async_scheduling=setting))
        try:
            assert state.engine.async_scheduling is expected
        finally:
            state.close()
    parser = argparse.ArgumentParser()
    _configure_parser(parser)
    assert parser.parse_args(["m"]).async_scheduling is None
    assert parser.parse_args(["m", "--async-scheduling"]).async_scheduling is True
    assert parser.parse_args(["m", "--no-async-scheduling"]).async_scheduling is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_graphs_decoding_ahead_give_the_eager_engines_outputs():
    def engine_on_gpu(**kwargs) -> Engine:
        options = {"max_model_len": 192, "eos_token_ids": [], "max_num_seqs": 8, "kv_cache_tokens": 8 * 192}
        return Engine(build_tiny_qwen3().cuda(), **options, **kwargs)

    eager = generate(engine_on_gpu(enforce_eager=True), PROMPTS, mixed_params())
    engine = engine_on_gpu(async_scheduling=True)
    ahead = generate(engine, PROMPTS, mixed_params())
    assert engine.graphs is not None and engine.graphs.enabled and engine.num_steps_ahead >= 90
    for a, b in zip(eager, ahead, strict=True):
        assert a.output_ids == b.output_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
