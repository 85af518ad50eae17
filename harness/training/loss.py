r"""Policy losses: score centering (the default) and GRPO's clipped surrogate, both with masked IS.

Both take, per trained token t, the trainer's log-probability log p(a_t) (differentiable, from
`harness.training.logprobs`), the sampler's log-probability log q(a_t) and the sample's advantage A_t. The
sampler's log-probabilities stand in for the old policy, so one importance ratio r_t = p(a_t) / q(a_t) covers
both the training-inference mismatch and the staleness. Tokens whose ratio falls outside
C = [vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max] lose their importance weight
(masked importance sampling): f(r) = r if r in C, else 0.

Two entry points give the same value, gradients and metrics: `policy_loss` after `row_logprobs` (modular),
and `fused_policy_loss`, which evaluates the per-token loss inside the chunked head so that the logits are
computed once (the trainer's fast path; see `harness.training.logprobs`).

Normalisation: the per-token losses are summed and divided by the number of trained tokens of the
micro-batch across all processes, and by gradient_accumulation_steps, so that summing gradients over
processes and micro-batches gives the spec's mean. (FSDP2 averages gradients over processes by default: the
trainer multiplies the loss by the world size, or sets the gradient divide factor to 1.)

Score centering: derivation
---------------------------
Fix a trained position with prefix h; the sampler drew a ~ q( . | h), the policy is p = p_theta( . | h), and
s_v = grad_theta log p_v is the score of token v. With weights w_v = f(p_v / q_v), the update estimates

    E_q[A w_a s_a] = Cov_q(A, w s) + E_q[A] * mu_w,        mu_w = E_q[w s] = sum_v q_v w_v s_v.

Only the covariance term says which tokens were better than others. With exact weights (f(r) = r
everywhere) mu_w = sum_v p_v s_v = grad sum_v p_v = 0, but masking drops terms (and f = 1, no correction,
gives mu = E_q[s], which points from p toward q), so the second term moves the policy along mu_w in
proportion to the prefix's mean advantage, which group normalisation does not make zero per prefix: drift.
Score centering subtracts the expectation of the weighted score under the sampler,

    g_t = A (w_a s_a - mu_w),        E_{a ~ q}[g_t] = E_q[A w s] - E_q[A] mu_w = Cov_q(A, w s)

(A is constant given h for a constant advantage, and then E_q[g_t] = 0 exactly). A surrogate with this
gradient, differentiating only through log p (sg = stop-gradient):

    loss_t = - sg(A) [ sg(w_a) log p_a  -  sum_v sg(q_v w_v) log p_v ],   - grad loss_t = A (w_a s_a - mu_w).

Differentiating through the weights would add terms the estimator does not have, hence the stop-gradients.

Only the sampler's top-k head H is known (num_sampler_logprobs ids with their probabilities q_v, v in H).
Approximate the unseen tail of q by the policy's tail scaled to the missing mass:

    P_H = sum_{v in H} p_v,   Q_H = sum_{v in H} q_v,   alpha = (1 - Q_H) / (1 - P_H),
    q^_v = q_v (v in H),   q^_v = alpha p_v (v not in H),              sum_v q^_v = 1.

Off the head every ratio is p_v / q^_v = 1 / alpha, so the tail contributes alpha f(1/alpha) sum_{v not in H}
p_v s_v = - alpha f(1/alpha) sum_{v in H} p_v s_v (because sum_v p_v s_v = 0), which folds onto the head:

    mu^_w = sum_{v in H} c_v s_v,      c_v = q_v f(p_v / q_v) - alpha f(1/alpha) p_v.

With the masked weight, q_v f(p_v/q_v) = p_v [p_v/q_v in C] and alpha f(1/alpha) = [1/alpha in C], so

    c_v = p_v ([p_v / q_v in C] - [1 / alpha in C])

and the loss needs log p only at the head ids (gathered by the chunked head):

    loss_t = - sg(A) [ sg(w_a) log p_a  -  sum_{v in H} sg(c_v) log p_v ].

A head token's coefficient is non-zero only when exactly one of its own ratio and the tail's ratio is
masked: with nothing masked, centering changes nothing, as it should. The sampled token need not be in H. A
masked sampled token (w_a = 0) keeps its centering term: dropping the whole position would leave
(1 - P_q(kept)) mu_w of drift. When H covers the sampler's support (Q_H = 1) the tail vanishes (alpha = 0)
and the centering is exact. With a sampling mask, p is renormalised over the candidate set and q is the
sampler's renormalised distribution, so the same formulas hold on that set. 1 - P_H is clamped away from 0.

Clipped surrogate (score_centering=False)
-----------------------------------------
loss_t = - [r_t in C] min(r_t A, clip(r_t, 1 - epsilon, 1 + epsilon_high) A), r_t = exp(log p - log q) with
gradient through log p: GRPO's objective with the sampler as the old policy and masked tokens dropped.

Metrics (per row, over its trained tokens; the trainer combines rows): sampling/* (log-prob differences,
ratios before masking, the masked fraction, and for score centering the sampler's head mass Q_H), entropy,
and clip_ratio/* (over the tokens in the loss: low = r < 1 - epsilon with A < 0, high = r > 1 + epsilon_high
with A > 0; low_min and high_max are the smallest / largest per-sample fractions). Score centering does not
clip, so there the clip_ratio/* metrics only count tokens outside the trust region.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.packing import PackedRow
from harness.training.logprobs import DEFAULT_CHUNK_SIZE, TokenLogProbs, fused_token_loss

__all__ = [
    "LossConfig",
    "LossOutput",
    "clipped_surrogate_token_loss",
    "fused_policy_loss",
    "policy_loss",
    "score_centering_token_loss",
]

_MIN_TAIL_MASS = 1e-6


@dataclass(frozen=True)
class LossConfig:
    """The loss settings of AsyncGRPOConfig (same names and defaults).

    Attributes:
        score_centering: Score centering (True) or the clipped surrogate (False).
        epsilon: Lower clipping range of the surrogate (and of the clip_ratio metrics).
        epsilon_high: Upper clipping range; None means epsilon.
        vllm_importance_sampling_clip_min: Lower bound of the kept importance ratios.
        vllm_importance_sampling_clip_max: Upper bound of the kept importance ratios.
    """

    score_centering: bool = True
    epsilon: float = 0.2
    epsilon_high: float | None = None
    vllm_importance_sampling_clip_min: float = 0.5
    vllm_importance_sampling_clip_max: float = 5.0

    def __post_init__(self) -> None:
        if self.epsilon < 0 or (self.epsilon_high is not None and self.epsilon_high < 0):
            raise ValueError("epsilon and epsilon_high must be non-negative")
        if not 0 <= self.vllm_importance_sampling_clip_min < self.vllm_importance_sampling_clip_max:
            raise ValueError(
                "need 0 <= vllm_importance_sampling_clip_min < vllm_importance_sampling_clip_max, got "
                f"{self.vllm_importance_sampling_clip_min} and {self.vllm_importance_sampling_clip_max}"
            )

    @property
    def upper_epsilon(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass(frozen=True)
class LossOutput:
    """The micro-step's loss and its row's metrics.

    Attributes:
        loss: Scalar, already normalised (see the module docstring); call backward on it.
        metrics: 0-dim detached tensors keyed by the spec's names, over this row's trained tokens. Means
            combine across rows weighted by num_trained_tokens, min/max by min/max.
        num_trained_tokens: This row's trained tokens.
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]
    num_trained_tokens: int


def _in_range(ratio: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return (ratio >= low) & (ratio <= high)


def score_centering_token_loss(
    logprobs_N: torch.Tensor,
    old_logprobs_N: torch.Tensor,
    advantages_N: torch.Tensor,
    trainer_head_logprobs_N_K: torch.Tensor | None,
    sampler_head_logprobs_N_K: torch.Tensor | None,
    *,
    clip_min: float,
    clip_max: float,
    importance_weighting: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token score-centering surrogate (module docstring) and the sampler's head mass Q_H per token.

    Head entries that are -inf on either side (padding, or ids outside the candidate set) are left out.
    `importance_weighting=False` uses f = 1 (no correction), the setting of the spec's hand test.
    """
    log_ratio = logprobs_N.detach() - old_logprobs_N
    ratio = log_ratio.exp()
    if importance_weighting:
        weight_sampled = torch.where(_in_range(ratio, clip_min, clip_max), ratio, 0.0)
    else:
        weight_sampled = torch.ones_like(ratio)
    surrogate = weight_sampled * logprobs_N
    sampler_mass = torch.zeros_like(ratio)
    if trainer_head_logprobs_N_K is not None and sampler_head_logprobs_N_K is not None:
        valid = torch.isfinite(trainer_head_logprobs_N_K) & torch.isfinite(sampler_head_logprobs_N_K)
        head_logp = trainer_head_logprobs_N_K.where(valid, 0.0)
        p_head = head_logp.detach().exp() * valid
        q_head = sampler_head_logprobs_N_K.where(valid, 0.0).exp() * valid
        sampler_mass = q_head.sum(dim=1)
        tail_scale = ((1.0 - sampler_mass) / (1.0 - p_head.sum(dim=1)).clamp(min=_MIN_TAIL_MASS)).clamp(
            min=0.0
        )
        if importance_weighting:
            head_kept = _in_range(
                p_head / q_head.clamp(min=torch.finfo(q_head.dtype).tiny), clip_min, clip_max
            )
            # alpha f(1/alpha) = [1/alpha in C], written in alpha so that alpha = 0 (no tail) is out of range
            tail_kept = (tail_scale >= 1.0 / clip_max) & (tail_scale > 0) & (tail_scale * clip_min <= 1.0)
            coefficient = p_head * (head_kept.float() - tail_kept[:, None].float())
        else:
            coefficient = q_head - tail_scale[:, None] * p_head
        surrogate = surrogate - (coefficient * valid * head_logp).sum(dim=1)
    return -advantages_N * surrogate, sampler_mass


def clipped_surrogate_token_loss(
    logprobs_N: torch.Tensor,
    old_logprobs_N: torch.Tensor,
    advantages_N: torch.Tensor,
    *,
    epsilon: float,
    epsilon_high: float,
    clip_min: float,
    clip_max: float,
) -> torch.Tensor:
    """Per-token clipped surrogate with the sampler as the old policy; masked tokens contribute 0."""
    ratio = (logprobs_N - old_logprobs_N).exp()
    kept = _in_range(ratio.detach(), clip_min, clip_max)
    unclipped = ratio * advantages_N
    clipped = ratio.clamp(1.0 - epsilon, 1.0 + epsilon_high) * advantages_N
    return -torch.minimum(unclipped, clipped) * kept


def _per_sample_fraction(
    flags: torch.Tensor, counted: torch.Tensor, sample_index: torch.Tensor
) -> torch.Tensor:
    """Per-sample fraction of `flags` among `counted` tokens; NaN for samples with no counted token."""
    num_samples = int(sample_index.max().item()) + 1 if sample_index.numel() else 0
    hits = torch.zeros(num_samples, device=flags.device).index_add_(
        0, sample_index, (flags & counted).float()
    )
    totals = torch.zeros(num_samples, device=flags.device).index_add_(0, sample_index, counted.float())
    return torch.where(totals > 0, hits / totals.clamp(min=1), float("nan"))


def _nan_reduce(values: torch.Tensor, reduce: str) -> torch.Tensor:
    finite = values[~torch.isnan(values)]
    if finite.numel() == 0:
        return values.new_tensor(float("nan"))
    return finite.min() if reduce == "min" else finite.max()


def _mean(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    count = where.sum()
    return torch.where(count > 0, (values * where).sum() / count.clamp(min=1), float("nan"))


def _token_loss(
    config: LossConfig,
    logprobs: torch.Tensor,
    old: torch.Tensor,
    advantages: torch.Tensor,
    trainer_head: torch.Tensor | None,
    sampler_head: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The configured per-token loss, and the sampler's head mass per token (score centering only)."""
    clip_min = config.vllm_importance_sampling_clip_min
    clip_max = config.vllm_importance_sampling_clip_max
    if config.score_centering:
        return score_centering_token_loss(
            logprobs, old, advantages, trainer_head, sampler_head, clip_min=clip_min, clip_max=clip_max
        )
    token_loss = clipped_surrogate_token_loss(
        logprobs, old, advantages,
        epsilon=config.epsilon, epsilon_high=config.upper_epsilon, clip_min=clip_min, clip_max=clip_max,
    )  # fmt: skip
    return token_loss, None


def _check_normaliser(num_trained_tokens_global: int, gradient_accumulation_steps: int) -> float:
    if num_trained_tokens_global < 1:
        raise ValueError(f"num_trained_tokens_global must be at least 1, got {num_trained_tokens_global}")
    if gradient_accumulation_steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be at least 1, got {gradient_accumulation_steps}")
    return 1.0 / (num_trained_tokens_global * gradient_accumulation_steps)


def _output(
    loss: torch.Tensor,
    head: TokenLogProbs,
    row: PackedRow,
    config: LossConfig,
    sampler_mass: torch.Tensor | None,
) -> LossOutput:
    logprobs = head.logprobs.detach()
    with torch.no_grad():
        metrics = _token_metrics(
            logprobs, row.old_logprobs, row.advantages, head.entropy, row.sample_index, config
        )
        if sampler_mass is not None:
            metrics["sampling/sampler_mass"] = sampler_mass.mean() if sampler_mass.numel() else _nan(logprobs)
    return LossOutput(loss=loss, metrics=metrics, num_trained_tokens=int(logprobs.shape[0]))


def policy_loss(
    head: TokenLogProbs,
    row: PackedRow,
    config: LossConfig,
    *,
    num_trained_tokens_global: int,
    gradient_accumulation_steps: int = 1,
) -> LossOutput:
    """The micro-step's loss over a packed row (on the head's device) and the row's metrics.

    `head` comes from `harness.training.logprobs.row_logprobs`. `num_trained_tokens_global` is the number of
    trained tokens of this micro-batch summed over all processes (an all-reduce of `row.num_trained`).
    """
    scale = _check_normaliser(num_trained_tokens_global, gradient_accumulation_steps)
    token_loss, sampler_mass = _token_loss(
        config, head.logprobs, row.old_logprobs, row.advantages, head.topk_logprobs, row.sampler_topk_logprobs
    )
    return _output(token_loss.sum() * scale, head, row, config, sampler_mass)


def fused_policy_loss(
    hidden_T_H: torch.Tensor,
    row: PackedRow,
    weight_V_H: torch.Tensor,
    config: LossConfig,
    *,
    num_trained_tokens_global: int,
    gradient_accumulation_steps: int = 1,
    temperature: float = 1.0,
    use_sampling_mask: bool = True,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> LossOutput:
    """`row_logprobs` then `policy_loss` in one pass over the vocabulary chunks (the trainer's fast path).

    Same value, gradients and metrics as the modular path: each chunk's gradient with respect to its
    log-probs comes from differentiating the same per-token loss on the chunk's detached log-probs, and the
    head turns it into parameter gradients while the chunk's logits are still in memory (see
    `harness.training.logprobs.fused_token_loss`).
    """
    scale = _check_normaliser(num_trained_tokens_global, gradient_accumulation_steps)
    sampler_mass = torch.zeros_like(row.old_logprobs) if config.score_centering else None

    def chunk_loss(
        rows: slice, logprobs: torch.Tensor, topk: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        with torch.enable_grad():
            leaf = logprobs.detach().requires_grad_()
            leaf_topk = None if topk is None else topk.detach().requires_grad_()
            sampler_head = None if row.sampler_topk_logprobs is None else row.sampler_topk_logprobs[rows]
            token_loss, mass = _token_loss(
                config, leaf, row.old_logprobs[rows], row.advantages[rows], leaf_topk, sampler_head
            )
            total = token_loss.sum() * scale
            inputs = [leaf] if leaf_topk is None else [leaf, leaf_topk]
            grads = torch.autograd.grad(total, inputs, allow_unused=True)
        if sampler_mass is not None and mass is not None:
            sampler_mass[rows] = mass.detach()
        grad_target = grads[0] if grads[0] is not None else torch.zeros_like(leaf)
        grad_topk = None
        if leaf_topk is not None:
            grad_topk = grads[1] if grads[1] is not None else torch.zeros_like(leaf_topk)
        return total.detach(), grad_target.detach(), grad_topk

    loss, head = fused_token_loss(
        hidden_T_H.index_select(0, row.pred_index),
        weight_V_H,
        row.target_ids,
        chunk_loss,
        temperature=temperature,
        candidate_ids_N_C=row.candidate_ids if use_sampling_mask else None,
        topk_ids_N_K=row.sampler_topk_ids,
        chunk_size=chunk_size,
    )
    return _output(loss, head, row, config, sampler_mass)


def _nan(like: torch.Tensor) -> torch.Tensor:
    return like.new_tensor(float("nan"), dtype=torch.float32)


def _token_metrics(
    logprobs: torch.Tensor,
    old: torch.Tensor,
    advantages: torch.Tensor,
    entropy: torch.Tensor,
    sample_index: torch.Tensor,
    config: LossConfig,
) -> dict[str, torch.Tensor]:
    if logprobs.numel() == 0:
        names = [
            "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
            "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
            "sampling/importance_sampling_ratio/max", "sampling/masked_mean", "entropy",
            "clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean", "clip_ratio/high_max",
            "clip_ratio/region_mean",
        ]  # fmt: skip
        return {name: _nan(logprobs) for name in names}
    difference = (logprobs - old).abs()
    ratio = (logprobs - old).exp()
    kept = _in_range(
        ratio, config.vllm_importance_sampling_clip_min, config.vllm_importance_sampling_clip_max
    )
    low = (ratio < 1.0 - config.epsilon) & (advantages < 0)
    high = (ratio > 1.0 + config.upper_epsilon) & (advantages > 0)
    return {
        "sampling/sampling_logp_difference/mean": difference.mean(),
        "sampling/sampling_logp_difference/max": difference.max(),
        "sampling/importance_sampling_ratio/min": ratio.min(),
        "sampling/importance_sampling_ratio/mean": ratio.mean(),
        "sampling/importance_sampling_ratio/max": ratio.max(),
        "sampling/masked_mean": (~kept).float().mean(),
        "entropy": entropy.mean(),
        "clip_ratio/low_mean": _mean(low.float(), kept),
        "clip_ratio/low_min": _nan_reduce(_per_sample_fraction(low, kept, sample_index), "min"),
        "clip_ratio/high_mean": _mean(high.float(), kept),
        "clip_ratio/high_max": _nan_reduce(_per_sample_fraction(high, kept, sample_index), "max"),
        "clip_ratio/region_mean": _mean((low | high).float(), kept),
    }
