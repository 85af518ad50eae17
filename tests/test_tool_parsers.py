"""Choosing a parser from a chat template, the parse result's message forms, typing of text values, and the
parse-error metrics."""

from __future__ import annotations

import math
import pickle
from pathlib import Path

import pytest

from tools import ParseError, ParseErrorKind, ToolStats, UnknownToolCallFormat, detect_family, get_parser
from tools.parsers import parser_for_template, typed_value

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"


@pytest.mark.parametrize(
    ("template_file", "family", "reasoning"),
    [
        ("qwen2_5.jinja", "qwen", False),
        ("qwen3.jinja", "qwen", True),
        ("qwq.jinja", "qwen", True),
        ("qwen3_5.jinja", "qwen_xml", True),
        ("qwen3_coder.jinja", "qwen_xml", False),
        ("llama3_1.jinja", "llama", False),
        ("llama3_2.jinja", "llama", False),
        ("mistral_small3_2.jinja", "mistral", False),
        ("mistral_nemo.jinja", "mistral", False),
        ("glm4_6.jinja", "glm", True),
        ("glm4_7.jinja", "glm", True),
    ],
)
def test_family_is_detected_from_template_markers(template_file, family, reasoning):
    template = (TEMPLATES / template_file).read_text()
    assert detect_family(template) == family
    parser = parser_for_template(template)
    assert parser.family == family and parser.reasoning is reasoning


def test_detection_uses_markers_not_whole_templates():
    assert detect_family("{{ '<tool_call>' }} my fine-tune, any layout") == "qwen"
    assert detect_family("<tool_call><function={{ name }}>") == "qwen_xml"
    assert detect_family('<|start_header_id|> ... "parameters": ...') == "llama"


def test_an_unknown_template_needs_the_override():
    template = (TEMPLATES / "deepseek_v3_1.jinja").read_text()
    with pytest.raises(UnknownToolCallFormat, match="tool_call_format") as raised:
        detect_family(template)
    assert isinstance(raised.value, LookupError)
    assert parser_for_template(template, family="qwen").family == "qwen"  # the explicit override
    with pytest.raises(UnknownToolCallFormat, match="choose one of qwen, qwen_xml, llama, mistral, glm"):
        get_parser("hermes2")


def test_parsed_message_renders_as_an_openai_style_assistant_message():
    parsed = get_parser("qwen", reasoning=True).parse(
        '<think>r</think>Text.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    )
    assert parsed.to_message() == {
        "role": "assistant",
        "content": "Text.",
        "reasoning_content": "r",
        "tool_calls": [
            {"id": "call00000", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
        ],
    }
    # No reasoning, no calls: the keys are absent rather than empty (Llama's template tests for the key).
    assert get_parser("llama").parse("Hi.").to_message() == {"role": "assistant", "content": "Hi."}


def test_the_error_message_tells_the_model_what_was_wrong_and_the_format():
    parser = get_parser("qwen")
    parsed = parser.parse('<tool_call>\n{"name": "f", "arguments": {"x": }\n</tool_call>')
    message = parser.error_message(parsed)
    assert message["role"] == "tool"
    assert "could not be read, so it was not run" in message["content"]
    assert "the JSON inside <tool_call></tool_call> is not valid: Expecting value" in message["content"]
    assert '{"name": "f", "arguments": {"x": }' in message["content"]  # the call as the model wrote it
    assert parser.call_format in message["content"]
    assert parser.error_message(parser.parse("fine")) is None
    assert (
        get_parser("mistral").error_message(parsed, tool_call_id="abcdefghi")["tool_call_id"] == "abcdefghi"
    )


def test_errors_pickle_and_long_snippets_are_cut():
    parsed = get_parser("qwen").parse("<tool_call>{" + "x" * 500 + "</tool_call>")
    (error,) = parsed.errors
    assert len(error.text) == 200 and error.text.endswith("...")
    assert pickle.loads(pickle.dumps(parsed)) == parsed


@pytest.mark.parametrize(
    ("raw", "schema", "expected"),
    [
        ("7", {"type": "integer"}, 7),
        (" 7 ", {"type": "integer"}, 7),
        ("7.5", {"type": "integer"}, "7.5"),  # not lossless: left for validation to report
        ("2.5", {"type": "number"}, 2.5),
        ("True", {"type": "boolean"}, True),
        ("false", {"type": "boolean"}, False),
        ("None", {"type": ["integer", "null"]}, None),
        ("null", {"anyOf": [{"type": "array"}, {"type": "null"}]}, None),
        ("None", {"type": ["string", "null"]}, "None"),  # a string may say None
        ("[1, 2]", {"type": "array", "items": {"type": "integer"}}, [1, 2]),
        ('{"a": "1"}', {"type": "object", "additionalProperties": {"type": "integer"}}, {"a": 1}),
        ("123", {"type": "string"}, "123"),
        ("123", None, "123"),
    ],
)
def test_text_values_are_typed_from_the_schema(raw, schema, expected):
    assert typed_value(raw, schema) == expected


def test_parse_errors_are_counted_per_family_and_kind():
    stats = ToolStats()
    assert stats.summary()["tools/parse_error_count"] == 0
    stats.record_parse_errors(
        [
            ParseError("qwen", ParseErrorKind.BAD_JSON, "m"),
            ParseError("qwen", ParseErrorKind.TRUNCATED, "m"),
        ]
    )
    stats.record_parse_errors([ParseError("glm", ParseErrorKind.BAD_JSON, "m")])
    stats.record_parse_errors([])
    summary = stats.summary()
    assert summary["tools/parse_error_count"] == 3
    assert summary["tools/parse_error/qwen_count"] == 2 and summary["tools/parse_error/glm_count"] == 1
    assert (
        summary["tools/parse_error/bad_json_count"] == 2 and summary["tools/parse_error/truncated_count"] == 1
    )
    assert math.isnan(summary["tools/failure_frequency"])  # parse errors are not executed calls
    stats.reset()
    assert stats.summary()["tools/parse_error_count"] == 0
    assert "tools/parse_error/qwen_count" not in stats.summary()
