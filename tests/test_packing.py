"""Tree packing: trie rows from literal token lists, the planner's placement rules, and batch metrics."""

from __future__ import annotations

import random

import pytest
import torch

from harness.packing import (
    PackingError,
    PrefixTrie,
    batch_metrics,
    pack_row,
    pair_weight_for_config,
    plan_micro_batches,
)
from harness.types import TrainingSample, TrainingSequence

# Readable token names for the spec's example: prompt p1 p2 p3, completions a1 a2 and b1 b2.
P1, P2, P3, A1, A2, B1, B2 = 11, 12, 13, 21, 22, 31, 32


def sample(
    prompt: list[int],
    completion: list[int],
    *,
    advantage: float = 1.0,
    group: int = 0,
    old: list[float] | None = None,
    topk: list[dict[int, float] | None] | None = None,
    candidates: list[list[int] | None] | None = None,
) -> TrainingSample:
    """A sample whose completion tokens are trained (old log-probs default to -0.1 * position)."""
    ids = prompt + completion
    n, m = len(ids), len(completion)
    old_trained = old if old is not None else [-0.1 * (len(prompt) + i) for i in range(m)]
    sequence = TrainingSequence(
        input_ids=ids,
        loss_mask=[0] * len(prompt) + [1] * m,
        old_log_probs=[0.0] * len(prompt) + old_trained,
        sampler_logprobs=[None] * len(prompt) + (topk if topk is not None else [None] * m),
        sampling_mask=[None] * len(prompt) + (candidates if candidates is not None else [None] * m),
    )
    assert len(sequence.input_ids) == n
    return TrainingSample(sequence=sequence, advantage=advantage, group_id=group)


def prompt_of(group: int, length: int) -> list[int]:
    return [1000 * (group + 1) + i for i in range(length)]


def test_spec_example_shares_the_prompt_and_predicts_each_token_from_its_own_predecessor():
    row = pack_row(
        [sample([P1, P2, P3], [A1, A2], advantage=0.5), sample([P1, P2, P3], [B1, B2], advantage=-2.0)]
    )

    assert row.input_ids.tolist() == [P1, P2, P3, A1, A2, B1, B2]
    assert row.position_ids.tolist() == [0, 1, 2, 3, 4, 3, 4]
    assert row.parent.tolist() == [-1, 0, 1, 2, 3, 2, 5]
    assert row.subtree_end.tolist() == [7, 7, 7, 5, 5, 7, 7]
    assert row.segment_start.tolist() == [0, 3, 5]
    assert row.segment_length.tolist() == [3, 2, 2]
    assert row.segment_parent.tolist() == [-1, 0, 0]
    # a1 a2 b1 b2 are predicted at p3 a1 p3 b1: p3 predicts two targets
    assert row.pred_index.tolist() == [2, 3, 2, 5]
    assert row.target_ids.tolist() == [A1, A2, B1, B2]
    assert row.advantages.tolist() == [0.5, 0.5, -2.0, -2.0]
    assert row.old_logprobs.tolist() == pytest.approx([-0.3, -0.4, -0.3, -0.4])
    assert row.sample_index.tolist() == [0, 0, 1, 1]
    assert row.num_tokens == 7 and row.packing_ratio == pytest.approx(10 / 7)
    assert row.attention_pairs == 1 + 2 + 3 + 4 + 5 + 4 + 5
    assert row.num_trained_nodes == 4


def test_without_sharing_each_sample_is_its_own_segment():
    row = pack_row(
        [sample([P1, P2, P3], [A1, A2]), sample([P1, P2, P3], [B1, B2])],
        share_prefixes=False,
    )
    assert row.input_ids.tolist() == [P1, P2, P3, A1, A2, P1, P2, P3, B1, B2]
    assert row.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
    assert row.parent.tolist() == [-1, 0, 1, 2, 3, -1, 5, 6, 7, 8]
    assert row.subtree_end.tolist() == [5] * 5 + [10] * 5
    assert row.pred_index.tolist() == [2, 3, 7, 8]
    assert row.packing_ratio == 1.0


def test_a_later_fork_splits_a_segment_and_a_shorter_sample_ends_inside_one():
    # r0 is inserted whole; r1 leaves it after p2 (split); r2 is a prefix of r0 and adds nothing.
    long = sample([P1, P2, P3], [A1, A2])
    fork = sample([P1, P2], [B1])
    prefix = sample([P1], [P2, P3])
    row = pack_row([long, fork, prefix])
    assert row.input_ids.tolist() == [P1, P2, P3, A1, A2, B1]
    assert row.position_ids.tolist() == [0, 1, 2, 3, 4, 2]
    assert row.parent.tolist() == [-1, 0, 1, 2, 3, 1]
    assert row.segment_length.tolist() == [2, 3, 1]
    assert row.subtree_end.tolist() == [6, 6, 5, 5, 5, 6]
    # long: a1 a2 at p3 a1; fork: b1 at p2; prefix: p2 p3 at p1 p2
    assert row.pred_index.tolist() == [2, 3, 1, 0, 1]
    assert row.num_trained_nodes == 5  # a1 a2 b1 p2 p3


def test_every_sample_reads_back_from_its_path_in_a_random_forest():
    rng = random.Random(0)
    prompts = [[rng.randrange(5) for _ in range(rng.randrange(1, 6))] for _ in range(4)]
    samples = []
    for i in range(40):
        prompt = list(rng.choice(prompts))
        completion = [rng.randrange(5) for _ in range(rng.randrange(1, 5))]
        samples.append(sample(prompt, completion, group=i % 3))
    for share in (True, False):
        row = pack_row(samples, share_prefixes=share)
        ids, parent, position = row.input_ids.tolist(), row.parent.tolist(), row.position_ids.tolist()
        # walk back from each trained token's predecessor: the path must spell the sample's prefix
        for pred, target, index in zip(
            row.pred_index.tolist(), row.target_ids.tolist(), row.sample_index.tolist(), strict=True
        ):
            path, node = [], pred
            while node >= 0:
                path.append(ids[node])
                node = parent[node]
            path.reverse()
            tokens = samples[index].sequence.input_ids
            assert tokens[: len(path)] == path and tokens[len(path)] == target
            assert position[pred] == len(path) - 1
        # the ancestor relation is an interval: every token's subtree holds exactly its descendants
        for node in range(row.num_tokens):
            descendants = {node}
            for other in range(node + 1, row.num_tokens):
                if parent[other] in descendants:
                    descendants.add(other)
            assert descendants == set(range(node, row.subtree_end[node].item()))
        assert row.num_tokens <= sum(row.sample_lengths)


def test_topk_and_candidate_sets_are_padded_per_trained_token():
    row = pack_row(
        [
            sample([P1], [A1, A2], topk=[{A1: -0.2, 7: -1.9}, None], candidates=[[A1, 7, 8], None]),
            sample([P1], [B1], topk=[{B1: -0.1}], candidates=[[B1]]),
        ]
    )
    assert row.sampler_topk_ids.tolist() == [[A1, 7], [-1, -1], [B1, -1]]
    logprobs = row.sampler_topk_logprobs
    assert logprobs[0].tolist() == pytest.approx([-0.2, -1.9]) and logprobs[2, 0].item() == pytest.approx(
        -0.1
    )
    assert torch.isinf(logprobs[1]).all() and torch.isinf(logprobs[2, 1])
    assert row.candidate_ids.tolist() == [[A1, 7, 8], [-1, -1, -1], [B1, -1, -1]]
    plain = pack_row([sample([P1], [A1])])
    assert plain.sampler_topk_ids is None and plain.candidate_ids is None


def test_a_trained_first_token_is_rejected():
    bad = TrainingSample(TrainingSequence([A1, A2], [1, 1], [0.0, 0.0], [None, None], [None, None]), 1.0, 0)
    with pytest.raises(PackingError, match="first token"):
        pack_row([bad])


def test_trie_counts_match_the_layout():
    trie = PrefixTrie()
    assert trie.insert(torch.tensor([1, 2, 3]).numpy(), torch.tensor([0, 1, 1]).bool().numpy()) == 3
    assert trie.match_length(torch.tensor([1, 2, 9]).numpy()) == 2
    assert trie.insert(torch.tensor([1, 2, 9, 9]).numpy(), torch.tensor([0, 0, 1, 1]).bool().numpy()) == 2
    assert (trie.num_tokens, trie.num_trained_nodes, trie.attention_pairs) == (5, 4, 1 + 2 + 3 + 3 + 4)


# ------------------------------------------------------------------------------------------------ planner


def group(group_id: int, *, prompt: int, completions: list[int], start: int = 0) -> list[TrainingSample]:
    return [
        sample(prompt_of(group_id, prompt), [500 + start + j] * length, group=group_id)
        for j, length in enumerate(completions)
    ]


def rows_of(plan):
    return [[list(row.sample_indices) for row in mb.rows] for mb in plan.micro_batches]


def test_a_group_stays_in_the_row_that_holds_its_prompt():
    # 2 groups of 3, interleaved in the queue; 2 rows: each row gets one whole group.
    g0, g1 = group(0, prompt=6, completions=[2, 2, 2]), group(1, prompt=6, completions=[2, 2, 2])
    samples = [g0[0], g1[0], g0[1], g1[1], g0[2], g1[2]]
    plan = plan_micro_batches(samples, num_rows=2, token_budget=100)
    assert rows_of(plan) == [[[0, 2, 4], [1, 3, 5]]]
    assert [row.num_tokens for row in plan.micro_batches[0].rows] == [12, 12]  # 6 shared + 3 * 2 each


def test_the_budget_counts_unique_tokens():
    # 4 samples of 10 tokens sharing an 8-token prompt: 40 raw tokens, 8 + 4 * 2 = 16 unique
    samples = group(0, prompt=8, completions=[2, 2, 2, 2])
    plan = plan_micro_batches(samples, num_rows=1, token_budget=16)
    assert rows_of(plan) == [[[0, 1, 2, 3]]]
    unshared = plan_micro_batches(samples, num_rows=1, token_budget=16, share_prefixes=False)
    assert rows_of(unshared) == [[[0]], [[1]], [[2]], [[3]]]


def test_the_budget_also_bounds_trained_tokens():
    # identical samples share every node, but each keeps its own loss terms
    samples = [sample([P1], [A1, A2, A1, A2]) for _ in range(3)]
    plan = plan_micro_batches(samples, num_rows=1, token_budget=8)
    assert rows_of(plan) == [[[0, 1]], [[2]]]
    assert plan.micro_batches[0].rows[0].num_tokens == 5


def test_oversize_samples_are_dropped_and_counted():
    samples = [sample(prompt_of(g, n), [1, 2], group=g) for g, n in enumerate([4, 9, 2])]
    plan = plan_micro_batches(samples, num_rows=1, token_budget=10)
    assert plan.dropped_oversize == (1,)
    assert rows_of(plan) == [[[0, 2]]]
    assert batch_metrics(plan)["batch/dropped_oversize_count"] == 1.0


def test_no_row_is_ever_empty():
    # one sample for two rows: nothing can be emitted, the sample waits
    plan = plan_micro_batches(group(0, prompt=3, completions=[2]), num_rows=2, token_budget=50)
    assert plan.micro_batches == () and plan.leftover == (0,)
    # three samples of one group for two rows: the group is split rather than leave a row empty
    plan = plan_micro_batches(group(0, prompt=3, completions=[2, 2, 2]), num_rows=2, token_budget=50)
    assert all(mb_row for mb in rows_of(plan) for mb_row in mb)
    assert sorted(i for mb in rows_of(plan) for row in mb for i in row) == [0, 1, 2]


def test_a_full_group_row_overflows_only_when_that_does_not_raise_the_most_loaded_row():
    # row budget 20: group 0 (prompt 10 + 3 x 3) fills row 0 to 19; group 1 (prompt 4 + 1) opens row 1.
    samples = group(0, prompt=10, completions=[3, 3, 3]) + group(1, prompt=4, completions=[1])
    # another group-0 sample no longer fits row 0; row 1 would end at 5 + 13 = 18 tokens < 19: allowed
    samples.append(group(0, prompt=10, completions=[3], start=9)[0])
    # and another would raise row 1 to 31 > 20: it does not fit anywhere, the micro-batch closes
    samples.append(group(0, prompt=10, completions=[3], start=10)[0])
    plan = plan_micro_batches(samples, num_rows=2, token_budget=20, pair_weight=0.0)
    assert rows_of(plan)[0] == [[0, 1, 2], [3, 4]]
    assert plan.leftover == (5,)  # alone in the next micro-batch of two rows


def test_rows_are_balanced_by_cost():
    # four single-sample groups of 10, 10, 2, 2 tokens into two rows: 12 and 12
    samples = [sample(prompt_of(g, n - 1), [1], group=g) for g, n in enumerate([10, 10, 2, 2])]
    plan = plan_micro_batches(samples, num_rows=2, token_budget=100)
    assert sorted(row.num_tokens for row in plan.micro_batches[0].rows) == [12, 12]


def test_max_micro_batches_leaves_the_rest_for_the_next_step():
    samples = group(0, prompt=4, completions=[4, 4, 4, 4])
    plan = plan_micro_batches(samples, num_rows=1, token_budget=12, max_micro_batches=1)
    assert rows_of(plan) == [[[0, 1]]] and plan.leftover == (2, 3)


def test_batch_metrics_on_a_literal_plan():
    # group 0: prompt 6 + completions 2, 2 -> 10 unique of 16 raw; group 1: prompt 3 + 1 -> 4 of 4
    samples = group(0, prompt=6, completions=[2, 2]) + group(1, prompt=3, completions=[1])
    plan = plan_micro_batches(samples, num_rows=2, token_budget=20)
    metrics = batch_metrics(plan)
    assert rows_of(plan) == [[[0, 1], [2]]]
    assert metrics["batch/forwarded_tokens_per_step"] == 14
    assert metrics["batch/trained_tokens_per_step"] == 5
    assert metrics["batch/samples_per_step"] == 3 and metrics["batch/groups_per_step"] == 2
    assert metrics["batch/microbatches_per_step"] == 1
    assert metrics["batch/masked_token_frac"] == pytest.approx(1 - 5 / 14)
    assert metrics["batch/samples_per_row"] == 1.5
    assert metrics["batch/row_tokens_mean"] == 7 and metrics["batch/row_tokens_max"] == 10
    assert metrics["batch/row_fill_frac"] == pytest.approx(14 / 40)
    assert metrics["batch/packing_ratio"] == pytest.approx(20 / 14)
    assert metrics["batch/pad_frac"] == pytest.approx(1 - 14 / 20)
    costs = [row.cost for row in plan.micro_batches[0].rows]
    assert metrics["batch/row_imbalance"] == pytest.approx(max(costs) / (sum(costs) / 2))
    assert metrics["batch/dropped_oversize_count"] == 0


def test_pair_weight_of_a_qwen3_1_7b_shaped_config():
    from transformers import Qwen3Config

    config = Qwen3Config(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936,
    )  # fmt: skip
    assert 1 / pair_weight_for_config(config) == pytest.approx(12288, rel=0.01)
