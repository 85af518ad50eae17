"""The bundled environments, each driven through its real tools: reset, tool calls, reward."""

from __future__ import annotations

import pytest

from environments import environment_tools, load, validate_environment
from environments.arithmetic import make_problem
from environments.word_guess import WORDS, feedback
from tools import ToolCall, ToolExecutor, ToolStatus

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def play(env, calls: list[tuple[str, dict]]) -> list:
    """Run tool calls against a live environment, as the rollout loop does, one turn per call."""
    toolset = environment_tools(env, validate_environment(type(env)))
    with ToolExecutor(max_workers=2, timeout_s=10) as executor:
        return [await executor.run_one(ToolCall(name, arguments), toolset) for name, arguments in calls]


async def test_counter_reaches_its_target():
    env = load("counter")()
    prompt = env.reset(seed=3)
    target = env.target
    assert f"by {target}" in prompt and 1 <= target <= 6
    assert env.reset(seed=3) == prompt  # same seed, same task: a group shares it
    assert env.reset(target=4, prompt=[{"role": "user", "content": "..."}]) is None
    results = await play(env, [("increment", {"step": 3}), ("increment", {"step": "1"})])
    assert [r.content for r in results] == ["3", "4"]
    assert env.get_reward() == 1.0
    await play(env, [("increment", {"step": 1})])
    assert env.get_reward() == 0.0


async def test_arithmetic_rewards_the_exact_submitted_answer():
    env = load("arithmetic")()
    prompt = env.reset(seed=11)
    expression, answer = make_problem(11)
    assert expression in prompt and env.answer == answer
    assert env.get_reward() == 0.0  # nothing submitted
    results = await play(env, [("calculator", {"expression": expression}), ("submit", {"answer": "1"})])
    assert results[0].content == str(answer)
    assert env.get_reward() == 0.0
    await play(env, [("submit", {"answer": results[0].content})])
    assert env.get_reward() == 1.0 and env.calculator_calls == 1
    refused = await play(env, [("calculator", {"expression": "__import__('os')"})])
    assert refused[0].status is ToolStatus.ERROR and "not allowed" in refused[0].content


def test_arithmetic_dataset_seeds_distinct_problems():
    rows = load("arithmetic").dataset(50, seed=1)
    assert rows.column_names == ["seed"] and len(rows) == 50
    assert len({make_problem(seed)[0] for seed in rows["seed"]}) > 45


async def test_word_guess_keeps_state_across_turns_and_rewards_fast_solves():
    env = load("word-guess")()
    env.reset(secret="apple")
    results = await play(
        env, [("guess", {"word": "allee"}), ("guess", {"word": "ample"}), ("guess", {"word": "apple"})]
    )
    assert results[0].content == "ALLEE GY..G; 5 guesses left"
    assert results[2].content == "APPLE GGGGG: solved in 3 guesses!"
    assert env.get_reward() == pytest.approx(1 - 2 / 12)
    over = await play(env, [("guess", {"word": "about"})])
    assert over[0].content == "The game is over: no more guesses."
    env.reset(secret="apple")
    bad = await play(env, [("guess", {"word": "apples"})])
    assert bad[0].status is ToolStatus.ERROR and "exactly five letters" in bad[0].content
    assert env.guesses == [] and env.get_reward() == 0.0


def test_word_guess_feedback_marks_duplicates_once_each():
    assert feedback("speed", "abide") == "..Y.Y"
    assert feedback("eerie", "there") == "Y.Y.G"
    assert feedback("apple", "apple") == "GGGGG"
    assert all(len(word) == 5 and word.isalpha() for word in WORDS)
