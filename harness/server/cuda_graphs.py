"""CUDA graphs of the built-in server's forward passes: a decode step, or a prefill in graph-sized pieces.

Who talks to it: the engine (`engine.py`) owns one `StepGraphs` when it runs on a CUDA device (unless
`enforce_eager`) and asks it for the logits of each decode step and each prefill, instead of calling the
model eagerly. A forward whose requests use a LoRA adapter runs eagerly (the adapters' hooks are not in
the graphs), and so does a prefill with a request of more new tokens than one graph holds
(`MAX_PREFILL_GRAPH_TOKENS`: such a prompt is compute-bound, launching costs little beside it).

Why: an eager forward of a transformers model launches each of its ~50 kernels per layer from Python, one
by one. For a 0.6B model that is about 1,500 launches, 40-150 ms of CPU per forward, while the GPU work of
decoding 64 rows, or prefilling two 128-token prompts, is about a millisecond. A graph replays them with
one call. Prefills matter as much as decode steps: requests arrive one by one, so a server at 64 requests
in flight prefills every step or two.

How: a graph is captured per shape bucket, every size padded up to a power of two within what the cache
holds: decode per (rows, key positions), prefill per (requests, new tokens per request, key positions),
where a prefill's new tokens and a decode step's key positions pad to a power of two or 1.5 times one
(`token_bucket`): prompts of 96-160 tokens pad to 1.24 times their tokens instead of 1.49, and rows of
129-192 tokens decode over 192 key positions instead of 256.
A decode step whose rows all sample by temperature alone (the RL rollout's case) records its sampling in
the same graph (`decode_and_sample`, `sampling.draw_tokens`): the uniform draws and temperatures are inputs
like the tokens, and the host launches one replay per step instead of the replay and some twenty sampling
kernels; any other step samples after its graph (`sampling.launch_sampling`).
A prefill runs as one graph per chunk of its requests, longest first, each chunk as many requests as
`MAX_PREFILL_GRAPH_TOKENS` holds at its new-token bucket: a wave of 32 prompts of 96-160 tokens is four
graphs of at most 2,048 tokens, not one eager forward (on an H200 at 64 requests in flight over HTTP, 5 of
8 prefills ran eagerly before, 1 of 8 after, and the server gave 7,350 tokens/s instead of 6,347).
Inputs live in static buffers filled by host-to-device copies; everything else (positions, where each key
is written, the attention mask) is computed inside the graph from them. Decode pads with rows no running
request holds (running requests occupy rows 0..n-1): they write one key at position 0 of their own row and
attend to it alone. Prefill left-pads each request's new tokens (so its last position is real, as the
eager prefill does) and pads the batch with empty requests; every padding token writes to the cache's
scratch row. Padding logits are dropped. The logits of every graph are copied into one persistent buffer,
so all graphs share one memory pool for the rest.

When a shape is captured: a decode shape at its first use (the same shape then serves step after step), a
prefill shape at its `PREFILL_CAPTURE_AT_USE`-th, eagerly before that. Prefill shapes are many (requests x new
tokens x key positions buckets) and a capture costs a warm-up forward (whose results serve: no replay
follows), the recorded forward and the graph's instantiation, more than the eager prefill it replaces: on an
H200 (0.6B, requests arriving one by one over HTTP, 64 in flight) the server's prefills of a warm-up and four
timed waves averaged 165 ms when every new shape was captured at once, where one eager prefill of 64 prompts
took 59 ms. A shape that recurs pays back its capture; uses are counted across cache reallocations, so a
dropped shape that recurred is captured again at once. Until a prefill shape is captured, its chunk runs in
the cheapest captured prefill graph that holds it (as many requests, new tokens and key positions or more),
padded further, if there is one: an eager prefill's host time is that of ~1,500 kernel launches, a replay's a
few padded tokens.

What invalidates a graph: it reads the cache's storage and the model's parameters by address. Weight
updates copy into the parameters in place (`weight_sync/wire.py`), so graphs survive them; a cache that
grows reallocates its storage, which bumps `RowKVCache.version`: every graph is then dropped, with its
memory pool, and captured again when next needed (the cache grows by doubling, so a few times per run). A
capture that fails (a model whose forward cannot be captured) is logged once and turns the graphs off: the
engine carries on eagerly.

Off a GPU (`capture=False`) the same padded forwards run eagerly, which is how the CPU tests check the
padding, the masks and the writes that the graphs replay.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, NamedTuple

import torch

from harness.server.device_copies import to_device
from harness.server.kv_cache import ForwardBatch, RowKVCache, forward_context
from harness.server.sampling import draw_scaled_tokens

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)
MIN_KEY_POSITIONS = 64
MIN_PREFILL_TOKENS = 16
MAX_PREFILL_GRAPH_TOKENS = 2048  # padded requests x new tokens: above this a prefill is compute-bound
MAX_PREFILL_GRAPH_KEYS = 65_536  # padded requests x key positions: the keys each layer gathers
PREFILL_CAPTURE_AT_USE = 3  # a prefill shape is captured at its third use (module docstring)


def bucket(size: int, limit: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(size, minimum), at most `limit` (which must be >= size)."""
    padded = max(minimum, 1 << max(0, size - 1).bit_length())
    return min(padded, limit)


def token_bucket(size: int, limit: int, minimum: int = 1) -> int:
    """The smallest power of two or 1.5 x a power of two >= max(size, minimum), at most `limit`: a
    prefill's new tokens pad by at most half, where powers of two alone pad by up to double (sizes spread
    log-uniformly over 17-2,048 pad to 1.19 times themselves on average, against 1.43)."""
    padded = bucket(size, 1 << 62, minimum)
    if padded >= 4 and padded * 3 // 4 >= max(size, minimum):
        padded = padded * 3 // 4
    return min(padded, limit)


class PrefillChunk(NamedTuple):
    """One graph's share of a prefill: which requests (indices into the prefill's lists) and its shape."""

    members: list[int]
    padded_batch: int
    new_tokens: int
    key_positions: int


class StepGraphs:
    """Decode steps and prefills replayed from graphs captured per shape bucket (module docstring).

    Args:
        model: The served model (its attention implementation already the engine's).
        cache: The engine's row cache; the graphs read and write it like the eager forwards.
        capture: Capture CUDA graphs (needs a CUDA model); False runs the same padded forwards eagerly.
    """

    # Whether the engine records a decode step's sampling in the step's graph where the rows allow it
    # (`decode_and_sample`); off, each step is sampled after its graph (benchmarks compare the two).
    samples_in_graph = True
    # How much larger a captured prefill graph may be, in padded tokens (requests x new tokens), than the
    # chunk it runs in place of an eager prefill (`_prefill_shape`); 0 runs such chunks eagerly.
    max_substitute_padding = float("inf")
    # Decode key positions pad by `token_bucket` (a power of two or 1.5 times one); False: powers of two.
    key_buckets_by_half = True
    # Whether the sampling a decode step's graph records is compiled first (`torch.compile` of
    # `sampling.draw_scaled_tokens`: its ~20 passes over [rows, vocabulary] fused into a few kernels,
    # compiled in the engine's warm-up, `warm_up_sampling`); off, it runs as its eager kernels. Off until
    # measured on a GPU (docs/serving-benchmarks.md).
    compile_sampling = False

    def __init__(self, model: PreTrainedModel, cache: RowKVCache, *, capture: bool = True) -> None:
        self.model = model
        self.cache = cache
        self.capture = capture
        self.enabled = True
        self.num_captures = 0
        # Forwards run through this class, replayed or not: "decode+sample" are decode steps sampled in-graph.
        self.num_forwards = {"decode": 0, "decode+sample": 0, "prefill": 0}
        self.last_run: Literal["replayed", "captured", "eager"] = "eager"  # how the last forward ran
        device = model.device
        max_rows = cache.max_rows
        # decode_2R[0]: each row's last token; decode_2R[1]: each row's length (keys after this step).
        self._decode_2R = torch.zeros((2, max_rows), dtype=torch.long, device=device)
        # prefill_3R: each request's cache row, first new position, number of new tokens; then its tokens.
        self._prefill_3R = torch.zeros((3, max_rows), dtype=torch.long, device=device)
        self._prefill_tokens = torch.zeros(MAX_PREFILL_GRAPH_TOKENS, dtype=torch.long, device=device)
        # sampling_2R[0]: each row's temperature; sampling_2R[1]: its uniform draw (-1: greedy); tokens_R and
        # packed_R4: what a sampled decode step draws (`decode_and_sample`).
        self._sampling_2R = torch.ones((2, max_rows), dtype=torch.float32, device=device)
        self._tokens_R = torch.zeros(max_rows, dtype=torch.long, device=device)
        self._packed_R4 = torch.zeros((max_rows, 4), dtype=torch.float64, device=device)
        self._row_ids_R = torch.arange(max_rows, device=device)
        self._zeros_R = torch.zeros(max_rows, dtype=torch.long, device=device)
        self._positions_L = torch.arange(cache.max_length, device=device)
        vocab_size = model.get_output_embeddings().weight.shape[0]
        self._logits_RV = torch.zeros((max_rows, vocab_size), dtype=model.dtype, device=device)
        self._graphs: dict[tuple[str | int, ...], Callable[[], None]] = {}
        self._draw = (
            torch.compile(draw_scaled_tokens, dynamic=True) if self.compile_sampling else draw_scaled_tokens
        )
        self._uses: collections.Counter[tuple[str | int, ...]] = collections.Counter()
        self._cache_version = cache.version
        self._pool: tuple[int, int] | None = None  # created at the first capture

    def warm_up_sampling(self) -> None:
        """Compile the in-graph sampling now, for 1 and for 2 rows (dynamic shapes specialise a size of 1),
        rather than inside the first sampled step's capture; if it cannot compile, say so and sample with
        its eager kernels from now on. Nothing unless `compile_sampling`."""
        if not self.compile_sampling:
            return
        try:
            for rows in (1, 2):
                logits = self._logits_RV[:rows]
                self._draw(
                    logits,
                    torch.ones(rows, device=logits.device),
                    torch.full((rows,), 0.5, device=logits.device),
                )
        except Exception as exc:
            self._draw = draw_scaled_tokens
            logger.warning("compiling the in-graph sampling failed, it runs eagerly instead: %r", exc)

    # ------------------------------------------------------------------ decode

    def decode(self, token_ids: list[int] | torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """Logits [n, vocab] of one decode step: row i's token `token_ids[i]` stored at position
        `lengths[i] - 1` of cache row i and attending over positions 0..lengths[i]-1.

        `token_ids` may be a tensor on the device (the tokens a sampling step queued before it has been
        read), which is copied in on the device: nothing here waits for the GPU. The cache must hold rows
        0..n-1 and max(lengths) positions (the engine's `reserve`). The result is a view of a buffer the
        next forward overwrites.
        """
        shape = self._decode_inputs(token_ids, lengths)
        self._replay("decode", shape, lambda: self._decode_forward(*shape))
        return self._logits_RV[: len(lengths)]

    def decode_and_sample(
        self,
        token_ids: list[int] | torch.Tensor,
        lengths: list[int],
        temperatures: list[float],
        uniforms: list[float],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step (as `decode`) and its sampling, both in one graph, for rows whose sampling is
        their temperature alone (`sampling.samples_in_graph`): each row's logits divided by
        `temperatures[i]` (1 for a greedy row), then the token of `uniforms[i]` (negative: the arg-max)
        and its log-prob and top-1, as `sampling.draw_tokens` packs them. Returns views of the token ids
        [n] and the packed columns [n, 4], buffers the next sampled step overwrites.
        """
        num_rows = len(lengths)
        rows, key_positions = self._decode_inputs(token_ids, lengths)
        padding = rows - num_rows
        host_2R = [temperatures + [1.0] * padding, uniforms + [-1.0] * padding]
        self._sampling_2R[:, :rows].copy_(to_device(host_2R, torch.float32, self._sampling_2R.device))
        shape = (rows, key_positions)
        self._replay("decode+sample", shape, lambda: self._decode_forward(*shape, sampled=True))
        return self._tokens_R[:num_rows], self._packed_R4[:num_rows]

    def _decode_inputs(self, token_ids: list[int] | torch.Tensor, lengths: list[int]) -> tuple[int, int]:
        """Copy a decode step's inputs into the static buffers; its padded (rows, key positions)."""
        num_rows = len(lengths)
        self._drop_stale()
        rows = bucket(num_rows, self.cache.allocated_rows)
        pad = token_bucket if self.key_buckets_by_half else bucket
        key_positions = pad(max(lengths), self.cache.allocated_length, MIN_KEY_POSITIONS)
        padding = rows - num_rows
        on_device = isinstance(token_ids, torch.Tensor)
        host_tokens = [0] * num_rows if on_device else list(token_ids)
        host_2R = [host_tokens + [0] * padding, lengths + [1] * padding]
        self._decode_2R[:, :rows].copy_(to_device(host_2R, torch.long, self._decode_2R.device))
        if on_device:
            self._decode_2R[0, :num_rows].copy_(token_ids)
        return rows, key_positions

    def _decode_forward(self, rows: int, key_positions: int, *, sampled: bool = False) -> None:
        """The padded decode step as the graph records it: views of static buffers and in-graph tensors;
        `sampled`, with its sampling (`decode_and_sample`)."""
        token_ids_R, lengths_R = self._decode_2R[0, :rows], self._decode_2R[1, :rows]
        positions_R = lengths_R - 1
        attend_RL = self._positions_L[None, :key_positions] < lengths_R[:, None]
        batch = ForwardBatch(
            mode="decode",
            cache=self.cache,
            rows_B=self._row_ids_R[:rows],
            write_batch_N=self._row_ids_R[:rows],
            write_token_N=self._zeros_R[:rows],
            write_position_N=positions_R,
            attn_mask=attend_RL[:, None, None, :],
            kv_length=key_positions,
        )
        self._run_model(batch, token_ids_R[:, None], positions_R[:, None], rows)
        if sampled:
            temperatures_R, draws_R = self._sampling_2R[:, :rows]
            tokens_R, packed_R4 = self._draw(self._logits_RV[:rows], temperatures_R, draws_R)
            self._tokens_R[:rows].copy_(tokens_R)
            self._packed_R4[:rows].copy_(packed_R4)

    # ------------------------------------------------------------------ prefill

    def prefill(
        self, rows: list[int], token_lists: list[list[int]], starts: list[int]
    ) -> torch.Tensor | None:
        """Logits [B, vocab] at the last token of each request, after storing the keys of its tokens from
        `starts[b]` on in cache row `rows[b]` (positions before `starts[b]` already hold its prefix); None
        when a request has more new tokens, or keys, than one graph holds (the engine then runs the
        prefill eagerly).

        A batch larger than one graph holds runs as several graphs, longest requests first (module
        docstring). The cache must hold those rows and positions. The result may be a view the next
        forward overwrites.
        """
        num_batch = len(rows)
        lengths = [len(tokens) - start for tokens, start in zip(token_lists, starts, strict=True)]
        self._drop_stale()
        if token_bucket(max(lengths), self.cache.max_length, MIN_PREFILL_TOKENS) > MAX_PREFILL_GRAPH_TOKENS:
            return None
        chunks = self._chunks(lengths, [len(tokens) for tokens in token_lists])
        if chunks is None:
            return None
        if len(chunks) == 1:  # the requests in their own order: the logits buffer is the answer
            self._prefill_chunk(chunks[0]._replace(members=list(range(num_batch))), rows, token_lists, starts)
            return self._logits_RV[:num_batch]
        logits = torch.empty_like(self._logits_RV[:num_batch])
        runs = []
        for chunk in chunks:
            self._prefill_chunk(chunk, rows, token_lists, starts)
            runs.append(self.last_run)
            members = to_device(chunk.members, torch.long, logits.device)
            logits.index_copy_(0, members, self._logits_RV[: len(chunk.members)])
        self.last_run = next(run for run in ("eager", "captured", "replayed") if run in runs)
        return logits

    def _chunks(self, lengths: list[int], totals: list[int]) -> list[PrefillChunk] | None:
        """The graphs a prefill runs as, longest requests first: each holds as many requests as its
        new-token bucket lets one graph hold (and its key positions let it gather); None when one
        request's keys alone are more than a graph gathers."""
        order = sorted(range(len(lengths)), key=lambda b: -lengths[b])
        chunks = []
        while order:
            new_tokens = token_bucket(lengths[order[0]], self.cache.max_length, MIN_PREFILL_TOKENS)
            capacity = min(MAX_PREFILL_GRAPH_TOKENS // new_tokens, self.cache.max_rows)
            capacity = 1 << (capacity.bit_length() - 1)  # a power of two, as the batch buckets are
            while True:
                members = order[:capacity]
                longest = max(totals[b] for b in members)
                key_positions = bucket(longest, self.cache.allocated_length, MIN_KEY_POSITIONS)
                padded_batch = bucket(len(members), capacity)
                if padded_batch * key_positions <= MAX_PREFILL_GRAPH_KEYS:
                    break
                if capacity == 1:
                    return None
                capacity //= 2
            chunks.append(PrefillChunk(members, padded_batch, new_tokens, key_positions))
            order = order[len(members) :]
        return chunks

    def _prefill_chunk(
        self, chunk: PrefillChunk, rows: list[int], token_lists: list[list[int]], starts: list[int]
    ) -> None:
        """Run one graph of a prefill: its logits land in rows 0..len(chunk.members)-1 of the logits
        buffer. The inputs come from pinned memory, so the host goes on to the next chunk while it runs."""
        shape = self._prefill_shape(chunk)
        padded_batch, new_tokens, _ = shape
        padding = padded_batch - len(chunk.members)
        host_3R: list[list[int]] = [[], [], []]
        host_tokens: list[int] = []
        for b in chunk.members:
            new = token_lists[b][starts[b] :]
            host_3R[0].append(rows[b])
            host_3R[1].append(starts[b])
            host_3R[2].append(len(new))
            host_tokens += [0] * (new_tokens - len(new)) + new  # left-padded
        for values, pad in zip(host_3R, (self.cache.scratch_row, 0, 0), strict=True):
            values += [pad] * padding
        host_tokens += [0] * (padding * new_tokens)
        device = self._prefill_3R.device
        self._prefill_3R[:, :padded_batch].copy_(to_device(host_3R, torch.long, device))
        self._prefill_tokens[: padded_batch * new_tokens].copy_(to_device(host_tokens, torch.long, device))
        self._replay("prefill", shape, lambda: self._prefill_forward(*shape))

    def _prefill_shape(self, chunk: PrefillChunk) -> tuple[int, int, int]:
        """The shape a prefill chunk runs as: its own, unless that would run eagerly (not captured, and not
        used often enough to be) while a captured prefill graph holds the chunk (as many requests or more,
        as many new tokens per request or more, as many key positions or more); then the cheapest such
        graph, padded further. Its own shape's use is still counted, so a shape that recurs gets its own
        graph as before; until then its requests pay a few padded tokens rather than an eager forward
        (the host's launches of ~1,500 kernels)."""
        own = (chunk.padded_batch, chunk.new_tokens, chunk.key_positions)
        key = ("prefill", *own)
        if key in self._graphs or self._uses[key] + 1 >= PREFILL_CAPTURE_AT_USE or not self.capture:
            return own
        captured = [tuple(int(size) for size in graph[1:]) for graph in self._graphs if graph[0] == "prefill"]
        most_tokens = self.max_substitute_padding * own[0] * own[1]
        holders = [
            shape
            for shape in captured
            if all(have >= need for have, need in zip(shape, own, strict=True))
            and shape[0] * shape[1] <= most_tokens
        ]
        if not holders:
            return own
        self._uses[key] += 1
        padded_batch, new_tokens, key_positions = min(holders, key=lambda s: (s[0] * s[1], s[2]))
        return padded_batch, new_tokens, key_positions

    def _prefill_forward(self, padded_batch: int, new_tokens: int, key_positions: int) -> None:
        """The padded prefill as the graph records it: the eager prefill's left-padded layout, every query
        attending over its row's cache (its prefix and its new keys), padding written to the scratch row."""
        rows_B, starts_B, lengths_B = self._prefill_3R[:, :padded_batch]
        token_ids_BT = self._prefill_tokens[: padded_batch * new_tokens].view(padded_batch, new_tokens)
        token_T = self._positions_L[:new_tokens]
        pad_B = new_tokens - lengths_B
        valid_BT = token_T[None, :] >= pad_B[:, None]
        position_BT = (starts_B[:, None] + token_T[None, :] - pad_B[:, None]).clamp(min=0)
        key_L = self._positions_L[:key_positions]
        mask_BTL = valid_BT[:, :, None] & (key_L[None, None, :] <= position_BT[:, :, None])
        # A padding query attends to position 0 only, so its softmax has something to normalise.
        mask_BTL |= (~valid_BT)[:, :, None] & (key_L == 0)[None, None, :]
        scratch_positions_BT = token_T.clamp(max=self.cache.allocated_length - 1)[None, :].expand_as(valid_BT)
        batch = ForwardBatch(
            mode="prefill",
            cache=self.cache,
            rows_B=rows_B,
            write_batch_N=self._row_ids_R[:padded_batch, None].expand_as(valid_BT).reshape(-1),
            write_token_N=token_T[None, :].expand_as(valid_BT).reshape(-1),
            write_position_N=torch.where(valid_BT, position_BT, scratch_positions_BT).reshape(-1),
            write_row_N=torch.where(valid_BT, rows_B[:, None], self.cache.scratch_row).reshape(-1),
            attn_mask=mask_BTL[:, None],
            kv_length=key_positions,
        )
        self._run_model(batch, token_ids_BT, position_BT, padded_batch)

    # ------------------------------------------------------------------ graphs

    def _run_model(
        self, batch: ForwardBatch, input_ids: torch.Tensor, position_ids: torch.Tensor, num_rows: int
    ) -> None:
        with forward_context(batch):
            output = self.model(
                input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=1
            )
        self._logits_RV[:num_rows].copy_(output.logits[:, -1])

    def _drop_stale(self) -> None:
        """Drop every graph once the cache's storage has moved (and the pool their memory came from)."""
        if self.cache.version != self._cache_version:
            self._graphs.clear()
            self._cache_version = self.cache.version
            self._pool = None  # a pool whose graphs are all gone is freed: later captures need a new one

    def _replay(self, kind: str, shape: tuple[int, ...], forward: Callable[[], None]) -> None:
        self.num_forwards[kind] += 1
        key: tuple[str | int, ...] = (kind, *shape)
        replay = self._graphs.get(key)
        if replay is not None:
            self.last_run = "replayed"
            replay()
            return
        self._uses[key] += 1
        wanted = PREFILL_CAPTURE_AT_USE if kind == "prefill" else 1
        self.last_run = "eager"
        if not (self.capture and self.enabled) or self._uses[key] < wanted:
            forward()
            return
        try:
            graph = self._capture(forward)
        except Exception as exc:  # the engine carries on eagerly; say why once
            self.enabled = False
            self._graphs.clear()
            logger.warning(
                "CUDA graph capture of the server's forward failed, running it eagerly from now on "
                "(pass --enforce-eager to skip the attempt): %r",
                exc,
            )
            forward()
            return
        self._graphs[key] = graph.replay
        self.num_captures += 1
        self.last_run = "captured"
        # No replay now: the capture's warm-up ran this forward on these inputs, and wrote what a replay
        # would write again (the keys, the logits, a sampled step's tokens): that is one forward less.

    def _capture(self, forward: Callable[[], None]) -> torch.cuda.CUDAGraph:
        # Warm up on a side stream (lazy initialisation, workspace allocation) as capture requires. The
        # warm-up runs the real forward on the real inputs, so its results are this forward's (`_replay`).
        device = self.model.device
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            forward()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            forward()
        return graph


__all__ = ["StepGraphs", "bucket", "token_bucket"]
