"""The demo's pieces (task, rewards, warm-up data) and one miniature run of every stage with a tiny model.

The real demo (SmolLM2-135M-Instruct, `make demo`) takes minutes and is measured, not tested: its figures
are in the README. Here a tiny random Llama goes through the same stages in a few steps, so a broken
stage, file or metric name fails CI.
"""

from __future__ import annotations

import json

import pytest

from harness.recipes import demo
from harness.testing import build_tiny_llama, build_tiny_tokenizer


def length_spread(completion_ids, **kwargs):
    """A random model never calls the calculator, so the demo's rewards alone would drop every group."""
    return [0.01 * (sum(ids) % 7) for ids in completion_ids]


def call(expression: str) -> dict:
    return {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}


def rollout(*, result: str, final: str) -> list[dict]:
    return [
        {"role": "assistant", "content": "", "tool_calls": [call("2 + 3 * 4")]},
        {"role": "tool", "name": "calculator", "content": result},
        {"role": "assistant", "content": final},
    ]


def test_problems_are_seeded_and_their_answers_exact():
    question, answer = demo.problem(7)
    assert (question, answer) == demo.problem(7)
    expression = question.removeprefix("What is ").removesuffix("?")
    assert answer == str(eval(expression))  # integers, + - * only
    dataset = demo.problems_dataset(5, seed=1)
    assert dataset.column_names == ["prompt", "answer", "seed"]
    assert [r["prompt"][0]["content"] for r in dataset] != [
        r["prompt"][0]["content"] for r in demo.problems_dataset(5, seed=2)
    ]


def test_rewards_need_the_exact_final_number_and_a_successful_calculator_call():
    good = rollout(result="14", final="2 + 3 * 4 = 14.")
    wrong = rollout(result="14", final="The answer is 20.")
    failed_tool = rollout(result="error: unsupported expression", final="The answer is 14")
    prose = [{"role": "assistant", "content": "It is 14."}]
    still_calling = good[:1]
    completions = [good, wrong, failed_tool, prose, still_calling]
    assert demo.correct_answer(completions, answer=["14"] * 5) == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert demo.tool_success(completions) == [demo.TOOL_BONUS, demo.TOOL_BONUS, 0.0, 0.0, 0.0]
    assert demo.final_answer([{"role": "assistant", "content": "1,565"}]) == "1565"


def test_warm_up_trains_only_the_assistant_turns():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = demo.DEMO_CHAT_TEMPLATE
    from tools import Toolset
    from tools.calculator import calculator

    tools = Toolset([calculator]).schemas()
    messages = demo.warmup_conversation(3)
    input_ids, labels = demo.render_for_training(tokenizer, messages, tools)
    assert len(input_ids) == len(labels)
    full = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert tokenizer.decode(input_ids) == full.removesuffix("\n")  # the pieces add up to the conversation
    trained = tokenizer.decode([t for t in labels if t != -100])
    assert '"name": "calculator"' in trained and "The answer is" in trained
    assert "What is" not in trained and "<tool_response>" not in trained  # prompt and tool output masked
    assert trained.count("<|im_end|>") == 2  # each assistant turn learns to stop


@pytest.mark.slow
def test_every_stage_runs_and_writes_its_report(tmp_path):
    model_dir = tmp_path / "tiny"
    build_tiny_llama().save_pretrained(model_dir)
    build_tiny_tokenizer().save_pretrained(model_dir)
    settings = demo.DemoSettings(
        output_dir=tmp_path / "out",
        model_dir=model_dir,
        warmup_steps=2,
        warmup_batch_size=2,
        eval_problems=2,
        eval_samples=1,
        grpo=demo.GRPOSettings(
            max_steps=2,
            num_generations=4,
            max_completion_length=8,
            token_budget=1024,
            max_concurrent_rollouts=8,
            reward_funcs=(demo.correct_answer, demo.tool_success, length_spread),
        ),
    )
    lines: list[str] = []
    result = demo.run_demo(settings, log=lines.append)
    out = tmp_path / "out"
    assert (out / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["before"]["reward"] == result.before.reward and summary["wall_s"] > 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in steps] == [1, 2]
    assert any("reward" in entry and "rewards/tool_success/mean" in entry for entry in steps)
    assert "expected answer:" in (out / "samples-after.txt").read_text()
    assert (out / "grpo-model" / "config.json").is_file()
    assert any(line.startswith("\nreward ") for line in lines)  # the before -> after verdict
    page = (out / "report.html").read_text()
    assert 'data-metric="rewards/tool_success/mean"' in page and "report.html" in lines[-1]
    saved = list((out / "grpo" / "rollouts").glob("rollouts-*.jsonl"))
    assert saved and json.loads(saved[0].read_text().splitlines()[0])["rewards"].keys() >= {"correct_answer"}
