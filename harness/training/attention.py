"""Tree attention: run a stock transformers decoder over a packed prefix-trie row.

A packed row (`harness.packing.PackedRow`) lays a trie out depth-first, so every token's subtree is a
contiguous index range and the ancestor relation needs one gather: query q may attend to key k iff

    k <= q < subtree_end[k]                                 (k is on q's root-to-token path)
    and depth[q] - depth[k] < sliding_window                (sliding-window layers only)

Three backends compute that attention, chosen per row by the device and dtype (`backend="auto"`):

* `"varlen"` (GPU default in bf16/fp16): variable-length FlashAttention, no mask, no compilation: any row
  length runs at once. Full-attention layers run as a cascade over the row as it lies
  (`harness.training.tree_cascade`): each segment causally against itself, then per trie level the tokens
  below each segment against that segment, merged by log-sum-exp; no K/V is copied. Sliding-window layers,
  and on a GPU rows shorter than `CASCADE_MIN_TOKENS`, use the gathered layout of `"varlen_gather"`. On
  CPU, where FlashAttention does not run, the same parts run in plain arithmetic (tests).
* `"varlen_gather"`: one sequence per trie segment, its queries its own tokens, its keys the tokens of its
  path (the ancestor segments' ranges, then its own) gathered by one `index_select`, so a shared prefix's
  K/V is copied once per descendant segment; the relation above is bottom-right causal alignment (a query
  sees every gathered key up to itself) and a sliding window is a window over the gathered keys, which are
  in depth order. On CPU it runs segment by segment through SDPA.
* `"flex"` (GPU, float32): PyTorch `flex_attention`, compiled, with a `BlockMask` built once per row and
  window from the mask above; fully masked 128x128 blocks are skipped, so a completion never pays for its
  siblings. Each new row length pays a compilation.
* `"sdpa"` (CPU default, tests): `scaled_dot_product_attention` with the dense [T, T] boolean mask.

The function is registered in transformers' `AttentionInterface` under `ATTENTION_NAME`, and the row's
structure travels as the `tree_mask` keyword argument, which stock decoders (Llama, Qwen2, Qwen3, Qwen3.5,
in transformers 5.17 and 5.24) forward untouched from `model(...)` to every attention call. The name has no
mask function registered, so transformers builds no mask of its own (and does not try to infer packed
sequences from position ids). Sliding-window layers pass their window (`sliding_window=`) to the attention
function, which applies it in depth, not in row index.

Gated DeltaNet hybrids (Qwen3.5 / Qwen3.6 layout: `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`) are
supported: `prepare_model_for_tree_attention` wraps each such layer so that, given a `tree_mask`, its causal
convolution reads every token's own predecessors on its path (possibly in ancestor segments), and its chunked
delta rule runs segment by segment, each starting from its parent segment's final state; segments of one trie
level run together as a batch. Other recurrent layouts (Qwen3-Next's fused projections, Mamba), attention
sinks and logit soft-capping are rejected at preparation with `TreeAttentionError`.

Usage (the trainer's micro-step; the head and loss live in harness.training.logprobs and
harness.training.loss):

    prepare_model_for_tree_attention(model)                      # once, before wrapping with FSDP
    row = pack_row([samples[i] for i in plan_row.sample_indices]).to(device)
    hidden_T_H = packed_forward(model, row)                      # [T, hidden], no LM head
    out = fused_policy_loss(hidden_T_H, row, lm_head_weight, loss_config, ...)
    out.loss.backward()
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Literal, overload

import torch
import torch.nn.functional as F
from torch import nn

from harness.packing import PackedRow
from harness.training.tree_cascade import CascadePlan, cascade_attention

__all__ = [
    "ATTENTION_NAME",
    "TreeAttentionError",
    "TreeMask",
    "VarlenPlan",
    "gated_delta_rule_chunked",
    "packed_forward",
    "prepare_model_for_tree_attention",
    "tree_attention_forward",
    "varlen_tree_attention",
]

ATTENTION_NAME = "harness_tree"
CASCADE_MIN_TOKENS = 8192  # on a GPU, shorter rows use the gathered layout (see varlen_tree_attention)
FLEX_BLOCK_SIZE = 128  # flex_attention's default block size; flex rows are padded to a multiple of it

Backend = Literal["auto", "varlen", "varlen_gather", "flex", "sdpa"]

_SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention", "linear_attention"}
_DELTANET_ATTRIBUTES = (
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_b",
    "in_proj_a",
    "conv1d",
    "A_log",
    "dt_bias",
    "norm",
    "out_proj",
    "head_k_dim",
    "head_v_dim",
    "num_k_heads",
    "num_v_heads",
    "conv_kernel_size",
    "activation",
)


class TreeAttentionError(ValueError):
    """The model or the call cannot run with tree attention; the message names what to change."""


@dataclass
class TreeMask:
    """The structure of one packed row on the forward's device, with per-row caches.

    Built by `TreeMask.from_row`; attention layers read `block_mask` / `dense_mask`, gated DeltaNet layers
    read `ancestors` and `segment_levels`. Caches live as long as the row's forward and backward (gradient
    checkpointing recomputes layers with the same object, so masks are built once per row).
    """

    position_ids: torch.Tensor  # [T] depth
    parent: torch.Tensor  # [T]
    subtree_end: torch.Tensor  # [T]
    segment_start: list[int]
    segment_length: list[int]
    segment_parent: list[int]
    backend: Backend
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_row(cls, row: PackedRow, backend: Backend = "auto") -> TreeMask:
        """The row's structure; "auto" resolves at the first attention call, which knows the dtype."""
        return cls(
            position_ids=row.position_ids,
            parent=row.parent,
            subtree_end=row.subtree_end,
            segment_start=row.segment_start.tolist(),
            segment_length=row.segment_length.tolist(),
            segment_parent=row.segment_parent.tolist(),
            backend=backend,
        )

    @property
    def num_tokens(self) -> int:
        return int(self.position_ids.shape[0])

    def dense_mask(self, sliding_window: int | None = None) -> torch.Tensor:
        """[T, T] boolean: True where query (row) may attend to key (column)."""
        key = ("dense", sliding_window)
        if key not in self._cache:
            index = torch.arange(self.num_tokens, device=self.position_ids.device)
            q, k = index[:, None], index[None, :]
            allowed = (k <= q) & (q < self.subtree_end[None, :])
            if sliding_window is not None:
                allowed &= self.position_ids[:, None] - self.position_ids[None, :] < sliding_window
            self._cache[key] = allowed
        return self._cache[key]

    @property
    def padded_tokens(self) -> int:
        """The row length rounded up to flex_attention's block size (128): the compiled backward of
        torch 2.11 fails on some shorter lengths, and fewer distinct lengths mean fewer recompilations."""
        return -(-self.num_tokens // FLEX_BLOCK_SIZE) * FLEX_BLOCK_SIZE

    def block_mask(self, sliding_window: int | None = None) -> Any:
        """flex_attention BlockMask of the same relation over `padded_tokens` (built on the tensors' device).

        Each padding token is a root of its own whose subtree is itself: it attends only to itself, and no
        real token attends to it.
        """
        key = ("block", sliding_window)
        if key not in self._cache:
            from torch.nn.attention.flex_attention import create_block_mask

            t, padded = self.num_tokens, self.padded_tokens
            device = self.position_ids.device
            pad = torch.arange(t + 1, padded + 1, device=device, dtype=self.subtree_end.dtype)
            subtree_end = torch.cat([self.subtree_end, pad])
            depth = torch.cat([self.position_ids, self.position_ids.new_zeros(padded - t)])

            def on_path(batch: Any, head: Any, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
                return (kv <= q) & (q < subtree_end[kv])

            def on_path_in_window(batch: Any, head: Any, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
                return (kv <= q) & (q < subtree_end[kv]) & (depth[q] - depth[kv] < sliding_window)

            mask_mod = on_path if sliding_window is None else on_path_in_window
            self._cache[key] = create_block_mask(
                mask_mod, None, None, padded, padded, device=device, _compile=True
            )
        return self._cache[key]

    def varlen_plan(self) -> VarlenPlan:
        """The segments as variable-length sequences: queries in row order, keys gathered along paths."""
        if "varlen" not in self._cache:
            self._cache["varlen"] = VarlenPlan.of(
                self.segment_start, self.segment_length, self.segment_parent, self.position_ids.device
            )
        return self._cache["varlen"]

    def cascade_plan(self) -> CascadePlan:
        """The segments as a cascade of variable-length calls over the row in place (full attention)."""
        if "cascade" not in self._cache:
            self._cache["cascade"] = CascadePlan.of(
                self.segment_start, self.segment_length, self.segment_parent, self.position_ids.device
            )
        return self._cache["cascade"]

    def resolve_backend(self, query: torch.Tensor) -> Literal["varlen", "varlen_gather", "flex", "sdpa"]:
        """ "auto": varlen on a GPU in half precision (the inputs', or autocast's: under bf16 autocast with
        float32 weights, a query norm hands attention float32), flex in float32 there, sdpa on CPU."""
        if self.backend != "auto":
            return self.backend
        if query.device.type != "cuda":
            return "sdpa"
        return "varlen" if _half_dtype(query) is not None and _has_varlen() else "flex"

    def ancestors(self, count: int) -> torch.Tensor:
        """[T, count] row index of each token's 1st .. count-th ancestor on its path, -1 past the root."""
        key = ("ancestors", count)
        if key not in self._cache:
            columns, current = [], self.parent
            for _ in range(count):
                columns.append(current)
                # -1 stays -1: index the parent array with a sentinel appended at position T
                current = torch.cat([self.parent, self.parent.new_full((1,), -1)])[current]
            self._cache[key] = torch.stack(columns, dim=1) if columns else self.parent[:, None][:, :0]
        return self._cache[key]

    def segment_levels(self) -> list[list[int]]:
        """Segments grouped by depth in the segment tree: every parent is in an earlier group."""
        if "levels" not in self._cache:
            level: list[int] = []
            for parent in self.segment_parent:  # parents precede children in depth-first order
                level.append(0 if parent < 0 else level[parent] + 1)
            groups: list[list[int]] = [[] for _ in range(max(level, default=-1) + 1)]
            for segment, depth in enumerate(level):
                groups[depth].append(segment)
            self._cache["levels"] = groups
        return self._cache["levels"]


@dataclass(frozen=True)
class VarlenPlan:
    """A packed row's trie segments as variable-length attention sequences.

    Sequence s has the queries of segment s (rows `cu_q[s]:cu_q[s+1]`, which are the segment's own row
    range: segments are laid out in row order) and the keys `key_index[cu_k[s]:cu_k[s+1]]`: the row indices
    of its path, root first, ending with its own tokens. Each segment starts right after its parent
    segment's last token (segments end at branches), so the path is the chain of ancestor segments, whole.
    """

    key_index: torch.Tensor  # [total_k] int64 row indices
    cu_q: torch.Tensor  # [S + 1] int32
    cu_k: torch.Tensor  # [S + 1] int32
    max_q: int
    max_k: int

    @classmethod
    def of(
        cls, starts: list[int], lengths: list[int], parents: list[int], device: torch.device
    ) -> VarlenPlan:
        path_length: list[int] = []
        pieces: list[torch.Tensor] = []
        position = 0
        for segment, (start, length, parent) in enumerate(zip(starts, lengths, parents, strict=True)):
            if start != position:
                raise TreeAttentionError(f"segment {segment} starts at {start}, not at row index {position}")
            position += length
            chain = []
            while parent >= 0:  # ancestors, nearest first
                chain.append(parent)
                parent = parents[parent]
            ranges = [(starts[a], lengths[a]) for a in reversed(chain)] + [(start, length)]
            pieces.extend(torch.arange(s, s + n) for s, n in ranges)
            path_length.append(sum(n for _, n in ranges))
        cu_q = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
        cu_k = torch.tensor([0, *path_length], dtype=torch.int64).cumsum(0)
        return cls(
            key_index=torch.cat(pieces).to(device),
            cu_q=cu_q.to(device=device, dtype=torch.int32),
            cu_k=cu_k.to(device=device, dtype=torch.int32),
            max_q=max(lengths, default=0),
            max_k=max(path_length, default=0),
        )


@functools.cache
def _has_varlen() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _varlen_takes_gqa() -> bool:
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def varlen_tree_attention(
    query_T_Hq_D: torch.Tensor,
    key_T_Hkv_D: torch.Tensor,
    value_T_Hkv_D: torch.Tensor,
    tree: TreeMask,
    *,
    scale: float | None,
    sliding_window: int | None,
    gather: bool = False,
) -> torch.Tensor:
    """Tree attention over one row as variable-length attention: the cascade (`tree_cascade`), or with
    `gather` or a sliding window the gathered layout (`VarlenPlan`); [T, Hq, D] out."""
    on_gpu = query_T_Hq_D.device.type == "cuda"
    out_dtype = query_T_Hq_D.dtype
    if on_gpu:
        dtype = _half_dtype(query_T_Hq_D)
        if dtype is None:
            raise TreeAttentionError(
                "the varlen backend (FlashAttention) needs bf16 or fp16 inputs or autocast; use "
                "backend='flex' for float32"
            )
        query_T_Hq_D, key_T_Hkv_D, value_T_Hkv_D = (
            x.to(dtype) for x in (query_T_Hq_D, key_T_Hkv_D, value_T_Hkv_D)
        )
    # On a GPU the cascade pays from about 8k-token rows (H200, 1.7B shape, single-turn groups: 396 vs 413 ms
    # per step at 8k, 823 vs 893 at 16k, 1904 vs 2181 at 32k); below, its extra calls cost more than the
    # gathers they save (269 vs 219 ms at 4k). benchmarks/bench_packing.py --sweep measures both.
    cascade = not on_gpu or tree.num_tokens >= CASCADE_MIN_TOKENS
    if sliding_window is None and not gather and cascade:
        output = cascade_attention(query_T_Hq_D, key_T_Hkv_D, value_T_Hkv_D, tree.cascade_plan(), scale=scale)
        return output.to(out_dtype)
    plan = tree.varlen_plan()
    left = -1 if sliding_window is None else sliding_window - 1  # keys within the window, in depth
    if not on_gpu:
        key_K = key_T_Hkv_D.index_select(0, plan.key_index)
        value_K = value_T_Hkv_D.index_select(0, plan.key_index)
        return _varlen_by_segment(query_T_Hq_D, key_K, value_K, plan, scale=scale, left=left)
    from torch.nn.attention.varlen import varlen_attn

    key_K = key_T_Hkv_D.index_select(0, plan.key_index)
    value_K = value_T_Hkv_D.index_select(0, plan.key_index)

    # Grouped K/V heads go in as they are: FlashAttention reads each for its query heads (torch 2.13 asks
    # for enable_gqa; 2.11's varlen_attn passes them through, checked equal to repeated heads on an H200).
    gqa = {"enable_gqa": True} if query_T_Hq_D.shape[1] != key_K.shape[1] and _varlen_takes_gqa() else {}
    output = varlen_attn(
        query_T_Hq_D.contiguous(),
        key_K,
        value_K,
        plan.cu_q,
        plan.cu_k,
        plan.max_q,
        plan.max_k,
        scale=scale,
        window_size=(left, 0),
        **gqa,
    )
    output = output[0] if isinstance(output, tuple) else output
    return output.to(out_dtype)


def _half_dtype(tensor: torch.Tensor) -> torch.dtype | None:
    """The half-precision dtype attention may compute `tensor` in: its own, or CUDA autocast's."""
    if tensor.dtype in (torch.bfloat16, torch.float16):
        return tensor.dtype
    if tensor.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
        return dtype if dtype in (torch.bfloat16, torch.float16) else None
    return None


def _varlen_by_segment(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: VarlenPlan,
    *,
    scale: float | None,
    left: int,
) -> torch.Tensor:
    """The same computation with SDPA, one segment at a time (CPU; FlashAttention needs a GPU)."""
    outputs = []
    cu_q, cu_k = plan.cu_q.tolist(), plan.cu_k.tolist()
    groups = query.shape[1] // key.shape[1]
    for s in range(len(cu_q) - 1):
        q = query[cu_q[s] : cu_q[s + 1]].transpose(0, 1)  # [H, Lq, D]
        k = key[cu_k[s] : cu_k[s + 1]].transpose(0, 1).repeat_interleave(groups, 0)
        v = value[cu_k[s] : cu_k[s + 1]].transpose(0, 1).repeat_interleave(groups, 0)
        length_q, length_k = q.shape[1], k.shape[1]
        rows = torch.arange(length_q, device=q.device)[:, None] + (length_k - length_q)  # bottom-right
        columns = torch.arange(length_k, device=q.device)[None, :]
        allowed = columns <= rows
        if left >= 0:
            allowed &= rows - columns <= left
        outputs.append(
            F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale).transpose(0, 1)
        )
    return torch.cat(outputs, dim=0)


@functools.cache
def _compiled_flex_attention() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    # Compiled once per process; dynamo marks the length dynamic after the first new shape, so rows of
    # varying length do not recompile each time.
    return torch.compile(flex_attention)


def tree_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    tree_mask: TreeMask | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function transformers calls (AttentionInterface signature).

    query [1, Hq, T, D], key / value [1, Hkv, T, D] -> output [1, T, Hq, D].
    """
    if tree_mask is None:
        raise TreeAttentionError(
            f"the model uses attention {ATTENTION_NAME!r} but was called without a tree_mask; run packed "
            "rows through harness.training.attention.packed_forward, or switch the model back with "
            "model.set_attn_implementation('sdpa') for ordinary forwards"
        )
    if query.shape[0] != 1:
        raise TreeAttentionError(
            f"a packed row is one sequence (batch size 1), got batch size {query.shape[0]}"
        )
    if dropout:
        raise TreeAttentionError(
            "tree attention has no attention dropout; set the config's attention_dropout=0"
        )
    gqa = query.shape[1] != key.shape[1]
    backend = tree_mask.resolve_backend(query)
    if backend in ("varlen", "varlen_gather"):
        output_T = varlen_tree_attention(
            query[0].transpose(0, 1),
            key[0].transpose(0, 1),
            value[0].transpose(0, 1),
            tree_mask,
            scale=scaling,
            sliding_window=sliding_window,
            gather=backend == "varlen_gather",
        )
        return output_T[None], None
    if backend == "flex":
        t, extra = tree_mask.num_tokens, tree_mask.padded_tokens - tree_mask.num_tokens
        query, key, value = (F.pad(x, (0, 0, 0, extra)) for x in (query, key, value))
        output = _compiled_flex_attention()(
            query, key, value, block_mask=tree_mask.block_mask(sliding_window), scale=scaling, enable_gqa=gqa
        )[:, :, :t]
    else:
        mask = tree_mask.dense_mask(sliding_window)[None, None]
        output = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa
        )
    return output.transpose(1, 2).contiguous(), None


# --------------------------------------------------------------------------------------- gated DeltaNet


def gated_delta_rule_chunked(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over [B, H, L, *] float32 inputs, in chunks; returns (output, final state).

    Per step t (queries already normalised and scaled), with state S of shape [Dk, Dv]:

        S <- exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t

    Within a chunk, with G_t the cumulative log decay since the chunk's start and S0 its initial state,
    unrolling gives u_t = beta_t v_t - beta_t e^{G_t} S0^T k_t - sum_{s<t} beta_t e^{G_t - G_s} (k_t.k_s) u_s,
    i.e. (I + A) U = beta V - (beta e^G K) S0 with A strictly lower triangular, solved by one triangular
    solve per chunk for both right-hand sides. Then

        o_t = e^{G_t} S0^T q_t + sum_{s<=t} e^{G_t - G_s} (q_t.k_s) u_s
        S_end = e^{G_C} S0 + sum_s e^{G_C - G_s} k_s u_s^T

    and every exponent is <= 0, so nothing overflows.
    Positions padded with beta = 0 and g = 0 leave the state unchanged, which batching segments relies on.
    """
    batch, heads, length, _ = key.shape
    pad = (-length) % chunk_size
    if pad:
        query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
        log_decay, beta = (F.pad(x, (0, pad)) for x in (log_decay, beta))
    num_chunks = (length + pad) // chunk_size

    def chunked(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(batch, heads, num_chunks, chunk_size, *x.shape[3:])

    q, k, v, g, b = (chunked(x) for x in (query, key, value, log_decay, beta))
    cumulative = g.cumsum(-1)  # [B, H, N, C]
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=key.device).tril()
    strictly_lower = lower.tril(-1)
    pair_decay = (
        (cumulative[..., :, None] - cumulative[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    )
    system = (b[..., :, None] * (k @ k.transpose(-1, -2)) * pair_decay).masked_fill(~strictly_lower, 0.0)
    system = system + torch.eye(chunk_size, dtype=system.dtype, device=system.device)
    u_from_values = torch.linalg.solve_triangular(system, b[..., None] * v, upper=False, unitriangular=True)
    u_per_state = torch.linalg.solve_triangular(
        system, (b * cumulative.exp())[..., None] * k, upper=False, unitriangular=True
    )
    attend = (q @ k.transpose(-1, -2)) * pair_decay
    q_from_state = q * cumulative.exp()[..., None]
    last = cumulative[..., -1:]
    k_to_end = k * (last - cumulative).exp()[..., None]
    chunk_decay = last.exp()[..., None]  # [B, H, N, 1, 1]

    state = initial_state
    outputs = []
    for c in range(num_chunks):
        u = u_from_values[:, :, c] - u_per_state[:, :, c] @ state
        outputs.append(q_from_state[:, :, c] @ state + attend[:, :, c] @ u)
        state = state * chunk_decay[:, :, c] + k_to_end[:, :, c].transpose(-1, -2) @ u
    output = torch.cat(outputs, dim=2)[:, :, :length]
    return output, state


def _l2_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _tree_gated_deltanet(module: nn.Module, hidden_states: torch.Tensor, tree: TreeMask) -> torch.Tensor:
    """A Qwen3.5 gated DeltaNet layer over a packed row: convolution along paths, state along segments."""
    from transformers.activations import ACT2FN

    if hidden_states.shape[0] != 1:
        raise TreeAttentionError(f"a packed row is one sequence (batch size 1), got {hidden_states.shape[0]}")
    x = hidden_states[0]
    num_tokens = x.shape[0]
    mixed = module.in_proj_qkv(x)  # [T, C]
    gate = module.in_proj_z(x).reshape(num_tokens, -1, module.head_v_dim)
    beta = module.in_proj_b(x).sigmoid()
    log_decay = -module.A_log.float().exp() * F.softplus(module.in_proj_a(x).float() + module.dt_bias)

    # Depthwise causal convolution over each token's own path: tap d reads the d-th ancestor.
    kernel = module.conv_kernel_size
    weight = module.conv1d.weight.squeeze(1)  # [C, K]; tap K-1 is the token itself
    mixed = mixed.to(weight.dtype)
    ancestors = tree.ancestors(kernel - 1)
    with_zero = torch.cat([mixed, mixed.new_zeros(1, mixed.shape[1])])
    convolved = mixed * weight[:, kernel - 1]
    for distance in range(1, kernel):
        index = ancestors[:, distance - 1]
        convolved = (
            convolved + with_zero[index.where(index >= 0, num_tokens)] * weight[:, kernel - 1 - distance]
        )
    if module.conv1d.bias is not None:
        convolved = convolved + module.conv1d.bias
    mixed = ACT2FN[module.activation](convolved)

    key_dim = module.head_k_dim * module.num_k_heads
    query, key, value = torch.split(mixed, [key_dim, key_dim, mixed.shape[1] - 2 * key_dim], dim=-1)
    query = query.reshape(num_tokens, -1, module.head_k_dim)
    key = key.reshape(num_tokens, -1, module.head_k_dim)
    value = value.reshape(num_tokens, -1, module.head_v_dim)
    repeat = module.num_v_heads // module.num_k_heads
    if repeat > 1:
        query = query.repeat_interleave(repeat, dim=1)
        key = key.repeat_interleave(repeat, dim=1)
    query = _l2_normalise(query.float()) * module.head_k_dim**-0.5
    key = _l2_normalise(key.float())
    value, beta = value.float(), beta.float()

    core = _tree_delta_rule(query, key, value, log_decay, beta, tree)  # [T, Hv, Dv] float32
    core = module.norm(
        core.to(hidden_states.dtype).reshape(-1, module.head_v_dim), gate.reshape(-1, module.head_v_dim)
    )
    return module.out_proj(core.reshape(1, num_tokens, -1))


def _tree_delta_rule(
    query: torch.Tensor,  # [T, H, Dk]
    key: torch.Tensor,
    value: torch.Tensor,  # [T, H, Dv]
    log_decay: torch.Tensor,  # [T, H]
    beta: torch.Tensor,  # [T, H]
    tree: TreeMask,
) -> torch.Tensor:
    num_tokens, heads, key_dim = key.shape
    value_dim = value.shape[-1]
    device = key.device
    # A zero row at index T serves every padded position of a batched level.
    padded = [torch.cat([x, x.new_zeros(1, *x.shape[1:])]) for x in (query, key, value, log_decay, beta)]
    output = value.new_zeros(num_tokens + 1, heads, value_dim)
    zero_state = value.new_zeros(heads, key_dim, value_dim)
    final_states: dict[int, torch.Tensor] = {}
    for level in tree.segment_levels():
        longest = max(tree.segment_length[s] for s in level)
        offsets = torch.arange(longest, device=device)
        starts = torch.tensor([tree.segment_start[s] for s in level], device=device)
        lengths = torch.tensor([tree.segment_length[s] for s in level], device=device)
        index = torch.where(offsets < lengths[:, None], starts[:, None] + offsets, num_tokens)  # [B, L]
        q, k, v, g, b = (x[index].transpose(1, 2) for x in padded)  # [B, H, L, *]
        initial = torch.stack(
            [final_states[p] if (p := tree.segment_parent[s]) >= 0 else zero_state for s in level]
        )
        level_output, level_states = gated_delta_rule_chunked(q, k, v, g, b, initial)
        output = output.index_put(
            (index.reshape(-1),), level_output.transpose(1, 2).reshape(-1, heads, value_dim)
        )
        for i, segment in enumerate(level):
            final_states[segment] = level_states[i]
    return output[:num_tokens]


def _wrap_deltanet(module: nn.Module) -> None:
    if getattr(module, "_harness_tree_ready", False):
        return
    stock_forward = module.forward

    def forward(hidden_states: torch.Tensor, *args: Any, tree_mask: TreeMask | None = None, **kwargs: Any):
        if tree_mask is None:
            return stock_forward(hidden_states, *args, **kwargs)
        if kwargs.get("cache") is not None or kwargs.get("cache_params") is not None:
            raise TreeAttentionError("packed rows run without a cache; call with use_cache=False")
        return _tree_gated_deltanet(module, hidden_states, tree_mask)

    module.forward = forward
    module._harness_tree_ready = True


# --------------------------------------------------------------------------------------------- the model


def _text_config(config: Any) -> Any:
    return getattr(config, "text_config", None) or config


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, tree_attention_forward)


def _is_recurrent_layer(name: str, module: nn.Module) -> bool:
    """A token mixer with state along the sequence (it must see the tree to be packed exactly)."""
    kind = type(module).__name__
    return name.rsplit(".", 1)[-1] == "linear_attn" or any(
        marker in kind for marker in ("DeltaNet", "Mamba", "LinearAttention", "RecurrentBlock")
    )


def prepare_model_for_tree_attention(model: nn.Module) -> nn.Module:
    """Switch a transformers causal LM to tree attention, or raise TreeAttentionError if it cannot run.

    Checks the model once, at the start: attention sinks, logit soft-capping, layer types other than full,
    sliding-window and gated-DeltaNet layers, and DeltaNet layers of another layout are rejected with the
    reason. Wraps supported DeltaNet layers (see the module docstring). Returns the model.
    """
    config = _text_config(model.config)
    problems = []
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, name, None):
            problems.append(f"{name}={getattr(config, name)} (tree attention has no soft-capping)")
    if getattr(config, "attention_dropout", 0.0):
        problems.append("attention_dropout > 0 (set it to 0 for RL fine-tuning)")
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if unknown := layer_types - _SUPPORTED_LAYER_TYPES:
        problems.append(f"layer types {sorted(unknown)} (supported: {sorted(_SUPPORTED_LAYER_TYPES)})")
    deltanets = []
    for module_name, module in model.named_modules():
        if isinstance(getattr(module, "sinks", None), torch.Tensor):
            problems.append(f"{module_name} has attention sinks")
        if _is_recurrent_layer(module_name, module):
            missing = [a for a in _DELTANET_ATTRIBUTES if not hasattr(module, a)]
            if missing:
                problems.append(
                    f"{module_name} ({type(module).__name__}) is a recurrent layer of a layout tree packing "
                    f"does not know (it lacks {missing}); supported: Qwen3.5-style gated DeltaNet"
                )
            else:
                deltanets.append(module)
    if "linear_attention" in layer_types and not deltanets and not problems:
        problems.append(
            "the config declares linear_attention layers but no supported gated DeltaNet was found"
        )
    if problems:
        raise TreeAttentionError(
            f"{type(model).__name__} cannot be trained with tree packing: " + "; ".join(problems)
        )
    _register()
    model.set_attn_implementation(ATTENTION_NAME)
    for module in deltanets:
        _wrap_deltanet(module)
    return model


@overload
def packed_forward(
    model: nn.Module,
    row: PackedRow,
    *,
    backend: Backend = "auto",
    output_router_logits: Literal[False] = False,
) -> torch.Tensor: ...


@overload
def packed_forward(
    model: nn.Module, row: PackedRow, *, backend: Backend = "auto", output_router_logits: Literal[True]
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]: ...


def packed_forward(
    model: nn.Module, row: PackedRow, *, backend: Backend = "auto", output_router_logits: bool = False
) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Run the model's decoder (no LM head) over one packed row; returns hidden states [T, hidden].

    The row must be on the model's device (`row.to(device)`); the LM head is left to
    `harness.training.logprobs`, which only evaluates it at the trained tokens' predecessors. With
    `output_router_logits=True` (a Mixture-of-Experts model) returns `(hidden_T_H, router_logits_L)` instead:
    one [T, num_experts] tensor per MoE layer, for the load-balancing loss
    (`harness.training.moe.router_aux_loss`).
    """
    if _text_config(model.config)._attn_implementation != ATTENTION_NAME:
        raise TreeAttentionError("call prepare_model_for_tree_attention(model) before packed_forward")
    tree = TreeMask.from_row(row, backend)
    router_kwargs = {"output_router_logits": True} if output_router_logits else {}
    outputs = model.get_decoder()(
        input_ids=row.input_ids[None],
        position_ids=row.position_ids[None],
        tree_mask=tree,
        use_cache=False,
        **router_kwargs,
    )
    hidden_T_H = outputs.last_hidden_state[0]
    if not output_router_logits:
        return hidden_T_H
    router_logits_L = getattr(outputs, "router_logits", None)
    if not router_logits_L:
        raise TreeAttentionError(
            f"{type(model).__name__}'s decoder returned no router logits: output_router_logits=True needs a "
            "Mixture-of-Experts model"
        )
    return hidden_T_H, tuple(router_logits_L)
