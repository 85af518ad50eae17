"""The records that flow from generation to training.

    TurnRecord        one sampling request: the prompt sent and the tokens that came back (spec name)
    TrainingSequence  one sample's tokens as reconciliation builds them from a rollout's turns
    TrainingSample    a TrainingSequence with its advantage and provenance, what the trainer packs

A multi-turn rollout is a list of TurnRecords; reconciliation (`harness/reconcile.py`) turns them into one
or more TrainingSequences (more when a turn's prompt does not extend the tokens held so far); scoring
attaches the rollout's advantage to each, giving TrainingSamples; the packer (`harness/packing.py`) lays
those out in prefix-trie rows. Every list here is indexed by token position, so the shapes can be read
off the names.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
            top-k / top-p truncation. None means the full vocabulary.
        output_sampler_logprobs: One dict per output token: the sampler's log-probabilities of its most
            likely tokens, keyed by token id (score centering's num_sampler_logprobs).
    """

    prompt_ids: list[int]
    output_ids: list[int]
    output_log_probs: list[float] = field(default_factory=list)
    output_mask: list[int] | None = None
    output_sampling_mask: list[list[int]] | None = None
    output_sampler_logprobs: list[dict[int, float]] | None = None


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
    """

    sequence: TrainingSequence
    advantage: float
    group_id: int
    model_version: int = 0
    queued_at: float = 0.0
