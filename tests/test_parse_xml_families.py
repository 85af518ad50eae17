"""The XML tool-call families (Qwen3.5/Qwen3-Coder, GLM-4.5+) on 40+ literal replies each, well-formed and
malformed, with argument values typed from the tools' schemas (see parser_cases.TOOLS)."""

from __future__ import annotations

import pytest
from parser_cases import Reply, cases, check

from tools.parsers import GlmParser, QwenXmlParser

W = "get_weather"


def xml_call(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


PARIS = xml_call(W, ("city", "Paris"))

QWEN_XML = cases(
    Reply("Plain answer.", "Plain answer."),
    Reply("", ""),
    Reply(PARIS, calls=((W, {"city": "Paris"}),)),
    Reply(xml_call(W, ("city", "Rome"), ("days", "3")), calls=((W, {"city": "Rome", "days": 3}),)),
    Reply(
        xml_call(W, ("city", "Rome"), ("metric", "false")), calls=((W, {"city": "Rome", "metric": False}),)
    ),
    Reply(xml_call(W, ("city", "Rome"), ("metric", "True")), calls=((W, {"city": "Rome", "metric": True}),)),
    Reply(
        xml_call("search", ("query", "q"), ("threshold", "0.25")),
        calls=(("search", {"query": "q", "threshold": 0.25}),),
    ),
    Reply(
        xml_call("search", ("query", "q"), ("tags", '["a", "b"]')),
        calls=(("search", {"query": "q", "tags": ["a", "b"]}),),
    ),
    Reply(
        xml_call("search", ("query", "q"), ("filters", '{"year": 2024}')),
        calls=(("search", {"query": "q", "filters": {"year": 2024}}),),
    ),
    Reply(
        xml_call("search", ("query", "q"), ("tags", "None")),
        calls=(("search", {"query": "q", "tags": None}),),
    ),
    Reply(
        xml_call("search", ("query", "q"), ("note", "None")),
        calls=(("search", {"query": "q", "note": "None"}),),
    ),
    Reply(xml_call("search", ("query", "123")), calls=(("search", {"query": "123"}),)),
    Reply(
        xml_call("write_file", ("path", "a.py"), ("content", "def f():\n    return 1\n")),
        calls=(("write_file", {"path": "a.py", "content": "def f():\n    return 1\n"}),),
    ),
    Reply(
        xml_call("write_file", ("path", "a.txt"), ("content", "\nx\n")),
        calls=(("write_file", {"path": "a.txt", "content": "\nx\n"}),),
    ),
    Reply(
        xml_call("write_file", ("path", "a"), ("content", "if a < b and c > d: pass")),
        calls=(("write_file", {"path": "a", "content": "if a < b and c > d: pass"}),),
    ),
    Reply(xml_call("unknown_tool", ("n", "5")), calls=(("unknown_tool", {"n": "5"}),)),
    Reply(xml_call(W, ("city", "Oslo"), ("hours", "5")), calls=((W, {"city": "Oslo", "hours": "5"}),)),
    Reply(
        PARIS + "\n" + xml_call(W, ("city", "Rome")), calls=((W, {"city": "Paris"}), (W, {"city": "Rome"}))
    ),
    Reply("I will look it up.\n\n" + PARIS, "I will look it up.", ((W, {"city": "Paris"}),)),
    Reply(
        "The user wants weather.\n</think>\n\n" + PARIS,
        calls=((W, {"city": "Paris"}),),
        reasoning="The user wants weather.",
    ),
    Reply("<think>\nhmm\n</think>\n\nAnswer: sunny.", "Answer: sunny.", reasoning="hmm"),
    Reply("<tool_call>\n<function=get_weather>\n</function>\n</tool_call>", calls=((W, {}),)),
    Reply(xml_call(W, ("city", "Oslo"), ("days", "three")), calls=((W, {"city": "Oslo", "days": "three"}),)),
    Reply(
        xml_call("search", ("query", "q"), ("tags", "[a, b]")),
        calls=(("search", {"query": "q", "tags": "[a, b]"}),),
    ),
    Reply(PARIS + "<|im_end|>", calls=((W, {"city": "Paris"}),)),
    Reply(
        "<tool_call><function=get_weather><parameter=city>Lima</parameter></function></tool_call>",
        calls=((W, {"city": "Lima"}),),
    ),
    Reply(
        xml_call(W, (" city ", "Quito")).replace("<function=get_weather>", "<function= get_weather >"),
        calls=((W, {"city": "Quito"}),),
    ),
    Reply(PARIS + "\nWaiting for the result.", "Waiting for the result.", ((W, {"city": "Paris"}),)),
    Reply(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n</function>\n"
        "<function=search>\n<parameter=query>\nB\n</parameter>\n</function>\n</tool_call>",
        calls=((W, {"city": "A"}), ("search", {"query": "B"})),
    ),
    Reply(xml_call(W, ("city", "  spaced  ")), calls=((W, {"city": "  spaced  "}),)),
    # Malformed
    Reply(
        "<tool_call>\nget_weather(city='Paris')\n</tool_call>",
        "<tool_call>\nget_weather(city='Paris')\n</tool_call>",
        errors=("missing_name",),
    ),
    Reply(
        "<tool_call>\n<function=>\n</function>\n</tool_call>",
        "<tool_call>\n<function=>\n</function>\n</tool_call>",
        errors=("missing_name",),
    ),
    Reply(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",
        errors=("unclosed_tag",),
    ),
    Reply(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
        errors=("unclosed_tag",),
    ),
    Reply(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
        errors=("unclosed_tag",),
    ),
    Reply(
        xml_call(W, ("city", "A"), ("city", "B")),
        xml_call(W, ("city", "A"), ("city", "B")),
        errors=("bad_arguments",),
    ),
    Reply(xml_call(W, ("", "A")), xml_call(W, ("", "A")), errors=("bad_arguments",)),
    Reply(
        "Let me see.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis",
        "Let me see.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis",
        errors=("unclosed_tag",),
    ),
    Reply(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
        errors=("truncated",),
        truncated=True,
    ),
    Reply(
        "<tool_call>\n<function=get_wea",
        "<tool_call>\n<function=get_wea",
        errors=("truncated",),
        truncated=True,
    ),
    Reply(
        PARIS + "\n<tool_call>\n</tool_call>",
        "<tool_call>\n</tool_call>",
        ((W, {"city": "Paris"}),),
        ("missing_name",),
    ),
    Reply(
        "<tool_call>\n<function=get_weather>\n" + PARIS,
        "<tool_call>\n<function=get_weather>",
        ((W, {"city": "Paris"}),),
        ("unclosed_tag",),
    ),
    Reply("A truncated plain answer", "A truncated plain answer", truncated=True),
    Reply(
        "<tool_call>\n<function=get_weather>\ncity is Paris\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\ncity is Paris\n</function>\n</tool_call>",
        errors=("bad_arguments",),
    ),
    Reply(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n"
        "A\n</parameter>\nand B\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n"
        "A\n</parameter>\nand B\n</function>\n</tool_call>",
        errors=("bad_arguments",),
    ),
)

GLM_PARIS = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"


def glm_call(name: str, *pairs: tuple[str, str], compact: bool = False) -> str:
    sep = "" if compact else "\n"
    body = "".join(
        f"{sep}<arg_key>{key}</arg_key>{sep}<arg_value>{value}</arg_value>" for key, value in pairs
    )
    return f"<tool_call>{name}{body}{sep}</tool_call>"


GLM = cases(
    Reply("Plain answer.", "Plain answer."),
    Reply("", ""),
    Reply(GLM_PARIS, calls=((W, {"city": "Paris"}),)),
    Reply(glm_call(W, ("city", "Paris"), compact=True), calls=((W, {"city": "Paris"}),)),
    Reply(glm_call(W, ("city", "Rome"), ("days", "4")), calls=((W, {"city": "Rome", "days": 4}),)),
    Reply(
        glm_call(W, ("city", "Rome"), ("metric", "false")), calls=((W, {"city": "Rome", "metric": False}),)
    ),
    Reply(
        glm_call("search", ("query", "q"), ("threshold", "0.9")),
        calls=(("search", {"query": "q", "threshold": 0.9}),),
    ),
    Reply(
        glm_call("search", ("query", "q"), ("tags", '["x", "y"]')),
        calls=(("search", {"query": "q", "tags": ["x", "y"]}),),
    ),
    Reply(
        glm_call("search", ("query", "q"), ("filters", '{"n": 1}')),
        calls=(("search", {"query": "q", "filters": {"n": 1}}),),
    ),
    Reply(
        glm_call("search", ("query", "q"), ("tags", "null")),
        calls=(("search", {"query": "q", "tags": None}),),
    ),
    Reply(glm_call("search", ("query", "42")), calls=(("search", {"query": "42"}),)),
    Reply(glm_call("search", ("query", " padded ")), calls=(("search", {"query": " padded "}),)),
    Reply(
        glm_call("write_file", ("path", "a.py"), ("content", "x = 1\ny = 2\n")),
        calls=(("write_file", {"path": "a.py", "content": "x = 1\ny = 2\n"}),),
    ),
    Reply(
        "\n<think>Weather needed.</think>\nChecking.\n" + GLM_PARIS,
        "Checking.",
        ((W, {"city": "Paris"}),),
        reasoning="Weather needed.",
    ),
    Reply(
        "Weather needed.</think>" + glm_call(W, ("city", "Paris"), compact=True),
        calls=((W, {"city": "Paris"}),),
        reasoning="Weather needed.",
    ),
    Reply("\n<think></think>\nJust text.", "Just text.", reasoning=""),
    Reply(
        GLM_PARIS + "\n" + glm_call(W, ("city", "Rome")),
        calls=((W, {"city": "Paris"}), (W, {"city": "Rome"})),
    ),
    Reply("<tool_call>get_weather\n</tool_call>", calls=((W, {}),)),
    Reply("<tool_call>get_weather</tool_call>", calls=((W, {}),)),
    Reply(glm_call("mystery", ("n", "5")), calls=(("mystery", {"n": "5"}),)),
    Reply(GLM_PARIS + "<|observation|>", calls=((W, {"city": "Paris"}),)),
    Reply("All done.<|user|>", "All done."),
    Reply(glm_call(W, ("city", "Oslo"), ("days", "two")), calls=((W, {"city": "Oslo", "days": "two"}),)),
    Reply(glm_call(W, ("city", '"quoted"')), calls=((W, {"city": '"quoted"'}),)),
    Reply(glm_call(W, ("city", "Zürich")), calls=((W, {"city": "Zürich"}),)),
    Reply(GLM_PARIS + "\nthen I answer", "then I answer", ((W, {"city": "Paris"}),)),
    Reply(
        glm_call("write_file", ("path", "p"), ("content", "<b>bold</b>")),
        calls=(("write_file", {"path": "p", "content": "<b>bold</b>"}),),
    ),
    Reply(glm_call(W, ("city", "A"), ("days", " 3 ")), calls=((W, {"city": "A", "days": 3}),)),
    # Malformed
    Reply(
        "<tool_call>\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
        "<tool_call>\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
        errors=("missing_name",),
    ),
    Reply("<tool_call></tool_call>", "<tool_call></tool_call>", errors=("missing_name",)),
    Reply(
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n</tool_call>",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n</tool_call>",
        errors=("bad_arguments",),
    ),
    Reply(
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris\n</tool_call>",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris\n</tool_call>",
        errors=("bad_arguments",),
    ),
    Reply(glm_call(W, ("", "x")), glm_call(W, ("", "x")), errors=("bad_arguments",)),
    Reply(
        glm_call(W, ("city", "A"), ("city", "B")),
        glm_call(W, ("city", "A"), ("city", "B")),
        errors=("bad_arguments",),
    ),
    Reply(
        "<tool_call>get_weather city=Paris</tool_call>",
        "<tool_call>get_weather city=Paris</tool_call>",
        errors=("bad_arguments",),
    ),
    Reply(
        "<tool_call>get_weather\ncity: Paris\n<arg_key>days</arg_key><arg_value>1</arg_value></tool_call>",
        "<tool_call>get_weather\ncity: Paris\n<arg_key>days</arg_key><arg_value>1</arg_value></tool_call>",
        errors=("bad_arguments",),
    ),
    Reply(
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>",
        errors=("unclosed_tag",),
    ),
    Reply(
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_va",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_va",
        errors=("truncated",),
        truncated=True,
    ),
    Reply(
        GLM_PARIS + "<tool_call></tool_call>",
        "<tool_call></tool_call>",
        ((W, {"city": "Paris"}),),
        ("missing_name",),
    ),
    Reply(
        "<tool_call>get_weather\n" + GLM_PARIS,
        "<tool_call>get_weather",
        ((W, {"city": "Paris"}),),
        ("unclosed_tag",),
    ),
    Reply(
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>A</arg_value>\nstray\n</tool_call>",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>A</arg_value>\nstray\n</tool_call>",
        errors=("bad_arguments",),
    ),
)


@pytest.mark.parametrize("reply", QWEN_XML)
def test_qwen_xml_replies(reply):
    check(QwenXmlParser(reasoning=True), reply)


@pytest.mark.parametrize("reply", GLM)
def test_glm_replies(reply):
    check(GlmParser(reasoning=True), reply)


def test_each_xml_family_has_at_least_40_replies_some_malformed():
    for table in (QWEN_XML, GLM):
        replies = [param.values[0] for param in table]
        assert len(replies) >= 40
        assert sum(1 for reply in replies if reply.errors) >= 10
