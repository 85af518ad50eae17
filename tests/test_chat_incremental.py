"""Incremental prompts: equal to full renders over random multi-turn conversations with tools, and what
happens when a reply is not what the template would render (kept as sampled, closed, counted as drift)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from harness.rollout.chat import ChatRenderer
from tools import Toolset

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
WORDS = ["the", "a", "tool", "result", "file", "error", "value", "print", "return", "def", "class", "import"]
WORDS += ["sunny", "42", "3.5", "été", "中文", "{x}", "[y]", "<b>"]


def get_weather(city: str, days: int = 1, metric: bool = True) -> str:
    """Forecast.

    Args:
        city: The city.
        days: Days ahead.
        metric: Metric units.
    """
    return ""


def run_python(code: str) -> str:
    """Run Python.

    Args:
        code: The source.
    """
    return ""


TOOLS = Toolset([get_weather, run_python])
IM_END = 151645


def words(rng: random.Random, most: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, most)))


def random_reply(rng: random.Random, *, reasoning: bool, last: bool) -> dict[str, Any]:
    """An assistant message a model could write: content, maybe reasoning, zero to two calls."""
    message: dict[str, Any] = {"role": "assistant", "content": words(rng, 8)}
    if reasoning:
        message["reasoning_content"] = "so " + words(rng, 10)  # never empty: see the Qwen3.5 drift test
    calls = []
    for _ in range(0 if last else rng.choice([0, 1, 1, 2])):
        if rng.random() < 0.5:
            arguments = {"city": words(rng, 3) or "Paris", "days": rng.randint(1, 9)}
            calls.append({"type": "function", "function": {"name": "get_weather", "arguments": arguments}})
        else:
            code = f"print({rng.randint(0, 99)})\nx = [1, 2]"
            calls.append(
                {"type": "function", "function": {"name": "run_python", "arguments": {"code": code}}}
            )
    if calls:
        message["tool_calls"] = calls
    return message


def sampled_ids(
    chat: ChatRenderer, messages: list[dict[str, Any]], reply: dict[str, Any], stops: tuple[str, str]
) -> list[int]:
    """The ids a well-behaved model generates for `reply`: the template's rendering of it, up to its stop
    (`stops`: the token ending a reply that calls tools, and one that does not)."""
    stop = stops[0] if reply.get("tool_calls") else stops[1]
    prompt = chat.render_text(messages, tools=TOOLS)
    text = chat.render_text([*messages, reply], tools=TOOLS, add_generation_prompt=False)[len(prompt) :]
    # GLM's next message opens with the stop token: a reply there ends where the template's text does.
    text = text[: text.rindex(stop) + len(stop)] if stop in text else text.rstrip() + stop
    return chat.tokenizer.encode(text, add_special_tokens=False)


def run_conversation(
    chat: ChatRenderer, rng: random.Random, *, reasoning: bool, stops: tuple[str, str], max_turns: int = 6
):
    """Drive one rollout; return (incremental prompt, full render) for every turn."""
    conversation = chat.start(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": words(rng, 12) or "hi"}],
        tools=TOOLS,
    )
    pairs = []
    for turn in range(max_turns):
        prompt = conversation.prompt_ids()
        pairs.append((prompt, chat.render(conversation.messages, tools=TOOLS)))
        reply = random_reply(rng, reasoning=reasoning, last=turn == max_turns - 1)
        output_ids = sampled_ids(chat, conversation.messages, reply, stops)
        parsed = chat.parse(output_ids, tools=TOOLS)
        assert parsed.ok and len(parsed.tool_calls) == len(reply.get("tool_calls", []))
        conversation.add_reply(output_ids, parsed.to_message())
        if parsed.tool_calls:
            results = [
                {"role": "tool", "tool_call_id": c.id, "name": c.name, "content": words(rng, 40)}
                for c in parsed.tool_calls
            ]
            conversation.add_messages(results)
        elif rng.random() < 0.5:
            conversation.add_messages([{"role": "user", "content": words(rng, 6) or "more"}])
        else:
            break
    return pairs


@pytest.mark.parametrize(
    ("name", "kwargs", "reasoning", "window"),
    [
        ("qwen2_5", {}, False, True),
        ("qwen3", {}, True, True),
        ("qwen3_5", {}, True, True),
        # the full-text path: render everything, tokenize only what is new
        pytest.param("qwen3", {}, True, False, marks=pytest.mark.slow),
        pytest.param("qwen3", {"enable_thinking": False}, False, True, marks=pytest.mark.slow),
        pytest.param("qwen3_5", {"enable_thinking": False}, False, True, marks=pytest.mark.slow),
        pytest.param("qwen3_coder", {}, False, True, marks=pytest.mark.slow),
    ],
)
def test_incremental_prompts_equal_full_renders_over_100_conversations(
    qwen_tokenizer, name, kwargs, reasoning, window
):
    source = (TEMPLATES / f"{name}.jinja").read_text()
    chat = ChatRenderer(qwen_tokenizer, chat_template=source, chat_template_kwargs=kwargs, window=window)
    assert chat.incremental and chat.window is window and chat.check.window
    rng = random.Random(0)
    turns = 0
    for _ in range(100):
        for prompt, full in run_conversation(
            chat, rng, reasoning=reasoning, stops=("<|im_end|>", "<|im_end|>")
        ):
            assert prompt == full
            turns += 1
    assert chat.stats.incremental_prompts == turns - 100  # every prompt after the first of each rollout
    assert chat.stats.rewritten_replies == 0


def glm_renderer(tiny_tokenizer, **kwargs) -> ChatRenderer:
    glm_tokens = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
    tiny_tokenizer.add_special_tokens({"additional_special_tokens": glm_tokens})
    template = (TEMPLATES / "glm4_6.jinja").read_text()
    return ChatRenderer(
        tiny_tokenizer, chat_template=template, chat_template_kwargs={"enable_thinking": False}, **kwargs
    )


def test_glm_replies_end_with_the_token_that_opens_the_next_message(tiny_tokenizer):
    # GLM stops on <|observation|> or <|user|>, which the template renders as the start of the next message.
    chat = glm_renderer(tiny_tokenizer, check_fraction=1.0)
    assert chat.incremental and chat.parser.family == "glm"
    rng = random.Random(1)
    for _ in range(20):
        for prompt, full in run_conversation(
            chat, rng, reasoning=False, stops=("<|observation|>", "<|user|>"), max_turns=4
        ):
            assert prompt == full
    assert chat.stats.drifted == 0 and chat.stats.checks > 0


# --- replies the template would render differently -----------------------------------------------------


def qwen3(qwen_tokenizer, **kwargs) -> ChatRenderer:
    return ChatRenderer(qwen_tokenizer, chat_template=(TEMPLATES / "qwen3.jinja").read_text(), **kwargs)


def start(chat: ChatRenderer):
    return chat.start([{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS)


def encode(chat: ChatRenderer, text: str) -> list[int]:
    return chat.tokenizer.encode(text, add_special_tokens=False)


def test_a_reply_with_extra_whitespace_is_kept_as_sampled_and_closed(qwen_tokenizer):
    chat = qwen3(qwen_tokenizer, check_fraction=1.0)
    conversation = start(chat)
    prompt = conversation.prompt_ids()
    # Two newlines before the call, where the template writes one: the parsed message re-renders differently.
    output = encode(
        chat,
        '<think>\nok\n</think>\n\nSure.\n\n<tool_call>\n{"name": "get_weather",'
        ' "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
    )
    parsed = chat.parse(output, tools=TOOLS)
    conversation.add_reply(output, parsed.to_message())
    conversation.add_messages([{"role": "tool", "content": "Sunny."}])
    following = conversation.prompt_ids()
    assert following[: len(prompt) + len(output)] == prompt + output
    assert chat.tokenizer.decode(following[len(prompt) + len(output) :]) == (
        "\n<|im_start|>user\n<tool_response>\nSunny.\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert chat.stats.rewritten_replies == 1
    # The full render writes one newline there: that is drift, measured on the checked prompt.
    assert chat.stats.checks == 1 and chat.stats.drifted == 1 and chat.stats.drift_tokens_max > 0


def test_a_reply_cut_by_the_token_limit_is_closed_before_the_next_message(qwen_tokenizer):
    chat = qwen3(qwen_tokenizer)
    conversation = start(chat)
    prompt = conversation.prompt_ids()
    output = encode(chat, "<think>\nThe user wants the weather in Paris, so I will call the tool with")
    parsed = chat.parse(output, tools=TOOLS)
    assert parsed.truncated and parsed.content == ""
    conversation.add_reply(output, parsed.to_message())
    conversation.add_messages([{"role": "user", "content": "Go on."}])
    following = conversation.prompt_ids()
    assert following[: len(prompt) + len(output)] == prompt + output
    # What the template renders after the cut text for the parsed message: the think block closes too.
    assert chat.tokenizer.decode(following[len(prompt) + len(output) :]) == (
        "\n</think>\n\n<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_malformed_call_stays_in_the_reply_and_the_error_message_follows(qwen_tokenizer):
    chat = qwen3(qwen_tokenizer, check_fraction=1.0)
    conversation = start(chat)
    prompt = conversation.prompt_ids()
    output = encode(
        chat,
        '<think>\nx\n</think>\n\n<tool_call>\n{"name": "get_weather",'
        ' "arguments": {"city": }\n</tool_call><|im_end|>',
    )
    parsed = chat.parse(output, tools=TOOLS)
    assert [str(e.kind) for e in parsed.errors] == ["bad_json"]
    conversation.add_reply(output, parsed.to_message())
    conversation.add_messages([chat.parser.error_message(parsed)])
    following = conversation.prompt_ids()
    assert following[: len(prompt) + len(output)] == prompt + output
    tail = chat.tokenizer.decode(following[len(prompt) + len(output) :])
    assert tail.startswith(
        "\n<|im_start|>user\n<tool_response>\nError: a tool call in your reply could not be read"
    )
    assert chat.stats.drifted == 0  # the kept text is what the template renders for this message


def test_an_empty_qwen3_5_think_block_is_drift_not_a_broken_prompt(qwen_tokenizer):
    # After "<think>\n" the model writes "\n</think>": tokens "\n" + "\n", where a fresh render has "\n\n".
    chat = ChatRenderer(
        qwen_tokenizer, chat_template=(TEMPLATES / "qwen3_5.jinja").read_text(), check_fraction=1.0
    )
    assert any("re-tokenizes" in note for note in chat.check.notes)
    conversation = start(chat)
    prompt = conversation.prompt_ids()
    output = encode(chat, "\n</think>\n\nIt is sunny.<|im_end|>")
    conversation.add_reply(output, chat.parse(output, tools=TOOLS).to_message())
    conversation.add_messages([{"role": "user", "content": "Thanks."}])
    assert conversation.prompt_ids()[: len(prompt) + len(output)] == prompt + output
    assert chat.stats.drifted == 1 and chat.stats.rewritten_replies == 0


def test_full_rendering_when_incremental_is_off(qwen_tokenizer):
    chat = qwen3(qwen_tokenizer, incremental=False)
    conversation = start(chat)
    prompt = conversation.prompt_ids()
    # "Sunny." sampled letter by letter: the same text, other tokens than a fresh tokenization.
    output = [*encode(chat, "<think>\n\n</think>\n\n"), *(encode(chat, c)[0] for c in "Sunny."), IM_END]
    conversation.add_reply(output, chat.parse(output).to_message())
    conversation.add_messages([{"role": "user", "content": "Thanks."}])
    following = conversation.prompt_ids()
    assert following == chat.render(conversation.messages, tools=TOOLS)
    assert following[: len(prompt) + len(output)] != prompt + output  # a fork for reconciliation
    assert chat.stats.incremental_prompts == 0


@pytest.mark.parametrize("window", [True, False])
def test_messages_added_after_a_prompt_was_taken_rebuild_it(qwen_tokenizer, window):
    chat = qwen3(qwen_tokenizer, window=window)
    conversation = start(chat)
    conversation.prompt_ids()
    output = encode(chat, "<think>\n\n</think>\n\nHi.<|im_end|>")
    conversation.add_reply(output, chat.parse(output).to_message())
    conversation.add_messages([{"role": "user", "content": "a"}])
    conversation.prompt_ids()
    conversation.add_messages([{"role": "user", "content": "b"}])
    assert conversation.prompt_ids() == chat.render(conversation.messages, tools=TOOLS)
    output = encode(chat, "<think>\n\n</think>\n\nOk.<|im_end|>")
    conversation.add_reply(output, chat.parse(output).to_message())
    conversation.add_messages([{"role": "user", "content": "c"}])
    assert conversation.prompt_ids() == chat.render(conversation.messages, tools=TOOLS)


def test_conversation_bookkeeping(qwen_tokenizer):
    chat = qwen3(qwen_tokenizer, check_fraction=0.0)
    conversation = start(chat)
    with pytest.raises(RuntimeError, match="prompt_ids"):
        conversation.add_reply([1, 2], {"role": "assistant", "content": "x"})
    first = conversation.prompt_ids()
    assert conversation.prompt_ids() is first  # cached until something changes
    conversation.add_reply(
        encode(chat, "<think>\n\n</think>\n\nHi.<|im_end|>"), {"role": "assistant", "content": "Hi."}
    )
    conversation.add_messages([{"role": "user", "content": "a"}])
    conversation.add_messages([{"role": "user", "content": "b"}])  # pending messages accumulate
    assert [m["content"] for m in conversation.messages][-2:] == ["a", "b"]
    assert conversation.prompt_ids() == chat.render(conversation.messages, tools=TOOLS)
    summary = chat.stats.summary()
    assert summary["chat/render_check_count"] == 0 and summary["chat/incremental_frac"] == 0.5
    chat.stats.reset()
    assert chat.stats.prompts == 0
