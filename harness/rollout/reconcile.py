"""Reconciliation: a rollout's turns -> the training sequences the loss is computed on.

Each turn of a multi-turn rollout is one sampling request (`TurnRecord`): the prompt it sent, every earlier
turn included, and the tokens it generated. Walking the turns in order, the tokens held so far are the
current sample's tokens. A turn whose prompt starts with them extends the sample: the rest of its prompt
(tool results, the next generation prompt) is appended as context, then its output. A turn whose prompt
does not (the chat template rendered the history differently from what was held) is a fork: the sample
is closed and a new one starts from that turn's prompt. Every generated token is therefore trained in
exactly one sample, and a fork costs forward tokens but no training signal.

    turn 0: prompt P0, output O0            sample A = P0 O0
    turn 1: prompt P0 O0 T1, output O1      sample A = P0 O0 T1 O1          (appended)
    turn 2: prompt P0 O0' T1 O1 T2, out O2  sample B = P0 O0' T1 O1 T2 O2   (forked: O0' != O0)

A sample in which nothing is trained (every output masked out or empty) is left out.

The rollout loop calls `reconcile_rollout()` once per finished rollout (its `.sequences` go to the group,
the whole result to the window) and `reconcile_metrics()` once per logging window; `reconcile()` is the
same walk returning the sequences only. All three are pure functions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from harness.types import TrainingSequence, TurnRecord


@dataclass(frozen=True)
class Reconciled:
    """A rollout's training sequences and how its turns were joined.

    Attributes:
        sequences: The samples, in turn order; only those with at least one trained token.
        drift_tokens: One entry per turn transition (turns - 1 entries): 0 when the turn was appended,
            else how many held tokens the fork re-rendered (held tokens past the longest common prefix).
    """

    sequences: list[TrainingSequence]
    drift_tokens: list[int] = field(default_factory=list)

    @property
    def num_forks(self) -> int:
        return sum(1 for drift in self.drift_tokens if drift > 0)


def reconcile(turns: Sequence[TurnRecord], *, rollout_id: str = "") -> list[TrainingSequence]:
    """The training sequences of one rollout, built from its turns (see `reconcile_rollout`)."""
    return reconcile_rollout(turns, rollout_id=rollout_id).sequences


def reconcile_rollout(turns: Sequence[TurnRecord], *, rollout_id: str = "") -> Reconciled:
    """Build the training sequences of one rollout from its turns, with the drift of each transition.

    Raises:
        ValueError: A turn's per-token lists do not match its output length, or a trained token has no
            sampler log-probability.
    """
    sequences: list[TrainingSequence] = []
    drift_tokens: list[int] = []
    sample: _Sample | None = None
    for index, turn in enumerate(turns):
        _check_turn(index, turn)
        if sample is None:
            sample = _Sample.starting_with(turn.prompt_ids)
        elif _starts_with(turn.prompt_ids, sample.input_ids):
            sample.add_context(turn.prompt_ids[len(sample.input_ids) :])
            drift_tokens.append(0)
        else:
            # A fork: at least one held token is re-rendered, even when the new prompt is only shorter.
            drift_tokens.append(
                len(sample.input_ids) - common_prefix_length(sample.input_ids, turn.prompt_ids)
            )
            sequences.append(sample.finish(rollout_id))
            sample = _Sample.starting_with(turn.prompt_ids)
        sample.add_output(turn)
    if sample is not None:
        sequences.append(sample.finish(rollout_id))
    return Reconciled([sequence for sequence in sequences if sequence.num_trained > 0], drift_tokens)


def reconcile_metrics(rollouts: Sequence[Reconciled]) -> dict[str, float]:
    """The window's reconciliation metrics, under the spec's names.

    rollout/fork_frac            forked transitions / transitions (NaN with no transition)
    rollout/drift_tokens_mean    drift tokens per transition, 0 for an appended one (NaN likewise)
    rollout/drift_tokens_max     the largest drift of one transition (NaN likewise)
    rollout/samples_per_rollout  samples / rollouts (NaN with no rollout)
    """
    drifts = [drift for rollout in rollouts for drift in rollout.drift_tokens]
    num_samples = sum(len(rollout.sequences) for rollout in rollouts)
    return {
        "rollout/fork_frac": sum(d > 0 for d in drifts) / len(drifts) if drifts else math.nan,
        "rollout/drift_tokens_mean": sum(drifts) / len(drifts) if drifts else math.nan,
        "rollout/drift_tokens_max": float(max(drifts)) if drifts else math.nan,
        "rollout/samples_per_rollout": num_samples / len(rollouts) if rollouts else math.nan,
    }


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two id sequences share."""
    a, b = _as_list(a), _as_list(b)
    low, high = 0, min(len(a), len(b))
    # Binary search on slice equality: O(n log n) in C rather than an O(n) loop in Python.
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


# --- internals ----------------------------------------------------------------------------------------


@dataclass
class _Sample:
    """A training sequence under construction: per-position lists grown together."""

    input_ids: list[int]
    loss_mask: list[int]
    old_log_probs: list[float]
    sampler_logprobs: list[dict[int, float] | None]
    sampling_mask: list[list[int] | None]

    @classmethod
    def starting_with(cls, prompt_ids: Sequence[int]) -> _Sample:
        sample = cls([], [], [], [], [])
        sample.add_context(prompt_ids)
        return sample

    def add_context(self, ids: Sequence[int]) -> None:
        self.input_ids.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.old_log_probs.extend([0.0] * len(ids))
        self.sampler_logprobs.extend([None] * len(ids))
        self.sampling_mask.extend([None] * len(ids))

    def add_output(self, turn: TurnRecord) -> None:
        for position, token in enumerate(turn.output_ids):
            trained = turn.output_mask is None or bool(turn.output_mask[position])
            self.input_ids.append(token)
            self.loss_mask.append(int(trained))
            self.old_log_probs.append(turn.output_log_probs[position] if trained else 0.0)
            self.sampler_logprobs.append(
                turn.output_sampler_logprobs[position]
                if trained and turn.output_sampler_logprobs is not None
                else None
            )
            self.sampling_mask.append(
                turn.output_sampling_mask[position]
                if trained and turn.output_sampling_mask is not None
                else None
            )

    def finish(self, rollout_id: str) -> TrainingSequence:
        return TrainingSequence(
            input_ids=self.input_ids,
            loss_mask=self.loss_mask,
            old_log_probs=self.old_log_probs,
            sampler_logprobs=self.sampler_logprobs,
            sampling_mask=self.sampling_mask,
            rollout_id=rollout_id,
        )


def _check_turn(index: int, turn: TurnRecord) -> None:
    num_outputs = len(turn.output_ids)
    per_token = {
        "output_mask": turn.output_mask,
        "output_sampling_mask": turn.output_sampling_mask,
        "output_sampler_logprobs": turn.output_sampler_logprobs,
    }
    for name, values in per_token.items():
        if values is not None and len(values) != num_outputs:
            raise ValueError(f"turn {index}: {name} has {len(values)} entries for {num_outputs} outputs")
    num_trained = num_outputs if turn.output_mask is None else sum(1 for m in turn.output_mask if m)
    if num_trained and len(turn.output_log_probs) != num_outputs:
        raise ValueError(
            f"turn {index}: output_log_probs has {len(turn.output_log_probs)} entries for {num_outputs} "
            "output tokens; the sampler's log-probabilities are required where tokens are trained"
        )


def _starts_with(ids: Sequence[int], prefix: Sequence[int]) -> bool:
    # A slice compared in C: far cheaper than a Python loop over long prompts.
    return len(ids) >= len(prefix) and list(ids[: len(prefix)]) == _as_list(prefix)


def _as_list(ids: Sequence[int]) -> list[int]:
    return ids if isinstance(ids, list) else list(ids)
