"""Rollouts as records a person can read: one JSON-able dict per rollout of a scored group.

Who makes them: `AsyncRolloutLoop._score` calls `group_records` for the groups the config asks for
(`log_completions`, or every `save_rollouts_every`-th group under `save_rollouts`) and sends them with the
group's `GroupResult`; the trainer writes them to the run folder (`harness.training.rollout_log`), prints
them (`log_completions`) and `harness report` shows them.

A record holds the prompt and the completion as messages (each assistant turn with its tool calls, each
tool result, a parse error as the tool message that reported it), the reward of each source and their sum,
the advantage, whether the group was dropped (all rewards equal) or the rollout failed (its error type),
why it stopped, and how many training samples it became (more than one: its turns forked). NaN becomes
None, so every record is plain JSON.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from harness.types import RolloutGroup

__all__ = ["group_records", "jsonable"]


def jsonable(value: Any) -> Any:
    """`value` with NaN and infinities as None, numpy scalars as Python numbers, tuples as lists, and any
    other object as its string."""
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(item) for item in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, bool | int | str):
        return value
    return str(value)


def group_records(
    group: RolloutGroup,
    *,
    position: int,
    source_names: Sequence[str],
    rewards_S_G: np.ndarray,
    total_G: np.ndarray,
    advantages_G: np.ndarray,
    dropped: bool,
    trained: Sequence[bool],
) -> list[dict[str, Any]]:
    """One record per rollout of `group` (see the module docstring); `trained[i]` says whether rollout i's
    samples went to training."""
    records = []
    for index, rollout in enumerate(group.rollouts):
        sequences = group.completions_sequences[index] if index < len(group.completions_sequences) else []
        records.append(
            jsonable(
                {
                    "rollout_id": rollout.rollout_id,
                    "group_id": group.group_id,
                    "position": position,
                    "row_index": group.row_index,
                    "model_version": group.model_version,
                    "environment": rollout.environment,
                    "prompt": group.prompts[index],
                    "completion": rollout.completion,
                    "rewards": {name: float(rewards_S_G[s, index]) for s, name in enumerate(source_names)},
                    "reward": float(total_G[index]),
                    "advantage": float(advantages_G[index]),
                    "group_dropped": dropped,
                    "trained": bool(trained[index]),
                    "status": rollout.status,
                    "error_type": rollout.error_type,
                    "error": rollout.error,
                    "stop_reason": rollout.stop_reason,
                    "num_turns": len(rollout.turns),
                    "tool_call_count": rollout.tool_call_count,
                    "tool_failure_count": rollout.tool_failure_count,
                    "completion_tokens": len(rollout.completion_ids),
                    "samples": len(sequences or []),
                }
            )
        )
    return records
