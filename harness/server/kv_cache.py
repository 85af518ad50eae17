"""The built-in server's KV cache, and the attention function that reads and writes it.

Who talks to it: the engine (`harness/server/engine.py`) owns one `RowKVCache`, describes each forward pass
in a `ForwardBatch` and runs the model inside `forward_context(batch)`; the model's attention layers call
`row_cache_attention`, which transformers dispatches to because the engine sets the model's attention
implementation to `ATTN_IMPLEMENTATION`. The model is called without a transformers `Cache` (use_cache=False),
so none of transformers' cache or mask machinery runs: this module alone decides where keys and values live
and what each query may attend to. That makes it work the same on transformers 5.17 and 5.24, whose
continuous-batching internals differ.

Layout: one dense row per running request, `[rows, kv_heads, length, head_dim]` per layer for keys and for
values. The engine keeps running requests in rows 0..n-1 (a finished request's row is refilled by moving
the last row into it), so a decode step attends over a plain slice of the cache, with no gather. Prefill
runs a left-padded batch of new requests with ordinary causal attention over their fresh keys, and writes
those keys into the requests' rows; when some of them start from a prefix copied in by the prefix cache
(`prefix_cache.py`), their queries attend over their rows (the copied positions and the fresh ones).
Storage grows by doubling up to `max_rows x max_length`, plus one scratch row that padding tokens of the CUDA
graphs' fixed-shape batches write to (`cuda_graphs.py`); the engine keeps `(rows + 1) x longest sequence`
(the scratch row counted) within the token budget it was given (`capacity_tokens`), preempting the newest
request when a step would exceed it. One request always runs: under a budget of two longest sequences, its
row and the scratch row exceed it by at most one row.

Supported models: decoder-only transformers models whose attention modules carry `layer_idx` and use the
`AttentionInterface` (Llama, Qwen2, Qwen3, Mistral without sliding window, SmolLM2, ...) with full attention
in every layer; `check_model_supported` says why another model is refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ATTN_IMPLEMENTATION = "harness_row_cache"


class UnsupportedModelError(ValueError):
    """The model's architecture cannot be served by the built-in server's KV cache."""


@dataclass
class ForwardBatch:
    """What one forward pass tells the attention function (index tensors live on the model's device).

    A prefill batch holds the tokens still to compute of new requests, left-padded to `num_tokens`
    positions (a request whose prefix came from the prefix cache starts after it); a decode batch holds
    one new token for each of the cache rows 0..num_rows-1.

    Attributes:
        mode: "prefill" or "decode".
        cache: The cache written and read.
        rows_B: Cache row of each batch entry.
        write_batch_N, write_token_N, write_position_N: For each real (non-padding) new token: its batch
            entry, its index in the padded batch and its position in the sequence (where its key is stored).
            A decode batch writes every entry's one token: batch entry i is written i-th.
        attn_mask: Boolean, True where a query may attend: [B, 1, T, T] for a prefill of fresh requests,
            [B, 1, T, L] for one where some continue a cached prefix, [B, 1, 1, L] for decode.
        kv_length: The number of cache positions attended (the longest sequence in the batch) for decode,
            and for a prefill that continues cached prefixes; 0 for a prefill of fresh requests, which
            attends over the new keys only.
        lora_groups: For LoRA adapters used in this batch: (adapter, batch entries that use it).
        write_row_N: The cache row of each written token when it is not its batch entry's row (padding
            tokens of a padded batch go to the cache's scratch row); None: `rows_B[write_batch_N]`, filled
            in at construction.
        attn_bias: `attn_mask` as the additive mask (0 or -inf, the cache's dtype) every layer's SDPA
            takes, made once per forward, by the first layer that asks (FlashAttention's decode never
            does: `DECODE_ATTENTION`) (a boolean mask would be converted by each layer's attention
            call: two kernels a layer, which in a decode step bound by its number of kernels is time; on
            an H100, 64 rows of a 0.6B model: 918 -> 834 kernels, 3.95 -> 3.79 ms a step, after the
            decode write without gathers had taken it from 999 and 4.23 ms).
    """

    mode: Literal["prefill", "decode"]
    cache: RowKVCache
    rows_B: torch.Tensor
    write_batch_N: torch.Tensor
    write_token_N: torch.Tensor
    write_position_N: torch.Tensor
    attn_mask: torch.Tensor
    kv_length: int = 0
    lora_groups: list[tuple[Any, torch.Tensor]] = field(default_factory=list)
    write_row_N: torch.Tensor | None = None
    _attn_bias: torch.Tensor | None = field(default=None, init=False, repr=False)
    # The varlen decode's index tensors (`_flash_decode`), made at the first layer that asks, once a forward.
    flash_plan: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.write_row_N is None:
            self.write_row_N = self.rows_B[self.write_batch_N]

    @property
    def attn_bias(self) -> torch.Tensor:
        if self._attn_bias is None:
            bias = torch.full(
                self.attn_mask.shape, float("-inf"), dtype=self.cache.dtype, device=self.attn_mask.device
            )
            self._attn_bias = bias.masked_fill_(self.attn_mask, 0.0)
        return self._attn_bias


_current_batch: ContextVar[ForwardBatch | None] = ContextVar("harness_forward_batch", default=None)


@contextlib.contextmanager
def forward_context(batch: ForwardBatch) -> Iterator[None]:
    """Make `batch` the one the attention function (and LoRA hooks) see during the model call."""
    token = _current_batch.set(batch)
    try:
        yield
    finally:
        _current_batch.reset(token)


def current_batch() -> ForwardBatch | None:
    return _current_batch.get()


class RowKVCache:
    """Keys and values of running requests, one dense row per request, grown on demand.

    Args:
        num_layers, num_kv_heads, head_dim: The model's attention shape.
        dtype, device: Where the cache lives (the model's).
        max_rows: Most rows ever allocated (the engine's max_num_seqs).
        max_length: Longest sequence (max_model_len).
        capacity_tokens: Token budget the storage keeps within, the scratch row included (`rows_fitting`);
            reported as the cache size in /metrics.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        max_rows: int,
        max_length: int,
        capacity_tokens: int,
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.max_rows = max_rows
        self.max_length = max_length
        self.capacity_tokens = capacity_tokens
        # Keys and values of every layer in one tensor, [2 (keys, values), layers, rows + 1, kv_heads, length,
        # head_dim], so copying a row is one kernel; `_keys[layer]` and `_values[layer]` are views of it.
        self._store: torch.Tensor | None = None
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self.allocated_rows = 0
        self.allocated_length = 0
        self.version = 0  # bumped whenever the storage is reallocated (CUDA graphs hold its addresses)

    @property
    def bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @property
    def allocated_tokens(self) -> int:
        """Positions allocated, the scratch row's included."""
        return (self.allocated_rows + 1) * self.allocated_length if self._store is not None else 0

    @property
    def allocated_bytes(self) -> int:
        return self.allocated_tokens * self.bytes_per_token

    def rows_fitting(self, length: int) -> int:
        """Request rows of `length` positions the budget holds beside the scratch row (at least one)."""
        return max(1, self.capacity_tokens // length - 1)

    def holds(self, num_rows: int, length: int) -> bool:
        """Whether rows 0..num_rows-1 of `length` positions fit the storage as allocated (no reserve)."""
        return num_rows <= self.allocated_rows and length <= self.allocated_length

    def reserve(self, num_rows: int, length: int) -> None:
        """Make room for rows 0..num_rows-1 of `length` positions, keeping what those rows hold.

        A dimension that must grow is doubled (so a long run reallocates O(log) times), within the row and
        length limits and within `capacity_tokens` (the scratch row counted); the slack of the other
        dimension is dropped when keeping it would exceed the budget. While it grows, the old storage and
        the new one are both held (the default budget, half the device's free memory, leaves room for that).
        """
        if num_rows > self.max_rows or length > self.max_length:
            raise ValueError(f"cache asked for {num_rows} rows x {length} positions, over its limits")
        if self.holds(num_rows, length):
            return
        new_rows = max(num_rows, self.allocated_rows)
        new_length = max(length, self.allocated_length)
        if (new_rows + 1) * new_length > self.capacity_tokens:
            new_rows, new_length = num_rows, length
        if num_rows > self.allocated_rows:
            doubled = min(self.max_rows, max(2 * self.allocated_rows, 8), self.rows_fitting(new_length))
            new_rows = max(new_rows, doubled)
        if length > self.allocated_length:
            doubled = min(
                self.max_length, max(2 * self.allocated_length, 64), self.capacity_tokens // (new_rows + 1)
            )
            new_length = max(new_length, doubled)
        # One row more than asked: the scratch row (`scratch_row`), where padding tokens write.
        shape = (2, self.num_layers, new_rows + 1, self.num_kv_heads, new_length, self.head_dim)
        kept_rows, kept_length = min(self.allocated_rows, new_rows), min(self.allocated_length, new_length)
        # zeros, not empty: masked-out positions still enter the value product with weight 0, and 0 x NaN
        # from uninitialised memory would poison the output.
        grown = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self._store is not None:
            grown[:, :, :kept_rows, :, :kept_length] = self._store[:, :, :kept_rows, :, :kept_length]
        self._store = grown
        # Views by indexing, not `unbind`: a view that came out of a multi-view function may not be written
        # in place where autograd is on (a forward outside inference mode, as in tests).
        self._keys = [grown[0, layer] for layer in range(self.num_layers)]
        self._values = [grown[1, layer] for layer in range(self.num_layers)]
        self.allocated_rows, self.allocated_length = new_rows, new_length
        self.version += 1

    @property
    def scratch_row(self) -> int:
        """A row past the usable ones, never held by a request: padding tokens of a padded batch (the CUDA
        graphs' fixed shapes) write their keys here, where nothing reads them as a request's."""
        return self.allocated_rows

    # Every layer's keys and values sit in one tensor (`_store`): each row copy below is one kernel. Copying
    # per layer cost ~30 us a tensor on a GPU (the 56 of a 28-layer model: 1.7 ms for every request that
    # finished); one `_foreach_copy_` over the 56 views still spent most of a millisecond making the views,
    # which over HTTP at 256 requests in flight, where a few requests finish at every step, was a quarter of
    # the engine thread's busy time on an H100 (py-spy, `bench_serving.py --py-spy`).

    def move_row(self, source: int, target: int, length: int) -> None:
        """Copy the first `length` positions of row `source` into row `target` (compaction)."""
        store = self._require_store()
        store[:, :, target, :, :length] = store[:, :, source, :, :length]

    def copy_row(self, row: int, length: int) -> torch.Tensor:
        """A copy of the first `length` positions of `row`: [2 (keys, values), layers, kv_heads, length,
        head_dim]."""
        return self._require_store()[:, :, row, :, :length].clone()

    def load_row(self, row: int, keys_and_values: torch.Tensor, length: int) -> None:
        """Write the first `length` positions of keys and values shaped as `copy_row` returns into `row`."""
        self._require_store()[:, :, row, :, :length] = keys_and_values[..., :length, :]

    def _require_store(self) -> torch.Tensor:
        if self._store is None:
            raise RuntimeError("the cache holds no rows: reserve() first")
        return self._store

    def gather(self, layer: int, rows_B: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the rows `rows_B`, positions 0..length-1: [B, kv_heads, length, head_dim]."""
        return self._keys[layer][rows_B, :, :length], self._values[layer][rows_B, :, :length]

    def release(self) -> None:
        """Free the storage (the next `reserve` allocates afresh)."""
        self._store, self._keys, self._values = None, [], []
        self.allocated_rows = self.allocated_length = 0
        self.version += 1

    def write(self, layer: int, batch: ForwardBatch, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store the real new tokens' keys and values ([B, kv_heads, T, head_dim]) at their positions."""
        if batch.mode == "decode":  # every entry's one token, in batch order: no gather needed
            keys_N, values_N = keys[:, :, 0], values[:, :, 0]
        else:
            keys_N = keys[batch.write_batch_N, :, batch.write_token_N]
            values_N = values[batch.write_batch_N, :, batch.write_token_N]
        self._keys[layer][batch.write_row_N, :, batch.write_position_N] = keys_N
        self._values[layer][batch.write_row_N, :, batch.write_position_N] = values_N

    def flat_rows(self, layer: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of rows 0..num_rows-1 as `[num_rows * kv_heads * allocated_length, 1, head_dim]`
        views: each (row, kv head) a run of `allocated_length` positions, in storage order."""
        flat = (num_rows * self.num_kv_heads * self.allocated_length, 1, self.head_dim)
        return self._keys[layer][:num_rows].view(flat), self._values[layer][:num_rows].view(flat)

    def rows(self, layer: int, num_rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of rows 0..num_rows-1, positions 0..length-1: [num_rows, kv_heads, length, head_dim]."""
        return self._keys[layer][:num_rows, :, :length], self._values[layer][:num_rows, :, :length]


# Prefill attention on a GPU, in order of preference: not cuDNN's, which PyTorch would pick first on a Hopper
# GPU and which builds an execution plan for every new shape on the host. Prefill shapes vary with the
# requests admitted together, and a shape runs eagerly until it recurs (`cuda_graphs.py`): over HTTP at 64
# requests in flight on an H100, such eager prefills took 233 ms each against 49 ms replayed, and more than
# half of their host time was inside this call (py-spy, `bench_serving.py --py-spy`). That cuDNN's planning
# was the cause is not shown: with this list, eager prefills still took 126-209 ms in the next run on an
# H100 (the figures in docs/serving-benchmarks.md were measured with it). Decode steps keep PyTorch's
# choice: their shapes are few, each built once, when its graph is captured.
PREFILL_SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
# Decode attention on a GPU: None leaves the choice to PyTorch; a list restricts it (benchmarks/
# bench_decode_step.py --decode-attention compares them). Read when a decode step runs or is captured.
DECODE_SDPA_BACKENDS: list[SDPBackend] | None = None
# How a decode step attends on a GPU: "sdpa", scaled_dot_product_attention over the step's padded key
# positions with the additive mask (the backends above); or "flash-varlen", FlashAttention's
# variable-length kernel reading each row's keys in place up to the row's own length (`_flash_decode`: no
# mask made or read, no padded key read). Off a GPU, or for a dtype or head size FlashAttention lacks,
# "sdpa" runs. Not the default: in one H100 run its steps were 1.5-3.4% shorter, less than runs differ
# (docs/serving-benchmarks.md; bench kind builtin-flash-decode, bench_decode_step.py --decode-attention).
DECODE_ATTENTION: Literal["sdpa", "flash-varlen"] = "sdpa"


def _sdpa_backends(
    backends: list[SDPBackend] | None, query: torch.Tensor
) -> contextlib.AbstractContextManager:
    """`sdpa_kernel(backends)` for a query on a GPU, else nothing (the CPU keeps PyTorch's choice)."""
    return sdpa_kernel(backends) if backends and query.is_cuda else contextlib.nullcontext()


# Not traced where a compiled decoder layer calls it (`compiled_blocks.compile_layers`): the graph breaks
# around it, and it runs as written, reading this forward's batch and the cache's storage as they are.
@torch.compiler.disable
def row_cache_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention for the engine's batches, in the signature transformers' AttentionInterface expects.

    query: [B, heads, T, head_dim]; key, value: [B, kv_heads, T, head_dim] for the new tokens only (the
    cache is ours, not transformers'). Returns [B, T, heads, head_dim].
    """
    batch = _current_batch.get()
    if batch is None:
        raise RuntimeError(
            f"attention implementation {ATTN_IMPLEMENTATION!r} called outside the server engine's forward"
        )
    layer = module.layer_idx
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    group = num_heads // num_kv_heads
    cache = batch.cache
    cache.write(layer, batch, key, value)
    if batch.mode == "prefill":
        if batch.kv_length:  # some requests continue a cached prefix: attend over their whole rows
            key, value = cache.gather(layer, batch.rows_B, batch.kv_length)
        num_batch, _, num_keys, head_dim = key.shape
        if group > 1:
            key = key[:, :, None].expand(num_batch, num_kv_heads, group, num_keys, head_dim)
            key = key.reshape(num_batch, num_heads, num_keys, head_dim)
            value = value[:, :, None].expand(num_batch, num_kv_heads, group, num_keys, head_dim)
            value = value.reshape(num_batch, num_heads, num_keys, head_dim)
        with _sdpa_backends(PREFILL_SDPA_BACKENDS, query):
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=batch.attn_bias, scale=scaling)
        return out.transpose(1, 2), None
    # Decode: one query per row. The query heads that share a key head become that head's "query positions",
    # so attention runs on the kv heads without materialising repeated keys.
    if DECODE_ATTENTION == "flash-varlen" and _flash_decodes(query):
        return _flash_decode(query, batch, layer, num_kv_heads, scaling), None
    num_rows, _, _, head_dim = query.shape
    keys, values = cache.rows(layer, num_rows, batch.kv_length)
    grouped_query = query.reshape(num_rows, num_kv_heads, group, head_dim)
    with _sdpa_backends(DECODE_SDPA_BACKENDS, query):
        out = F.scaled_dot_product_attention(
            grouped_query, keys, values, attn_mask=batch.attn_bias, scale=scaling
        )
    return out.reshape(num_rows, num_heads, 1, head_dim).transpose(1, 2), None


def _flash_decodes(query: torch.Tensor) -> bool:
    """Whether FlashAttention's kernel takes this query: on a GPU, half precision, a head size it has."""
    head_dim = query.shape[-1]
    return (
        query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and head_dim % 8 == 0
        and head_dim <= 256
    )


def _flash_decode(
    query: torch.Tensor, batch: ForwardBatch, layer: int, num_kv_heads: int, scaling: float | None
) -> torch.Tensor:
    """A decode step's attention as one variable-length FlashAttention call over the cache in place.

    Each (row, kv head) is one sequence: its queries are the `group` query heads sharing that kv head, its
    keys the row's run of `allocated_length` cache positions, of which the first `length` are used
    (`seqused_k`): the batch's additive mask is never made and no padding position is read. query: [rows,
    heads, 1, head_dim]; returns [rows, 1, heads, head_dim] as the SDPA path does.
    """
    num_rows, num_heads, _, head_dim = query.shape
    group = num_heads // num_kv_heads
    keys, values = batch.cache.flat_rows(layer, num_rows)
    if batch.flash_plan is None:
        sequences = torch.arange(num_rows * num_kv_heads + 1, dtype=torch.int32, device=query.device)
        lengths_R = (batch.write_position_N + 1).to(torch.int32)
        # expand (no host sync inside a capture), then a copy: one row's expansion flattens to a stride-0
        # view, and the kernel wants its lengths contiguous
        lengths = lengths_R[:, None].expand(num_rows, num_kv_heads).reshape(-1).contiguous()
        batch.flash_plan = (sequences * group, sequences * batch.cache.allocated_length, lengths)
    cu_q, cu_k, used_k = batch.flash_plan
    out = torch.ops.aten._flash_attention_forward(
        query.reshape(num_rows * num_heads, 1, head_dim),
        keys,
        values,
        cu_q,
        cu_k,
        group,
        batch.kv_length,
        0.0,
        False,
        False,
        scale=scaling,
        seqused_k=used_k,
    )[0]
    return out.view(num_rows, num_heads, 1, head_dim).transpose(1, 2)


def register_attention() -> None:
    """Register `row_cache_attention` with transformers under ATTN_IMPLEMENTATION (idempotent).

    No mask function is registered on purpose: transformers then skips building masks for this
    implementation, and the engine passes its own in the ForwardBatch.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, row_cache_attention)


def check_model_supported(model: PreTrainedModel) -> None:
    """Raise UnsupportedModelError unless every layer is full attention with a `layer_idx`."""
    config = model.config.get_text_config()
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(kind != "full_attention" for kind in layer_types):
        kinds = sorted(set(layer_types))
        raise UnsupportedModelError(
            f"{type(model).__name__} mixes attention kinds {kinds}; the built-in server supports models with "
            "full attention in every layer (serve this one with vLLM)"
        )
    if getattr(config, "use_sliding_window", False) or (
        getattr(config, "sliding_window", None) and not hasattr(config, "use_sliding_window")
    ):
        raise UnsupportedModelError(
            f"{type(model).__name__} uses sliding-window attention, which the built-in server lacks"
        )
    attention_modules = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")]
    if len(attention_modules) != config.num_hidden_layers:
        raise UnsupportedModelError(
            f"{type(model).__name__}: found {len(attention_modules)} attention modules with a layer_idx for "
            f"{config.num_hidden_layers} layers; the built-in server needs one per layer"
        )


def attention_shape(model: PreTrainedModel) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a supported model."""
    config = model.config.get_text_config()
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return config.num_hidden_layers, num_kv_heads, head_dim
