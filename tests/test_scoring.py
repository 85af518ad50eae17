"""Scoring a group with the reference's reward-function examples, summing sources, and advantages."""

from __future__ import annotations

import math
import re

import anyio
import numpy as np
import pytest

from harness.rollout.scoring import (
    RewardFunctionError,
    call_reward_funcs,
    group_advantages,
    is_degenerate,
    reward_func_name,
    sum_rewards,
)

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


def length_reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def format_reward(completions, **kwargs):
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    return [1.0 if re.match(pattern, c[0]["content"]) else 0.0 for c in completions]


def reference_reward(completions, ground_truth, **kwargs):
    found = [re.search(r"\\boxed\{(.*?)\}", c[0]["content"]) for c in completions]
    return [1.0 if m and m.group(1) == gt else 0.0 for m, gt in zip(found, ground_truth, strict=True)]


def math_only(prompts, completions, task, **kwargs):
    return [1.0 if t == "math" else None for t in task]


FIRST, SECOND = None, None  # events set per test: each function waits for the other


async def waits_for_second(completions, **kwargs):
    FIRST.set()
    await SECOND.wait()
    return [0.5] * len(completions)


async def waits_for_first(completions, **kwargs):
    SECOND.set()
    await FIRST.wait()
    return [0.25] * len(completions)


class CallableScorer:
    async def __call__(self, completions, **kwargs):
        return [2.0] * len(completions)


def message(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


async def test_reference_examples_score_as_documented():
    completions = [message("<think>x</think><answer>12</answer>"), message(r"so \boxed{6}.")]
    rewards = await call_reward_funcs(
        [length_reward, format_reward, reference_reward, math_only],
        prompts=[[{"role": "user", "content": "q"}]] * 2,
        completions=completions,
        completion_ids=[[6303, 13], [304, 279, 12884, 13]],
        columns={"ground_truth": ["2", "6"], "task": ["math", "code"]},
    )
    assert rewards[0].tolist() == [2.0, 4.0]
    assert rewards[1].tolist() == [1.0, 0.0]
    assert rewards[2].tolist() == [0.0, 1.0]
    assert rewards[3][0] == 1.0 and math.isnan(rewards[3][1])  # None: not scored by this function


async def test_reward_functions_run_concurrently():
    global FIRST, SECOND
    FIRST, SECOND = anyio.Event(), anyio.Event()
    with anyio.fail_after(5):  # only finishes if both wait at the same time
        rewards = await call_reward_funcs(
            [waits_for_second, waits_for_first, CallableScorer(), length_reward],
            [None],
            [message("a")],
            [[1]],
            {},
        )
    assert rewards[:, 0].tolist() == [0.5, 0.25, 2.0, 1.0]


async def test_a_broken_reward_function_is_named():
    def broken(completions, **kwargs):
        raise KeyError("ground_truth")

    def short(completions, **kwargs):
        return [1.0]

    for func, needle in [
        (broken, "'broken' raised KeyError"),
        (short, "'short' returned 1 values for a group of 2"),
    ]:
        with pytest.raises(RewardFunctionError, match=needle):
            await call_reward_funcs([func], [None] * 2, [message("a")] * 2, [[1]] * 2, {})


def test_sources_sum_and_unscored_stay_nan():
    rewards_F_G = np.array([[1.0, np.nan, np.nan], [0.5, 0.5, np.nan]])
    total = sum_rewards(rewards_F_G, env_rewards_G=[1.0, None, None], rollout_rewards_G=[None, 2.0, None])
    assert total[:2].tolist() == [2.5, 2.5] and math.isnan(total[2])


def test_advantages_standardise_scored_rollouts_and_zero_the_rest():
    advantages = group_advantages(np.array([1.0, 0.0, np.nan, 1.0, 0.0]))
    assert advantages[2] == 0.0
    scored = np.array([1.0, 0.0, 1.0, 0.0])
    expected = (scored - 0.5) / (scored.std(ddof=1) + 1e-4)
    assert np.allclose(advantages[[0, 1, 3, 4]], expected)
    assert group_advantages(np.array([1.0, np.nan])).tolist() == [0.0, 0.0]


def test_degenerate_groups():
    assert is_degenerate(np.array([1.0, 1.0, 1.0]))
    assert is_degenerate(np.array([0.3, np.nan, np.nan]))
    assert is_degenerate(np.array([np.nan, np.nan]))
    assert not is_degenerate(np.array([0.0, 1.0, np.nan]))


def test_reward_names_follow_functions_partials_and_classes():
    import functools

    assert reward_func_name(length_reward) == "length_reward"
    assert reward_func_name(functools.partial(reference_reward, ground_truth=["1"])) == "reference_reward"
    assert reward_func_name(CallableScorer()) == "CallableScorer"
