"""Log-probabilities and entropy of the trained tokens, without a row's full-vocabulary logits.

The loss needs, per trained token, log p(target) at the config's temperature, the entropy (a metric), and
for score centering log p of the sampler's top-k tokens. Materialising the logits of a row costs
tokens x vocabulary floats (32k tokens x 152k vocabulary = 20 GB in float32, plus as much again for their
gradient), so the head works on chunks of tokens, with float32 logits (bf16 operands, float32 accumulation
and output where the device supports it) and float32 log-sum-exps. Two entry points:

* `token_logprobs` (modular): a custom autograd function returns differentiable log-probs. Its forward keeps
  only the per-token log-sum-exp; its backward recomputes each chunk's logits and forms
  d loss / d logits = sum_j g_j (e_{id_j} - p) / temperature (p the renormalised softmax, zero outside the
  candidate set), accumulating the hidden states' and the weight's gradients, the weight's in float32.
* `fused_token_loss` (the trainer's fast path): the losses here are per token and their gradient with respect
  to a token's log-probs depends only on detached values, so a per-chunk loss function can be evaluated as
  soon as a chunk's log-probs exist, and the chunk's parameter gradients formed from the logits still in
  memory. That saves the backward's recomputation of the logits (one of four vocabulary-sized matmuls) and
  half the elementwise passes over the chunk; backward only scales the stored gradients.

Peak memory is a few chunk x vocabulary buffers plus one float32 copy of the weight's gradient,
independent of the row's length.

Candidate sets (top-k / top-p): the sampler draws from a truncated, renormalised distribution and reports
log-probabilities under it, so a token's probability must be renormalised over the same set, or every
importance ratio is biased. `candidate_ids` gives each token's set (padded with -1; a row of -1 means the
full vocabulary); the target is always treated as a candidate. Top-k ids outside the set get -inf.

Entropy is of the same (renormalised) distribution and carries no gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from harness.packing import PackedRow

__all__ = ["ChunkLoss", "TokenLogProbs", "fused_token_loss", "row_logprobs", "token_logprobs"]

DEFAULT_CHUNK_SIZE = 1024

# (token slice, log-probs [n], top-k log-probs [n, K] or None) -> (loss summed over the slice,
# d loss / d log-probs [n], d loss / d top-k log-probs [n, K] or None); everything detached.
ChunkLoss = Callable[
    [slice, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
]


@dataclass(frozen=True)
class TokenLogProbs:
    """The head's outputs for N trained tokens.

    Attributes:
        logprobs: [N] float32 log p(target) (differentiable from `token_logprobs`, detached from the fused
            path).
        entropy: [N] float32 entropy of the token's distribution, detached.
        topk_logprobs: [N, K] float32 log p of the requested top-k ids; -inf at padding and at ids outside the
            candidate set. None when no ids were requested.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor
    topk_logprobs: torch.Tensor | None


@functools.cache
def _mixed_precision_matmul_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether mm / addmm with out_dtype=float32 run for low-precision operands on this device."""
    try:
        a = torch.ones(16, 16, dtype=dtype, device=device_type)
        accumulator = torch.zeros(16, 16, device=device_type)
        torch.mm(a, a, out_dtype=torch.float32)
        torch.addmm(accumulator, a, a, out_dtype=torch.float32, out=accumulator)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool((accumulator == 16).all())


def _matmul_float32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with a float32 result: exact for float32, float32-accumulated for bf16/fp16 where supported."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return a @ b
    if a.dtype == b.dtype and _mixed_precision_matmul_works(a.device.type, a.dtype):
        return torch.mm(a, b, out_dtype=torch.float32)
    if a.device.type == "cpu":
        return a.float() @ b.float()
    return (a @ b.to(a.dtype)).float()  # the matmul still accumulates in float32; only its output is rounded


def _add_matmul_float32(accumulator: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """accumulator (float32) += a @ b, inside the matmul when the device can (no extra pass over it)."""
    if (
        a.dtype != torch.float32
        and a.dtype == b.dtype
        and _mixed_precision_matmul_works(a.device.type, a.dtype)
    ):
        torch.addmm(accumulator, a, b, out_dtype=torch.float32, out=accumulator)
    else:
        accumulator += _matmul_float32(a, b)


@dataclass
class _Chunk:
    """One chunk's forward quantities."""

    allowed: torch.Tensor | None  # [n, V] candidate mask, None for the full vocabulary
    lse: torch.Tensor  # [n]
    logprobs: torch.Tensor  # [n]
    topk_logprobs: torch.Tensor  # [n, K]
    entropy: torch.Tensor  # [n]
    probs: torch.Tensor | None  # [n, V] when kept for a gradient


def _chunk_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    temperature: float,
    targets: torch.Tensor,
    candidates: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tempered float32 logits of a chunk, -inf outside the candidate sets; and the candidate mask."""
    logits = _matmul_float32(hidden, weight.t())
    if temperature != 1.0:
        logits = logits / temperature
    if candidates is None:
        return logits, None
    vocab = logits.shape[1]
    # Padding (-1) scatters into a spare column that is dropped; a row without candidates keeps everything.
    allowed = torch.zeros(logits.shape[0], vocab + 1, dtype=torch.bool, device=logits.device)
    allowed.scatter_(1, candidates.where(candidates >= 0, vocab), True)
    allowed = allowed[:, :vocab]
    allowed[(candidates < 0).all(dim=1)] = True
    allowed.scatter_(1, targets[:, None], True)
    return logits.masked_fill(~allowed, float("-inf")), allowed


def _valid_topk(topk_ids: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    valid = topk_ids >= 0
    if allowed is not None:
        valid &= allowed.gather(1, topk_ids.clamp(min=0))
    return valid


def _chunk_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    candidates: torch.Tensor | None,
    topk_ids: torch.Tensor,
    temperature: float,
    keep_probs: bool,
) -> _Chunk:
    logits, allowed = _chunk_logits(hidden, weight, temperature, targets, candidates)
    lse = torch.logsumexp(logits, dim=-1)
    logprobs_V = logits.sub_(lse[:, None])  # in place: one vocabulary-sized buffer fewer
    probs = logprobs_V.exp()
    # -sum p log p rather than lse - sum p z, which cancels badly for peaked distributions
    plogp = probs * logprobs_V
    if allowed is not None:
        plogp = plogp.masked_fill(~allowed, 0.0)
    entropy = -plogp.sum(dim=-1)
    del plogp
    logprobs = logprobs_V.gather(1, targets[:, None])[:, 0]
    topk_logprobs = logprobs_V.gather(1, topk_ids.clamp(min=0))
    topk_logprobs = topk_logprobs.masked_fill(~_valid_topk(topk_ids, allowed), float("-inf"))
    return _Chunk(allowed, lse, logprobs, topk_logprobs, entropy, probs if keep_probs else None)


def _grad_logits(
    probs: torch.Tensor,
    allowed: torch.Tensor | None,
    targets: torch.Tensor,
    topk_ids: torch.Tensor,
    grad_target: torch.Tensor,
    grad_topk: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """d loss / d raw logits for upstream gradients on log p(target) and log p(top-k ids).

    d log p_j / d z = e_j - p for every requested id j, so the p terms share one coefficient per token.
    Modifies `probs` in place (it becomes the result).
    """
    total = grad_target.clone()
    if grad_topk is not None and topk_ids.shape[1]:
        grad_topk = grad_topk.masked_fill(~_valid_topk(topk_ids, allowed), 0.0)
        total += grad_topk.sum(dim=1)
    grad = probs.mul_(-total[:, None])
    grad.scatter_add_(1, targets[:, None], grad_target[:, None])
    if grad_topk is not None and topk_ids.shape[1]:
        grad.scatter_add_(1, topk_ids.clamp(min=0), grad_topk)
    if temperature != 1.0:
        grad /= temperature
    return grad


def _accumulate_parameter_grads(
    grad_logits: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    grad_hidden: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
    rows: slice,
) -> None:
    low = grad_logits.to(hidden.dtype)
    if grad_hidden is not None:
        grad_hidden[rows] = low @ weight.to(hidden.dtype)
    if grad_weight is not None:
        _add_matmul_float32(grad_weight, low.t(), hidden[rows])


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        candidates: torch.Tensor | None,
        topk_ids: torch.Tensor,
        temperature: float,
        chunk_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        num_tokens = hidden.shape[0]
        float_options = {"dtype": torch.float32, "device": hidden.device}
        logprobs = torch.empty(num_tokens, **float_options)
        entropy = torch.empty(num_tokens, **float_options)
        topk_logprobs = torch.empty(topk_ids.shape, **float_options)
        lse = torch.empty(num_tokens, **float_options)
        for start in range(0, num_tokens, chunk_size):
            rows = slice(start, min(start + chunk_size, num_tokens))
            chunk = _chunk_forward(
                hidden[rows],
                weight,
                targets[rows],
                _rows_of(candidates, rows),
                topk_ids[rows],
                temperature,
                False,
            )
            logprobs[rows], entropy[rows], topk_logprobs[rows] = (
                chunk.logprobs,
                chunk.entropy,
                chunk.topk_logprobs,
            )
            lse[rows] = chunk.lse
        ctx.save_for_backward(hidden, weight, targets, candidates, topk_ids, lse)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy, topk_logprobs

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx,
        grad_logprobs: torch.Tensor,
        grad_entropy: torch.Tensor,
        grad_topk: torch.Tensor,
    ) -> tuple[torch.Tensor | None, ...]:
        del grad_entropy  # entropy is a metric: non-differentiable
        hidden, weight, targets, candidates, topk_ids, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, min(start + ctx.chunk_size, hidden.shape[0]))
            logits, allowed = _chunk_logits(
                hidden[rows], weight, ctx.temperature, targets[rows], _rows_of(candidates, rows)
            )
            probs = logits.sub_(lse[rows, None]).exp_()
            grad_logits = _grad_logits(
                probs,
                allowed,
                targets[rows],
                topk_ids[rows],
                grad_logprobs[rows],
                grad_topk[rows],
                ctx.temperature,
            )
            _accumulate_parameter_grads(grad_logits, hidden, weight, grad_hidden, grad_weight, rows)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def _rows_of(tensor: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if tensor is None else tensor[rows]


def _check(hidden_N_H: torch.Tensor, target_ids_N: torch.Tensor, temperature: float, chunk_size: int) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    if hidden_N_H.shape[0] != target_ids_N.shape[0]:
        raise ValueError(f"{hidden_N_H.shape[0]} hidden states for {target_ids_N.shape[0]} targets")


def token_logprobs(
    hidden_N_H: torch.Tensor,
    weight_V_H: torch.Tensor,
    target_ids_N: torch.Tensor,
    *,
    temperature: float = 1.0,
    candidate_ids_N_C: torch.Tensor | None = None,
    topk_ids_N_K: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> TokenLogProbs:
    """Log-probabilities, entropy and top-k log-probabilities of N tokens under the LM head `weight_V_H`.

    `hidden_N_H` are the final hidden states (after the last norm) at the positions that predict the tokens.
    `weight_V_H` must be a plain tensor (under FSDP2, the unsharded LM-head weight). Padded id entries are -1.
    """
    _check(hidden_N_H, target_ids_N, temperature, chunk_size)
    topk = topk_ids_N_K if topk_ids_N_K is not None else target_ids_N.new_empty(target_ids_N.shape[0], 0)
    logprobs, entropy, topk_logprobs = _ChunkedHead.apply(
        hidden_N_H, weight_V_H, target_ids_N, candidate_ids_N_C, topk, float(temperature), chunk_size
    )
    return TokenLogProbs(logprobs, entropy, topk_logprobs if topk_ids_N_K is not None else None)


class _FusedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        candidates: torch.Tensor | None,
        topk_ids: torch.Tensor,
        temperature: float,
        chunk_size: int,
        chunk_loss: ChunkLoss,
        has_topk: bool,
    ) -> tuple[torch.Tensor, ...]:
        num_tokens = hidden.shape[0]
        float_options = {"dtype": torch.float32, "device": hidden.device}
        logprobs = torch.empty(num_tokens, **float_options)
        entropy = torch.empty(num_tokens, **float_options)
        topk_logprobs = torch.empty(topk_ids.shape, **float_options)
        loss = torch.zeros((), **float_options)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, num_tokens, chunk_size):
            rows = slice(start, min(start + chunk_size, num_tokens))
            chunk = _chunk_forward(
                hidden[rows],
                weight,
                targets[rows],
                _rows_of(candidates, rows),
                topk_ids[rows],
                temperature,
                True,
            )
            logprobs[rows], entropy[rows], topk_logprobs[rows] = (
                chunk.logprobs,
                chunk.entropy,
                chunk.topk_logprobs,
            )
            chunk_value, grad_target, grad_topk = chunk_loss(
                rows, chunk.logprobs, chunk.topk_logprobs if has_topk else None
            )
            loss += chunk_value
            grad_logits = _grad_logits(
                chunk.probs, chunk.allowed, targets[rows], topk_ids[rows], grad_target, grad_topk, temperature
            )
            _accumulate_parameter_grads(grad_logits, hidden, weight, grad_hidden, grad_weight, rows)
            del chunk, grad_logits
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.mark_non_differentiable(logprobs, entropy, topk_logprobs)
        return loss, logprobs, entropy, topk_logprobs

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_loss: torch.Tensor, *unused: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_loss.to(torch.float32)
        hidden_out = None if grad_hidden is None else grad_hidden * scale.to(grad_hidden.dtype)
        weight_out = None if grad_weight is None else grad_weight * scale.to(grad_weight.dtype)
        return hidden_out, weight_out, None, None, None, None, None, None, None


def fused_token_loss(
    hidden_N_H: torch.Tensor,
    weight_V_H: torch.Tensor,
    target_ids_N: torch.Tensor,
    chunk_loss: ChunkLoss,
    *,
    temperature: float = 1.0,
    candidate_ids_N_C: torch.Tensor | None = None,
    topk_ids_N_K: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, TokenLogProbs]:
    """A per-token loss of the head's log-probs and its gradient, computed in one pass over the chunks.

    `chunk_loss` receives each chunk's (detached) log-probs and returns the chunk's summed loss and its
    gradient with respect to them (see `ChunkLoss`); `harness.training.loss.fused_policy_loss` builds it from
    the same per-token losses as the modular path. Returns the loss (a scalar whose backward delivers the
    gradients to `hidden_N_H` and `weight_V_H`) and the detached log-probs, entropy and top-k log-probs.
    """
    _check(hidden_N_H, target_ids_N, temperature, chunk_size)
    has_topk = topk_ids_N_K is not None
    topk = topk_ids_N_K if has_topk else target_ids_N.new_empty(target_ids_N.shape[0], 0)
    loss, logprobs, entropy, topk_logprobs = _FusedHeadLoss.apply(
        hidden_N_H,
        weight_V_H,
        target_ids_N,
        candidate_ids_N_C,
        topk,
        float(temperature),
        chunk_size,
        chunk_loss,
        has_topk,
    )
    return loss, TokenLogProbs(logprobs, entropy, topk_logprobs if has_topk else None)


def row_logprobs(
    hidden_T_H: torch.Tensor,
    row: PackedRow,
    weight_V_H: torch.Tensor,
    *,
    temperature: float = 1.0,
    use_sampling_mask: bool = True,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> TokenLogProbs:
    """`token_logprobs` for a packed row's trained tokens, read at their predecessors (`row.pred_index`).

    The sampler's top-k ids are always evaluated when the row has them (score centering needs them); the
    candidate sets are used when `use_sampling_mask` (the server reported them, see the spec's top-k/top-p).
    """
    return token_logprobs(
        hidden_T_H.index_select(0, row.pred_index),
        weight_V_H,
        row.target_ids,
        temperature=temperature,
        candidate_ids_N_C=row.candidate_ids if use_sampling_mask else None,
        topk_ids_N_K=row.sampler_topk_ids,
        chunk_size=chunk_size,
    )
