"""Tree attention as a cascade of variable-length attention calls over the packed row as it lies (no gathers).

A token's keys in a packed prefix trie are the tokens of its own segment up to itself and, whole, those of
every ancestor segment. Attention over that set splits into parts, each an ordinary variable-length attention
call (FlashAttention on a GPU) that reads the row's own query, key and value tensors in place:

* the self part: every segment against itself, causal (the sequences are the segments);
* one cross part per trie level d with descendants: the tokens below each level-d segment (its subtree past
  its own tokens, a contiguous row range in the depth-first layout) against that segment's tokens, with no
  mask (every key is an ancestor of every query).

For single-turn groups (one prompt, N completions) that is two calls: each completion causally against itself,
and all completions at once against the prompt, a dense rectangle that the kernel runs at full efficiency,
where gathering the prompt's keys per completion copies them N times and spends mask-free work on small
sequences.

The parts' outputs are merged by their log-sum-exps, in float32:

    lse = log(sum_i exp(lse_i))        out = sum_i exp(lse_i - lse) * out_i

and the backward runs each part's own backward kernel with the merged output and log-sum-exp. With those, the
kernel's recomputed probabilities exp(q.k * scale - lse) are the whole attention's, restricted to the part's
keys, and its correction term rowsum(d_out * out) is the whole attention's, so each part returns exactly its
share of the gradient (the identity ring attention's backward rests on); the shares add up.

A cross part lays the whole row out as sequences, in row order: for each level-d segment with descendants one
sequence (queries: the descendants' rows, keys: the segment's rows), and between them filler sequences with
queries and no keys (rows this part does not cover: their output is left out of the merge) or keys and no
queries. So a call covers the row's tensors exactly, with offsets only.

`CascadePlan.of` builds the parts from a row's segments; `cascade_attention` runs them (CUDA: the
FlashAttention operators that `torch.nn.attention.varlen` wraps; CPU: the same parts in plain float32
arithmetic, forward and backward written out, which the CPU tests check the decomposition and its backward
with).
Sliding-window layers are not cascaded: a window in depth crosses segment boundaries, and
`harness.training.attention` keeps the gathered layout for them.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

__all__ = ["CascadePart", "CascadePlan", "cascade_attention"]


@dataclass(frozen=True)
class CascadePart:
    """One variable-length attention call over the whole row: sequence j has queries rows
    `cu_q[j]:cu_q[j+1]` and keys rows `cu_k[j]:cu_k[j+1]`. `rows` are the rows that have keys in this part
    (the self part: `slice(None)`, every row); the others' output is not merged."""

    cu_q: torch.Tensor  # [n + 1] int32
    cu_k: torch.Tensor  # [n + 1] int32
    max_q: int
    max_k: int
    causal: bool
    rows: slice | torch.Tensor
    keys: slice | None = None  # one rectangle (rows x keys, no mask), as a single group's cross part is


@dataclass(frozen=True)
class CascadePlan:
    """The parts of one packed row's tree attention: the self part first, then one cross part per level."""

    parts: tuple[CascadePart, ...]

    @classmethod
    def of(
        cls, starts: list[int], lengths: list[int], parents: list[int], device: torch.device
    ) -> CascadePlan:
        num_tokens = sum(lengths)
        level: list[int] = []
        for parent in parents:  # parents precede children in depth-first order
            level.append(0 if parent < 0 else level[parent] + 1)
        subtree_end = [start + length for start, length in zip(starts, lengths, strict=True)]
        for segment in reversed(range(len(parents))):
            if parents[segment] >= 0:
                parent = parents[segment]
                subtree_end[parent] = max(subtree_end[parent], subtree_end[segment])

        parts = [_part([(n, n) for n in lengths], causal=True, rows=slice(None), device=device)]
        for depth in range(max(level, default=-1) + 1):
            ancestors = [
                s
                for s in range(len(parents))
                if level[s] == depth and subtree_end[s] > starts[s] + lengths[s]
            ]
            if not ancestors:
                continue
            sequences: list[tuple[int, int]] = []
            covered: list[tuple[int, int]] = []
            next_q = next_k = 0
            for a in ancestors:
                start, end, below_end = starts[a], starts[a] + lengths[a], subtree_end[a]
                sequences += [(end - next_q, 0), (0, start - next_k), (below_end - end, end - start)]
                covered.append((end, below_end))
                next_q, next_k = below_end, end
            sequences += [(num_tokens - next_q, 0), (0, num_tokens - next_k)]
            part = _part(sequences, causal=False, rows=_rows(covered, device), device=device)
            if len(ancestors) == 1:
                a = ancestors[0]
                part = dataclasses.replace(part, keys=slice(starts[a], starts[a] + lengths[a]))
            parts.append(part)
        return cls(parts=tuple(parts))


def _part(
    sequences: list[tuple[int, int]], *, causal: bool, rows: slice | torch.Tensor, device: torch.device
) -> CascadePart:
    sequences = [(q, k) for q, k in sequences if q or k]
    cu_q = torch.tensor([0, *(q for q, _ in sequences)], dtype=torch.int64).cumsum(0)
    cu_k = torch.tensor([0, *(k for _, k in sequences)], dtype=torch.int64).cumsum(0)
    return CascadePart(
        cu_q=cu_q.to(device=device, dtype=torch.int32),
        cu_k=cu_k.to(device=device, dtype=torch.int32),
        max_q=max((q for q, _ in sequences), default=0),
        max_k=max((k for _, k in sequences), default=0),
        causal=causal,
        rows=rows,
    )


def _rows(ranges: list[tuple[int, int]], device: torch.device) -> slice | torch.Tensor:
    """One range as a slice (a view, no copy); several as an index tensor."""
    if len(ranges) == 1:
        return slice(*ranges[0])
    return torch.cat([torch.arange(a, b) for a, b in ranges]).to(device)


def cascade_attention(
    query_T_Hq_D: torch.Tensor,
    key_T_Hkv_D: torch.Tensor,
    value_T_Hkv_D: torch.Tensor,
    plan: CascadePlan,
    *,
    scale: float | None,
) -> torch.Tensor:
    """Tree attention over one row by the plan's parts; [T, Hq, D] in the inputs' dtype.

    Grouped K/V heads (Hq a multiple of Hkv) go in unrepeated. On CUDA the inputs must be bf16 or fp16.
    """
    if scale is None:
        scale = query_T_Hq_D.shape[-1] ** -0.5
    output: torch.Tensor = _Cascade.apply(
        query_T_Hq_D.contiguous(), key_T_Hkv_D.contiguous(), value_T_Hkv_D.contiguous(), plan, scale
    )
    return output


class _Cascade(torch.autograd.Function):
    """Forward: the parts merged by log-sum-exp; backward: each part's kernel given the merged output and
    log-sum-exp, the shares summed. With one cross part (single-turn groups) the merge and the sums stay in
    the inputs' dtype, rounding once per part as each kernel does; with more they accumulate in float32."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        plan: CascadePlan,
        scale: float,
    ) -> torch.Tensor:
        self_part, *cross_parts = plan.parts
        out, lse, _ = _forward(query, key, value, self_part, scale)
        accumulate = query.dtype if len(cross_parts) <= 1 else torch.float32
        out = out.to(accumulate)
        states = []
        for part in cross_parts:
            rows = part.rows
            part_out, part_lse, state = _forward(query, key, value, part, scale)
            states.append(state)
            merged_lse = torch.logaddexp(lse[:, rows], part_lse)
            kept = (lse[:, rows] - merged_lse).exp().transpose(0, 1)[..., None]
            added = (part_lse - merged_lse).exp().transpose(0, 1)[..., None]
            out[rows] = (out[rows].float() * kept + part_out.float() * added).to(accumulate)
            lse[:, rows] = merged_lse
        out = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.plan, ctx.scale, ctx.states = plan, scale, [None, *states]
        return out

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        query, key, value, out, lse = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        grad_out = grad_out.contiguous()
        accumulate = query.dtype if len(plan.parts) <= 2 else torch.float32
        totals: list[torch.Tensor] = []
        for part, state in zip(plan.parts, ctx.states, strict=True):
            (dq, dk, dv), (rows, keys) = _backward(grad_out, query, key, value, out, lse, part, scale, state)
            if not totals:
                totals = [g.to(accumulate) for g in (dq, dk, dv)]
                continue
            totals[0][rows] += dq
            totals[1][keys] += dk
            totals[2][keys] += dv
        dq, dk, dv = (t.to(x.dtype) for t, x in zip(totals, (query, key, value), strict=True))
        return dq, dk, dv, None, None


# ------------------------------------------------------------------------------------------- the kernels


def _forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, part: CascadePart, scale: float
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """(out, lse float32, kernel state) of one part at its rows: [R, Hq, D] and [Hq, R] (every row for the
    self part). A rectangle goes to cuDNN where it runs (faster than FlashAttention 2 on Hopper)."""
    rows = part.rows
    if query.device.type != "cuda":
        out, lse = _math_forward(query, key, value, part, scale)
        return out[rows], lse[:, rows], None
    if part.keys is not None and _cudnn_rectangles(query.device):
        q, k, v = (
            _bhsd(query[rows]),
            _bhsd(_heads(key[part.keys], query)),
            _bhsd(_heads(value[part.keys], query)),
        )
        out, lse, _, _, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, False, False, scale=scale
        )
        return out[0].transpose(0, 1), lse[0, :, :, 0], (seed, offset)
    out, lse, _seed, _offset, _ = torch.ops.aten._flash_attention_forward(
        query,
        key,
        value,
        part.cu_q,
        part.cu_k,
        part.max_q,
        part.max_k,
        0.0,
        part.causal,
        False,
        scale=scale,
    )
    return out[rows], lse[:, rows], None


def _backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    part: CascadePart,
    scale: float,
    state: tuple[torch.Tensor, ...] | None,
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], tuple[slice | torch.Tensor, slice]]:
    """One part's (dq, dk, dv), given the whole attention's output and log-sum-exp, and the query rows and
    key rows they are for (the rectangle's, or every row)."""
    everything = slice(None)
    if query.device.type != "cuda":
        return _math_backward(grad_out, query, key, value, out, lse, part, scale), (everything, everything)
    if state is not None:  # a cuDNN rectangle
        rows, keys = part.rows, part.keys or everything
        q, k, v = _bhsd(query[rows]), _bhsd(_heads(key[keys], query)), _bhsd(_heads(value[keys], query))
        o, d_o = _bhsd(out[rows]), _bhsd(grad_out[rows])
        seed, offset = state
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            d_o, q, k, v, o, lse[:, rows].contiguous()[None, ..., None], seed, offset, None, None, None,
            q.shape[2], k.shape[2], 0.0, False, scale=scale,
        )  # fmt: skip
        groups = query.shape[1] // key.shape[1]
        dk, dv = (_sum_heads(x[0].transpose(0, 1), groups) for x in (dk, dv))
        return (dq[0].transpose(0, 1), dk, dv), (rows, keys)
    unused = torch.empty(0, device=query.device)
    rng_state = torch.zeros(2, dtype=torch.uint64, device=query.device)  # no dropout
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        grad_out,
        query,
        key,
        value,
        out,
        lse,
        part.cu_q,
        part.cu_k,
        part.max_q,
        part.max_k,
        0.0,
        part.causal,
        rng_state,
        unused,
        scale=scale,
    )
    return (dq, dk, dv), (everything, everything)


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """[S, H, D] -> [1, H, S, D] (a view)."""
    return x.transpose(0, 1)[None]


def _heads(kv: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """Grouped K/V heads repeated to the query's (cuDNN's rectangle takes equal head counts)."""
    groups = query.shape[1] // kv.shape[1]
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _sum_heads(grad: torch.Tensor, groups: int) -> torch.Tensor:
    return grad if groups == 1 else grad.unflatten(1, (-1, groups)).sum(2)


@functools.cache
def _cudnn_rectangles(device: torch.device) -> bool:
    """cuDNN's fused attention runs (Hopper and newer, a cuDNN build with it); else FlashAttention does."""
    return torch.cuda.get_device_capability(device) >= (9, 0) and hasattr(
        torch.ops.aten, "_scaled_dot_product_cudnn_attention"
    )


def _sequences(part: CascadePart) -> list[tuple[int, int, int, int]]:
    cu_q, cu_k = part.cu_q.tolist(), part.cu_k.tolist()
    return [(cu_q[j], cu_q[j + 1], cu_k[j], cu_k[j + 1]) for j in range(len(cu_q) - 1)]


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """[Hq, Lq, Lk] float32 scores of one sequence, -inf where a causal (bottom-right) mask hides a key."""
    groups = q.shape[1] // k.shape[1]
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float().repeat_interleave(groups, 1)) * scale
    if causal:
        length_q, length_k = q.shape[0], k.shape[0]
        rows = torch.arange(length_q)[:, None] + (length_k - length_q)
        scores = scores.masked_fill(torch.arange(length_k)[None, :] > rows, float("-inf"))
    return scores


def _math_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, part: CascadePart, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.zeros_like(query)
    lse = torch.full(query.shape[1::-1], float("-inf"), dtype=torch.float32)
    groups = query.shape[1] // key.shape[1]
    for q0, q1, k0, k1 in _sequences(part):
        if q0 == q1 or k0 == k1:
            continue
        scores = _scores(query[q0:q1], key[k0:k1], scale, part.causal)
        lse[:, q0:q1] = scores.logsumexp(-1)
        probs = (scores - lse[:, q0:q1, None]).exp()
        v = value[k0:k1].float().repeat_interleave(groups, 1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out, lse


def _math_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    part: CascadePart,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = (torch.zeros_like(x, dtype=torch.float32) for x in (query, key, value))
    heads_kv, groups = key.shape[1], query.shape[1] // key.shape[1]
    for q0, q1, k0, k1 in _sequences(part):
        if q0 == q1 or k0 == k1:
            continue
        q, k, d_o = query[q0:q1].float(), key[k0:k1].float(), grad_out[q0:q1].float()
        v = value[k0:k1].float().repeat_interleave(groups, 1)
        probs = (_scores(query[q0:q1], key[k0:k1], scale, part.causal) - lse[:, q0:q1, None]).exp()
        d_probs = torch.einsum("qhd,khd->hqk", d_o, v)
        correction = (d_o * out[q0:q1].float()).sum(-1).transpose(0, 1)  # [Hq, Lq]
        d_scores = probs * (d_probs - correction[..., None]) * scale
        dq[q0:q1] += torch.einsum("hqk,khd->qhd", d_scores, k.repeat_interleave(groups, 1))
        length_k = k1 - k0
        dk[k0:k1] += torch.einsum("hqk,qhd->khd", d_scores, q).reshape(length_k, heads_kv, groups, -1).sum(2)
        dv[k0:k1] += torch.einsum("hqk,qhd->khd", probs, d_o).reshape(length_k, heads_kv, groups, -1).sum(2)
    return dq, dk, dv
