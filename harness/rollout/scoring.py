"""Scoring a group: reward functions, environment rewards and rollout rewards, summed; advantages.

    rewards_F_G = await call_reward_funcs(reward_funcs, prompts, completions, completion_ids, columns)
    total_G = sum_rewards(rewards_F_G, env_rewards_G, rollout_rewards_G)     # NaN where nothing scored
    advantages_G = group_advantages(total_G)                                 # NaN rollouts get 0
    if is_degenerate(total_G): drop the group (it still counts toward the epoch)

Reward functions take `prompts`, `completions`, `completion_ids` and every other dataset column as
keyword arguments and return one float (or None: not scored by this function) per completion. Several
run concurrently: async ones are awaited together, sync ones run on worker threads, so their latencies
overlap. A function that raises, or returns the wrong number of values, raises `RewardFunctionError`
naming it; the rollout loop counts that and drops the group rather than stopping the run.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
import numpy as np

from tools.threads import DaemonThreadPool

RewardFunc = Callable[..., Any]
ADVANTAGE_EPS = 1e-4


class RewardFunctionError(RuntimeError):
    """A reward function raised or returned something unusable; the message names it and says what."""


def reward_func_name(func: RewardFunc) -> str:
    """The name a reward function's metrics are logged under (rewards/{name}/...)."""
    while isinstance(func, functools.partial):
        func = func.func
    if inspect.isfunction(func) or inspect.ismethod(func):
        return func.__name__
    return type(func).__name__


@functools.cache
def _default_threads() -> DaemonThreadPool:
    return DaemonThreadPool(64, name="reward")


async def call_reward_funcs(
    reward_funcs: Sequence[RewardFunc],
    prompts: list[Any],
    completions: list[Any],
    completion_ids: list[list[int]],
    columns: Mapping[str, list[Any]],
    *,
    threads: DaemonThreadPool | None = None,
) -> np.ndarray:
    """Every reward function on the group, concurrently; an (F, G) float array, NaN where one said None.
    Sync functions run on `threads` (the rollout loop's daemon threads), else on a pool of their own."""
    threads = threads or _default_threads()
    size = len(completions)
    rewards_F_G = np.full((len(reward_funcs), size), np.nan)
    kwargs = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **columns}

    failures: list[RewardFunctionError] = []

    async def run(index: int, func: RewardFunc) -> None:
        name = reward_func_name(func)
        try:
            if _is_async(func):
                values = await func(**kwargs)
            else:
                values = await threads.run(func, **kwargs)
            rewards_F_G[index] = _as_rewards(name, values, size)
        except RewardFunctionError as exc:
            failures.append(exc)
        except Exception as exc:  # collected, so one failing function does not cancel the others midway
            error = RewardFunctionError(f"reward function {name!r} raised {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            failures.append(error)

    async with anyio.create_task_group() as group:
        for index, func in enumerate(reward_funcs):
            group.start_soon(run, index, func)
    if failures:
        raise failures[0]
    return rewards_F_G


def sum_rewards(
    rewards_F_G: np.ndarray,
    env_rewards_G: Sequence[float | None] | None = None,
    rollout_rewards_G: Sequence[float | None] | None = None,
) -> np.ndarray:
    """Sum every source per rollout (weight 1 each), ignoring sources that did not score it; NaN when none
    did."""
    sources = [rewards_F_G]
    for extra in (env_rewards_G, rollout_rewards_G):
        if extra is not None:
            sources.append(np.array([[math.nan if v is None else float(v) for v in extra]]))
    stacked_S_G = np.concatenate(sources, axis=0) if sources else np.empty((0, 0))
    scored_G = ~np.isnan(stacked_S_G).all(axis=0)
    total_G = np.nansum(stacked_S_G, axis=0)
    total_G[~scored_G] = np.nan
    return total_G


def group_advantages(rewards_G: np.ndarray) -> np.ndarray:
    """Rewards standardised within the group: (r - mean) / (std + eps) over the scored rollouts (sample
    std), 0 for a rollout with a NaN reward; all zeros when fewer than two are scored."""
    scored_G = ~np.isnan(rewards_G)
    advantages_G = np.zeros_like(rewards_G, dtype=np.float64)
    if scored_G.sum() < 2:
        return advantages_G
    scored = rewards_G[scored_G]
    advantages_G[scored_G] = (scored - scored.mean()) / (scored.std(ddof=1) + ADVANTAGE_EPS)
    return advantages_G


def is_degenerate(rewards_G: np.ndarray) -> bool:
    """A group that teaches nothing: fewer than two scored rollouts, or all scored rewards equal."""
    scored = rewards_G[~np.isnan(rewards_G)]
    return scored.size < 2 or bool(np.all(scored == scored[0]))


def _as_rewards(name: str, values: Any, size: int) -> np.ndarray:
    try:
        values = list(values)
    except TypeError:
        raise RewardFunctionError(
            f"reward function {name!r} returned {type(values).__name__}; it must return a list of {size} "
            "floats (or None for completions it does not score)"
        ) from None
    if len(values) != size:
        raise RewardFunctionError(
            f"reward function {name!r} returned {len(values)} values for a group of {size} completions"
        )
    out = np.full(size, np.nan)
    for i, value in enumerate(values):
        if value is None:
            continue
        try:
            out[i] = float(value)
        except (TypeError, ValueError):
            raise RewardFunctionError(
                f"reward function {name!r} returned {value!r} at position {i}; a reward is a number or None"
            ) from None
    return out


def _is_async(func: RewardFunc) -> bool:
    while isinstance(func, functools.partial):
        func = func.func
    if inspect.iscoroutinefunction(func):
        return True
    return not inspect.isroutine(func) and inspect.iscoroutinefunction(type(func).__call__)
