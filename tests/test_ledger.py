"""The prompt ledger: a prompt is done once each of its samples is trained or dropped, so a checkpoint's
resume position never skips a prompt whose samples were pulled but not trained."""

from __future__ import annotations

from harness.training.checkpointing import RunCounters
from harness.training.ledger import PromptLedger
from harness.types import TrainingSample, TrainingSequence


def sample(position: int) -> TrainingSample:
    sequence = TrainingSequence([1, 2], [False, True], [0.0, -1.0], [None, None], [None, None])
    return TrainingSample(sequence, advantage=1.0, group_id=position, position=position)


def test_a_prompt_is_done_when_its_last_sample_is_settled_not_when_it_is_pulled():
    counters = RunCounters()
    ledger = PromptLedger(counters)
    first, second = sample(0), sample(0)
    ledger.opened(0, num_samples=2)
    assert (counters.trained_position, counters.prompts_done) == (0, 0)  # pulled, not trained
    ledger.settled(first, trained=True)
    ledger.snapshot()
    assert counters.retrained_positions == [0]  # half trained: a resume generates it again
    ledger.settled(second, trained=False)  # dropped (too long for a row): settled all the same
    assert (counters.trained_position, counters.prompts_done) == (1, 1)
    ledger.snapshot()
    assert counters.retrained_positions == []


def test_groups_settle_out_of_order_and_the_frontier_waits_for_the_gap():
    counters = RunCounters()
    ledger = PromptLedger(counters)
    ledger.opened(1, num_samples=0)  # a dropped group: done at once
    ledger.opened(2, num_samples=1)
    late = sample(2)
    ledger.settled(late, trained=True)
    ledger.snapshot()
    assert counters.trained_position == 0 and counters.done_positions == [1, 2]
    ledger.opened(0, num_samples=0)
    ledger.snapshot()
    assert counters.trained_position == 3 and counters.done_positions == [] and counters.prompts_done == 3


def test_a_resumed_ledger_knows_the_done_positions_past_its_frontier():
    counters = RunCounters(trained_position=4, done_positions=[6, 7], prompts_done=6)
    ledger = PromptLedger(counters)
    ledger.opened(5, num_samples=0)
    assert counters.trained_position == 4  # 4 is still open
    ledger.opened(4, num_samples=0)
    assert counters.trained_position == 8 and counters.prompts_done == 8


def test_the_counters_round_trip_through_rollout_state_json():
    counters = RunCounters(model_version=3, trained_position=5, done_positions=[7], retrained_positions=[6])
    restored, step = RunCounters.from_json(counters.to_json(global_step=9))
    assert (restored, step) == (counters, 9)
