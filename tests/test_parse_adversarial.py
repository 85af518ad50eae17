"""Tool calls written to break the parser: closing tags inside argument values, and JSON nested thousands
of levels deep. Each ends as data the model sees (the call it meant, or a parse error it is told about),
never as an exception out of the parser, the executor or the rollout."""

from __future__ import annotations

import json

import pytest

from tools import ToolCall, ToolExecutor, Toolset, ToolStatus
from tools.parsers import get_parser
from tools.parsers.json_calls import MAX_JSON_DEPTH

CODE = 'print("</tool_call>")\nprint("<tool_call>")\nprint("</parameter>")\nprint("</function>")\n'


def python(code: str) -> str:
    """Run code.

    Args:
        code: The code.
    """
    return code


TOOLS = Toolset([python])


def test_a_closing_tag_inside_a_json_argument_does_not_end_the_call():
    reply = f"<tool_call>\n{json.dumps({'name': 'python', 'arguments': {'code': CODE}})}\n</tool_call>"
    parsed = get_parser("qwen").parse(reply, tools=TOOLS)
    assert parsed.errors == ()
    assert [(call.name, call.arguments) for call in parsed.tool_calls] == [("python", {"code": CODE})]


def test_closing_tags_inside_an_xml_value_do_not_end_the_call():
    reply = f"<tool_call>\n<function=python>\n<parameter=code>\n{CODE}</parameter>\n</function>\n</tool_call>"
    parsed = get_parser("qwen_xml").parse(reply, tools=TOOLS)
    assert parsed.errors == ()
    assert [(call.name, call.arguments) for call in parsed.tool_calls] == [
        ("python", {"code": CODE.rstrip("\n")})
    ]


def test_two_calls_around_tags_in_values_stay_two_calls():
    first = json.dumps({"name": "python", "arguments": {"code": "x = '</tool_call>'"}})
    second = json.dumps({"name": "python", "arguments": {"code": "y = 1"}})
    reply = f"<tool_call>\n{first}\n</tool_call>\ntext\n<tool_call>\n{second}\n</tool_call>"
    parsed = get_parser("qwen").parse(reply, tools=TOOLS)
    assert [call.arguments["code"] for call in parsed.tool_calls] == ["x = '</tool_call>'", "y = 1"]
    assert parsed.content.strip() == "text"


DEEP = "[" * 5000 + "]" * 5000
DEEP_REPLIES = {
    "qwen": f'<tool_call>\n{{"name": "python", "arguments": {{"code": {DEEP}}}}}\n</tool_call>',
    "llama": f'{{"name": "python", "parameters": {{"code": {DEEP}}}}}',
    "mistral": f'[TOOL_CALLS][{{"name": "python", "arguments": {{"code": {DEEP}}}}}]',
    "qwen_xml": (
        f"<tool_call>\n<function=python>\n<parameter=code>\n{DEEP}\n</parameter>\n</function>\n</tool_call>"
    ),
}


@pytest.mark.parametrize("family", sorted(DEEP_REPLIES))
def test_json_nested_thousands_deep_is_a_parse_error_or_a_string(family):
    parsed = get_parser(family).parse(DEEP_REPLIES[family], tools=TOOLS)
    if family == "qwen_xml":  # a string parameter keeps its text as it is
        assert parsed.tool_calls[0].arguments == {"code": DEEP}
        return
    assert parsed.tool_calls == ()
    (error,) = parsed.errors
    assert error.kind == "bad_json" and f"nested more than {MAX_JSON_DEPTH} levels deep" in error.message


def test_nesting_just_under_the_cap_still_parses():
    inner = MAX_JSON_DEPTH - 2  # the call object and its arguments are two of the levels
    value = "[" * inner + "]" * inner
    reply = f'<tool_call>\n{{"name": "python", "arguments": {{"code": {value}}}}}\n</tool_call>'
    parsed = get_parser("qwen").parse(reply, tools=TOOLS)
    assert parsed.errors == () and len(parsed.tool_calls) == 1


def deep(depth: int) -> object:
    value: object = []
    for _ in range(depth):
        value = [value]
    return value


def take_anything(value: list) -> str:
    """Take a list.

    Args:
        value: A list.
    """
    return "ok"


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_run_one_never_raises_on_arguments_nested_deeper_than_validation_walks(anyio_backend):
    arguments = {"value": deep(20_000)}
    with ToolExecutor() as executor:
        result = await executor.run_one(ToolCall("take_anything", arguments), Toolset([take_anything]))
    assert result.status is ToolStatus.INVALID_ARGUMENTS
    assert f"nested more than {MAX_JSON_DEPTH} levels deep" in result.content
