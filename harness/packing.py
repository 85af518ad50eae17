"""Tree packing: training samples laid out as prefix tries, one row per rank, and the planner that fills rows.

A row is what one process forwards in one micro-batch. Instead of concatenating samples, the packer inserts
their token sequences into a prefix trie and lays the trie out depth-first, so a token shared by several
samples (a group's prompt, the earlier turns of a forked conversation, a common system prompt) is forwarded
once. On the spec's example, two rollouts of one prompt:

    samples   r0: p1 p2 p3 a1 a2          r1: p1 p2 p3 b1 b2        (a*, b* trained)
    trie      S0 [p1 p2 p3] -+- S1 [a1 a2]
                             +- S2 [b1 b2]
    row       index         0  1  2 | 3  4 | 5  6
              input_ids     p1 p2 p3| a1 a2| b1 b2
              position_ids  0  1  2 | 3  4 | 3  4       position = depth in the trie
              parent        -1 0  1 | 2  3 | 2  5       the previous token on the token's own path
    trained   a1 a2 b1 b2 predicted at index 2 3 2 5    the index of each token's own predecessor

Unlike the spec's drawing, p3 is shared too: every trained token carries the row index it is predicted
from (`pred_index`), so one position may predict several targets (a1 and b1 here), each with its own
advantage and old log-probability. The log-prob head gathers hidden states at `pred_index`, which costs one
row of the hidden states per trained token, never a duplicated forward.

Attention needs only the trie's shape: depth-first order makes every token's subtree a contiguous index
range, so "key k is on query q's root-to-token path" is `k <= q < subtree_end[k]` (see
`harness.training.attention`). Segments (maximal runs of tokens without a branch) are kept as well, for
recurrent layers, whose state must flow from a segment's parent into it.

The planner (`plan_micro_batches`) assigns samples to rows under `token_budget`, which bounds a row's unique
tokens and its trained tokens (its loss terms), and `batch_metrics` turns a plan into the spec's batch/*
metrics. Everything here is pure Python, numpy and CPU tensors; the trainer moves a row to its device with
`PackedRow.to`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch

from harness.types import TrainingSample

__all__ = [
    "DEFAULT_PAIR_WEIGHT",
    "MicroBatchPlan",
    "PackedRow",
    "PackingError",
    "PackingPlan",
    "PrefixTrie",
    "RowPlan",
    "batch_metrics",
    "pack_row",
    "packed_token_count",
    "pair_weight_for_config",
    "plan_micro_batches",
]

# Linear-cost equivalent of one query-key pair, relative to one token through the weights: about
# 2 * layers * heads * head_dim / (parameters in the layers). 1/8192 is representative of 0.5B-2B models
# (Qwen3-1.7B: 1/12288; Qwen3-0.6B: 1/3840); `pair_weight_for_config` computes it for a given model.
DEFAULT_PAIR_WEIGHT = 1.0 / 8192


class PackingError(ValueError):
    """A sample cannot be packed as given (e.g. a trained token with no predecessor)."""


class _Segment:
    """A run of trie nodes with no branch inside: `tokens[i]` sits at depth `depth + i`.

    `trained[i]` says whether any inserted sample trains on that node; `children` are keyed by their first
    token (or by a unique negative key when prefixes are not shared).
    """

    __slots__ = ("children", "depth", "tokens", "trained")

    def __init__(self, tokens: np.ndarray, trained: np.ndarray, depth: int) -> None:
        self.tokens = tokens
        self.trained = trained
        self.depth = depth
        self.children: dict[int, _Segment] = {}


def _common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two equally long arrays."""
    mismatch = np.flatnonzero(a != b)
    return int(mismatch[0]) if len(mismatch) else len(a)


class PrefixTrie:
    """A radix trie over token sequences, with the counts the planner needs and the row layout.

    With `share_prefixes=False` every sequence becomes its own root segment: ordinary padding-free packing,
    the baseline tree packing is measured against.
    """

    def __init__(self, *, share_prefixes: bool = True) -> None:
        self.share_prefixes = share_prefixes
        self._root = _Segment(np.empty(0, np.int64), np.empty(0, bool), depth=0)
        self._num_unshared = 0
        self.num_tokens = 0  # unique tokens (trie nodes)
        self.num_trained_nodes = 0  # nodes some sequence trains on
        self.attention_pairs = 0  # query-key pairs of tree attention: sum over nodes of (depth + 1)

    def _walk(self, ids: np.ndarray) -> tuple[int, _Segment, _Segment | None, int]:
        """Follow `ids` down: (tokens matched, last segment fully matched, segment stopped in, its offset)."""
        node, pos, n = self._root, 0, len(ids)
        while pos < n:
            child = node.children.get(int(ids[pos]))
            if child is None:
                return pos, node, None, 0
            m = min(len(child.tokens), n - pos)
            lcp = _common_prefix_length(child.tokens[:m], ids[pos : pos + m])
            if lcp < len(child.tokens):
                return pos + lcp, node, child, lcp
            pos += lcp
            node = child
        return pos, node, None, 0

    def match_length(self, ids: np.ndarray) -> int:
        """How many leading tokens of `ids` the trie already holds (0 when prefixes are not shared)."""
        return self._walk(ids)[0] if self.share_prefixes else 0

    def insert(self, ids: np.ndarray, trained: np.ndarray) -> int:
        """Add a sequence (with its per-token trained flags); return the number of new nodes."""
        n = len(ids)
        if not self.share_prefixes:
            self._num_unshared += 1
            self._root.children[-self._num_unshared] = _Segment(ids.copy(), trained.copy(), depth=0)
            self._count_new(trained, start_depth=0)
            return n
        self._mark_trained(ids, trained)
        matched, node, stopped_in, offset = self._walk(ids)
        if matched == n:
            return 0
        if stopped_in is not None:  # the sequence leaves the trie inside a segment: split it there
            lower = _Segment(
                stopped_in.tokens[offset:], stopped_in.trained[offset:], stopped_in.depth + offset
            )
            lower.children = stopped_in.children
            stopped_in.tokens = stopped_in.tokens[:offset]
            stopped_in.trained = stopped_in.trained[:offset]
            stopped_in.children = {int(lower.tokens[0]): lower}
            node = stopped_in
        node.children[int(ids[matched])] = _Segment(ids[matched:].copy(), trained[matched:].copy(), matched)
        self._count_new(trained[matched:], start_depth=matched)
        return n - matched

    def _count_new(self, trained: np.ndarray, start_depth: int) -> None:
        n = len(trained)
        self.num_tokens += n
        self.num_trained_nodes += int(trained.sum())
        # depths start_depth .. start_depth + n - 1, each attending to depth + 1 keys
        self.attention_pairs += n * (2 * start_depth + n + 1) // 2

    def _mark_trained(self, ids: np.ndarray, trained: np.ndarray) -> None:
        """OR the trained flags of the part of `ids` already in the trie into its nodes."""
        node, pos, n = self._root, 0, len(ids)
        while pos < n:
            child = node.children.get(int(ids[pos]))
            if child is None:
                return
            m = min(len(child.tokens), n - pos)
            lcp = _common_prefix_length(child.tokens[:m], ids[pos : pos + m])
            newly = trained[pos : pos + lcp] & ~child.trained[:lcp]
            if newly.any():
                child.trained[:lcp] |= newly
                self.num_trained_nodes += int(newly.sum())
            if lcp < len(child.tokens):
                return
            pos += lcp
            node = child

    def layout(self) -> _Layout:
        """The depth-first row layout of the trie (children in insertion order)."""
        order: list[_Segment] = []
        parent_segment: list[int] = []
        stack = [(child, -1) for child in reversed(self._root.children.values())]
        while stack:
            segment, parent = stack.pop()
            index = len(order)
            order.append(segment)
            parent_segment.append(parent)
            stack.extend((child, index) for child in reversed(segment.children.values()))
        return _Layout(order, np.asarray(parent_segment, dtype=np.int64))

    def path_rows(self, ids: np.ndarray, layout: _Layout, unshared_index: int | None = None) -> np.ndarray:
        """Row index of every token of an inserted sequence (for unshared tries, give its insertion index)."""
        rows = np.empty(len(ids), dtype=np.int64)
        if unshared_index is not None:
            segment = self._root.children[-(unshared_index + 1)]
            start = layout.segment_start[layout.index_of[id(segment)]]
            rows[:] = start + np.arange(len(ids))
            return rows
        node, pos, n = self._root, 0, len(ids)
        while pos < n:
            child = node.children[int(ids[pos])]
            take = min(len(child.tokens), n - pos)
            start = layout.segment_start[layout.index_of[id(child)]]
            rows[pos : pos + take] = start + np.arange(take)
            pos += take
            node = child
        return rows


class _Layout:
    """Segments in depth-first order with their row offsets, parents, depths and subtree ends."""

    def __init__(self, order: list[_Segment], parent_segment: np.ndarray) -> None:
        self.order = order
        self.index_of = {id(segment): i for i, segment in enumerate(order)}
        self.segment_parent = parent_segment
        self.segment_length = np.asarray([len(s.tokens) for s in order], dtype=np.int64)
        self.segment_start = np.concatenate([[0], np.cumsum(self.segment_length)[:-1]]).astype(np.int64)
        self.segment_depth = np.asarray([s.depth for s in order], dtype=np.int64)
        # A child follows its parent in depth-first order, so one reverse pass folds subtree ends upwards.
        subtree_end = self.segment_start + self.segment_length
        for i in range(len(order) - 1, -1, -1):
            parent = parent_segment[i]
            if parent >= 0 and subtree_end[i] > subtree_end[parent]:
                subtree_end[parent] = subtree_end[i]
        self.segment_subtree_end = subtree_end


@dataclass(frozen=True)
class PackedRow:
    """One packed row: the trie's tokens in depth-first order, and the trained tokens that read from it.

    Per-token tensors have T entries (the row's unique tokens), per-trained-token tensors N entries, in
    sample order then position order. Optional top-k / candidate tensors are padded with id -1.

    Attributes:
        input_ids: [T] token ids.
        position_ids: [T] depth in the trie, which is the token's position in each of its samples.
        parent: [T] row index of the previous token on the token's path; -1 for the first token of a sample.
        subtree_end: [T] one past the last row index of the token's subtree: token q sees key k iff
            k <= q < subtree_end[k].
        segment_start, segment_length, segment_parent: [S] the trie's branch-free runs in row order; the
            parent is a segment index (-1 for a root). A child starts right after its parent's last token.
        pred_index: [N] row index whose output predicts the trained token (its predecessor in its sample).
        target_ids: [N] the trained token ids.
        advantages: [N] float32, the sample's advantage.
        old_logprobs: [N] float32, the sampler's log-probability of the token.
        sample_index: [N] which of the row's samples the token belongs to (0 .. num_samples-1).
        sampler_topk_ids, sampler_topk_logprobs: [N, K] the sampler's most likely tokens and their
            log-probabilities (score centering); id -1 / -inf pads. None when no trained token has them.
        candidate_ids: [N, C] the candidate set the token was sampled from (top-k / top-p); a row of -1
            means the full vocabulary. None when no trained token has one.
        group_ids: the group of each sample.
        sample_lengths: tokens of each sample before packing.
        num_trained_nodes: unique row tokens that some sample trains on.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    parent: torch.Tensor
    subtree_end: torch.Tensor
    segment_start: torch.Tensor
    segment_length: torch.Tensor
    segment_parent: torch.Tensor
    pred_index: torch.Tensor
    target_ids: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor
    sample_index: torch.Tensor
    sampler_topk_ids: torch.Tensor | None
    sampler_topk_logprobs: torch.Tensor | None
    candidate_ids: torch.Tensor | None
    group_ids: tuple[int, ...]
    sample_lengths: tuple[int, ...]
    num_trained_nodes: int

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_trained(self) -> int:
        return int(self.target_ids.shape[0])

    @property
    def num_samples(self) -> int:
        return len(self.sample_lengths)

    @property
    def attention_pairs(self) -> int:
        """Query-key pairs tree attention computes: every token attends to its depth + 1 ancestors."""
        return int(self.position_ids.sum().item()) + self.num_tokens

    @property
    def packing_ratio(self) -> float:
        """Tokens before packing per forwarded token."""
        return sum(self.sample_lengths) / max(self.num_tokens, 1)

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> PackedRow:
        """A copy with every tensor on `device`."""
        moved = {
            f.name: value.to(device, non_blocking=non_blocking)
            for f in fields(self)
            if isinstance(value := getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)


def packed_token_count(samples: Sequence[TrainingSample]) -> int:
    """The tokens `samples` forward when packed into one row: a prefix they share counts once.

    The unit of the token budget, and of the worker's token allowance (a group's samples share its prompt).
    """
    trie = PrefixTrie()
    for sample in samples:
        trie.insert(*_sample_arrays(sample))
    return trie.num_tokens


def _sample_arrays(sample: TrainingSample) -> tuple[np.ndarray, np.ndarray]:
    sequence = sample.sequence
    ids = np.asarray(sequence.input_ids, dtype=np.int64)
    trained = np.asarray(sequence.loss_mask, dtype=bool)
    if len(ids) == 0:
        raise PackingError("a training sample has no tokens")
    if trained[0]:
        raise PackingError(
            "the first token of a sample is marked trained, but nothing precedes it to predict it; "
            "reconciliation should only train tokens that follow a prompt"
        )
    return ids, trained


def pack_row(samples: Sequence[TrainingSample], *, share_prefixes: bool = True) -> PackedRow:
    """Lay out `samples` as one prefix-trie row (see the module docstring); CPU tensors.

    With `share_prefixes=False` nothing is shared: each sample is its own segment (plain packing).
    """
    if not samples:
        raise PackingError("cannot pack an empty row")
    trie = PrefixTrie(share_prefixes=share_prefixes)
    arrays = [_sample_arrays(sample) for sample in samples]
    for ids, trained in arrays:
        trie.insert(ids, trained)
    layout = trie.layout()

    lengths = layout.segment_length
    segment_of_token = np.repeat(np.arange(len(lengths)), lengths)
    offset_in_segment = np.arange(int(lengths.sum())) - layout.segment_start[segment_of_token]
    input_ids = np.concatenate([segment.tokens for segment in layout.order])
    position_ids = layout.segment_depth[segment_of_token] + offset_in_segment
    parent = np.arange(len(input_ids), dtype=np.int64) - 1
    has_parent = layout.segment_parent >= 0
    parent_segments = layout.segment_parent[has_parent]
    parent[layout.segment_start] = -1
    parent[layout.segment_start[has_parent]] = (
        layout.segment_start[parent_segments] + layout.segment_length[parent_segments] - 1
    )
    subtree_end = layout.segment_subtree_end[segment_of_token]

    pred_index, target_ids, advantages, old_logprobs, sample_index = [], [], [], [], []
    topk: list[dict[int, float] | None] = []
    candidates: list[list[int] | None] = []
    for i, (sample, (ids, trained)) in enumerate(zip(samples, arrays, strict=True)):
        rows = trie.path_rows(ids, layout, unshared_index=None if share_prefixes else i)
        positions = np.flatnonzero(trained)
        pred_index.append(rows[positions - 1])
        target_ids.append(ids[positions])
        advantages.append(np.full(len(positions), sample.advantage, dtype=np.float32))
        old = np.asarray(sample.sequence.old_log_probs, dtype=np.float32)
        old_logprobs.append(old[positions])
        sample_index.append(np.full(len(positions), i, dtype=np.int64))
        topk.extend(sample.sequence.sampler_logprobs[p] for p in positions)
        candidates.extend(sample.sequence.sampling_mask[p] for p in positions)

    topk_ids, topk_logprobs = _pad_topk(topk)
    return PackedRow(
        input_ids=torch.from_numpy(input_ids),
        position_ids=torch.from_numpy(position_ids),
        parent=torch.from_numpy(parent),
        subtree_end=torch.from_numpy(subtree_end),
        segment_start=torch.from_numpy(layout.segment_start),
        segment_length=torch.from_numpy(layout.segment_length),
        segment_parent=torch.from_numpy(layout.segment_parent),
        pred_index=torch.from_numpy(np.concatenate(pred_index)),
        target_ids=torch.from_numpy(np.concatenate(target_ids)),
        advantages=torch.from_numpy(np.concatenate(advantages)),
        old_logprobs=torch.from_numpy(np.concatenate(old_logprobs)),
        sample_index=torch.from_numpy(np.concatenate(sample_index)),
        sampler_topk_ids=topk_ids,
        sampler_topk_logprobs=topk_logprobs,
        candidate_ids=_pad_candidates(candidates),
        group_ids=tuple(sample.group_id for sample in samples),
        sample_lengths=tuple(len(ids) for ids, _ in arrays),
        num_trained_nodes=trie.num_trained_nodes,
    )


def _pad_topk(topk: list[dict[int, float] | None]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    width = max((len(entry) for entry in topk if entry), default=0)
    if width == 0:
        return None, None
    ids = np.full((len(topk), width), -1, dtype=np.int64)
    logprobs = np.full((len(topk), width), -np.inf, dtype=np.float32)
    for i, entry in enumerate(topk):
        if entry:
            ids[i, : len(entry)] = list(entry.keys())
            logprobs[i, : len(entry)] = list(entry.values())
    return torch.from_numpy(ids), torch.from_numpy(logprobs)


def _pad_candidates(candidates: list[list[int] | None]) -> torch.Tensor | None:
    width = max((len(entry) for entry in candidates if entry), default=0)
    if width == 0:
        return None
    ids = np.full((len(candidates), width), -1, dtype=np.int64)
    for i, entry in enumerate(candidates):
        if entry:
            ids[i, : len(entry)] = np.asarray(entry, dtype=np.int64)
    return torch.from_numpy(ids)


# --------------------------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class RowPlan:
    """One planned row: which samples, and what the row will cost.

    Attributes:
        sample_indices: Indices into the planner's input list, in placement order.
        num_tokens: Unique tokens (the forward's length).
        num_trained: Trained tokens, i.e. loss terms (a token trained by two samples counts twice).
        num_trained_nodes: Unique tokens some sample trains on.
        num_raw_tokens: Tokens before packing.
        attention_pairs: Query-key pairs tree attention computes.
        cost: num_tokens + pair_weight * attention_pairs, what the planner balances.
        group_ids: Distinct groups in the row.
    """

    sample_indices: tuple[int, ...]
    num_tokens: int
    num_trained: int
    num_trained_nodes: int
    num_raw_tokens: int
    attention_pairs: int
    cost: float
    group_ids: frozenset[int]


@dataclass(frozen=True)
class MicroBatchPlan:
    """One row per process; never an empty row."""

    rows: tuple[RowPlan, ...]


@dataclass(frozen=True)
class PackingPlan:
    """The planner's answer.

    Attributes:
        micro_batches: Planned micro-batches, in order.
        leftover: Indices of samples not placed: past `max_micro_batches`, or too few to give every row of
            a last micro-batch one sample. The trainer keeps them for the next step.
        dropped_oversize: Indices of samples longer than the budget (tokens or trained tokens); they fit no
            row and are dropped.
        token_budget: The budget the plan was made under.
    """

    micro_batches: tuple[MicroBatchPlan, ...]
    leftover: tuple[int, ...]
    dropped_oversize: tuple[int, ...]
    token_budget: int


class _OpenRow:
    def __init__(self, share_prefixes: bool, pair_weight: float) -> None:
        self.trie = PrefixTrie(share_prefixes=share_prefixes)
        self.pair_weight = pair_weight
        self.samples: list[int] = []
        self.groups: set[int] = set()
        self.num_trained = 0
        self.num_raw_tokens = 0

    @property
    def cost(self) -> float:
        return self.trie.num_tokens + self.pair_weight * self.trie.attention_pairs

    def cost_after(self, ids: np.ndarray) -> tuple[int, float]:
        """(unique tokens, cost) of the row if `ids` were added."""
        matched = self.trie.match_length(ids)
        n = len(ids)
        new_pairs = (n - matched) * (matched + n + 1) // 2
        tokens = self.trie.num_tokens + n - matched
        return tokens, tokens + self.pair_weight * (self.trie.attention_pairs + new_pairs)

    def add(self, index: int, ids: np.ndarray, trained: np.ndarray, group_id: int) -> None:
        self.trie.insert(ids, trained)
        self.samples.append(index)
        self.groups.add(group_id)
        self.num_trained += int(trained.sum())
        self.num_raw_tokens += len(ids)

    def freeze(self) -> RowPlan:
        return RowPlan(
            sample_indices=tuple(self.samples),
            num_tokens=self.trie.num_tokens,
            num_trained=self.num_trained,
            num_trained_nodes=self.trie.num_trained_nodes,
            num_raw_tokens=self.num_raw_tokens,
            attention_pairs=self.trie.attention_pairs,
            cost=self.cost,
            group_ids=frozenset(self.groups),
        )


def plan_micro_batches(
    samples: Sequence[TrainingSample],
    *,
    num_rows: int,
    token_budget: int,
    max_micro_batches: int | None = None,
    share_prefixes: bool = True,
    pair_weight: float = DEFAULT_PAIR_WEIGHT,
) -> PackingPlan:
    """Assign samples, in queue order, to micro-batches of `num_rows` rows (one per process).

    A row holds at most `token_budget` unique tokens and `token_budget` trained tokens. For each sample:

    1. it joins the row that already holds its group, where its prompt already is, if it fits there;
    2. else an empty row, if the micro-batch still has one;
    3. else, for the first sample of a group, the fitting row that ends cheapest;
    4. else (its group's row is full) the fitting row that ends cheapest, provided that does not raise the
       most expensive row, which sets the micro-batch's time;

    otherwise the micro-batch closes and the sample opens the next one. Row cost is
    `unique tokens + pair_weight * attention pairs` (see `DEFAULT_PAIR_WEIGHT`). A sample longer than the
    budget is dropped and reported. A last micro-batch with an empty row is rebalanced by moving samples out
    of the fullest rows; if it holds fewer samples than rows, they are returned as leftover.
    """
    if num_rows < 1:
        raise ValueError(f"num_rows must be at least 1, got {num_rows}")
    if token_budget < 1:
        raise ValueError(f"token_budget must be at least 1, got {token_budget}")
    micro_batches: list[MicroBatchPlan] = []
    leftover: list[int] = []
    dropped: list[int] = []
    arrays: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def new_rows() -> list[_OpenRow]:
        return [_OpenRow(share_prefixes, pair_weight) for _ in range(num_rows)]

    rows = new_rows()
    for index, sample in enumerate(samples):
        ids, trained = _sample_arrays(sample)
        if len(ids) > token_budget or int(trained.sum()) > token_budget:
            dropped.append(index)
            continue
        if max_micro_batches is not None and len(micro_batches) >= max_micro_batches:
            leftover.append(index)
            continue
        arrays[index] = (ids, trained)
        target = _choose_row(rows, ids, int(trained.sum()), sample.group_id, token_budget)
        if target is None:
            micro_batches.append(MicroBatchPlan(tuple(row.freeze() for row in rows)))
            rows = new_rows()
            if max_micro_batches is not None and len(micro_batches) >= max_micro_batches:
                leftover.append(index)
                continue
            target = rows[0]
        target.add(index, ids, trained, sample.group_id)

    placed = [i for row in rows for i in row.samples]
    if placed:
        if len(placed) < num_rows:
            leftover.extend(placed)
        else:
            final = _rebalance(rows, samples, arrays, share_prefixes, pair_weight)
            micro_batches.append(MicroBatchPlan(tuple(row.freeze() for row in final)))
    return PackingPlan(
        micro_batches=tuple(micro_batches),
        leftover=tuple(sorted(leftover)),
        dropped_oversize=tuple(dropped),
        token_budget=token_budget,
    )


def _choose_row(
    rows: list[_OpenRow], ids: np.ndarray, num_trained: int, group_id: int, token_budget: int
) -> _OpenRow | None:
    fitting: list[tuple[float, int, _OpenRow]] = []
    group_is_placed = False
    for row in rows:
        tokens, cost = row.cost_after(ids)
        fits = tokens <= token_budget and row.num_trained + num_trained <= token_budget
        if group_id in row.groups:
            group_is_placed = True
            if fits:
                return row
        if fits:
            fitting.append((cost, tokens, row))
    for row in rows:
        if not row.samples:
            return row
    if not fitting:
        return None
    cost, _, best = min(fitting, key=lambda entry: (entry[0], entry[1]))
    if not group_is_placed:
        return best
    return best if cost <= max(row.cost for row in rows) else None


def _rebalance(
    rows: list[_OpenRow],
    samples: Sequence[TrainingSample],
    arrays: dict[int, tuple[np.ndarray, np.ndarray]],
    share_prefixes: bool,
    pair_weight: float,
) -> list[_OpenRow]:
    """Give every row a sample by moving the last-placed samples of the fullest rows into empty ones."""
    assignment = [list(row.samples) for row in rows]
    while any(not row for row in assignment):
        empty = next(i for i, row in enumerate(assignment) if not row)
        donor = max(range(len(assignment)), key=lambda i: len(assignment[i]))
        assignment[empty].append(assignment[donor].pop())
    if all(list(row.samples) == new for row, new in zip(rows, assignment, strict=True)):
        return rows
    rebuilt = []
    for indices in assignment:
        row = _OpenRow(share_prefixes, pair_weight)
        for index in sorted(indices):
            ids, trained = arrays[index]
            row.add(index, ids, trained, samples[index].group_id)
        rebuilt.append(row)
    return rebuilt


def pair_weight_for_config(config: object) -> float:
    """Linear-cost equivalent of one attention query-key pair for a transformers decoder config.

    Forward FLOPs of one pair are 4 * heads * head_dim per layer; of one token through the layers' weights,
    2 * (their parameters). Embeddings and the LM head are left out (the head runs on trained tokens only).
    """
    text: Any = getattr(config, "text_config", None) or config
    hidden = text.hidden_size
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    layers = text.num_hidden_layers
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * text.intermediate_size
    layer_types = getattr(text, "layer_types", None) or ["full_attention"] * layers
    attention_layers = sum(1 for kind in layer_types if kind != "linear_attention")
    return 4 * attention_layers * heads * head_dim / (2 * layers * per_layer)


def batch_metrics(plan: PackingPlan) -> dict[str, float]:
    """The spec's batch/* metrics for one optimizer step's plan (all processes' rows).

    `pad_frac` is the padding that would make each micro-batch's rows one length: rows are built on their
    own process and never padded here, so it measures the length spread rather than a cost paid.
    """
    rows = [row for micro_batch in plan.micro_batches for row in micro_batch.rows]
    if not rows:
        return {"batch/dropped_oversize_count": float(len(plan.dropped_oversize))}
    forwarded = sum(row.num_tokens for row in rows)
    raw = sum(row.num_raw_tokens for row in rows)
    padded = sum(
        len(micro_batch.rows) * max(row.num_tokens for row in micro_batch.rows)
        for micro_batch in plan.micro_batches
    )
    imbalance = [
        max(row.cost for row in mb.rows) / (sum(row.cost for row in mb.rows) / len(mb.rows))
        for mb in plan.micro_batches
    ]
    groups = set().union(*(row.group_ids for row in rows))
    return {
        "batch/forwarded_tokens_per_step": float(forwarded),
        "batch/trained_tokens_per_step": float(sum(row.num_trained for row in rows)),
        "batch/samples_per_step": float(sum(len(row.sample_indices) for row in rows)),
        "batch/groups_per_step": float(len(groups)),
        "batch/microbatches_per_step": float(len(plan.micro_batches)),
        "batch/masked_token_frac": 1.0 - sum(row.num_trained_nodes for row in rows) / forwarded,
        "batch/samples_per_row": sum(len(row.sample_indices) for row in rows) / len(rows),
        "batch/row_tokens_mean": forwarded / len(rows),
        "batch/row_tokens_max": float(max(row.num_tokens for row in rows)),
        "batch/row_fill_frac": forwarded / (len(rows) * plan.token_budget),
        "batch/row_imbalance": sum(imbalance) / len(imbalance),
        "batch/packing_ratio": raw / forwarded,
        "batch/pad_frac": 1.0 - forwarded / padded,
        "batch/dropped_oversize_count": float(len(plan.dropped_oversize)),
    }
