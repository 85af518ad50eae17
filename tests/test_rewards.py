"""harness.rewards: accuracy_reward (math-verify in checker processes, with a deadline), format rewards."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import anyio.to_thread
import pytest

from harness import rewards
from harness.rewards import accuracy_reward, format_reward, think_format_reward

needs_math_verify = pytest.mark.skipif(
    __import__("importlib").util.find_spec("math_verify") is None, reason="needs math-verify"
)

# sympy spins on this for minutes (over 10 minutes unbounded, measured) when comparing it with a number.
POWER_TOWER = r"The answer is \boxed{9^{9^{9^{9}}}}."


def _children() -> set[int]:
    """Pids of this process's live children, read from /proc (zombies excluded, and multiprocessing's
    resource tracker, which the first spawned process of any earlier test starts and keeps for the
    session)."""
    me = os.getpid()
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rpartition(")")[2].split()
        except OSError:
            continue
        state, ppid = fields[0], int(fields[1])
        if ppid == me and state != "Z" and not _is_resource_tracker(entry):
            found.add(int(entry))
    return found


def _is_resource_tracker(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return b"resource_tracker" in cmdline.read()
    except OSError:
        return False


@pytest.fixture(scope="module", autouse=True)
def no_leftover_processes() -> Iterator[None]:
    rewards.close()
    before = _children()
    yield
    rewards.close()
    assert _children() - before == set(), "checker processes left behind"


def said(text: str) -> list[dict[str, Any]]:
    return [{"role": "assistant", "content": text}]


def score(text: str | list[dict[str, Any]], solution: Any) -> float | None:
    completion = said(text) if isinstance(text, str) else text
    return accuracy_reward(prompts=[[]], completions=[completion], completion_ids=[[]], solution=[solution])[
        0
    ]


# ---------------------------------------------------------------------------------------------------------
# accuracy_reward
# ---------------------------------------------------------------------------------------------------------


@needs_math_verify
def test_boxed_answer_matches_plain_solution() -> None:
    assert score(r"2x = 4, so the answer is \boxed{2}.", "2") == 1.0


@needs_math_verify
@pytest.mark.parametrize(
    ("answer", "solution"),
    [
        (r"\boxed{\frac{1}{2}}", "0.5"),
        (r"\boxed{0.5}", r"\frac{1}{2}"),
        (r"\boxed{\dfrac{2}{4}}", r"\frac12"),
        (r"\boxed{\sqrt{8}}", r"2\sqrt{2}"),
        (r"\boxed{\frac{\pi}{4}}", r"\frac{\pi}{4}"),
        (r"\boxed{x^2 + 1}", "1 + x^2"),
    ],
)
def test_equivalent_forms_are_correct(answer: str, solution: str) -> None:
    assert score(answer, solution) == 1.0


@needs_math_verify
@pytest.mark.parametrize(
    ("answer", "solution"),
    [
        (r"\boxed{3}", "2"),
        (r"\boxed{\frac{1}{3}}", "0.5"),
        (r"\boxed{2\sqrt{3}}", r"3\sqrt{2}"),
        ("I do not know.", "2"),
        ("", "2"),
    ],
)
def test_wrong_or_missing_answers_score_zero(answer: str, solution: str) -> None:
    assert score(answer, solution) == 0.0


@needs_math_verify
@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        # \boxed{} is the preferred form, and wins over anything said before it
        (r"At first I got 3. Checking again, the final answer is \boxed{2}.", 1.0),
        # an anchored answer counts, in LaTeX or plain text
        ("The answer is 2.", 1.0),
        ("Final answer: $2$", 1.0),
        ("**Answer:** 2", 1.0),
        # an <answer> block counts, read like the solution (a bare expression is enough)
        ("<answer>2</answer>", 1.0),
        (r"<answer>\frac{4}{2}</answer>", 1.0),
        # a bare number or $...$ without an anchor does not
        ("So x = 2", 0.0),
        ("2", 0.0),
        ("$2$", 0.0),
    ],
)
def test_what_counts_as_the_answer(answer: str, expected: float) -> None:
    assert score(answer, "2") == expected


@needs_math_verify
def test_answer_is_read_after_the_reasoning_block() -> None:
    assert score(r"<think>Maybe \boxed{3}? No.</think>The answer is \boxed{2}.", "2") == 1.0
    assert score(r"<think>Surely \boxed{2}.</think>The answer is \boxed{3}.", "2") == 0.0
    # opened by the generation prompt: only the closing tag is in the completion
    assert score(r"Maybe \boxed{3}.</think>\boxed{2}", "2") == 1.0
    # cut off while thinking: no answer, even though the thought holds the right one
    assert score(r"<think>It is \boxed{2}, let me double check", "2") == 0.0
    # reasoning already split out of the content by a parser
    split = [{"role": "assistant", "reasoning_content": r"\boxed{3}", "content": r"\boxed{2}"}]
    assert score(split, "2") == 1.0


@needs_math_verify
def test_answer_is_in_the_last_assistant_message() -> None:
    conversation = [
        {"role": "assistant", "content": r"Let me compute. \boxed{3}", "tool_calls": [{"id": "c0"}]},
        {"role": "tool", "tool_call_id": "c0", "content": r"\boxed{2}"},
        {"role": "assistant", "content": [{"type": "text", "text": r"So it is \boxed{2}."}]},
    ]
    assert score(conversation, "2") == 1.0
    assert score(conversation[:2], "2") == 0.0
    assert score([], "2") == 0.0


@needs_math_verify
def test_worked_solution_with_boxed_answer() -> None:
    solution = r"Since $2x + 3 = 7$, we get $x = \boxed{2}$."
    assert score(r"\boxed{2}", solution) == 1.0
    assert score(r"\boxed{7}", solution) == 0.0


@needs_math_verify
@pytest.mark.parametrize("solution", ["", "   ", r"\frac{1}{", None])
def test_unparseable_solution_is_not_scored(solution: Any) -> None:
    assert score(r"\boxed{2}", solution) is None


@needs_math_verify
def test_a_group_with_duplicates_keeps_order() -> None:
    completions = [
        said(r"\boxed{2}"),
        said(r"\boxed{3}"),
        said(r"\boxed{2}"),
        said("no idea"),
        said(r"\boxed{2}"),
    ]
    solution = ["2", "2", "2", "2", ""]
    assert accuracy_reward(completions=completions, solution=solution) == [1.0, 0.0, 1.0, 0.0, None]
    assert accuracy_reward(completions=[], solution=[]) == []
    with pytest.raises(ValueError, match="solutions"):
        accuracy_reward(completions=completions, solution=solution[:2])


@needs_math_verify
def test_works_off_the_main_thread() -> None:
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.append(score(r"\boxed{\frac{1}{2}}", "0.5")))
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert results == [1.0]

    async def from_anyio() -> list[float | None]:
        return await anyio.to_thread.run_sync(
            lambda: accuracy_reward(completions=[said(r"\boxed{2}"), said(r"\boxed{5}")], solution=["2", "2"])
        )

    assert anyio.run(from_anyio) == [1.0, 0.0]


@needs_math_verify
def test_concurrent_callers_share_the_pool() -> None:
    results: dict[int, list[float | None]] = {}

    def call(n: int) -> None:
        results[n] = accuracy_reward(
            completions=[said(rf"\boxed{{{n}}}"), said(rf"\boxed{{{n + 1}}}")], solution=[str(n), str(n)]
        )

    threads = [threading.Thread(target=call, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results == {n: [1.0, 0.0] for n in range(8)}
    assert len(rewards._pool().pids()) <= rewards.NUM_CHECKERS


@needs_math_verify
def test_close_stops_the_checkers_and_a_later_call_restarts() -> None:
    assert score(r"\boxed{2}", "2") == 1.0
    pids = rewards._pool().pids()
    assert pids and set(pids) <= _children()
    rewards.close()
    assert not set(pids) & _children()
    rewards.close()  # twice is fine
    assert score(r"\boxed{2}", "2") == 1.0


@needs_math_verify
def test_a_checker_that_died_while_idle_is_replaced() -> None:
    assert score(r"\boxed{2}", "2") == 1.0
    for pid in rewards._pool().pids():
        os.kill(pid, 9)
    time.sleep(0.2)
    assert score(r"\boxed{2}", "2") == 1.0


@needs_math_verify
def test_a_forked_child_gets_its_own_checkers() -> None:
    assert score(r"\boxed{2}", "2") == 1.0
    parents = rewards._pool().pids()
    pid = os.fork()
    if pid == 0:  # the child must neither use nor stop the parent's checkers
        ok = False
        try:
            rewards.close()
            ok = score(r"\boxed{2}", "2") == 1.0 and not set(rewards._pool().pids()) & set(parents)
            rewards.close()
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert rewards._pool().pids() == parents
    assert score(r"\boxed{3}", "3") == 1.0


@needs_math_verify
def test_checkers_stop_at_interpreter_exit() -> None:
    script = textwrap.dedent(
        r"""
        from harness import rewards
        from harness.rewards import accuracy_reward
        completion = [{"role": "assistant", "content": r"\boxed{2}"}]
        assert accuracy_reward(completions=[completion], solution=["2"]) == [1.0]
        print(*rewards._pool().pids())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    pids = [int(pid) for pid in done.stdout.split()]
    assert pids
    time.sleep(0.2)
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")]


@pytest.mark.slow
@needs_math_verify
def test_a_pathological_answer_times_out_without_blocking_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    rewards.close()
    others = _children()  # children of earlier tests that outlive them by design (the session's vLLM server)
    monkeypatch.setattr(rewards, "CHECK_TIMEOUT_S", 2.0)
    monkeypatch.setattr(rewards, "NUM_CHECKERS", 2)
    assert accuracy_reward(completions=[said(r"\boxed{1}")] * 2, solution=["1", "2"]) == [1.0, 0.0]  # warm 2

    results: list[Any] = []

    def stuck() -> None:
        started = time.monotonic()
        results.append(score(POWER_TOWER, "2"))
        results.append(time.monotonic() - started)

    thread = threading.Thread(target=stuck)
    thread.start()
    time.sleep(0.5)
    # the other checker keeps answering while one spins
    started = time.monotonic()
    assert score(r"\boxed{2}", "2") == 1.0
    assert time.monotonic() - started < 1.5
    thread.join(timeout=30)
    assert not thread.is_alive(), "the check did not return within 30 s"
    assert results[0] == 0.0
    assert 2.0 <= results[1] < 30.0

    # the stuck checker was killed and reaped; the pool works on, through a fresh checker
    assert _children() - others == set(rewards._pool().pids())
    assert accuracy_reward(completions=[said(r"\boxed{2}")] * 2, solution=["2", "3"]) == [1.0, 0.0]


def test_missing_math_verify_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(ImportError, match=r'pip install "agent-harness\[math\]"'):
        score(r"\boxed{2}", "2")


def test_import_is_cheap() -> None:
    code = "import sys, harness.rewards; print(sorted({'sympy', 'math_verify'} & set(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------------------
# format_reward and think_format_reward
# ---------------------------------------------------------------------------------------------------------

FORMAT_CASES = [
    # (content, format_reward, think_format_reward)
    ("<think>3 times 4 is 12.</think><answer>12</answer>", 1.0, 1.0),
    ("\n<think>\n3 times 4.\n</think>\n\n<answer>\n12\n</answer>\n", 1.0, 1.0),
    ("3 times 4 is 12.</think><answer>12</answer>", 1.0, 1.0),  # <think> opened by the prompt
    ("<think>3 times 4 is 12.</think>The answer is \\boxed{12}.", 0.0, 1.0),
    ("The answer is 12.", 0.0, 0.0),
    ("<answer>12</answer>", 0.0, 0.0),
    ("<think></think><answer>12</answer>", 0.0, 0.0),  # empty reasoning
    ("<think>\n\n</think>\n\n12", 0.0, 0.0),
    ("<think>hm</think><answer> </answer>", 0.0, 1.0),  # empty answer block
    ("<think>hm</think>", 0.0, 0.0),
    ("<think>hm</think><answer>12</answer> and more", 0.0, 1.0),
    ("<think>hm</think><answer>1</answer><answer>2</answer>", 0.0, 1.0),
    ("<think>hm</think><think>again</think><answer>12</answer>", 0.0, 0.0),
    ("Sure. <think>hm</think><answer>12</answer>", 0.0, 0.0),
    ("<think>still thinking", 0.0, 0.0),
]


@pytest.mark.parametrize(("content", "expected_format", "expected_think"), FORMAT_CASES)
def test_format_rewards(content: str, expected_format: float, expected_think: float) -> None:
    assert format_reward(completions=[said(content)]) == [expected_format]
    assert think_format_reward(completions=[said(content)]) == [expected_think]


def test_format_rewards_match_the_spec_example_and_split_reasoning() -> None:
    prompts = [
        [{"role": "user", "content": "What is the result of (1 + 2) * 4?"}],
        [{"role": "user", "content": "What is the result of (3 + 1) * 2?"}],
    ]
    completions = [
        said(
            "<think>The sum of 1 and 2 is 3, which we multiply by 4 to get 12.</think>"
            "<answer>(1 + 2) * 4 = 12</answer>"
        ),
        said("The sum of 3 and 1 is 4, which we multiply by 2 to get 8. So (3 + 1) * 2 = 8."),
    ]
    assert format_reward(prompts=prompts, completions=completions) == [1.0, 0.0]
    split = [{"role": "assistant", "reasoning_content": "3 times 4.", "content": "<answer>12</answer>"}]
    assert format_reward(completions=[split]) == [1.0]
    assert think_format_reward(completions=[split]) == [1.0]
    assert format_reward(completions=[[]]) == [0.0]
