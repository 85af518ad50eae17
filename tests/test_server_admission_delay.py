"""The engine's admission delay (`scheduler_delay_factor`): requests arriving one by one while rows decode
wait for the delay and then share one prefill; with no row running they go at once; 0 admits every step."""

from __future__ import annotations

import threading
import time
from collections import deque

import pytest
from engine_requests import run_requests
from test_server_engine import assert_greedy_matches

from harness.server.engine import Engine, GenerationOutput
from harness.server.sampling import SamplingParams
from harness.server.state import ServerConfig, ServerState, default_delay_factor
from harness.testing import build_tiny_qwen3

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, num_logprobs=0)
LONG = SamplingParams(max_tokens=56, temperature=0.0, num_logprobs=0)


def new_engine(factor: float) -> Engine:
    """An engine on the tiny model with that delay factor, not started."""
    return Engine(
        build_tiny_qwen3(),
        max_model_len=64,
        eos_token_ids=[],
        max_num_seqs=4,
        kv_cache_tokens=512,
        scheduler_delay_factor=factor,
    )


def make_engine(factor: float) -> tuple[Engine, list[int]]:
    """A started engine on the tiny model and the list it appends each prefill's number of rows to."""
    engine = new_engine(factor)
    prefills: list[int] = []
    prefill = engine._prefill

    def recording(chosen, twins):  # type: ignore[no-untyped-def]
        prefills.append(len(chosen) + len(twins))
        prefill(chosen, twins)

    engine._prefill = recording  # type: ignore[method-assign]
    engine.start()
    return engine, prefills


def wait_for(condition, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def arrivals_during_a_long_request(factor: float) -> tuple[list[int], list[GenerationOutput], list[str]]:
    """A long request decodes; two short ones arrive one after the other while it runs (the second once
    the engine has seen the first). The prefills' sizes, the short outputs, and the finishing order."""
    engine, prefills = make_engine(factor)
    finished: list[str] = []
    outputs: list[GenerationOutput] = []
    lock = threading.Lock()

    def on_done(result: GenerationOutput | BaseException) -> None:
        assert isinstance(result, GenerationOutput), result
        with lock:
            finished.append(result.request_id)
            if result.request_id != "long":
                outputs.append(result)

    try:
        engine.submit([5, 6, 7], LONG, on_done, request_id="long")
        wait_for(lambda: engine.stats().num_generation_tokens > 0)
        engine.submit([8, 9], GREEDY, on_done, request_id="first")
        wait_for(lambda: len(engine._running) + len(engine._waiting) == 2)  # taken from the inbox
        engine.submit([10, 11, 12], GREEDY, on_done, request_id="second")
        wait_for(lambda: len(finished) == 3)
    finally:
        engine.close()
    return prefills, sorted(outputs, key=lambda o: o.request_id), finished


def test_arrivals_while_rows_decode_wait_and_share_one_prefill():
    # A delay far longer than the long request: the two short ones wait until it is done, then the engine,
    # with no row running, admits them at once and together.
    prefills, outputs, finished = arrivals_during_a_long_request(factor=1e9)
    assert prefills == [1, 2]
    assert finished[0] == "long"
    reference = build_tiny_qwen3()
    for output in outputs:
        assert output.finish_reason == "length"
        assert_greedy_matches(reference, output)


def test_without_a_delay_each_arrival_is_prefilled_at_the_next_step():
    prefills, outputs, finished = arrivals_during_a_long_request(factor=0.0)
    assert prefills == [1, 1, 1]
    assert finished[-1] == "long"  # the short ones ran beside it
    reference = build_tiny_qwen3()
    for output in outputs:
        assert_greedy_matches(reference, output)


def test_the_delay_is_the_factor_times_the_median_of_recent_prefills():
    engine = new_engine(2.0)  # not started: its scheduling state is set by hand
    outputs: list[GenerationOutput | BaseException] = []
    for tokens in ([1, 2], [3, 4]):
        engine.submit(tokens, GREEDY, outputs.append)
    engine._take_inbox()
    running, waiting = engine._waiting
    engine._running, engine._waiting = [running], deque([waiting])
    # One slow prefill (a graph capture, say) among fast ones does not set the pace: the median is 0.1 s.
    engine._prefill_s.extend([0.1, 0.1, 5.0])
    now = time.monotonic()
    waiting.submitted_s = now - 0.15
    assert engine._delaying_admission()  # waited 0.15 s of 2 x 0.1 s
    waiting.submitted_s = now - 0.25
    assert not engine._delaying_admission()
    waiting.submitted_s = now
    engine._running = []
    assert not engine._delaying_admission()  # nothing decodes: no reason to wait
    engine._running = [running]
    engine.scheduler_delay_factor = 0.0
    assert not engine._delaying_admission()
    engine.close()


def test_a_delayed_engine_still_serves_a_burst_exactly():
    engine, prefills = make_engine(factor=4.0)
    try:
        prompts = [[5 + i, 6, 7] for i in range(4)]
        outputs = run_requests(engine, prompts, GREEDY, together=True)
    finally:
        engine.close()
    assert prefills == [
        4
    ]  # all four arrived before the first step: one prefill, no delay with no row running
    reference = build_tiny_qwen3()
    for output in outputs:
        assert_greedy_matches(reference, output)


@pytest.mark.parametrize("factor", [-0.5, float("nan")])
def test_a_negative_or_nan_factor_is_refused_with_its_name(factor):
    with pytest.raises(ValueError, match="scheduler_delay_factor must be >= 0"):
        ServerConfig(model="m", scheduler_delay_factor=factor)
    with pytest.raises(ValueError, match="scheduler_delay_factor must be >= 0"):
        new_engine(factor)


def test_the_server_admits_at_every_step_unless_given_a_delay():
    assert default_delay_factor(None) == 0.0
    assert default_delay_factor(1.0) == 1.0  # an explicit factor is kept
    for factor, expected in ((None, 0.0), (0.5, 0.5)):
        state = ServerState.from_model(
            build_tiny_qwen3(), ServerConfig(model="m", scheduler_delay_factor=factor)
        )
        try:
            assert state.engine.scheduler_delay_factor == expected
        finally:
            state.close()
