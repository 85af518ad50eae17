"""The chunked log-prob head against log_softmax over materialised logits (values and gradients)."""

from __future__ import annotations

import pytest
import torch

from harness.packing import pack_row
from harness.training.logprobs import row_logprobs, token_logprobs
from harness.types import TrainingSample, TrainingSequence

N, H, V = 11, 8, 40


def inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=generator).requires_grad_()
    weight = torch.randn(V, H, generator=generator).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=generator)
    return hidden, weight, targets


def reference(hidden, weight, targets, temperature=1.0, candidates=None, topk=None):
    """Materialised float64 logits: log_softmax over each token's candidate set (all of it for a -1 row)."""
    logits = hidden.double() @ weight.double().t() / temperature
    allowed = torch.ones_like(logits, dtype=torch.bool)
    if candidates is not None:
        for i, row in enumerate(candidates.tolist()):
            ids = [c for c in row if c >= 0]
            if ids:
                allowed[i] = False
                allowed[i, [*ids, int(targets[i])]] = True
    logprobs = logits.masked_fill(~allowed, float("-inf")).log_softmax(-1)
    entropy = -(logprobs.exp() * logprobs.where(allowed, 0.0)).sum(-1)
    top = None
    if topk is not None:
        top = logprobs.gather(1, topk.clamp(min=0)).masked_fill(topk < 0, float("-inf")).float()
    return logprobs.gather(1, targets[:, None])[:, 0].float(), entropy.float(), top


@pytest.mark.parametrize("chunk_size", [1, 4, 11, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_entropy_and_gradients_match_materialised_logits(chunk_size, temperature):
    hidden, weight, targets = inputs()
    out = token_logprobs(hidden, weight, targets, temperature=temperature, chunk_size=chunk_size)
    expected, entropy, _ = reference(hidden, weight, targets, temperature)
    torch.testing.assert_close(out.logprobs, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.entropy, entropy, atol=1e-5, rtol=0)
    assert not out.entropy.requires_grad

    upstream = torch.linspace(-1, 1, N)
    got = torch.autograd.grad((out.logprobs * upstream).sum(), (hidden, weight))
    want = torch.autograd.grad((expected * upstream).sum(), (hidden, weight))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_candidate_sets_renormalise_and_topk_ids_are_gathered():
    hidden, weight, targets = inputs(1)
    candidates = torch.full((N, 4), -1)
    candidates[0] = torch.tensor([3, 5, 7, -1])  # the target joins the set even when not listed
    candidates[1] = torch.tensor([int(targets[1]), 2, 9, 10])
    candidates[4, :2] = torch.tensor([int(targets[4]), 1])
    topk = torch.tensor([[3, 5, 0]] * N)
    topk[0, 2] = -1  # padding
    topk[4, 2] = 30  # outside token 4's candidate set: -inf
    out = token_logprobs(
        hidden, weight, targets, candidate_ids_N_C=candidates, topk_ids_N_K=topk, chunk_size=3
    )
    expected, entropy, top = reference(hidden, weight, targets, candidates=candidates, topk=topk)
    torch.testing.assert_close(out.logprobs, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.entropy, entropy, atol=1e-5, rtol=0)
    assert torch.equal(torch.isinf(out.topk_logprobs), torch.isinf(top))
    assert torch.isinf(out.topk_logprobs[4, 2]) and torch.isinf(out.topk_logprobs[0, 2])
    finite = torch.isfinite(top)
    torch.testing.assert_close(out.topk_logprobs[finite], top[finite], atol=1e-5, rtol=0)
    # renormalised: a token whose set is {target, 1} gets more than its full-vocabulary probability
    assert out.logprobs[4] > reference(hidden, weight, targets)[0][4]

    # gradients through both the target and the finite top-k log-probs
    g_target, g_top = torch.linspace(-1, 1, N), torch.linspace(0.5, -0.5, N * 3).reshape(N, 3)
    loss = (out.logprobs * g_target).sum() + (out.topk_logprobs.where(finite, 0.0) * g_top).sum()
    loss_ref = (expected * g_target).sum() + (top.where(finite, 0.0) * g_top).sum()
    got = torch.autograd.grad(loss, (hidden, weight))
    want = torch.autograd.grad(loss_ref, (hidden, weight))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_row_logprobs_reads_each_token_at_its_predecessor():
    # spec example: a1 a2 b1 b2 are predicted at rows 2 3 2 5, so their log-probs come from those rows
    def sample(completion):
        ids = [1, 2, 3, *completion]
        n = len(ids)
        sequence = TrainingSequence(ids, [0, 0, 0, 1, 1], [0.0] * n, [None] * n, [None] * n)
        return TrainingSample(sequence, 1.0, 0)

    row = pack_row([sample([4, 5]), sample([6, 7])])
    hidden, weight, _ = inputs(2)
    hidden_T_H = hidden[: row.num_tokens]
    out = row_logprobs(hidden_T_H, row, weight)
    logprobs = (hidden_T_H @ weight.t()).log_softmax(-1)
    expected = logprobs[[2, 3, 2, 5], [4, 5, 6, 7]]
    torch.testing.assert_close(out.logprobs, expected, atol=1e-5, rtol=0)


def test_bf16_inputs_accumulate_in_float32():
    hidden, weight, targets = inputs(3)
    out = token_logprobs(hidden.bfloat16(), weight.bfloat16(), targets, chunk_size=4)
    expected, _, _ = reference(hidden.bfloat16().float(), weight.bfloat16().float(), targets)
    assert out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs, expected, atol=1e-4, rtol=0)
