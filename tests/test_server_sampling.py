"""The built-in server's sampling step on its own: inverse-CDF draws, greedy rows, top log-probs.

Every draw is checked against the distribution in float64: the drawn token's interval of the cumulative
distribution holds `uniform x total mass` (to float32 rounding), and its probability is positive. Vocabulary
sizes straddle the search's block size (`CDF_BLOCK`), and the draws include both ends of [0, 1). Both
searches are checked, the two-level one (a CPU's) and the one over the whole row (a GPU's).
"""

from __future__ import annotations

import threading

import pytest
import torch

from harness.server import sampling
from harness.server.sampling import (
    CDF_BLOCK,
    RequestRandom,
    SamplingParams,
    inverse_cdf,
    processed_logprobs,
    sample_next_tokens,
)


class FixedDraw(RequestRandom):
    """A request whose next uniform draw is given."""

    def __init__(self, value: float) -> None:
        self.value = value

    def uniform(self) -> float:
        return self.value


def assert_draw_in_interval(probs_V: torch.Tensor, uniform: float, token: int) -> None:
    probs = probs_V.double()
    cdf = torch.cumsum(probs, dim=0)
    target = uniform * cdf[-1].item()
    below = cdf[token - 1].item() if token > 0 else 0.0
    assert probs[token] > 0, f"token {token} has zero probability"
    assert below - 1e-5 <= target <= cdf[token].item() + 1e-5, (token, below, target, cdf[token].item())


@pytest.mark.parametrize("blocked", [True, False])
@pytest.mark.parametrize("vocab_size", [7, CDF_BLOCK, 3 * CDF_BLOCK + 17, 151_936])
def test_each_draw_lands_in_its_tokens_interval(vocab_size, blocked):
    generator = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(48, vocab_size, generator=generator) * 3
    logits[::3, vocab_size // 2 :] = float("-inf")  # some rows with a masked tail
    probs = logits.softmax(-1)
    uniforms = torch.rand(48, generator=generator)
    uniforms[:4] = torch.tensor([0.0, 1 - 2**-24, 0.5, 1e-9])
    tokens = inverse_cdf(probs, uniforms, blocked=blocked)
    for row in range(48):
        assert_draw_in_interval(probs[row], uniforms[row].item(), int(tokens[row]))


@pytest.mark.parametrize("blocked", [True, False])
def test_a_draw_at_the_top_never_takes_a_masked_token(blocked):
    # Only the first 3 tokens of a block-crossing vocabulary may be drawn; a target at the very top (a uniform
    # just under 1, or at 1: where rounding can put `uniform x total`) must still take one of them.
    vocab_size = 2 * CDF_BLOCK + 5
    logits = torch.full((3, vocab_size), float("-inf"))
    logits[:, :3] = torch.tensor([0.2, 1.0, -0.5])
    logits[1, :3] = float("-inf")
    logits[1, CDF_BLOCK - 1] = 0.0  # row 1: one token, at the end of the first block
    probs = logits.softmax(-1)
    for top in (1 - 2**-24, 1.0):
        found = inverse_cdf(probs, torch.full((3,), top), blocked=blocked)
        assert found.tolist() == [2, CDF_BLOCK - 1, 2]
    assert inverse_cdf(probs, torch.zeros(3), blocked=blocked).tolist() == [0, CDF_BLOCK - 1, 0]


@pytest.mark.parametrize("blocked", [True, False])
def test_sampled_rows_agree_with_the_processed_distribution_and_ignore_their_batch(blocked, monkeypatch):
    monkeypatch.setattr(sampling, "SEARCH", "blocks" if blocked else "rows")
    generator = torch.Generator().manual_seed(0)
    vocab_size = 5 * CDF_BLOCK + 300
    logits = torch.randn(6, vocab_size, generator=generator) * 4
    params = [
        SamplingParams(temperature=0.8, num_logprobs=3),
        SamplingParams(temperature=0.0, num_logprobs=3),  # greedy
        SamplingParams(top_k=5, num_logprobs=0),
        SamplingParams(top_p=0.5, temperature=1.3, num_logprobs=1),
        SamplingParams(min_p=0.2, num_logprobs=None),
        SamplingParams(temperature=0.0, num_logprobs=1),  # greedy, its top-1 is its token
    ]
    uniforms = [0.37, 0.9, 0.999, 0.01, 0.6, 0.2]
    batch = sample_next_tokens(logits, params, [FixedDraw(u) for u in uniforms], [[]] * 6)
    for row, (param, uniform) in enumerate(zip(params, uniforms, strict=True)):
        alone = sample_next_tokens(logits[row : row + 1], [param], [FixedDraw(uniform)], [[]])
        assert alone.token_ids_B == batch.token_ids_B[row : row + 1]
        assert alone.logprobs_B == pytest.approx(batch.logprobs_B[row : row + 1], abs=1e-6)
        scaled = logits[row] / (1.0 if param.greedy else param.temperature)
        processed = scaled.log_softmax(-1)
        if param.top_k:
            processed = processed.masked_fill(processed < processed.topk(param.top_k).values[-1], -torch.inf)
        token = batch.token_ids_B[row]
        if param.greedy:
            assert token == int(logits[row].argmax())
        elif param.top_k or not param.truncates:
            assert_draw_in_interval(processed.log_softmax(-1).exp(), uniform, token)
        top = batch.top_B[row]
        assert len(top) == (param.num_logprobs or 0)
        assert [value for _, value in top] == sorted((value for _, value in top), reverse=True)
        if top and not param.truncates:
            best = processed.log_softmax(-1).topk(len(top))
            assert [token_id for token_id, _ in top] == best.indices.tolist()
            assert [value for _, value in top] == pytest.approx(best.values.tolist(), abs=1e-5)
    assert batch.top_B[5][0][0] == batch.token_ids_B[5]
    assert batch.logprobs_B[2] > -torch.inf and batch.token_ids_B[2] in logits[2].topk(5).indices.tolist()


def test_an_all_greedy_batch_takes_each_rows_maximum():
    logits = torch.randn(4, 3 * CDF_BLOCK, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0, num_logprobs=2)] * 4
    out = sample_next_tokens(logits, params, [FixedDraw(0.5)] * 4, [[]] * 4)
    assert out.token_ids_B == logits.argmax(-1).tolist()
    assert out.logprobs_B == pytest.approx(logits.log_softmax(-1).max(-1).values.tolist(), abs=1e-5)
    assert [top[0][0] for top in out.top_B] == out.token_ids_B


def test_blocks_are_searched_on_a_cpu_and_whole_rows_on_a_gpu():
    assert sampling.searches_by_block(torch.device("cpu"))
    assert not sampling.searches_by_block(torch.device("cuda", 0))


def test_the_search_setting_overrides_the_device_and_names_its_choices(monkeypatch):
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setattr(sampling, "SEARCH", "rows")
    assert not sampling.searches_by_block(cpu) and not sampling.searches_by_block(gpu)
    monkeypatch.setattr(sampling, "SEARCH", "blocks")
    assert sampling.searches_by_block(cpu) and sampling.searches_by_block(gpu)
    monkeypatch.setattr(sampling, "SEARCH", "block")
    with pytest.raises(ValueError, match=r"'block'.*auto, blocks, rows"):
        sampling.searches_by_block(cpu)


def test_candidate_sets_are_each_masked_rows_surviving_tokens():
    logits = torch.randn(5, 2 * CDF_BLOCK + 9, generator=torch.Generator().manual_seed(2))
    params = [
        SamplingParams(top_k=7, return_sampling_mask=True),
        SamplingParams(return_sampling_mask=True),  # nothing truncated: no set
        SamplingParams(top_p=0.3, return_sampling_mask=True),
        SamplingParams(top_k=7),  # truncated, but no set asked for
        SamplingParams(top_k=1, return_sampling_mask=True),
    ]
    out = sample_next_tokens(logits, params, [FixedDraw(0.5)] * 5, [[]] * 5)
    assert out.candidates_B[1] is None and out.candidates_B[3] is None
    assert out.candidates_B[0] == sorted(logits[0].topk(7).indices.tolist())
    assert out.candidates_B[4] == [int(logits[4].argmax())] == [out.token_ids_B[4]]
    nucleus = out.candidates_B[2]
    assert nucleus is not None and out.token_ids_B[2] in nucleus
    probs = logits[2].softmax(-1)
    inside = probs[nucleus].sum().item()
    assert inside >= 0.3 and inside - probs[nucleus].min().item() < 0.3  # the smallest set reaching top_p
    for row in (0, 2, 4):
        assert out.token_ids_B[row] in (out.candidates_B[row] or [])


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor(
        [[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0], [1.0, 1.0, 1.0, 1.0, 1.0]]
    )
    params = [
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(repetition_penalty=1.0),  # off: its seen tokens are untouched
        SamplingParams(repetition_penalty=0.5),
    ]
    seen = [[0, 1, 1, 0], [0, 1], [4]]
    processed = processed_logprobs(logits, params, seen)
    expected = torch.tensor(
        [[1.0, -2.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0], [1.0, 1.0, 1.0, 1.0, 2.0]]
    )
    assert torch.allclose(processed, expected.log_softmax(-1))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7),
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(top_k=5),
        SamplingParams(top_p=0.9),
        SamplingParams(min_p=0.1),
    ],
    ids=["plain", "greedy", "temperature", "penalty", "top_k", "top_p", "min_p"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_processing_never_writes_into_the_models_logits(params, dtype):
    """The logits are the model's output (or a CUDA graph's buffer): processing them works on a copy, and
    float32 logits that nothing processes are used as they are."""
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(0)).to(dtype)
    before = logits.clone()
    processed = sampling.processed_logits(logits, [params, SamplingParams(), params], [[1, 2, 7]] * 3)
    assert torch.equal(logits, before)
    assert processed.dtype == torch.float32
    unprocessed = dtype == torch.float32 and params in (SamplingParams(), SamplingParams(temperature=0.0))
    assert (processed.data_ptr() == logits.data_ptr()) == unprocessed


def test_threads_sampling_at_once_with_batches_of_every_size_get_their_own_answers():
    """On a CPU the step's weights live in a buffer reused per thread: two engines' threads sampling at
    once, batches growing and shrinking, each gets exactly what it gets sampling alone."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 2 * CDF_BLOCK + 77, generator=generator) * 3
    params = [SamplingParams(num_logprobs=1)] * 9

    def sample(rows: int, first: int) -> tuple[list[int], list[float]]:
        randoms = [FixedDraw((first + row) % 10 / 10 + 0.05) for row in range(rows)]
        out = sample_next_tokens(logits[first : first + rows], params[:rows], randoms, [[]] * rows)
        return out.token_ids_B, out.logprobs_B

    plans = [[(9, 0), (2, 4), (5, 1)] * 15, [(3, 6), (8, 1), (1, 0)] * 15]
    expected = {shape: sample(*shape) for plan in plans for shape in plan}
    found: list[list[tuple[list[int], list[float]]]] = [[], []]

    def work(index: int) -> None:
        found[index] = [sample(*shape) for shape in plans[index]]

    threads = [threading.Thread(target=work, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for plan, answers in zip(plans, found, strict=True):
        assert answers == [expected[shape] for shape in plan]
