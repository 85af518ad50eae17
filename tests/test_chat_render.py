"""Chat rendering with the exact Qwen tokenizer and the official Qwen2.5 / Qwen3 / Qwen3.5 templates: golden
renders, the start-up prefix check, the training templates, and incremental prompts against full renders."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from harness.rollout.chat import ChatRenderer, ChatTemplateError, check_agreement, load_training_template
from harness.rollout.chat.check import probe_conversation
from tools import Toolset, UnknownToolCallFormat

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
IM_START, IM_END, TOOL_CALL, THINK = 151644, 151645, 151657, 151667


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: First.
        b: Second.
    """
    return a + b


TOOLS = Toolset([add])
SCHEMA = (
    '{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": '
    '{"type": "object", "properties": {"a": {"type": "integer", "description": "First."}, "b": {"type": '
    '"integer", "description": "Second."}}, "required": ["a", "b"]}}}'
)
CONVERSATION = [
    {"role": "user", "content": "What is 2+3?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Use the tool.",
        "tool_calls": [
            {
                "id": "call00000",
                "type": "function",
                "function": {"name": "add", "arguments": {"a": 2, "b": 3}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call00000", "name": "add", "content": "5"},
]
QWEN_JSON_HEADER = (
    "\n\n# Tools\n\nYou may call one or more functions to"
    " assist with the user query.\n\nYou are provided with "
    f"function signatures within <tools></tools> XML tags:\n<tools>\n{SCHEMA}\n</tools>\n\nFor each function "
    "call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)
TAIL = "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def renderer(tokenizer, name: str, **kwargs) -> ChatRenderer:
    return ChatRenderer(tokenizer, chat_template=template(name), **kwargs)


# --- golden renders ------------------------------------------------------------------------------------


def test_qwen2_5_golden_ids_for_a_plain_conversation(qwen_tokenizer):
    ids = renderer(qwen_tokenizer, "qwen2_5").render(
        [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hello"}]
    )
    assert ids == [
        151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198,  # <|im_start|>system\n...
        151644, 872, 198, 9707, 151645, 198,  # <|im_start|>user\nHello<|im_end|>\n
        151644, 77091, 198,  # <|im_start|>assistant\n
    ]  # fmt: skip


def test_qwen2_5_golden_render_with_a_tool_call(qwen_tokenizer):
    chat = renderer(qwen_tokenizer, "qwen2_5")
    text = chat.render_text(CONVERSATION, tools=TOOLS)
    assert text == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
        + QWEN_JSON_HEADER
        + "<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "add",'
        ' "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>\n' + TAIL
    )
    ids = chat.render(CONVERSATION, tools=TOOLS)
    assert qwen_tokenizer.decode(ids) == text
    # <tool_call> appears in the instructions twice (the tag names and the example) and in the call
    assert ids.count(IM_START) == 5 and ids.count(IM_END) == 4 and ids.count(TOOL_CALL) == 3
    # The same ids as transformers' own tokenizing path.
    assert ids == qwen_tokenizer.apply_chat_template(
        CONVERSATION, tools=TOOLS.schemas(), chat_template=template("qwen2_5"), add_generation_prompt=True,
        tokenize=True, return_dict=False,
    )  # fmt: skip


def test_qwen3_golden_render_matches_the_official_template_on_the_last_turn(qwen_tokenizer):
    chat = renderer(qwen_tokenizer, "qwen3")
    assert chat.template_name == "training template 'qwen3'"
    text = chat.render_text(CONVERSATION, tools=TOOLS)
    assert text == (
        "<|im_start|>system" + QWEN_JSON_HEADER.replace("\n\n# Tools", "\n# Tools", 1)
        + "<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nUse the tool.\n</think>\n\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>\n'
        + TAIL
    )  # fmt: skip
    official = qwen_tokenizer.apply_chat_template(
        CONVERSATION, tools=TOOLS.schemas(), chat_template=template("qwen3"), add_generation_prompt=True,
        tokenize=False,
    )  # fmt: skip
    assert text == official  # one user query, so the official template keeps this reasoning too
    ids = chat.render(CONVERSATION, tools=TOOLS)
    assert ids.count(THINK) == 1 and qwen_tokenizer.decode(ids) == text


def test_qwen3_5_golden_render_with_an_xml_call(qwen_tokenizer):
    chat = renderer(qwen_tokenizer, "qwen3_5")
    assert chat.template_name == "training template 'qwen3_5'"
    text = chat.render_text(CONVERSATION, tools=TOOLS)
    assert text.startswith(
        f"<|im_start|>system\n# Tools\n\nYou have access to the"
        f" following functions:\n\n<tools>\n{SCHEMA}\n</tools>"
    )
    assert text.endswith(
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nUse the tool.\n</think>\n\n"
        "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n3\n</parameter>\n"
        "</function>\n</tool_call><|im_end|>\n" + TAIL + "<think>\n"
    )
    official = qwen_tokenizer.apply_chat_template(
        CONVERSATION, tools=TOOLS.schemas(), chat_template=template("qwen3_5"), add_generation_prompt=True,
        tokenize=False,
    )  # fmt: skip
    assert text == official


# --- the start-up check and the training templates -----------------------------------------------------


@pytest.mark.parametrize(
    ("name", "kwargs", "expected_template", "incremental"),
    [
        ("qwen2_5", {}, "the given chat template", True),
        ("qwen3", {}, "training template 'qwen3'", True),
        ("qwen3", {"enable_thinking": False}, "training template 'qwen3'", True),
        ("qwen3_5", {}, "training template 'qwen3_5'", True),
        ("qwen3_5", {"enable_thinking": False}, "training template 'qwen3_5'", True),
        ("qwen3_coder", {}, "the given chat template", True),
        ("qwq", {}, "the given chat template", False),  # not preserving, and the qwen3 template does not fit
    ],
)
def test_which_template_renders_and_how(qwen_tokenizer, name, kwargs, expected_template, incremental):
    chat = renderer(qwen_tokenizer, name, chat_template_kwargs=kwargs)
    assert chat.template_name == expected_template
    assert chat.incremental is incremental
    assert chat.window is incremental
    assert chat.check.close == "<|im_end|>\n"


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5"])
def test_official_qwen3_templates_are_not_prefix_preserving(qwen_tokenizer, name):
    chat = renderer(qwen_tokenizer, name, training_template=False)
    assert chat.template_name == "the given chat template"
    assert not chat.check.preserving and not chat.incremental
    assert any("changes once" in failure for failure in chat.check.failures)


def test_the_swap_is_logged(qwen_tokenizer, caplog):
    with caplog.at_level(logging.INFO, logger="harness.rollout.chat.renderer"):
        renderer(qwen_tokenizer, "qwen3")
    assert "not prefix-preserving" in caplog.text
    assert "using the training template 'qwen3'" in caplog.text
    assert "rendering: incremental (window)" in caplog.text


@pytest.mark.parametrize(
    ("name", "kwargs"), [("qwen3", {}), ("qwen3", {"enable_thinking": False}), ("qwen3_5", {})]
)
def test_training_templates_agree_with_the_official_ones_on_the_turn_generated(qwen_tokenizer, name, kwargs):
    def render_with(source):
        return lambda messages, tools, generation: qwen_tokenizer.apply_chat_template(
            messages,
            tools=tools,
            chat_template=source,
            add_generation_prompt=generation,
            tokenize=False,
            **kwargs,
        )

    assert check_agreement(render_with(template(name)), render_with(load_training_template(name).text)) == []


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5"])
def test_training_templates_keep_earlier_reasoning_that_the_official_ones_drop(qwen_tokenizer, name):
    probe = probe_conversation()  # its first reply reasons, and a second user message follows it
    official = renderer(qwen_tokenizer, name, training_template=False).render_text(probe)
    training = renderer(qwen_tokenizer, name).render_text(probe)
    assert "I should call the weather tool." not in official
    assert "I should call the weather tool." in training


def test_a_template_without_known_tool_format_renders_but_refuses_tools(qwen_tokenizer):
    chat = renderer(qwen_tokenizer, "deepseek_v3_1")
    assert chat.parser is None
    chat.start([{"role": "user", "content": "hi"}])  # without tools: fine
    with pytest.raises(UnknownToolCallFormat, match="tool_call_format"):
        chat.start([{"role": "user", "content": "hi"}], tools=TOOLS)


def test_configuration_errors_are_typed(qwen_tokenizer):
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatRenderer(qwen_tokenizer)  # the rebuilt Qwen tokenizer carries no template
    with pytest.raises(ChatTemplateError, match="check_fraction"):
        renderer(qwen_tokenizer, "qwen2_5", check_fraction=1.5)
    with pytest.raises(UnknownToolCallFormat, match="no tool-call parser named 'hermes2'"):
        renderer(qwen_tokenizer, "qwen2_5", tool_call_format="hermes2")


def test_a_failing_template_raises_chat_template_error(qwen_tokenizer):
    chat = renderer(qwen_tokenizer, "qwen3_5")
    with pytest.raises(ChatTemplateError, match="System message must be at the beginning"):
        chat.render_text([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])


# --- parsing replies through the renderer ---------------------------------------------------------------


def test_parse_detects_the_end_token_and_truncation(qwen_tokenizer):
    chat = renderer(qwen_tokenizer, "qwen3")
    reply = (
        '<think>\nAdd.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    )
    ids = qwen_tokenizer.encode(reply + "<|im_end|>", add_special_tokens=False)
    parsed = chat.parse(ids, tools=TOOLS)
    assert parsed.reasoning == "Add." and not parsed.truncated
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("add", {"a": 1, "b": 2})]
    cut = chat.parse(ids[:-6], tools=TOOLS)
    assert cut.truncated and not cut.tool_calls and [str(e.kind) for e in cut.errors] == ["truncated"]
    assert IM_END in chat.eos_token_ids and 151643 in chat.eos_token_ids  # <|im_end|>, <|endoftext|>


def test_the_chat_package_exports_what_it_lists():
    import harness.rollout.chat

    assert {"ChatRenderer", "Conversation", "TemplateCheck", "RenderStats"} <= set(
        harness.rollout.chat.__all__
    )
    for name in harness.rollout.chat.__all__:
        assert getattr(harness.rollout.chat, name) is not None


FAMILY_TOKENS = {
    "llama": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"],
    "mistral": [
        "[INST]",
        "[/INST]",
        "[TOOL_CALLS]",
        "[AVAILABLE_TOOLS]",
        "[/AVAILABLE_TOOLS]",
        "[TOOL_RESULTS]",
    ],
    "glm": ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"],
}


@pytest.mark.parametrize(
    ("name", "family", "kwargs", "preserving"),
    [
        ("llama3_1", "llama", {}, True),  # checked with single calls: the template refuses parallel ones
        ("llama3_2", "llama", {}, True),
        ("mistral_small3_2", "mistral", {}, False),  # the tools block moves to the latest user message
        ("mistral_nemo", "mistral", {}, False),  # so does the system prompt
        ("glm4_6", "glm", {}, False),  # reasoning before the last user message is dropped
        ("glm4_6", "glm", {"enable_thinking": False}, True),
        ("glm4_7", "glm", {}, False),
    ],
)
def test_other_families_as_shipped(tiny_tokenizer, name, family, kwargs, preserving):
    # The tiny tokenizer with the family's control tokens added, so that they tokenize as single ids.
    tiny_tokenizer.add_special_tokens({"additional_special_tokens": FAMILY_TOKENS[family]})
    chat = renderer(tiny_tokenizer, name, chat_template_kwargs=kwargs)
    assert chat.parser.family == family
    assert chat.check.preserving is preserving and chat.incremental is preserving
