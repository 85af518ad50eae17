"""Reconciliation of a rollout's turns into training sequences, on literal token lists.

Token ids are small numbers chosen to be read: prompts in the 10s, outputs in the 100s (turn 0), 200s
(turn 1) and so on, tool results in the 50s.
"""

from __future__ import annotations

import math

import pytest

from harness.rollout.reconcile import (
    Reconciled,
    common_prefix_length,
    reconcile,
    reconcile_metrics,
    reconcile_rollout,
)
from harness.types import TurnRecord


def turn(prompt: list[int], output: list[int], *, mask: list[int] | None = None, **extra) -> TurnRecord:
    """A turn whose sampler log-probabilities are -output_id / 1000, so each is recognisable."""
    return TurnRecord(prompt, output, [-token / 1000 for token in output], mask, **extra)


def test_a_single_turn_is_one_sample_with_its_output_trained():
    (sample,) = reconcile([turn([10, 11, 12], [101, 102])], rollout_id="r0")
    assert sample.input_ids == [10, 11, 12, 101, 102]
    assert sample.loss_mask == [0, 0, 0, 1, 1]
    assert sample.old_log_probs == [0.0, 0.0, 0.0, -0.101, -0.102]
    assert sample.rollout_id == "r0"


def test_a_clean_chain_appends_every_turn_to_one_sample():
    turns = [
        turn([10, 11], [101, 102]),
        turn([10, 11, 101, 102, 50, 51], [201]),
        turn([10, 11, 101, 102, 50, 51, 201, 52], [301, 302]),
    ]
    result = reconcile_rollout(turns)
    (sample,) = result.sequences
    assert sample.input_ids == [10, 11, 101, 102, 50, 51, 201, 52, 301, 302]
    assert sample.loss_mask == [0, 0, 1, 1, 0, 0, 1, 0, 1, 1]
    assert sample.old_log_probs == [0.0, 0.0, -0.101, -0.102, 0.0, 0.0, -0.201, 0.0, -0.301, -0.302]
    assert result.drift_tokens == [0, 0]
    assert result.num_forks == 0


def test_one_fork_starts_a_new_sample_and_trains_each_output_once():
    # Turn 1 re-renders the first output (102 -> 99): its prompt does not extend what is held.
    turns = [
        turn([10, 11], [101, 102]),
        turn([10, 11, 101, 99, 50], [201, 202]),
    ]
    result = reconcile_rollout(turns)
    first, second = result.sequences
    assert first.input_ids == [10, 11, 101, 102]
    assert first.loss_mask == [0, 0, 1, 1]
    assert second.input_ids == [10, 11, 101, 99, 50, 201, 202]
    assert second.loss_mask == [0, 0, 0, 0, 0, 1, 1]  # 101 is context here: trained in the first sample
    # Held were 4 tokens; the common prefix is 3 (10, 11, 101), so one held token was re-rendered.
    assert result.drift_tokens == [1]


def test_several_forks_each_measure_their_own_drift():
    turns = [
        turn([10, 11], [101]),
        turn([10, 11, 101, 50], [201]),  # appended
        turn([10, 12, 101, 50, 201, 51], [301]),  # fork: diverges at position 1 of 5 held
        turn([10, 12, 101, 50, 201, 51, 301, 52], [401]),  # appended to the new sample
        turn([10, 12, 101, 50, 201], [501]),  # fork: shorter than held (9), shares 5
    ]
    result = reconcile_rollout(turns, rollout_id="abc")
    assert [s.input_ids for s in result.sequences] == [
        [10, 11, 101, 50, 201],
        [10, 12, 101, 50, 201, 51, 301, 52, 401],
        [10, 12, 101, 50, 201, 501],
    ]
    assert [s.loss_mask for s in result.sequences] == [
        [0, 0, 1, 0, 1],
        [0, 0, 0, 0, 0, 0, 1, 0, 1],
        [0, 0, 0, 0, 0, 1],
    ]
    assert result.drift_tokens == [0, 4, 0, 4]
    assert result.num_forks == 2
    assert {s.rollout_id for s in result.sequences} == {"abc"}


def test_every_output_token_is_trained_exactly_once_across_forks():
    turns = [
        turn([1], [101, 102]),
        turn([1, 7, 102], [201]),
        turn([1, 7, 102, 201, 8], [301, 302, 303]),
        turn([2], [401]),
    ]
    sequences = reconcile(turns)
    trained = [token for s in sequences for token, m in zip(s.input_ids, s.loss_mask, strict=True) if m]
    assert sorted(trained) == [101, 102, 201, 301, 302, 303, 401]


def test_output_mask_keeps_masked_tokens_as_context_without_log_probs():
    turns = [
        turn([10], [101, 102, 103], mask=[1, 0, 1]),
        TurnRecord([10, 101, 102, 103, 50], [201, 202], [], [0, 0]),  # nothing trained: no log-probs needed
    ]
    (sample,) = reconcile(turns)
    assert sample.input_ids == [10, 101, 102, 103, 50, 201, 202]
    assert sample.loss_mask == [0, 1, 0, 1, 0, 0, 0]
    assert sample.old_log_probs == [0.0, -0.101, 0.0, -0.103, 0.0, 0.0, 0.0]


def test_sampler_top_k_and_sampling_mask_are_kept_only_where_trained():
    top_k = [{101: -0.1, 7: -2.3}, {102: -0.2}]
    candidates = [[101, 7], [102, 8, 9]]
    turns = [
        TurnRecord(
            [10],
            [101, 102],
            [-0.1, -0.2],
            [1, 0],
            output_sampling_mask=candidates,
            output_sampler_logprobs=top_k,
        )
    ]
    (sample,) = reconcile(turns)
    assert sample.sampler_logprobs == [None, {101: -0.1, 7: -2.3}, None]
    assert sample.sampling_mask == [None, [101, 7], None]


def test_empty_outputs_produce_no_sample_of_their_own():
    turns = [
        turn([10, 11], []),
        turn([10, 11, 50], [201]),
    ]
    (sample,) = reconcile(turns)
    assert sample.input_ids == [10, 11, 50, 201]
    assert sample.loss_mask == [0, 0, 0, 1]


def test_a_forked_sample_with_nothing_trained_is_left_out():
    turns = [
        turn([10, 11], []),  # nothing generated
        turn([12], [201]),  # fork
    ]
    result = reconcile_rollout(turns)
    (sample,) = result.sequences
    assert sample.input_ids == [12, 201]
    assert result.drift_tokens == [2]


def test_no_turns_gives_no_sample():
    assert reconcile_rollout([]) == Reconciled([], [])


def test_missing_log_probs_for_trained_tokens_raise():
    with pytest.raises(ValueError, match="turn 1: output_log_probs has 0 entries for 2"):
        reconcile([turn([10], [101]), TurnRecord([10, 101], [201, 202])])


def test_per_token_lists_of_the_wrong_length_raise():
    with pytest.raises(ValueError, match="turn 0: output_mask has 1 entries for 2"):
        reconcile([turn([10], [101, 102], mask=[1])])
    with pytest.raises(ValueError, match="output_sampler_logprobs has 1 entries"):
        reconcile([turn([10], [101, 102], output_sampler_logprobs=[{101: -0.1}])])


def test_metrics_over_a_window():
    chain = reconcile_rollout([turn([1], [101]), turn([1, 101, 5], [201]), turn([1, 101, 5, 201, 6], [301])])
    forked = reconcile_rollout([turn([1, 2, 3], [101]), turn([1, 9, 3, 101, 5], [201])])
    metrics = reconcile_metrics([chain, forked])
    assert metrics["rollout/fork_frac"] == pytest.approx(1 / 3)  # 3 transitions, 1 fork
    assert metrics["rollout/drift_tokens_mean"] == pytest.approx(3 / 3)  # the fork re-rendered 3 of 4 held
    assert metrics["rollout/drift_tokens_max"] == 3
    assert metrics["rollout/samples_per_rollout"] == pytest.approx(3 / 2)


def test_metrics_without_transitions_are_nan_and_samples_can_be_below_one():
    metrics = reconcile_metrics([reconcile_rollout([turn([1], [])]), reconcile_rollout([turn([1], [101])])])
    assert math.isnan(metrics["rollout/fork_frac"])
    assert math.isnan(metrics["rollout/drift_tokens_max"])
    assert metrics["rollout/samples_per_rollout"] == 0.5
    assert math.isnan(reconcile_metrics([])["rollout/samples_per_rollout"])


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length((5, 6), [5, 6]) == 2
    assert common_prefix_length(list(range(1000)), [*range(777), -1]) == 777
