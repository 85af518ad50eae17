"""The JSON tool-call families (Qwen2.5/Qwen3, Llama 3.1/3.2, Mistral) on 40+ literal replies each,
well-formed and malformed."""

from __future__ import annotations

import pytest
from parser_cases import Reply, cases, check

from tools.parsers import LlamaParser, MistralParser, QwenParser

W = "get_weather"
TC, ETC = "<tool_call>", "</tool_call>"


def qwen_call(body: str) -> str:
    return f"{TC}\n{body}\n{ETC}"


PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ROME = '{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}'

QWEN = cases(
    Reply("Hello there.", "Hello there."),
    Reply("", ""),
    Reply(qwen_call(PARIS), calls=((W, {"city": "Paris"}),)),
    Reply("Let me check.\n" + qwen_call(PARIS), "Let me check.", ((W, {"city": "Paris"}),)),
    Reply(
        qwen_call(PARIS) + "\n" + qwen_call(ROME),
        calls=((W, {"city": "Paris"}), (W, {"city": "Rome", "days": 2})),
    ),
    Reply(
        "A\n" + qwen_call(PARIS) + "\nB\n" + qwen_call(ROME) + "\nC",
        "A\n\nB\n\nC",
        ((W, {"city": "Paris"}), (W, {"city": "Rome", "days": 2})),
    ),
    Reply(
        qwen_call(
            '{"name": "search", "arguments": {"query": "x", "filters": {"year": 2024}, "tags": ["a", "b"]}}'
        ),
        calls=(("search", {"query": "x", "filters": {"year": 2024}, "tags": ["a", "b"]}),),
    ),
    Reply(
        qwen_call('{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}'),
        calls=((W, {"city": "Oslo"}),),
    ),
    Reply(qwen_call('{"name": "get_weather", "arguments": {}}'), calls=((W, {}),)),
    Reply(qwen_call('{"name": "get_weather"}'), calls=((W, {}),)),
    Reply(
        qwen_call('{"name": "get_weather", "parameters": {"city": "Lima"}}'), calls=((W, {"city": "Lima"}),)
    ),
    Reply(
        qwen_call('{"name": "get_weather", "arguments": {"city": "Zürich 東京"}}'),
        calls=((W, {"city": "Zürich 東京"}),),
    ),
    Reply(qwen_call(PARIS) + "<|im_end|>", calls=((W, {"city": "Paris"}),)),
    Reply("Done.<|endoftext|>", "Done."),
    Reply(
        "<think>\nNeed weather.\n</think>\n\n" + qwen_call(PARIS),
        calls=((W, {"city": "Paris"}),),
        reasoning="Need weather.",
    ),
    Reply("Need weather.\n</think>\n\nSure.", "Sure.", reasoning="Need weather."),
    Reply("<think>\nStill thinking about", "", reasoning="Still thinking about", truncated=True),
    Reply(
        "<think>maybe " + qwen_call(PARIS) + "?</think>No call.",
        "No call.",
        reasoning="maybe " + qwen_call(PARIS) + "?",
    ),
    Reply(f"{TC}   {PARIS}   {ETC}", calls=((W, {"city": "Paris"}),)),
    Reply(
        qwen_call('{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}'),
        calls=((W, {"city": "Paris"}),),
    ),
    Reply(
        qwen_call('{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abc"}'),
        calls=((W, {"city": "Paris"}),),
        ids=("abc",),
    ),
    Reply(
        qwen_call(PARIS) + "\nI will wait for the result.",
        "I will wait for the result.",
        ((W, {"city": "Paris"}),),
    ),
    Reply(qwen_call('{"name": "get_weather", "arguments": null}'), calls=((W, {}),)),
    Reply(
        qwen_call(PARIS) + qwen_call(ROME),
        calls=((W, {"city": "Paris"}), (W, {"city": "Rome", "days": 2})),
        ids=("call00000", "call00001"),
    ),
    Reply("Stray </tool_call> tag.", "Stray </tool_call> tag."),
    # Malformed: the text stays, the error says why.
    Reply(
        qwen_call('{"name": "get_weather", "arguments": {"city": "Paris"}'),
        qwen_call('{"name": "get_weather", "arguments": {"city": "Paris"}'),
        errors=("bad_json",),
    ),
    Reply(
        qwen_call('{"name": "get_weather", "arguments": {"city": "Paris",}}'),
        qwen_call('{"name": "get_weather", "arguments": {"city": "Paris",}}'),
        errors=("bad_json",),
    ),
    Reply(qwen_call("{'name': 'get_weather'}"), qwen_call("{'name': 'get_weather'}"), errors=("bad_json",)),
    Reply(qwen_call("[1, 2]"), qwen_call("[1, 2]"), errors=("bad_json",)),
    Reply(
        qwen_call('{"arguments": {"city": "Paris"}}'),
        qwen_call('{"arguments": {"city": "Paris"}}'),
        errors=("missing_name",),
    ),
    Reply(
        qwen_call('{"name": "", "arguments": {}}'),
        qwen_call('{"name": "", "arguments": {}}'),
        errors=("missing_name",),
    ),
    Reply(
        qwen_call('{"name": 3, "arguments": {}}'),
        qwen_call('{"name": 3, "arguments": {}}'),
        errors=("missing_name",),
    ),
    Reply(
        qwen_call('{"name": "get_weather", "arguments": ["Paris"]}'),
        qwen_call('{"name": "get_weather", "arguments": ["Paris"]}'),
        errors=("bad_arguments",),
    ),
    Reply(
        qwen_call('{"name": "get_weather", "arguments": "city=Paris"}'),
        qwen_call('{"name": "get_weather", "arguments": "city=Paris"}'),
        errors=("bad_json",),
    ),
    Reply(
        qwen_call('{"name": "get_weather", "arguments": 7}'),
        qwen_call('{"name": "get_weather", "arguments": 7}'),
        errors=("bad_arguments",),
    ),
    Reply("Ok.\n" + TC + "\n" + PARIS, "Ok.\n" + TC + "\n" + PARIS, errors=("unclosed_tag",)),
    Reply(
        "Ok.\n" + TC + '\n{"name": "get_wea',
        "Ok.\n" + TC + '\n{"name": "get_wea',
        errors=("truncated",),
        truncated=True,
    ),
    Reply("A long answer cut in the mid", "A long answer cut in the mid", truncated=True),
    Reply(
        TC + '\n{"name": "get_weather"\n' + qwen_call(ROME),
        TC + '\n{"name": "get_weather"',
        ((W, {"city": "Rome", "days": 2}),),
        ("unclosed_tag",),
    ),
    Reply(f"{TC}{ETC}", f"{TC}{ETC}", errors=("bad_json",)),
    Reply(
        qwen_call(PARIS) + "\n" + qwen_call("{bad}"),
        qwen_call("{bad}"),
        ((W, {"city": "Paris"}),),
        ("bad_json",),
    ),
    Reply(
        qwen_call("{bad}") + "\n" + qwen_call(PARIS),
        qwen_call("{bad}"),
        ((W, {"city": "Paris"}),),
        ("bad_json",),
    ),
    Reply(qwen_call(PARIS + '{"x": 1}'), qwen_call(PARIS + '{"x": 1}'), errors=("bad_json",)),
    Reply(
        qwen_call("{bad}") + "\n" + qwen_call('{"name": ""}'),
        qwen_call("{bad}") + "\n" + qwen_call('{"name": ""}'),
        errors=("bad_json", "missing_name"),
    ),
)

LLAMA_PARIS = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_ROME = '{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}'

LLAMA = cases(
    Reply("The weather is fine.", "The weather is fine."),
    Reply("", ""),
    Reply(LLAMA_PARIS, calls=((W, {"city": "Paris"}),)),
    Reply('{"name": "get_weather", "arguments": {"city": "Paris"}}', calls=((W, {"city": "Paris"}),)),
    Reply("<|python_tag|>" + LLAMA_PARIS, calls=((W, {"city": "Paris"}),)),
    Reply("\n\n  " + LLAMA_PARIS, calls=((W, {"city": "Paris"}),)),
    Reply(LLAMA_PARIS + "<|eot_id|>", calls=((W, {"city": "Paris"}),)),
    Reply("<|python_tag|>" + LLAMA_PARIS + "<|eom_id|>", calls=((W, {"city": "Paris"}),)),
    Reply(LLAMA_PARIS + "; " + LLAMA_ROME, calls=((W, {"city": "Paris"}), (W, {"city": "Rome", "days": 2}))),
    Reply(LLAMA_PARIS + "\n" + LLAMA_ROME, calls=((W, {"city": "Paris"}), (W, {"city": "Rome", "days": 2}))),
    Reply(LLAMA_PARIS + ";", calls=((W, {"city": "Paris"}),)),
    Reply('{"answer": 42}', '{"answer": 42}'),
    Reply("{x} is a set in my notation.", "{x} is a set in my notation."),
    Reply("Let me call: " + LLAMA_PARIS, "Let me call: " + LLAMA_PARIS),
    Reply(
        '{"name": "search", "parameters": {"query": "q", "filters": {"a": 1}, "tags": ["t"]}}',
        calls=(("search", {"query": "q", "filters": {"a": 1}, "tags": ["t"]}),),
    ),
    Reply('{"name": "get_weather", "parameters": {}}', calls=((W, {}),)),
    Reply(
        '{"name": "get_weather", "parameters": "{\\"city\\": \\"Oslo\\"}"}', calls=((W, {"city": "Oslo"}),)
    ),
    Reply(
        '{"type": "function", "name": "get_weather", "parameters": {"city": "Oslo"}}',
        calls=((W, {"city": "Oslo"}),),
    ),
    Reply(LLAMA_PARIS + "\nThat is my call.", "That is my call.", ((W, {"city": "Paris"}),)),
    Reply(
        '{"name": "get_weather", "parameters": {"city": "São Paulo"}}', calls=((W, {"city": "São Paulo"}),)
    ),
    Reply('{"name": "get_weather", "parameters": null}', calls=((W, {}),)),
    Reply('{"name": "get_weather"}', calls=((W, {}),)),
    Reply("{}", "{}"),
    Reply("[1, 2, 3]", "[1, 2, 3]"),
    Reply(
        '{"name": "get_weather", "parameters": {"city": "A"}}'
        ' ; {"name": "search", "parameters": {"query": "b"}}',
        calls=((W, {"city": "A"}), ("search", {"query": "b"})),
    ),
    Reply("Done.<|eot_id|>", "Done."),
    Reply(
        '{\n  "name": "get_weather",\n  "parameters": {"city": "Paris"}\n}', calls=((W, {"city": "Paris"}),)
    ),
    # Malformed
    Reply(
        '{"name": "get_weather", "parameters": {"city": "Paris"}',
        '{"name": "get_weather", "parameters": {"city": "Paris"}',
        errors=("bad_json",),
    ),
    Reply(
        '{"name": "get_weather", "parameters": {"ci',
        '{"name": "get_weather", "parameters": {"ci',
        errors=("truncated",),
        truncated=True,
    ),
    Reply(
        '<|python_tag|>brave_search.call(query="x")',
        '<|python_tag|>brave_search.call(query="x")',
        errors=("bad_json",),
    ),
    Reply(
        '<|python_tag|>{"parameters": {"city": "Paris"}}',
        '{"parameters": {"city": "Paris"}}',
        errors=("missing_name",),
    ),
    Reply('{"name": "", "parameters": {}}', '{"name": "", "parameters": {}}', errors=("missing_name",)),
    Reply('{"name": 5, "parameters": {}}', '{"name": 5, "parameters": {}}', errors=("missing_name",)),
    Reply(
        '{"name": "get_weather", "parameters": ["Paris"]}',
        '{"name": "get_weather", "parameters": ["Paris"]}',
        errors=("bad_arguments",),
    ),
    Reply(
        '{"name": "get_weather", "parameters": "city=Paris"}',
        '{"name": "get_weather", "parameters": "city=Paris"}',
        errors=("bad_json",),
    ),
    Reply(
        LLAMA_PARIS + '; {"name": "search", "parameters": {',
        '{"name": "search", "parameters": {',
        ((W, {"city": "Paris"}),),
        ("bad_json",),
    ),
    Reply(
        LLAMA_PARIS + '; {"name": "", "parameters": {}}',
        '{"name": "", "parameters": {}}',
        ((W, {"city": "Paris"}),),
        ("missing_name",),
    ),
    Reply(
        '{"type": "function", "name": "get_weather", "parameters": {',
        '{"type": "function", "name": "get_weather", "parameters": {',
        errors=("truncated",),
        truncated=True,
    ),
    Reply(
        '<|python_tag|>{"name": "get_weather", "param',
        '{"name": "get_weather", "param',
        errors=("truncated",),
        truncated=True,
    ),
    Reply(
        '{"name": "get_weather", \'parameters\': {}}',
        '{"name": "get_weather", \'parameters\': {}}',
        errors=("bad_json",),
    ),
    Reply("<|python_tag|>", "<|python_tag|>", errors=("bad_json",)),
)

MISTRAL = cases(
    Reply("Bonjour.", "Bonjour."),
    Reply("", ""),
    Reply(
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', calls=((W, {"city": "Paris"}),), ids=("call00000",)
    ),
    Reply(
        '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}',
        calls=((W, {"city": "Paris"}),),
        ids=("a1b2c3d4e",),
    ),
    Reply(
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]search[ARGS]{"query": "x"}',
        calls=((W, {"city": "Paris"}), ("search", {"query": "x"})),
    ),
    Reply('Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "Checking.", ((W, {"city": "Paris"}),)),
    Reply('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}</s>', calls=((W, {"city": "Paris"}),)),
    Reply(
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcdefghi"}]',
        calls=((W, {"city": "Paris"}),),
        ids=("abcdefghi",),
    ),
    Reply(
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "A"}, "id":'
        ' "aaaaaaaaa"}, {"name": "search", "arguments": {"query": "b"}, "id": "bbbbbbbbb"}]',
        calls=((W, {"city": "A"}), ("search", {"query": "b"})),
        ids=("aaaaaaaaa", "bbbbbbbbb"),
    ),
    Reply(
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        calls=((W, {"city": "Paris"}),),
        ids=("call00000",),
    ),
    Reply(
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]</s>',
        calls=((W, {"city": "Paris"}),),
    ),
    Reply('[TOOL_CALLS]get_weather[ARGS] {"city": "Paris"}', calls=((W, {"city": "Paris"}),)),
    Reply(
        '[TOOL_CALLS]search[ARGS]{"query": "q", "filters": {"y": 1}, "tags": ["a"]}',
        calls=(("search", {"query": "q", "filters": {"y": 1}, "tags": ["a"]}),),
    ),
    Reply("[TOOL_CALLS]get_weather[ARGS]{}", calls=((W, {}),)),
    Reply(
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"} and more text',
        " and more text",
        ((W, {"city": "Paris"}),),
    ),
    Reply('[TOOL_CALLS] get_weather [ARGS]{"city": "Paris"}', calls=((W, {"city": "Paris"}),)),
    Reply('[TOOL_CALLS]get_weather[ARGS]{"city": "Kraków"}', calls=((W, {"city": "Kraków"}),)),
    Reply(
        '[TOOL_CALLS][{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}]',
        calls=((W, {"city": "Oslo"}),),
    ),
    Reply("No tools needed here.</s>", "No tools needed here."),
    Reply(
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS][{"name":'
        ' "search", "arguments": {"query": "x"}}]',
        calls=((W, {"city": "Paris"}), ("search", {"query": "x"})),
    ),
    Reply(
        '[TOOL_CALLS]get_weather[CALL_ID]123456789[ARGS]{"city":'
        ' "A"}[TOOL_CALLS]get_weather[CALL_ID]987654321[ARGS]{"city": "B"}',
        calls=((W, {"city": "A"}), (W, {"city": "B"})),
        ids=("123456789", "987654321"),
    ),
    Reply('[TOOL_CALLS]get_weather[ARGS]{\n  "city": "Paris"\n}', calls=((W, {"city": "Paris"}),)),
    # Malformed
    Reply("[TOOL_CALLS]get_weather", "[TOOL_CALLS]get_weather", errors=("bad_arguments",)),
    Reply("[TOOL_CALLS]get_wea", "[TOOL_CALLS]get_wea", errors=("truncated",), truncated=True),
    Reply(
        '[TOOL_CALLS][ARGS]{"city": "Paris"}', '[TOOL_CALLS][ARGS]{"city": "Paris"}', errors=("missing_name",)
    ),
    Reply(
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"',
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"',
        errors=("bad_json",),
    ),
    Reply(
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa',
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa',
        errors=("truncated",),
        truncated=True,
    ),
    Reply(
        '[TOOL_CALLS]get_weather[ARGS]["Paris"]',
        '[TOOL_CALLS]get_weather[ARGS]["Paris"]',
        errors=("bad_arguments",),
    ),
    Reply(
        "[TOOL_CALLS]get_weather[ARGS]city=Paris",
        "[TOOL_CALLS]get_weather[ARGS]city=Paris",
        errors=("bad_json",),
    ),
    Reply(
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}',
        errors=("bad_json",),
    ),
    Reply(
        '[TOOL_CALLS][{"name": "get_weather", "argum',
        '[TOOL_CALLS][{"name": "get_weather", "argum',
        errors=("truncated",),
        truncated=True,
    ),
    Reply("[TOOL_CALLS][]", "[TOOL_CALLS][]", errors=("missing_name",)),
    Reply(
        '[TOOL_CALLS][{"arguments": {"city": "Paris"}}]',
        '[TOOL_CALLS][{"arguments": {"city": "Paris"}}]',
        errors=("missing_name",),
    ),
    Reply(
        '[TOOL_CALLS][{"name": "get_weather", "arguments": [1]}]',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": [1]}]',
        errors=("bad_arguments",),
    ),
    Reply('[TOOL_CALLS]["get_weather"]', '[TOOL_CALLS]["get_weather"]', errors=("bad_json",)),
    Reply(
        '[TOOL_CALLS]get_weather[ARGS]{"city": "A"}[TOOL_CALLS]search',
        "[TOOL_CALLS]search",
        ((W, {"city": "A"}),),
        ("bad_arguments",),
    ),
    Reply(
        '[TOOL_CALLS]search[ARGS]{bad}[TOOL_CALLS]get_weather[ARGS]{"city": "A"}',
        "[TOOL_CALLS]search[ARGS]{bad}",
        ((W, {"city": "A"}),),
        ("bad_json",),
    ),
    Reply("[TOOL_CALLS]", "[TOOL_CALLS]", errors=("bad_arguments",)),
    Reply("[TOOL_CALLS]", "[TOOL_CALLS]", errors=("truncated",), truncated=True),
    Reply(
        "[TOOL_CALLS]get_weather[CALL_ID]abc[ARGS]",
        "[TOOL_CALLS]get_weather[CALL_ID]abc[ARGS]",
        errors=("bad_json",),
    ),
)


@pytest.mark.parametrize("reply", QWEN)
def test_qwen_replies(reply):
    check(QwenParser(reasoning=True), reply)


@pytest.mark.parametrize("reply", LLAMA)
def test_llama_replies(reply):
    check(LlamaParser(), reply)


@pytest.mark.parametrize("reply", MISTRAL)
def test_mistral_replies(reply):
    check(MistralParser(), reply)


def test_each_json_family_has_at_least_40_replies_some_malformed():
    for table in (QWEN, LLAMA, MISTRAL):
        replies = [param.values[0] for param in table]
        assert len(replies) >= 40
        assert sum(1 for reply in replies if reply.errors) >= 10
