"""The metrics of a scored group and of its rollouts, recorded into a logging window.

Pure bookkeeping, kept out of the rollout loop so the loop reads as a loop. Names and meanings are the
reference's (reward, reward_kept, reward_dropped, frac_reward_zero_std, rewards/{name}/mean and
group_std, reward_group_std, completions/*, tools/call_frequency, tools/loop_exhausted_frac), plus ours
for failures: rollout/failed_count and rollout/failed/{type}_count, and env/{name}/... per environment in
runs with several environments.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from harness.metrics import MetricsWindow
from harness.types import Rollout


def record_group(
    window: MetricsWindow,
    *,
    rollouts: Sequence[Rollout],
    source_names: Sequence[str],
    rewards_S_G: np.ndarray,
    total_G: np.ndarray,
    dropped: bool,
    num_samples: int,
    eos_token_ids: set[int],
    has_tools: bool,
    per_environment: bool,
) -> None:
    """Record one scored group: its rewards, its completions, its tool use, its failures."""
    scored_G = ~np.isnan(total_G)
    for value in total_G[scored_G]:
        window.add("reward", value)
        window.add("reward_dropped" if dropped else "reward_kept", value)
    window.add("frac_reward_zero_std", float(dropped))
    for name, rewards_G in zip(source_names, rewards_S_G, strict=True):
        for value in rewards_G[~np.isnan(rewards_G)]:
            window.add(f"rewards/{name}/mean", value)
        if not dropped and num_samples:
            window.add(f"rewards/{name}/group_std", _std(rewards_G), weight=num_samples)
    if not dropped and num_samples:
        window.add("reward_group_std", _std(total_G), weight=num_samples)

    seen: set[tuple[tuple[int, ...], ...]] = set()
    for index, rollout in enumerate(rollouts):
        record_rollout(window, rollout, eos_token_ids, has_tools)
        outputs = tuple(tuple(turn.output_ids) for turn in rollout.turns)
        window.add("completions/duplicate_frac", float(outputs in seen))
        seen.add(outputs)
        if per_environment and rollout.environment:
            _record_environment(window, rollout, total_G[index])


def record_rollout(window: MetricsWindow, rollout: Rollout, eos_token_ids: set[int], has_tools: bool) -> None:
    """Lengths (generated tokens only, tool results excluded), clipping, turns, tools, failures."""
    length = len(rollout.completion_ids)
    window.add("completions/mean_length", length)
    window.add("completions/min_length", length)
    window.add("completions/max_length", length)
    last_output = rollout.turns[-1].output_ids if rollout.turns else []
    terminated = bool(last_output) and last_output[-1] in eos_token_ids
    window.add("completions/clipped_ratio", float(not terminated))
    if terminated:
        window.add("completions/mean_terminated_length", length)
        window.add("completions/min_terminated_length", length)
        window.add("completions/max_terminated_length", length)
    window.add("rollout/turns_mean", len(rollout.turns))
    window.add("rollout/turns_max", len(rollout.turns))
    if has_tools:
        window.add("tools/call_frequency", rollout.tool_call_count)
        window.add("tools/loop_exhausted_frac", float(rollout.stop_reason == "max_tool_calling_iterations"))
    window.add("rollout/failed_count", int(rollout.failed))
    if rollout.failed:
        window.add(f"rollout/failed/{rollout.error_type}_count", 1)


def _record_environment(window: MetricsWindow, rollout: Rollout, reward: float) -> None:
    prefix = f"env/{rollout.environment}"
    if not math.isnan(reward):
        window.add(f"{prefix}/reward", reward)
    window.add(f"{prefix}/completion_length", len(rollout.completion_ids))
    window.add(f"{prefix}/tool_call_count", rollout.tool_call_count)
    window.add(f"{prefix}/tool_failure_count", rollout.tool_failure_count)
    window.add(f"{prefix}/failed_count", int(rollout.failed))


def _std(values_G: np.ndarray) -> float:
    scored = values_G[~np.isnan(values_G)]
    return float(scored.std(ddof=1)) if scored.size >= 2 else 0.0
