"""The losses: score centering against its definition on toy categoricals, the clipped surrogate on literal
ratios, normalisation and metrics."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from harness.packing import pack_row
from harness.training.logprobs import TokenLogProbs, row_logprobs
from harness.training.loss import (
    LossConfig,
    clipped_surrogate_token_loss,
    fused_policy_loss,
    policy_loss,
    score_centering_token_loss,
)
from harness.types import TrainingSample, TrainingSequence

CLIP_MIN, CLIP_MAX = 0.5, 5.0


def masked_weight(ratio: float) -> float:
    return ratio if CLIP_MIN <= ratio <= CLIP_MAX else 0.0


def centering_gradient(logits, q, sampled, head, advantage, importance_weighting=True):
    """d loss / d logits of the implementation for one position of a categorical policy softmax(logits)."""
    logits = logits.clone().requires_grad_()
    logp = logits.log_softmax(-1)
    loss, _ = score_centering_token_loss(
        logp[sampled].reshape(1),
        q[sampled].log().reshape(1),
        torch.tensor([advantage], dtype=logits.dtype),
        logp[head][None],
        q[head].log()[None],
        clip_min=CLIP_MIN,
        clip_max=CLIP_MAX,
        importance_weighting=importance_weighting,
    )
    (grad,) = torch.autograd.grad(loss.sum(), logits)
    return grad


def explicit_gradient(logits, q, sampled, head, advantage):
    """-A (w_a s_a - mu^) summed over the whole vocabulary with the tail-completed sampler q^ (no folding).

    In logit space the score of token v is s_v = e_v - p.
    """
    p = logits.softmax(-1)
    vocab = len(p)
    scores = torch.eye(vocab, dtype=p.dtype) - p  # row v: s_v
    in_head = torch.zeros(vocab, dtype=torch.bool)
    in_head[head] = True
    alpha = (1 - q[in_head].sum()) / (1 - p[in_head].sum())
    q_hat = torch.where(in_head, q, alpha * p)
    mu = sum(
        q_hat[v] * masked_weight(float(p[v] / q_hat[v])) * scores[v] for v in range(vocab) if q_hat[v] > 0
    )
    w_sampled = masked_weight(float(p[sampled] / q[sampled]))
    return -advantage * (w_sampled * scores[sampled] - mu)


LOGITS = torch.tensor(
    [2.0, 1.0, 0.5, 0.0, -1.0, -2.0], dtype=torch.float64
)  # p ~ .557 .205 .124 .075 .028 .010


def test_spec_hand_test_centering_removes_the_drift_toward_the_sampler():
    # p = (0.6, 0.4), q = (0.5, 0.5), f = 1: the uncentered update's expectation under q is A (q - p).
    logits = torch.tensor([math.log(0.6), math.log(0.4)], dtype=torch.float64)
    q = torch.tensor([0.5, 0.5], dtype=torch.float64)
    head = [0, 1]
    centered = sum(
        q[a] * centering_gradient(logits, q, a, head, 1.0, importance_weighting=False) for a in (0, 1)
    )
    torch.testing.assert_close(centered, torch.zeros(2, dtype=torch.float64), atol=1e-12, rtol=0)
    uncentered = sum(
        q[a] * centering_gradient(logits, q, a, [], 1.0, importance_weighting=False) for a in (0, 1)
    )  # no head: nothing to center with
    # d loss / d logits = -A E_q[s] = -(q - p) = (0.1, -0.1): gradient descent moves p toward q
    torch.testing.assert_close(uncentered, torch.tensor([0.1, -0.1], dtype=torch.float64), atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    ("q", "sampled", "case"),
    [
        # head {1, 0, 2}: token 1's ratio 0.41 masked, the tail's 1/alpha = 0.57 kept; a = 3 is off the head
        ([0.2, 0.5, 0.1, 0.1, 0.05, 0.05], 3, "head ratio masked"),
        # head {0, 1, 2} covers 99.5% of q: 1/alpha = 23 is masked; the sampled token's ratio 28 is masked too
        ([0.6, 0.3, 0.095, 0.003, 0.001, 0.001], 4, "tail and sampled token masked"),
    ],
)
def test_gradient_equals_the_definition_with_the_tail_completed_sampler(q, sampled, case):
    q = torch.tensor(q, dtype=torch.float64)
    head = [int(i) for i in q.argsort(descending=True, stable=True)[:3]]
    got = centering_gradient(LOGITS, q, sampled, head, advantage=1.7)
    want = explicit_gradient(LOGITS, q, sampled, head, advantage=1.7)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0, msg=case)
    # centering is doing something: the plain masked-IS gradient differs
    plain = centering_gradient(LOGITS, q, sampled, [], advantage=1.7)
    assert (got - plain).abs().max() > 1e-3


def test_with_the_whole_vocabulary_as_head_the_update_has_zero_mean_under_the_sampler():
    q = torch.tensor([0.2, 0.5, 0.1, 0.1, 0.05, 0.05], dtype=torch.float64)  # two ratios masked
    head = list(range(6))
    expected = sum(q[a] * centering_gradient(LOGITS, q, a, head, advantage=1.0) for a in range(6))
    torch.testing.assert_close(expected, torch.zeros(6, dtype=torch.float64), atol=1e-12, rtol=0)
    uncentered = sum(q[a] * centering_gradient(LOGITS, q, a, [], advantage=1.0) for a in range(6))
    assert uncentered.abs().max() > 1e-2  # masked IS alone drifts


def test_with_nothing_masked_centering_changes_nothing():
    # ratios 1.24 1.03 .83 .75 .55 on the head and the sampled tokens, and 1/alpha = 0.57: all kept
    q = torch.tensor([0.45, 0.2, 0.15, 0.1, 0.05, 0.05], dtype=torch.float64)
    head = [0, 1, 2]
    for sampled in range(4):
        torch.testing.assert_close(
            centering_gradient(LOGITS, q, sampled, head, 1.0),
            centering_gradient(LOGITS, q, sampled, [], 1.0),
            atol=1e-12,
            rtol=0,
        )


def test_clipped_surrogate_on_literal_ratios():
    ratios = torch.tensor([0.3, 0.7, 1.0, 1.5, 1.5, 6.0])
    advantages = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0, 1.0])
    old = torch.full((6,), -2.0)
    logprobs = (old + ratios.log()).requires_grad_()
    loss = clipped_surrogate_token_loss(
        logprobs, old, advantages, epsilon=0.2, epsilon_high=0.2, clip_min=CLIP_MIN, clip_max=CLIP_MAX
    )
    # masked (0.3, 6.0): 0; 0.7 with A<0 clipped at 0.8; 1.5 with A>0 clipped at 1.2; 1.5 with A<0 not
    torch.testing.assert_close(loss, torch.tensor([0.0, 0.8, -1.0, -1.2, 1.5, 0.0]))
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    torch.testing.assert_close(grad, torch.tensor([0.0, 0.0, -1.0, 0.0, 1.5, 0.0]))


def literal_row():
    """Two samples after a shared prompt [1, 2]: A = +1 with ratios 1.0 1.5 6.0, A = -1 with 0.7 0.3."""

    def sample(completion, advantage):
        ids = [1, 2, *completion]
        n = len(ids)
        sequence = TrainingSequence(ids, [0, 0] + [1] * len(completion), [-1.0] * n, [None] * n, [None] * n)
        return TrainingSample(sequence, advantage, 0)

    row = pack_row([sample([3, 4, 5], 1.0), sample([6, 7], -1.0)])
    ratios = torch.tensor([1.0, 1.5, 6.0, 0.7, 0.3])
    logprobs = (row.old_logprobs + ratios.log()).requires_grad_()
    head = TokenLogProbs(
        logprobs=logprobs, entropy=torch.tensor([0.5, 1.0, 1.5, 2.0, 2.5]), topk_logprobs=None
    )
    return row, head, ratios


def test_clipped_loss_is_normalised_by_global_trained_tokens_and_accumulation_steps():
    row, head, _ = literal_row()
    out = policy_loss(
        head,
        row,
        LossConfig(score_centering=False),
        num_trained_tokens_global=10,
        gradient_accumulation_steps=2,
    )
    # per token: -1, -1.2, 0 (masked), 0.8, 0 (masked): sum -1.4 over 10 tokens x 2 micro-batches
    assert out.loss.item() == pytest.approx(-1.4 / 20)
    assert out.num_trained_tokens == 5


def test_metrics_on_a_literal_row():
    row, head, ratios = literal_row()
    out = policy_loss(head, row, LossConfig(score_centering=False), num_trained_tokens_global=5)
    metrics = {name: value.item() for name, value in out.metrics.items()}
    assert metrics["sampling/importance_sampling_ratio/min"] == pytest.approx(0.3)
    assert metrics["sampling/importance_sampling_ratio/max"] == pytest.approx(6.0)
    assert metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.9)
    assert metrics["sampling/masked_mean"] == pytest.approx(0.4)
    assert metrics["sampling/sampling_logp_difference/mean"] == pytest.approx(
        ratios.log().abs().mean().item()
    )
    assert metrics["sampling/sampling_logp_difference/max"] == pytest.approx(math.log(6.0))
    assert metrics["entropy"] == pytest.approx(1.5)
    # over the kept tokens 1.0 1.5 (A>0) and 0.7 (A<0): 0.7 is low-clipped, 1.5 high-clipped
    assert metrics["clip_ratio/low_mean"] == pytest.approx(1 / 3)
    assert metrics["clip_ratio/high_mean"] == pytest.approx(1 / 3)
    assert metrics["clip_ratio/region_mean"] == pytest.approx(2 / 3)
    assert metrics["clip_ratio/low_min"] == 0.0  # sample 0 has no low-clipped token
    assert metrics["clip_ratio/high_max"] == 0.5  # sample 0: one of its two kept tokens
    assert "sampling/sampler_mass" not in metrics


def test_score_centering_without_a_head_is_masked_importance_sampling():
    row, head, ratios = literal_row()
    out = policy_loss(head, row, LossConfig(), num_trained_tokens_global=5)
    (grad,) = torch.autograd.grad(out.loss, head.logprobs)
    weights = torch.where((ratios >= CLIP_MIN) & (ratios <= CLIP_MAX), ratios, 0.0)
    torch.testing.assert_close(grad, -row.advantages * weights / 5)
    assert out.metrics["sampling/sampler_mass"].item() == 0.0


def test_score_centering_reads_the_rows_sampler_head():
    row, head, _ = literal_row()
    # every token's sampler head {target, 9}: q = 0.6 and 0.3; the trainer's p = 0.5 and 0.1 (ratio 1/3)
    sampler = torch.log(torch.tensor([[0.6, 0.3]] * 5))
    trainer = torch.log(torch.tensor([[0.5, 0.1]] * 5)).requires_grad_()
    row = dataclasses.replace(row, sampler_topk_ids=torch.tensor([[0, 9]] * 5), sampler_topk_logprobs=sampler)
    head = TokenLogProbs(head.logprobs, head.entropy, trainer)
    out = policy_loss(head, row, LossConfig(), num_trained_tokens_global=5)
    assert out.metrics["sampling/sampler_mass"].item() == pytest.approx(0.9)
    (grad,) = torch.autograd.grad(out.loss, trainer)
    # alpha = 0.1 / 0.4 = 0.25 -> 1/alpha = 4 is kept; the second head id's ratio 1/3 is masked, so
    # c = p * ([r in C] - 1) = (0, -0.1) and d loss / d log p_head = -A * (-c) / 5 = A * c / 5
    expected = row.advantages[:, None] * torch.tensor([[0.0, -0.1]]) / 5
    torch.testing.assert_close(grad, expected)


def row_with_sampler_data():
    """Three samples after a shared prompt, with sampler top-k dicts and candidate sets on some tokens."""

    def sample(completion, advantage, topk, candidates):
        ids = [1, 2, 3, *completion]
        m = len(completion)
        old = [0.0] * 3 + [-2.2 - 0.3 * i for i in range(m)]  # near log(1/16): most ratios in [0.5, 5]
        sequence = TrainingSequence(ids, [0] * 3 + [1] * m, old, [None] * 3 + topk, [None] * 3 + candidates)
        return TrainingSample(sequence, advantage, 0)

    return pack_row(
        [
            sample([4, 5, 6], 1.0, [{4: -1.3, 9: -2.0}, {5: -1.9, 4: -3.0}, None], [[4, 9, 10], None, None]),
            sample([7, 8], -0.5, [{7: -2.2, 4: -1.8, 9: -3.0}, {8: -0.4}], [None, [8, 2]]),
            sample([4, 11], 2.0, [{4: -1.3, 9: -2.0}, None], [[4, 9, 10], None]),
        ]
    )


@pytest.mark.parametrize("score_centering", [True, False])
def test_fused_path_equals_the_modular_path(score_centering):
    row = row_with_sampler_data()
    generator = torch.Generator().manual_seed(0)
    hidden = (torch.randn(row.num_tokens, 8, generator=generator, dtype=torch.float64) * 0.5).requires_grad_()
    weight = (torch.randn(16, 8, generator=generator, dtype=torch.float64) * 0.5).requires_grad_()
    config = LossConfig(score_centering=score_centering, epsilon_high=0.28)
    options = {"num_trained_tokens_global": 9, "gradient_accumulation_steps": 2}

    head = row_logprobs(hidden, row, weight, temperature=0.8, chunk_size=3)
    modular = policy_loss(head, row, config, **options)
    want = torch.autograd.grad(modular.loss, (hidden, weight))
    fused = fused_policy_loss(hidden, row, weight, config, temperature=0.8, chunk_size=3, **options)
    got = torch.autograd.grad(fused.loss, (hidden, weight))

    assert fused.loss.item() == pytest.approx(modular.loss.item(), abs=1e-12)
    for g, w in zip(got, want, strict=True):
        assert w.abs().max() > 0
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-10)
    assert fused.metrics.keys() == modular.metrics.keys()
    for name, value in modular.metrics.items():
        torch.testing.assert_close(fused.metrics[name].double(), value.double(), equal_nan=True, msg=name)
