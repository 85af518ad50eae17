"""A training step is filled from the kept groups, and the worker's allowance is counted in packed tokens.

The trainer's real `_plan_step` runs against a scripted worker (a test double of `RolloutWorker`'s queue and
flags; the real worker's side of the protocol is tested in test_rollout_loop.py): it pulls groups until the
step's rows overflow, trains on less only when nothing more can come (the allowance holds the worker with
nothing in flight, or the worker finished), and counts what a step consumed as the worker counts what it
produced: tokens as packed, a group's prompt once.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from harness.packing import packed_token_count
from harness.types import GroupResult, TrainingSample, TrainingSequence

PROMPT, COMPLETION, GROUP = 20, 10, 4  # a group: 4 completions of one 20-token prompt -> 60 packed tokens
SYSTEM = 10  # the prompts' first 10 tokens are the same system prompt: a row holds it once
BUDGET = 170  # three groups fill a row (10 + 3 x 50 = 160 tokens); a sample of a fourth (+20) overflows it
ROW_OF_THREE = SYSTEM + 3 * (PROMPT - SYSTEM + GROUP * COMPLETION)


def group(index: int) -> GroupResult:
    prompt = [7] * SYSTEM + [100 + index] * (PROMPT - SYSTEM)
    samples = []
    for k in range(GROUP):
        ids = prompt + [500 + 10 * index + k] * COMPLETION
        sequence = TrainingSequence(
            ids, [0] * PROMPT + [1] * COMPLETION, [0.0] * len(ids), [None] * len(ids), [None] * len(ids)
        )
        samples.append(TrainingSample(sequence, 1.0 if k % 2 else -1.0, group_id=index))
    return GroupResult(
        position=index, row_index=index, samples=samples, num_tokens=packed_token_count(samples)
    )


class ScriptedWorker:
    """Hands out `groups` one per `get`; `held` says whether the allowance holds it once they run out."""

    def __init__(self, groups: list[GroupResult], *, held_when_empty: bool = False, finish: bool = False):
        self.groups = list(groups)
        self.held_when_empty = held_when_empty
        self.finish = finish
        self.finished = False
        self.gets = 0
        self.allowances: list[int] = []

    @property
    def held(self) -> bool:
        return self.held_when_empty and not self.groups

    def get(self, timeout_s: float) -> GroupResult | None:
        self.gets += 1
        if self.groups:
            return self.groups.pop(0)
        self.finished = self.finish
        if not (self.held_when_empty or self.finish):
            raise AssertionError("the trainer waited for a group that will never come")
        return None

    def set_token_allowance(self, tokens: int) -> None:
        self.allowances.append(tokens)


def trainer_with(worker: ScriptedWorker, tmp_path, **overrides: Any) -> Any:
    from harness import AsyncGRPOConfig, AsyncGRPOTrainer
    from harness.testing import build_tiny_qwen3, build_tiny_tokenizer

    settings: dict[str, Any] = dict(
        output_dir=str(tmp_path),
        max_steps=10,
        max_staleness=2,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    settings.update(overrides)
    torch.manual_seed(0)
    trainer = AsyncGRPOTrainer(
        build_tiny_qwen3(),
        reward_funcs=[lambda completions, **kwargs: [0.0] * len(completions)],
        args=AsyncGRPOConfig(**settings),
        train_dataset=[{"prompt": [{"role": "user", "content": "hi"}]}] * 64,
        processing_class=build_tiny_tokenizer(),
    )
    trainer._setup_run(None)
    trainer._token_budget = BUDGET
    trainer.worker = worker
    return trainer


def stepped_groups(plan_rows: dict[str, Any]) -> list[set[int]]:
    """Per micro-batch, the groups it trains."""
    return [{s.group_id for row in mb for s in row} for mb in plan_rows["micro_batches"]]


def test_a_step_waits_until_its_rows_overflow_and_keeps_the_rest(tmp_path):
    worker = ScriptedWorker([group(i) for i in range(10)])
    trainer = trainer_with(worker, tmp_path)
    plan_rows = trainer._plan_step()
    assert stepped_groups(plan_rows) == [{0, 1, 2}]  # the row is full; the fourth group did not fit
    assert worker.gets == 4 and len(worker.groups) == 6  # pulled only until the overflow
    assert {s.group_id for s in trainer.pending} == {3}  # kept for the next step, not dropped
    assert plan_rows["forwarded_tokens"] == ROW_OF_THREE

    second = trainer._plan_step()
    assert stepped_groups(second) == [{3, 4, 5}]


def test_gradient_accumulation_fills_every_micro_batch(tmp_path):
    worker = ScriptedWorker([group(i) for i in range(10)])
    trainer = trainer_with(worker, tmp_path, gradient_accumulation_steps=2)
    assert stepped_groups(trainer._plan_step()) == [{0, 1, 2}, {3, 4, 5}]


@pytest.mark.parametrize("ending", ["held", "finished"])
def test_a_step_trains_on_less_only_when_nothing_more_can_come(tmp_path, ending):
    worker = ScriptedWorker([group(0)], held_when_empty=ending == "held", finish=ending == "finished")
    trainer = trainer_with(worker, tmp_path)
    assert stepped_groups(trainer._plan_step()) == [{0}]
    assert trainer.pending == []


def test_too_few_samples_for_every_process_raise_the_allowance_instead_of_waiting(tmp_path, monkeypatch):
    """Two processes need two rows. One pending sample with the worker held would wait forever: the trainer
    raises the allowance past what is queued, the worker sends more, and the step trains on both groups."""
    from harness import AsyncGRPOConfig

    lone = group(0)
    lone.samples = lone.samples[:1]
    lone.num_tokens = packed_token_count(lone.samples)

    class HeldUntilRaised(ScriptedWorker):
        """Sends its first group, then holds until the allowance is raised, then sends the rest."""

        @property
        def held(self) -> bool:
            return self.gets >= 1 and not self.allowances

        def get(self, timeout_s: float) -> GroupResult | None:
            if self.held:
                self.gets += 1
                assert self.gets < 50, "the trainer kept waiting for a worker its allowance holds"
                return None
            return super().get(timeout_s)

    worker = HeldUntilRaised([lone, group(1)], finish=True)
    trainer = trainer_with(worker, tmp_path)
    monkeypatch.setattr(AsyncGRPOConfig, "world_size", property(lambda self: 2))  # rows planned for two
    before = trainer._token_allowance()
    plan_rows = trainer._plan_step()
    assert worker.allowances == [before + lone.num_tokens]  # raised past the queued sample, once
    (micro_batch,) = plan_rows["micro_batches"]
    assert len(micro_batch) == 2 and all(micro_batch)  # a row for each process
    assert {s.group_id for row in micro_batch for s in row} == {0, 1}


def test_the_allowance_counts_tokens_as_the_worker_does(tmp_path):
    """The worker counts each group's tokens packed alone (GroupResult.num_tokens); the trainer gives back
    exactly that when it trains or drops the group's samples, whatever the rows shared across groups, so
    what the worker sees queued (produced minus consumed) never drifts."""
    worker = ScriptedWorker([group(i) for i in range(10)])
    trainer = trainer_with(worker, tmp_path, max_staleness=2)
    assert trainer._token_allowance() == 2 * BUDGET  # before the first step: max_staleness steps of full rows
    plan_rows = trainer._plan_step()
    produced = sum(group(i).num_tokens for i in range(3))
    assert group(0).num_tokens == PROMPT + GROUP * COMPLETION
    assert plan_rows["forwarded_tokens"] == ROW_OF_THREE < produced  # the system prompt is forwarded once
    assert trainer.counters.tokens_consumed == pytest.approx(produced)
    trainer._raise_allowance()
    assert worker.allowances[-1] == produced + 2 * produced


def test_raising_the_allowance_clears_the_held_flag_until_the_worker_sets_it_again():
    from harness.rollout.loop import AsyncRolloutLoop
    from harness.rollout.worker import RolloutWorker

    worker = RolloutWorker(AsyncRolloutLoop, {}, initial_token_allowance=100)
    worker.channels.held_event.set()  # what the worker does while the allowance holds it
    worker.set_token_allowance(100)
    assert worker.held  # not raised: still held
    worker.set_token_allowance(300)
    assert not worker.held  # a step's trainer must not read the old allowance's flag and train on less


def test_stale_samples_free_their_allowance_at_once(tmp_path):
    stale = group(0)
    for sample in stale.samples:
        sample.model_version = 0
    worker = ScriptedWorker([stale, group(1)], held_when_empty=True)
    trainer = trainer_with(worker, tmp_path, max_staleness=1)
    trainer.counters.model_version = 3
    for sample in worker.groups[1].samples:
        sample.model_version = 3
    plan_rows = trainer._plan_step()
    assert stepped_groups(plan_rows) == [{1}]
    assert trainer.window.summary()["sample/dropped_stale_count"] == GROUP
    # raised as soon as the stale group was dropped, before any step: its packed tokens count as consumed
    assert worker.allowances[0] == stale.num_tokens + 1 * BUDGET
    assert trainer.counters.tokens_consumed == pytest.approx(stale.num_tokens + group(1).num_tokens)


def test_leftovers_that_an_update_made_too_old_are_dropped_before_the_next_step(tmp_path):
    """A sample fresh when pulled but left over for a later step is checked again then: with
    max_staleness=0 (sync) a step trains only the current policy's samples."""
    worker = ScriptedWorker([group(i) for i in range(8)], held_when_empty=True)
    trainer = trainer_with(worker, tmp_path, max_staleness=0)
    assert stepped_groups(trainer._plan_step()) == [{0, 1, 2}]
    (leftover,) = {s.group_id for s in trainer.pending}
    trainer.counters.model_version = 1  # the step's update; the groups still queued are newer
    for remaining in worker.groups:
        for sample in remaining.samples:
            sample.model_version = 1
    consumed = trainer.counters.tokens_consumed
    second = trainer._plan_step()
    assert leftover not in set().union(*stepped_groups(second))
    assert all(s.model_version == 1 for mb in second["micro_batches"] for row in mb for s in row)
    assert trainer.window.summary()["sample/dropped_stale_count"] == GROUP
    # the dropped group's share is given back: it counts as consumed, as a trained one would
    assert trainer.counters.tokens_consumed >= consumed + group(leftover).num_tokens - 1e-6
