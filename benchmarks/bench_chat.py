"""Benchmark: the token bookkeeping of one multi-turn rollout, per turn, incremental against full rendering.

Run:  python benchmarks/bench_chat.py [--turns 8 32 128] [--tool-output-chars 4000] [--repeats 3]

A scripted agent rollout with the exact Qwen tokenizer and the official Qwen3 template (the renderer swaps
in its training template): every turn the "model" replies with reasoning and one tool call, and the tool
answers with a long output. Per turn it measures, in milliseconds:

    prompt (window)      Conversation.prompt_ids(), incremental, rendering a window of the conversation
    prompt (checked)     the same with the default drift check (2% of prompts also rendered in full)
    prompt (text)        the same, rendering the whole conversation's text, tokenizing only what is new
    prompt (full)        ChatRenderer.render(): render and tokenize the whole conversation, every turn
    parse                ChatRenderer.parse() of the reply (decode + tool-call parsing)
    add reply            Conversation.add_reply() (incremental: decoding the reply to find the boundary)
    reconcile            reconcile() of the finished rollout's turns, divided by the number of turns

and prints the mean per turn, the cost of the last turn (where full rendering is at its worst), and the
share of the per-turn bookkeeping that full re-rendering adds. Each figure is the median over repeats.
Before timing, every incremental prompt is checked equal to the full render of the same conversation.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

from harness.rollout.chat import ChatRenderer
from harness.rollout.reconcile import reconcile
from harness.testing import load_qwen_tokenizer
from harness.types import TurnRecord
from tools import Toolset

QWEN3_TEMPLATE = "tests/fixtures/chat_templates/qwen3.jinja"
# What tool outputs and code are made of, so that the text tokenizes like a real transcript.
WORDS = (
    "def", "return", "import", "class", "self", "value", "result", "error", "file", "path", "line", "test",
    "assert", "print", "json", "data", "the", "a", "of", "to", "and", "in", "is", "for", "with", "on", "that",
    "this", "it", "as", "be", "by", "are", "was", "0", "1", "2", "3", "42", "100", "True", "None", "{x}",
    "[y]", "->", "==", "!=", "<=", ">=",
)  # fmt: skip


def run_python(code: str, timeout_s: float = 10.0) -> str:
    """Run Python code in the sandbox and return its output.

    Args:
        code: The source to run.
        timeout_s: Seconds before the run is stopped.
    """
    return ""


def read_file(path: str, start_line: int = 1, num_lines: int = 200) -> str:
    """Read part of a file.

    Args:
        path: The file.
        start_line: First line to read.
        num_lines: How many lines.
    """
    return ""


TOOLS = Toolset([run_python, read_file])


def tool_output(rng: random.Random, num_chars: int) -> str:
    lines, size = [], 0
    while size < num_chars:
        line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14)))
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)[:num_chars]


def scripted_reply(turn: int, last: bool) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": "" if not last else "All tests pass now.",
        "reasoning_content": f"Step {turn}: read the output, then decide what to run next.",
    }
    if not last:
        arguments = {"code": f"import json\nprint(json.dumps(check_{turn}()))", "timeout_s": 10.0}
        message["tool_calls"] = [
            {"type": "function", "function": {"name": "run_python", "arguments": arguments}}
        ]
    return message


def reply_ids(chat: ChatRenderer, messages: list[dict[str, Any]], reply: dict[str, Any]) -> list[int]:
    """The ids a model following the template generates for `reply` (up to and including <|im_end|>)."""
    prompt = chat.render_text(messages, tools=TOOLS)
    text = chat.render_text([*messages, reply], tools=TOOLS, add_generation_prompt=False)[len(prompt) :]
    return chat.tokenizer.encode(
        text[: text.rindex("<|im_end|>") + len("<|im_end|>")], add_special_tokens=False
    )


def script(
    chat: ChatRenderer, num_turns: int, tool_chars: int
) -> list[tuple[list[int], list[dict[str, Any]]]]:
    """Per turn: the reply's ids and the messages that follow it, prepared outside the timed loop."""
    rng = random.Random(0)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. Use the tools to make the tests pass."},
        {"role": "user", "content": "The test suite fails; find out why and fix it."},
    ]
    steps = []
    for turn in range(num_turns):
        reply = scripted_reply(turn, last=turn == num_turns - 1)
        ids = reply_ids(chat, messages, reply)
        parsed = chat.parse(ids, tools=TOOLS)
        after = [
            {
                "role": "tool",
                "tool_call_id": call.id,
                "name": call.name,
                "content": tool_output(rng, tool_chars),
            }
            for call in parsed.tool_calls
        ]
        messages += [parsed.to_message(), *after]
        steps.append((ids, after))
    return steps


def rollout(chat: ChatRenderer, steps) -> dict[str, float]:
    """Run the scripted rollout once; return the seconds spent in each part (sums over turns)."""
    spent = {"prompt": 0.0, "parse": 0.0, "add_reply": 0.0, "reconcile": 0.0, "last_prompt": 0.0}
    conversation = chat.start(
        [
            {"role": "system", "content": "You are a coding agent. Use the tools to make the tests pass."},
            {"role": "user", "content": "The test suite fails; find out why and fix it."},
        ],
        tools=TOOLS,
    )
    turns = []
    for ids, after in steps:
        started = time.perf_counter()
        prompt = conversation.prompt_ids()
        took = time.perf_counter() - started
        spent["prompt"] += took
        spent["last_prompt"] = took

        started = time.perf_counter()
        parsed = chat.parse(ids, tools=TOOLS)
        spent["parse"] += time.perf_counter() - started

        started = time.perf_counter()
        conversation.add_reply(ids, parsed.to_message())
        spent["add_reply"] += time.perf_counter() - started
        conversation.add_messages(after)
        turns.append(TurnRecord(prompt, ids, [-0.5] * len(ids)))

    started = time.perf_counter()
    sequences = reconcile(turns)
    spent["reconcile"] = time.perf_counter() - started
    assert len(sequences) == 1, "the scripted rollout should never fork"
    spent["tokens"] = len(sequences[0].input_ids)
    return spent


def check_equal(chat: ChatRenderer, steps) -> None:
    conversation = chat.start(
        [
            {"role": "system", "content": "You are a coding agent. Use the tools to make the tests pass."},
            {"role": "user", "content": "The test suite fails; find out why and fix it."},
        ],
        tools=TOOLS,
    )
    for ids, after in steps:
        assert conversation.prompt_ids() == chat.render(conversation.messages, tools=TOOLS)
        conversation.add_reply(ids, chat.parse(ids, tools=TOOLS).to_message())
        conversation.add_messages(after)


def main(turn_counts: list[int], tool_chars: int, repeats: int) -> None:
    tokenizer = load_qwen_tokenizer()
    template = Path(QWEN3_TEMPLATE).read_text(encoding="utf-8")
    renderers = {
        "window": ChatRenderer(tokenizer, chat_template=template, check_fraction=0.0),
        "checked": ChatRenderer(tokenizer, chat_template=template),  # the default share of full re-renders
        "text": ChatRenderer(tokenizer, chat_template=template, check_fraction=0.0, window=False),
        "full": ChatRenderer(tokenizer, chat_template=template, incremental=False),
    }
    chat = renderers["window"]
    assert chat.window and renderers["text"].incremental and not renderers["full"].incremental
    print(
        f"# chat bookkeeping per turn ({platform.python_version()}, {os.cpu_count()} cores, "
        f"{chat.template_name}, tool outputs of {tool_chars} chars, median of {repeats})"
    )
    print(
        f"{'turns':>5} {'tokens':>7} | {'prompt ms/turn':^35} | {'parse':>6} {'add':>6} {'recon':>6} | "
        f"{'last turn prompt ms':^26} | {'total ms/turn':^15} {'speedup':>7}"
    )
    print(
        f"{'':>5} {'':>7} | {'window':>8} {'checked':>8} {'text':>8}"
        f" {'full':>8} | {'ms/turn':>6} {'ms':>6} {'ms':>6} | "
        f"{'window':>8} {'text':>8} {'full':>8} | {'incr':>7} {'full':>7} {'':>7}"
    )
    for num_turns in turn_counts:
        steps = script(chat, num_turns, tool_chars)
        check_equal(chat, steps)
        results: dict[str, list[dict[str, float]]] = {mode: [] for mode in renderers}
        for _ in range(repeats):
            for mode, renderer in renderers.items():
                results[mode].append(rollout(renderer, steps))

        def med(mode: str, key: str, results=results) -> float:
            return statistics.median(run[key] for run in results[mode])

        per_turn = {mode: med(mode, "prompt") / num_turns * 1e3 for mode in results}
        last = {mode: med(mode, "last_prompt") * 1e3 for mode in results}
        parse = med("window", "parse") / num_turns * 1e3
        add = med("window", "add_reply") / num_turns * 1e3
        recon = med("window", "reconcile") / num_turns * 1e3
        incremental_total = per_turn["window"] + parse + add + recon
        full_total = per_turn["full"] + parse + med("full", "add_reply") / num_turns * 1e3 + recon
        print(
            f"{num_turns:>5} {int(med('window', 'tokens')):>7} | {per_turn['window']:>8.2f} "
            f"{per_turn['checked']:>8.2f} {per_turn['text']:>8.2f} "
            f"{per_turn['full']:>8.2f} | {parse:>6.3f} {add:>6.3f} {recon:>6.3f} | {last['window']:>8.2f} "
            f"{last['text']:>8.2f} {last['full']:>8.2f} | {incremental_total:>7.2f} {full_total:>7.2f} "
            f"{full_total / incremental_total:>6.1f}x"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--turns", type=int, nargs="+", default=[8, 32, 128], help="rollout lengths to measure"
    )
    parser.add_argument("--tool-output-chars", type=int, default=4000, help="length of each tool output")
    parser.add_argument(
        "--repeats", type=int, default=3, help="rollouts per measurement (the median is shown)"
    )
    arguments = parser.parse_args()
    main(arguments.turns, arguments.tool_output_chars, arguments.repeats)
