"""The records that flow from generation to training.

    TurnRecord        one sampling request: the prompt sent and the tokens that came back (spec name)
    TrainingSequence  one sample's tokens as reconciliation builds them from a rollout's turns
    TrainingSample    a TrainingSequence with its advantage and provenance, what the trainer packs
    Rollout           one finished rollout: its messages, turns, tool counts, status (spec name)
    RolloutGroup      the num_generations rollouts of one prompt, scored together (spec name)
    GroupResult       what the worker sends the trainer per prompt: samples, or none when dropped

A multi-turn rollout is a list of TurnRecords; reconciliation (`harness/rollout/reconcile.py`) turns them into
one or more TrainingSequences (more when a turn's prompt does not extend the tokens held so far); scoring
attaches the rollout's advantage to each, giving TrainingSamples; the packer (`harness/packing.py`) lays
those out in prefix-trie rows. Every list here is indexed by token position, so the shapes can be read
off the names.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np


@dataclass
class TurnRecord:
    """One sampling request: the prompt sent to the sampler and the tokens it generated.

    Attributes:
        prompt_ids: Token ids of the full prompt of this turn, every earlier turn included.
        output_ids: Token ids the sampler generated.
        output_log_probs: Sampler log-probability of each token of output_ids. Required when any of them
            is trained on.
        output_mask: One value per output token: 1 to train on it, 0 to keep it as context only. None
            trains every output token.
        output_sampling_mask: One list per output token: the token ids the sampler could draw from under
            top-k / top-p truncation (None for a token whose set is unknown). None means the full vocabulary.
        output_sampler_logprobs: One dict per output token: the sampler's log-probabilities of its most
            likely tokens, keyed by token id (score centering's num_sampler_logprobs).
        finish_reason: Beyond the reference: why the sampler stopped ("stop", "length",
            "prompt_too_long"), when known.
    """

    prompt_ids: list[int]
    output_ids: list[int]
    output_log_probs: list[float] = field(default_factory=list)
    output_mask: list[int] | None = None
    output_sampling_mask: list[list[int] | None] | None = None
    output_sampler_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None


@dataclass
class TrainingSequence:
    """The tokens of one training sample, built from a rollout's turns.

    All lists have one entry per position of `input_ids`. At a trained position t, `input_ids[t]` is the
    target: the model predicts it from positions < t.

    Attributes:
        input_ids: Prompt, generated and tool-result tokens, in order.
        loss_mask: 1 where the token is trained (a generated token the sampler produced), else 0.
        old_log_probs: The sampler's log-probability of the token where trained, else 0.0.
        sampler_logprobs: Where trained and known, the sampler's top-k log-probabilities at that
            position ({token id: log-prob}); else None.
        sampling_mask: Where trained and known, the candidate set the sampler drew from; else None
            (the full vocabulary).
        rollout_id: The rollout this sample comes from.
    """

    input_ids: list[int]
    loss_mask: list[int]
    old_log_probs: list[float]
    sampler_logprobs: list[dict[int, float] | None]
    sampling_mask: list[list[int] | None]
    rollout_id: str = ""

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        lengths = {
            "loss_mask": len(self.loss_mask),
            "old_log_probs": len(self.old_log_probs),
            "sampler_logprobs": len(self.sampler_logprobs),
            "sampling_mask": len(self.sampling_mask),
        }
        wrong = {name: length for name, length in lengths.items() if length != n}
        if wrong:
            raise ValueError(f"TrainingSequence of {n} tokens has per-position lists of lengths {wrong}")

    @property
    def num_trained(self) -> int:
        return sum(self.loss_mask)


@dataclass
class TrainingSample:
    """A training sequence with what the loss and the pipeline need to know about it.

    Attributes:
        sequence: The tokens and their per-position sampler data.
        advantage: The rollout's advantage, shared by every trained token of the sample.
        group_id: The group (prompt) the rollout belongs to; samples of a group share a prompt prefix.
        model_version: Policy version that generated the rollout (for staleness).
        queued_at: time.monotonic() when the sample entered the rollout queue.
        token_share: Its share of its group's `GroupResult.num_tokens` (set by the trainer when it takes
            the group): what training or dropping it gives back to the worker's token allowance.
        position: Its prompt's position in the worker's stream (set by the trainer when it takes the group):
            a prompt is done, for resuming, once all its samples are trained or dropped.
    """

    sequence: TrainingSequence
    advantage: float
    group_id: int
    model_version: int = 0
    queued_at: float = 0.0
    token_share: float = 0.0
    position: int = -1


RolloutStatus = Literal["ok", "failed"]


@dataclass
class Rollout:
    """One finished rollout, as `AsyncRolloutLoop.generate_one` returns it (the reference's fields first).

    Attributes:
        completion: Messages generated after the prompt; passed to reward functions as `completions`.
        completion_ids: Token ids of the completion (generated tokens, every turn); `completion_ids`.
        turns: The sampling requests that produced it, in order; training sequences are built from them.
        tool_call_count: Tool calls made during the rollout.
        tool_failure_count: Those that failed.
        reward: A reward set while generating (e.g. an external grader); summed with the others. None
            when this source does not score the rollout.
        rollout_id: Identifies the rollout in its training rows.
        status: "ok", or "failed" when infrastructure failed it (a sandbox that died, a server error after
            retries, an exception in environment code): such a rollout is kept out of the group's
            statistics and out of training unless the config scores failures.
        error_type: The failure's exception type, e.g. "SandboxDied" (None when ok).
        error: The failure's message.
        environment: Name of the environment the rollout ran in (None without environments).
        stop_reason: Why generation stopped: "stop" (no tool call), "max_tool_calling_iterations",
            "max_model_len", "length" (cut by max_completion_length), "episode_timeout", "failed".
    """

    completion: list[dict[str, Any]]
    completion_ids: list[int]
    turns: list[TurnRecord]
    tool_call_count: int = 0
    tool_failure_count: int = 0
    reward: float | None = None
    rollout_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    status: RolloutStatus = "ok"
    error_type: str | None = None
    error: str | None = None
    environment: str | None = None
    stop_reason: str = "stop"

    @property
    def failed(self) -> bool:
        return self.status == "failed"


@dataclass
class RolloutGroup:
    """The num_generations rollouts of one prompt, scored together; each list has one entry per rollout."""

    prompts: list[list[dict[str, Any]]]
    reward_kwargs: dict[str, list[Any]]
    completions: list[list[dict[str, Any]]]
    completions_ids: list[list[int]]
    completions_sequences: list[list[TrainingSequence]]
    tool_call_counts: list[int]
    tool_failure_counts: list[int]
    model_version: int
    group_id: int
    row_index: int
    env_rewards: list[tuple[type, float] | None]
    rollout_rewards: list[float | None]
    queued_at: float = 0.0
    rewards: np.ndarray | None = None
    rollouts: list[Rollout] = field(default_factory=list)  # beyond the reference: the full records


@dataclass
class GroupResult:
    """What the rollout worker sends the trainer for one prompt: its samples (none when the group was
    dropped or the prompt filtered out), so the trainer can count epochs and the resume position.

    Attributes:
        position: The prompt's position in the worker's stream of prompts (epoch * len(dataset) + index).
        row_index: The prompt's row in the dataset.
        samples: The group's training samples; empty when nothing of it is trained on.
        num_tokens: Tokens of the samples packed together, a shared prefix counted once
            (`harness.packing.packed_token_count`): what the group adds to the rows it is trained in.
        records: Beyond the reference: the group's rollouts as readable records
            (`harness.rollout.records`) when the config asks for them (log_completions, save_rollouts).
    """

    position: int
    row_index: int
    samples: list[TrainingSample]
    num_tokens: int = 0
    records: list[dict[str, Any]] = field(default_factory=list)
