"""The engine's decode steps and small prefills replayed from CUDA graphs (`harness/server/cuda_graphs.py`).

On CPU the graphs' padded forwards run eagerly (`capture=False`): the same padding rows and tokens, shape
buckets, in-graph masks and writes the graphs record, checked against the engine's eager forwards and a
direct forward, with prefixes from the prefix cache and a group sharing one prefill.
The gpu tests capture real graphs and check them against eager decoding, across a weight update, cache
growth, and a model whose forward cannot be captured.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch
from engine_requests import Outputs, run_requests

from harness.server import cuda_graphs
from harness.server.cuda_graphs import StepGraphs, bucket, token_bucket
from harness.server.engine import Engine, GenerationOutput
from harness.server.sampling import SamplingParams
from harness.testing import build_tiny_qwen3

MAX_MODEL_LEN = 192
PROMPTS = [[5, 6, 7], list(range(20, 61)), list(range(100, 170))]  # 3, 41 and 70 tokens


def make_engine(model: torch.nn.Module, *, graphs: str, **kwargs) -> Engine:
    """graphs: "none" (eager decode), "padded" (the graphs' step run eagerly) or "cuda" (captured)."""
    options = {
        "max_model_len": MAX_MODEL_LEN,
        "eos_token_ids": [],
        "max_num_seqs": 8,
        "kv_cache_tokens": 8 * 192,
    }
    options.update(kwargs)
    engine = Engine(model, enforce_eager=graphs != "cuda", **options)
    if graphs == "padded":
        engine.graphs = StepGraphs(model, engine.cache, capture=False)
    assert (engine.graphs is not None) == (graphs != "none")
    return engine


def generate(
    engine: Engine, prompts: list[list[int]], params: list[SamplingParams]
) -> list[GenerationOutput]:
    engine.start()
    try:
        return run_requests(engine, prompts, params)
    finally:
        engine.close()


def assert_greedy_matches(model: torch.nn.Module, output: GenerationOutput, atol: float) -> None:
    device = next(model.parameters()).device
    tokens = torch.tensor([output.prompt_ids + output.output_ids], device=device)
    with torch.no_grad():
        logprobs = model(tokens).logits[0].float().log_softmax(-1)
    start = len(output.prompt_ids) - 1
    assert output.output_ids == logprobs[start:-1].argmax(-1).tolist()
    expected = [logprobs[start + j, t].item() for j, t in enumerate(output.output_ids)]
    assert output.logprobs == pytest.approx(expected, abs=atol)


def mixed_params() -> list[SamplingParams]:
    """Greedy with top-3 log-probs, seeded sampling, seeded top-k sampling: one per prompt."""
    return [
        SamplingParams(max_tokens=100, temperature=0.0, num_logprobs=3),
        SamplingParams(max_tokens=90, temperature=1.0, seed=11, num_logprobs=0),
        SamplingParams(max_tokens=80, temperature=0.8, top_k=20, seed=12, num_logprobs=2),
    ]


def plain_params() -> list[SamplingParams]:
    """Sampling by temperature alone, which a decode step's graph records with it: greedy with its top-1
    log-prob, seeded at temperature 1 with its sampled token's, seeded at 0.7 with none."""
    return [
        SamplingParams(max_tokens=100, temperature=0.0, num_logprobs=1),
        SamplingParams(max_tokens=90, temperature=1.0, seed=11, num_logprobs=0),
        SamplingParams(max_tokens=80, temperature=0.7, seed=12),
    ]


def assert_same_outputs(left: list[GenerationOutput], right: list[GenerationOutput], atol: float) -> None:
    for a, b in zip(left, right, strict=True):
        assert a.output_ids == b.output_ids
        assert a.finish_reason == b.finish_reason
        assert a.logprobs == pytest.approx(b.logprobs, abs=atol)
        for top_a, top_b in zip(a.top_logprobs or [], b.top_logprobs or [], strict=True):
            assert [token for token, _ in top_a] == [token for token, _ in top_b]


def test_bucket_pads_to_a_power_of_two_within_the_limit():
    assert [bucket(n, 64) for n in (1, 2, 3, 5, 8, 9, 33, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert bucket(40, 48) == 48  # capped by what the cache holds
    assert bucket(3, 512, minimum=64) == 64
    assert bucket(65, 512, minimum=64) == 128


def test_token_bucket_pads_new_tokens_by_at_most_half():
    sizes = [1, 16, 17, 24, 25, 33, 49, 96, 97, 129, 160, 193, 1000]
    assert [token_bucket(n, 4096, minimum=16) for n in sizes] == [
        16, 16, 24, 24, 32, 48, 64, 96, 128, 192, 192, 256, 1024,
    ]  # fmt: skip
    assert token_bucket(150, 160) == 160  # capped by the cache's length
    for n in range(1, 3000):
        padded = token_bucket(n, 1 << 20)
        assert n <= padded <= max(2, 3 * n // 2 + 1)


def test_the_padded_step_decodes_exactly_as_the_eager_one():
    # Three rows pad to four; the rows grow past 64 and 128 key positions, so the key bucket changes and the
    # cache reallocates mid-run (its version moves and the step is rebuilt).
    eager = generate(make_engine(build_tiny_qwen3(), graphs="none"), PROMPTS, mixed_params())
    engine = make_engine(build_tiny_qwen3(), graphs="padded")
    versions_before = engine.cache.version
    padded = generate(engine, PROMPTS, mixed_params())
    assert engine.cache.version > versions_before + 1
    assert_same_outputs(eager, padded, atol=1e-5)
    assert engine.graphs.num_forwards["prefill"] >= 1 and engine.graphs.num_forwards["decode"] >= 99
    assert max(len(o.prompt_ids) + len(o.output_ids) for o in padded) > 128
    assert_greedy_matches(build_tiny_qwen3(), padded[0], atol=1e-4)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_step_sampled_in_its_graph_draws_as_the_eager_engine_does(monkeypatch, compiled):
    # Every row samples by temperature alone, so each decode step runs with its sampling (the graphs'
    # "decode+sample" forward); with a top-k row among them (mixed_params, above) the step samples apart.
    # compiled: that sampling compiled by inductor (StepGraphs.compile_sampling), the same draws.
    monkeypatch.setattr(StepGraphs, "compile_sampling", compiled)
    eager = generate(make_engine(build_tiny_qwen3(), graphs="none"), PROMPTS, plain_params())
    engine = make_engine(build_tiny_qwen3(), graphs="padded")
    padded = generate(engine, PROMPTS, plain_params())
    assert engine.graphs is not None and engine.graphs.num_forwards["decode+sample"] > 50
    assert engine.graphs.num_forwards["decode"] == 0
    assert_same_outputs(eager, padded, atol=1e-5)
    assert [len(top) for top in padded[0].top_logprobs] == [1] * 100
    assert padded[0].top_logprobs[5][0] == (padded[0].output_ids[5], padded[0].logprobs[5])  # greedy: top-1
    assert padded[2].logprobs is None
    apart = make_engine(build_tiny_qwen3(), graphs="padded")
    generate(apart, PROMPTS, mixed_params())
    assert apart.graphs.num_forwards["decode+sample"] == 0 and apart.graphs.num_forwards["decode"] > 50


def test_in_graph_sampling_that_cannot_compile_runs_eagerly_after_a_warning(monkeypatch, caplog):
    def no_compiler(function, **options):
        def fails(*args):
            raise RuntimeError("no C++ compiler")

        return fails

    monkeypatch.setattr(StepGraphs, "compile_sampling", True)
    monkeypatch.setattr(torch, "compile", no_compiler)
    eager = generate(make_engine(build_tiny_qwen3(), graphs="none"), PROMPTS, plain_params())
    engine = make_engine(build_tiny_qwen3(), graphs="padded")
    with caplog.at_level(logging.WARNING, logger="harness.server.cuda_graphs"):
        engine.warm_up()  # tries to compile the sampling here, before any request
    assert "compiling the in-graph sampling failed, it runs eagerly instead" in caplog.text
    padded = generate(engine, PROMPTS, plain_params())
    assert engine.graphs.num_forwards["decode+sample"] > 50
    assert_same_outputs(eager, padded, atol=1e-5)


def test_padding_rows_leave_rows_joining_later_intact():
    # One request runs alone (a bucket of 1), then two join while it runs (three rows, padded to four: the
    # padding row is the next free one), then one more takes that row. Every greedy output must still equal
    # a direct forward, so no padding write may land in a row that a request holds or will hold.
    model = build_tiny_qwen3()
    engine = make_engine(model, graphs="padded", max_num_seqs=4)
    params = SamplingParams(max_tokens=60, temperature=0.0, num_logprobs=0)
    outputs = Outputs(4)  # the on_done callback

    engine.start()
    try:
        engine.submit([9, 8, 7, 6], params, outputs, request_id="first")
        while engine.stats().num_generation_tokens < 5:
            time.sleep(0.005)
        engine.submit(list(range(30, 50)), params, outputs, request_id="second")
        engine.submit([4, 4, 4], params, outputs, request_id="third")
        while engine.stats().num_generation_tokens < 40:
            time.sleep(0.005)
        engine.submit(list(range(60, 75)), params, outputs, request_id="fourth")
        assert outputs.done.wait(60)
    finally:
        engine.close()
    reference = build_tiny_qwen3()
    for output in outputs.values():
        assert len(output.output_ids) == 60
        assert_greedy_matches(reference, output, atol=1e-4)


def test_padded_prefills_continue_cached_prefixes_and_share_a_group_prefill():
    # A first request finishes (its keys go to the prefix store); then a second turn that extends it (its
    # prefill starts after the stored prefix), a group of four identical prompts (one prefill, its keys
    # copied to the twins) and an unrelated prompt arrive together: one padded prefill of three requests.
    model = build_tiny_qwen3()
    engine = make_engine(model, graphs="padded")
    greedy = SamplingParams(max_tokens=12, temperature=0.0, num_logprobs=0)
    engine.start()
    try:
        (first,) = run_requests(engine, [list(range(40, 75))], greedy)
        second_turn = first.prompt_ids + first.output_ids + [7, 8, 9]
        group = list(range(200, 230))
        outputs = run_requests(engine, [second_turn, group, group, group, group, [3, 1, 4]], greedy)
        stats = engine.stats()
    finally:
        engine.close()
    assert stats.num_prefix_cache_hits >= len(first.prompt_ids) + len(first.output_ids) - 1
    assert engine.graphs.num_forwards["prefill"] >= 2
    reference = build_tiny_qwen3()
    for output in [first, *outputs]:
        assert_greedy_matches(reference, output, atol=1e-4)
    assert len({tuple(o.output_ids) for o in outputs[1:5]}) == 1


class RecordingGraphs(StepGraphs):
    """StepGraphs whose "capture" runs the padded forward once, as the real capture's warm-up does (its
    results are the captured forward's), records it, and replays by running the padded forward (CPU)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, capture=True, **kwargs)
        self.captured: list[str] = []

    def _capture(self, forward):
        forward()
        self.captured.append("capture")
        return type("Replay", (), {"replay": staticmethod(forward)})()


def recording_graphs(rows: int, length: int) -> tuple[Engine, RecordingGraphs]:
    """A tiny model's engine (not started) and RecordingGraphs over its cache, sized to rows x length."""
    model = build_tiny_qwen3()
    engine = make_engine(model, graphs="none")
    graphs = RecordingGraphs(model, engine.cache)
    engine.cache.reserve(rows, length)
    return engine, graphs


@torch.inference_mode()  # as the engine's thread runs every forward
def test_a_decode_shape_is_captured_at_once_and_a_prefill_shape_once_it_recurs():
    engine, graphs = recording_graphs(4, 64)
    prompts = [list(range(10, 40)), list(range(50, 70))]

    def prefill() -> torch.Tensor:
        return graphs.prefill([0, 1], prompts, [0, 0]).clone()

    first = prefill()
    assert graphs.last_run == "eager"
    assert graphs.num_captures == 0 and prefill().equal(first)  # a new shape, then its second use: eager
    assert graphs.num_captures == 0 and graphs.last_run == "eager"
    assert prefill().equal(first) and graphs.num_captures == 1  # the third: captured
    assert graphs.last_run == "captured"
    assert prefill().equal(first) and graphs.num_captures == 1  # then replayed
    assert graphs.last_run == "replayed"
    graphs.decode([3, 4], [31, 21])
    assert graphs.num_captures == 2  # decode: at its first use
    graphs.decode([5, 6], [32, 22])
    assert graphs.num_captures == 2
    graphs.decode_and_sample([5, 6], [33, 23], [1.0, 1.0], [0.5, -1.0])
    assert graphs.num_captures == 3  # the same step with its sampling is a graph of its own
    engine.cache.reserve(8, 128)  # the cache grows: every graph is dropped ...
    assert prefill().equal(first) and graphs.num_captures == 4  # ... and a recurring shape captured at once
    assert graphs.num_forwards == {"prefill": 5, "decode": 2, "decode+sample": 1}


@torch.inference_mode()
def test_decode_key_positions_pad_by_half_a_power_of_two_unless_turned_off():
    _, graphs = recording_graphs(4, 128)
    reference = graphs.decode([3, 4], [90, 20]).clone()
    graphs.key_buckets_by_half = False
    assert graphs.decode([3, 4], [90, 20]).equal(reference)  # the same step over more padding
    assert list(graphs._graphs) == [("decode", 2, 96), ("decode", 2, 128)]


@torch.inference_mode()
def test_a_prefill_shape_not_captured_yet_runs_in_a_captured_graph_that_holds_it():
    # Two prompts of 30 and 20 tokens make a (2 requests, 32 new tokens, 64 keys) graph, captured at its
    # third use. One prompt of 10 tokens, (1, 16, 64) of its own, then replays that graph, padded, twice;
    # its own shape is captured at its third use. Three prompts fit no captured graph: eager.
    engine, graphs = recording_graphs(8, 64)
    pair = [list(range(10, 40)), list(range(50, 70))]
    for _ in range(3):
        graphs.prefill([0, 1], pair, [0, 0])
    assert graphs.num_captures == 1 and graphs.last_run == "captured"
    short = list(range(200, 210))
    reference = build_tiny_qwen3()(torch.tensor([short]), use_cache=True)
    for row in (2, 3):
        logits = graphs.prefill([row], [short], [0])
        assert graphs.last_run == "replayed" and graphs.num_captures == 1
        torch.testing.assert_close(logits[0], reference.logits[0, -1], atol=1e-5, rtol=1e-5)
        keys, _ = engine.cache.rows(0, row + 1, len(short))
        expected = reference.past_key_values.layers[0].keys[0]
        torch.testing.assert_close(keys[row], expected, atol=1e-5, rtol=1e-5)
    graphs.prefill([4], [short], [0])
    assert graphs.last_run == "captured" and graphs.num_captures == 2
    graphs.prefill([0, 1, 2], [*pair, short], [0, 0, 0])
    assert graphs.last_run == "eager" and graphs.num_captures == 2
    # A cap on the substitute's padding: two prompts of 10 tokens, (2, 16, 64), fit the pair's graph at
    # twice their padded tokens
    shorts = [short, list(range(300, 310))]
    graphs.max_substitute_padding = 1.5
    graphs.prefill([5, 6], shorts, [0, 0])
    assert graphs.last_run == "eager"
    graphs.max_substitute_padding = 2
    graphs.prefill([5, 6], shorts, [0, 0])
    assert graphs.last_run == "replayed" and graphs.num_captures == 2


def test_a_prefill_larger_than_one_graph_runs_as_several_in_the_callers_order(monkeypatch):
    # Graphs of at most 64 new tokens: prompts of 50, 9, 30, 20 and 12 tokens make a graph of one (50 -> 64
    # tokens), one of two (30 and 20 -> 32 each) and one of two (12 and 9 -> 16 each), the first two with
    # a padding row. Each request's logits come back in the caller's order, equal to a forward of its
    # prompt alone, and its keys land in its own row.
    monkeypatch.setattr(cuda_graphs, "MAX_PREFILL_GRAPH_TOKENS", 64)
    engine, graphs = recording_graphs(8, 64)
    prompts = [list(range(10, 60)), list(range(70, 79)), list(range(100, 130)), [3] * 20, [4, 5] * 6]
    rows = [4, 0, 2, 1, 3]
    shapes = [chunk[1:] for chunk in graphs._chunks([len(p) for p in prompts], [len(p) for p in prompts])]
    assert shapes == [(1, 64, 64), (2, 32, 64), (2, 16, 64)]
    with torch.inference_mode():
        logits = graphs.prefill(rows, prompts, [0] * 5).clone()
        assert graphs.last_run == "eager" and graphs.num_forwards["prefill"] == 3
        for _ in range(2):  # every shape's third use captures it
            assert graphs.prefill(rows, prompts, [0] * 5).equal(logits)
        assert graphs.last_run == "captured" and graphs.num_captures == 3
        assert graphs.prefill(rows, prompts, [0] * 5).equal(logits) and graphs.last_run == "replayed"
        assert graphs.prefill([5], [list(range(65))], [0]) is None  # more new tokens than a graph holds
        reference = build_tiny_qwen3()
        for prompt, row, row_logits in zip(prompts, rows, logits, strict=True):
            output = reference(torch.tensor([prompt]), use_cache=True)
            torch.testing.assert_close(row_logits, output.logits[0, -1], atol=1e-5, rtol=1e-5)
            keys, _ = engine.cache.rows(0, 5, len(prompt))
            expected = output.past_key_values.layers[0].keys[0]
            torch.testing.assert_close(keys[row], expected, atol=1e-5, rtol=1e-5)


def test_a_prompt_whose_bucket_is_over_the_graph_limit_is_left_to_the_eager_prefill(monkeypatch):
    monkeypatch.setattr(cuda_graphs, "MAX_PREFILL_GRAPH_TOKENS", 100)  # not a bucket size
    _, graphs = recording_graphs(4, 128)
    with torch.inference_mode():
        assert graphs.prefill([0], [list(range(97))], [0]) is None  # 97 tokens pad to 128
        assert (
            graphs.prefill([0, 1], [list(range(96)), [5] * 40], [0, 0]) is not None
        )  # 96 and 48: two graphs
    assert graphs.num_forwards["prefill"] == 2


def test_chunked_prefills_generate_as_the_eager_engine_does(monkeypatch):
    # The engine's own prefills, with prefixes from the prefix cache and a group's twins, split into graphs
    # of at most 32 new tokens: greedy outputs equal a direct forward's.
    monkeypatch.setattr(cuda_graphs, "MAX_PREFILL_GRAPH_TOKENS", 32)
    engine = make_engine(build_tiny_qwen3(), graphs="padded")
    greedy = SamplingParams(max_tokens=12, temperature=0.0, num_logprobs=0)
    engine.start()
    try:
        (first,) = run_requests(engine, [list(range(40, 60))], greedy)
        second_turn = first.prompt_ids + first.output_ids + [7, 8, 9]
        prompts = [second_turn, list(range(200, 225)), [3, 1, 4], [3, 1, 4], list(range(300, 310))]
        outputs = run_requests(engine, prompts, greedy, together=True)
        stats = engine.stats()
    finally:
        engine.close()
    assert engine.graphs.num_forwards["prefill"] >= 4  # the second prefill took more than one graph
    assert stats.num_prefix_cache_hits >= len(first.prompt_ids) + len(first.output_ids) - 1
    reference = build_tiny_qwen3()
    for output in [first, *outputs]:
        assert_greedy_matches(reference, output, atol=1e-4)


def test_the_engine_counts_its_prefills_by_how_they_ran():
    model = build_tiny_qwen3()
    engine = make_engine(model, graphs="none", enable_prefix_caching=False)
    engine.graphs = RecordingGraphs(model, engine.cache)
    engine.start()
    try:
        for wave in range(4):  # the same shape each time: eager, eager, captured, replayed
            prompts = [list(range(10 + wave, 40 + wave)), list(range(50 + wave, 70 + wave))]
            run_requests(engine, prompts, SamplingParams(max_tokens=2, temperature=0.0), together=True)
        stats = engine.stats()
    finally:
        engine.close()
    assert stats.prefills_by_run == {"eager": 2, "captured": 1, "replayed": 1}
    assert set(stats.prefill_s_by_run) == {"eager", "captured", "replayed"}
    assert sum(stats.prefill_s_by_run.values()) == pytest.approx(stats.prefill_s)


def test_the_padded_step_under_a_tight_budget_preempts_and_recomputes_correctly():
    engine = make_engine(
        build_tiny_qwen3(), graphs="padded", max_model_len=64, max_num_seqs=4, kv_cache_tokens=128
    )
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    outputs = generate(engine, prompts, [SamplingParams(max_tokens=56, temperature=0.0, num_logprobs=0)] * 4)
    assert engine.stats().num_preemptions > 0
    reference = build_tiny_qwen3()
    for output in outputs:
        assert_greedy_matches(reference, output, atol=1e-4)


@pytest.mark.gpu
def test_cuda_graphs_decode_as_the_eager_engine_does():
    eager = generate(make_engine(build_tiny_qwen3().cuda(), graphs="none"), PROMPTS, mixed_params())
    engine = make_engine(build_tiny_qwen3().cuda(), graphs="cuda")
    graphed = generate(engine, PROMPTS, mixed_params())
    assert engine.graphs is not None and engine.graphs.enabled
    assert engine.graphs.num_captures >= 3  # several key-position buckets, and recaptures after growth
    assert_same_outputs(eager, graphed, atol=1e-4)
    assert_greedy_matches(build_tiny_qwen3().cuda(), graphed[0], atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_graphs_that_sample_draw_as_the_eager_engine_does(monkeypatch, compiled):
    monkeypatch.setattr(StepGraphs, "compile_sampling", compiled)  # the graph records inductor's kernels
    eager = generate(make_engine(build_tiny_qwen3().cuda(), graphs="none"), PROMPTS, plain_params())
    # With async scheduling, as the server runs on a GPU: each step's tokens feed the next from the graph's
    # output buffer before the host reads them.
    engine = make_engine(build_tiny_qwen3().cuda(), graphs="cuda", async_scheduling=True)
    graphed = generate(engine, PROMPTS, plain_params())
    assert engine.graphs is not None and engine.graphs.enabled
    assert engine.graphs.num_forwards["decode+sample"] > 50 and engine.graphs.num_forwards["decode"] == 0
    assert engine.num_steps_ahead > 50
    assert_same_outputs(eager, graphed, atol=1e-4)
    assert_greedy_matches(build_tiny_qwen3().cuda(), graphed[0], atol=1e-3)


@pytest.mark.gpu
def test_cuda_graphs_read_weights_updated_after_their_capture():
    model = build_tiny_qwen3().cuda()
    engine = make_engine(model, graphs="cuda")
    engine.start()
    try:
        greedy = SamplingParams(max_tokens=30, temperature=0.0, num_logprobs=0)
        before = run_requests(engine, PROMPTS, [greedy] * 3)
        captured = engine.graphs.num_captures
        assert captured > 0
        new_weights = build_tiny_qwen3(seed=5).cuda().state_dict()

        def swap() -> None:
            model.load_state_dict(new_weights)  # copies into the parameters, as a weight update does
            engine.invalidate_cache()

        engine.call(swap).result(10)
        after = run_requests(engine, PROMPTS, [greedy] * 3)
    finally:
        engine.close()
    new_model = build_tiny_qwen3(seed=5).cuda()
    for output in after:
        assert_greedy_matches(new_model, output, atol=1e-3)
    assert [o.output_ids for o in before] != [o.output_ids for o in after]


@pytest.mark.gpu
def test_a_forward_that_cannot_be_captured_falls_back_to_eager_decoding(caplog):
    model = build_tiny_qwen3().cuda()

    def synchronising_hook(module, args, output):
        output.sum().item()  # a host sync: forbidden while a CUDA graph is being captured

    model.model.layers[0].mlp.register_forward_hook(synchronising_hook)
    engine = make_engine(model, graphs="cuda")
    with caplog.at_level(logging.WARNING, logger="harness.server.cuda_graphs"):
        (output,) = generate(
            engine, PROMPTS[:1], [SamplingParams(max_tokens=20, temperature=0.0, num_logprobs=0)]
        )
    assert engine.graphs is not None and not engine.graphs.enabled
    assert "CUDA graph capture of the server's forward failed" in caplog.text
    assert_greedy_matches(build_tiny_qwen3().cuda(), output, atol=1e-3)


def ragged_decode_logits(model: torch.nn.Module, *, capture: bool, rows: int = 3) -> torch.Tensor:
    """Logits of three decode steps over the first `rows` of rows of 3, 41 and 70 tokens prefilled into a
    fresh cache (the rows' own lengths, padded to one key bucket), fixed tokens in each step."""
    engine = make_engine(model, graphs="none")
    graphs = StepGraphs(model, engine.cache, capture=capture)
    engine.cache.reserve(4, 128)
    prompts = PROMPTS[:rows]
    lengths = [len(p) for p in prompts]
    steps = []
    with torch.inference_mode():
        graphs.prefill(list(range(rows)), prompts, [0] * rows)
        for step in range(3):
            lengths = [n + 1 for n in lengths]
            steps.append(graphs.decode([7 + step, 30 + step, 90 + step][:rows], lengths).float().clone())
    return torch.stack(steps)


def test_a_forward_batch_makes_its_additive_mask_only_when_a_layer_asks():
    # FlashAttention's decode reads no mask, so a step that takes it must not pay for making one.
    from harness.server.kv_cache import ForwardBatch

    cache = make_engine(build_tiny_qwen3(), graphs="none").cache
    allowed = torch.tensor([[True, False, True], [False, False, True]])[:, None, None, :]
    index = torch.arange(2)
    batch = ForwardBatch("decode", cache, index, index, index, index, allowed, kv_length=3)
    assert batch._attn_bias is None
    bias = batch.attn_bias
    assert bias.dtype == cache.dtype
    assert bias.eq(0).equal(allowed) and bias[~allowed].eq(float("-inf")).all()
    assert batch.attn_bias is bias  # made once a forward, whichever layers ask


def test_the_flash_decode_setting_runs_sdpa_off_a_gpu(monkeypatch):
    from harness.server import kv_cache

    model = build_tiny_qwen3()
    reference = ragged_decode_logits(model, capture=False)
    monkeypatch.setattr(kv_cache, "DECODE_ATTENTION", "flash-varlen")
    assert ragged_decode_logits(model, capture=False).equal(reference)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("capture", [False, True])
def test_flash_varlen_decode_attends_as_sdpa_does(monkeypatch, capture, rows):
    # bf16, as FlashAttention needs: every (row, kv head) a sequence of its own length over the cache in
    # place, against SDPA over the padded keys with the mask; eagerly and replayed from a captured graph.
    # One row is the case where the lengths spread over the kv heads are a stride-0 view unless copied.
    from harness.server import kv_cache

    model = build_tiny_qwen3(dtype=torch.bfloat16).cuda()
    reference = ragged_decode_logits(model, capture=False, rows=rows)
    calls = []
    flash = kv_cache._flash_decode
    # Each call notes whether its batch had made the additive mask it does not read.
    monkeypatch.setattr(
        kv_cache, "_flash_decode", lambda *args: calls.append(args[1]._attn_bias is None) or flash(*args)
    )
    monkeypatch.setattr(kv_cache, "DECODE_ATTENTION", "flash-varlen")
    flashed = ragged_decode_logits(model, capture=capture, rows=rows)
    assert calls and all(calls)  # the kernel ran (at capture, for a graph), and no mask was made
    torch.testing.assert_close(flashed, reference, atol=3e-2, rtol=3e-2)
