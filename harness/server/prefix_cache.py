"""The built-in server's prefix cache: keys and values of token sequences seen before, reused by new requests.

Who talks to it: the engine (`engine.py`) alone, on its thread. Before a prefill it asks `lookup` for the
longest cached prefix of each new request, copies those positions into the request's cache row and
prefills only the rest. After a prefill it registers the running request as a source (`add_running`);
when a request finishes, `retire` copies its keys and values out of its row before the row is reused.

Why: the rollouts of a group share their prompt, and each turn of a multi-turn rollout starts with the
whole conversation before it, so without reuse every turn recomputes everything before it. This is what
vLLM calls automatic prefix caching (on by default there). Matching works on blocks of `BLOCK_SIZE`
tokens through a chained hash of each block and its predecessors, then extends token by token along the
source, so a hit can end anywhere (a new request always keeps at least one token to compute).

Sources: a running request (its row, while its cached positions are valid: a preemption or a weight
update makes them stale) or a stored entry (a finished request's keys and values, copied out of its
row). Keys depend on the LoRA adapter a request ran with, so each source is salted by its adapter object,
which the source holds, so its id is not reused while the source lives. A weight update or
/reset_prefix_cache calls `clear`.

Budget: stored entries live inside the engine's KV budget: stored tokens plus the row cache's allocated
tokens stay within `capacity_tokens`; `trim` evicts least recently used entries when the row cache
grows, and an entry that cannot fit is not stored.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from harness.server.kv_cache import RowKVCache

BLOCK_SIZE = 16


class Source(Protocol):
    """What a source of cached keys looks like to the index: the engine's running requests qualify."""

    @property
    def tokens(self) -> list[int]: ...
    @property
    def adapter(self) -> Any: ...
    @property
    def num_cached(self) -> int: ...


@dataclass(eq=False)
class StoredPrefix:
    """A finished request's keys and values: [2 (keys, values), layers, kv_heads, len(tokens), head_dim]."""

    tokens: list[int]
    adapter: Any
    keys_and_values: torch.Tensor = field(repr=False)

    @property
    def num_cached(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class PrefixHit:
    """`length` leading tokens of a request whose keys `source` holds (0 and None: a miss)."""

    length: int = 0
    source: Source | StoredPrefix | None = None


MISS = PrefixHit()


class PrefixCache:
    """An index from token blocks to sources, and a least-recently-used store of finished sequences."""

    def __init__(self, cache: RowKVCache, *, block_size: int = BLOCK_SIZE) -> None:
        self.cache = cache
        self.block_size = block_size
        self._index: dict[int, Any] = {}  # chained block hash -> the newest source holding that prefix
        self._hashes: dict[int, tuple[Any, list[int]]] = {}  # id(source) -> (source, its hashes)
        self._stored: OrderedDict[int, StoredPrefix] = OrderedDict()  # id -> entry, oldest first
        self.stored_tokens = 0

    def __len__(self) -> int:
        """The number of stored entries."""
        return len(self._stored)

    # ------------------------------------------------------------------ lookups

    def block_hashes(self, tokens: list[int], adapter: Any, num_blocks: int) -> list[int]:
        """The chained hash of each of the first `num_blocks` full blocks of `tokens`."""
        size = self.block_size
        running = hash(("harness-prefix", id(adapter)))
        hashes = []
        for block in range(num_blocks):
            running = hash((running, *tokens[block * size : (block + 1) * size]))
            hashes.append(running)
        return hashes

    def lookup(self, tokens: list[int], adapter: Any) -> PrefixHit:
        """The longest prefix of `tokens` (leaving at least the last token to compute) a valid source
        holds under the same adapter."""
        limit = len(tokens) - 1
        hashes = self.block_hashes(tokens, adapter, limit // self.block_size)
        for num_blocks in range(len(hashes), 0, -1):
            source = self._index.get(hashes[num_blocks - 1])
            if source is None or source.adapter is not adapter:
                continue
            length = num_blocks * self.block_size
            held = source.tokens
            # A running row decoded ahead counts the token in flight as cached before the host has read it.
            usable = min(source.num_cached, len(held), limit)
            if usable < length or held[:length] != tokens[:length]:
                continue  # stale (preempted, or moved on) or a hash collision
            while length < usable and held[length] == tokens[length]:
                length += 1
            if isinstance(source, StoredPrefix):
                self._stored.move_to_end(id(source))
            return PrefixHit(length, source)
        return MISS

    def first_block(self, tokens: list[int], adapter: Any) -> int | None:
        """The first block's hash (None for a sequence shorter than a block): how the engine spots
        requests of one step that share a prefix, to prefill one of them first."""
        if len(tokens) <= self.block_size:
            return None
        return self.block_hashes(tokens, adapter, 1)[0]

    # ------------------------------------------------------------------ sources

    def add_running(self, request: Source) -> None:
        """Index a request whose row now holds keys for its first `num_cached` tokens."""
        self._register(request, request.num_cached)

    def retire(self, request: Source, row: int) -> None:
        """The request finished: keep its keys (read from `row`, before the row is reused) if they fit."""
        self.forget(request)
        length = request.num_cached
        if length < self.block_size:
            return
        self._evict_until(length)
        if self.room_tokens() < length:
            return
        entry = StoredPrefix(
            tokens=request.tokens[:length],
            adapter=request.adapter,
            keys_and_values=self.cache.copy_row(row, length),
        )
        self._stored[id(entry)] = entry
        self.stored_tokens += length
        self._register(entry, length)

    def forget(self, request: Source) -> None:
        """Drop a request from the index (it finished, or was aborted)."""
        registered = self._hashes.pop(id(request), None)
        if registered is None or registered[0] is not request:
            return
        for value in registered[1]:
            if self._index.get(value) is request:
                del self._index[value]

    def _register(self, source: Any, length: int) -> None:
        self.forget(source)
        hashes = self.block_hashes(source.tokens, source.adapter, length // self.block_size)
        for value in hashes:
            self._index[value] = source
        self._hashes[id(source)] = (source, hashes)

    # ------------------------------------------------------------------ budget

    def room_tokens(self) -> int:
        """Tokens the store may still take within the KV budget."""
        return self.cache.capacity_tokens - self.cache.allocated_tokens - self.stored_tokens

    def trim(self) -> None:
        """Evict the oldest entries until the store fits beside the row cache (after the cache grew)."""
        self._evict_until(0)

    def _evict_until(self, room: int) -> None:
        """Evict the oldest entries until the store has `room` tokens to spare (or is empty)."""
        while self._stored and self.room_tokens() < room:
            _, entry = self._stored.popitem(last=False)
            self.stored_tokens -= len(entry.tokens)
            self.forget(entry)

    def clear(self) -> None:
        """Forget everything (the weights changed, or a client asked)."""
        self._index.clear()
        self._hashes.clear()
        self._stored.clear()
        self.stored_tokens = 0
