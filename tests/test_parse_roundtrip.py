"""Property: a call rendered by a model's official chat template parses back to the same call.

For random tool names, argument names and values of every JSON type (with a schema saying which), the
assistant message is rendered with the family's template (tests/fixtures/chat_templates), the text the
model would have generated is cut out of the rendering, and the family's parser must return the same
names, arguments and content. For the XML families this also checks that values written as text are typed
back from the schema.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tools import Tool
from tools.parsers import parser_for_template

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"

# (template file, family, calls per message at most, whether the template renders content next to calls)
FAMILIES = [
    ("qwen2_5.jinja", "qwen", 3, True),
    ("qwen3.jinja", "qwen", 3, True),
    ("qwen3_5.jinja", "qwen_xml", 3, True),
    ("qwen3_coder.jinja", "qwen_xml", 3, True),
    ("llama3_1.jinja", "llama", 1, False),
    ("llama3_2.jinja", "llama", 1, False),
    ("mistral_small3_2.jinja", "mistral", 3, False),
    ("mistral_nemo.jinja", "mistral", 3, False),
    ("glm4_6.jinja", "glm", 3, True),
    ("glm4_7.jinja", "glm", 3, True),
]

NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,15}", fullmatch=True)
# Text a model could put in a string argument; XML formats cannot carry "<" (it would read as a tag).
JSON_TEXT = st.text(max_size=40)
XML_TEXT = st.text(st.characters(exclude_characters="<", exclude_categories=("Cs",)), max_size=40)
CONTENT = st.text(
    st.characters(whitelist_categories=("L", "N", "Zs"), whitelist_characters=".,!?'"), max_size=30
)


def values(text: st.SearchStrategy[str]) -> st.SearchStrategy[tuple[dict[str, Any], Any]]:
    """(schema, value) pairs of every JSON type."""
    return st.one_of(
        st.tuples(st.just({"type": "string"}), text),
        st.tuples(st.just({"type": "integer"}), st.integers(-(10**12), 10**12)),
        st.tuples(st.just({"type": "number"}), st.floats(allow_nan=False, allow_infinity=False)),
        st.tuples(st.just({"type": "boolean"}), st.booleans()),
        st.tuples(st.just({"type": ["integer", "null"]}), st.none()),
        st.tuples(
            st.just({"type": "array", "items": {"type": "integer"}}),
            st.lists(st.integers(-99, 99), max_size=4),
        ),
        st.tuples(st.just({"type": "array", "items": {"type": "string"}}), st.lists(text, max_size=3)),
        st.tuples(
            st.just({"type": "object", "additionalProperties": {"type": "integer"}}),
            st.dictionaries(NAMES, st.integers(-99, 99), max_size=3),
        ),
    )


@st.composite
def messages(
    draw, *, max_calls: int, xml: bool, with_content: bool
) -> tuple[dict[str, Any], dict[str, Tool]]:
    """An assistant message calling random tools, and those tools (their schemas type the XML values)."""
    tools: dict[str, Tool] = {}
    calls = []
    for index in range(draw(st.integers(1, max_calls))):
        name = draw(NAMES)
        typed = draw(st.dictionaries(NAMES, values(XML_TEXT if xml else JSON_TEXT), max_size=4))
        properties = {key: schema for key, (schema, _) in typed.items()}
        if name in tools:  # the same tool called twice: one schema for both calls, so no key is retyped
            known = tools[name].parameters["properties"]
            typed = {key: pair for key, pair in typed.items() if key not in known}
            properties = {**known, **{key: schema for key, (schema, _) in typed.items()}}
        schema = {
            "type": "function",
            "function": {
                "name": name,
                "description": "",
                "parameters": {"type": "object", "properties": properties},
            },
        }
        tools[name] = Tool(name=name, fn=print, schema=schema, is_async=False)
        calls.append(
            {
                "id": f"call{index:05d}",
                "type": "function",
                "function": {"name": name, "arguments": {key: value for key, (_, value) in typed.items()}},
            }
        )
    content = draw(CONTENT) if with_content else ""
    return {"role": "assistant", "content": content, "tool_calls": calls}, tools


@functools.cache
def tokenizer():
    from harness.testing import build_tiny_tokenizer

    return build_tiny_tokenizer()


def generated_text(template: str, message: dict[str, Any], tools: dict[str, Tool]) -> str:
    """The assistant's part of the rendering: what follows the prompt (and its generation prompt)."""
    history = [{"role": "user", "content": "Go."}]
    schemas = [tool.schema for tool in tools.values()]

    def render(conversation, generation):
        return tokenizer().apply_chat_template(
            conversation,
            tools=schemas,
            chat_template=template,
            add_generation_prompt=generation,
            tokenize=False,
        )

    # A model stops at its end-of-turn token: nothing the template writes after it was generated.
    full = render([*history, message], False).rstrip()
    for generation in (True, False):
        prompt = render(history, generation)
        if full.startswith(prompt):
            return full[len(prompt) :]
    raise AssertionError("the template's rendering of the reply does not extend its prompt")


def strategy_for(template_file: str, max_calls: int, with_content: bool):
    family = parser_for_template((TEMPLATES / template_file).read_text()).family
    return messages(max_calls=max_calls, xml=family in ("qwen_xml", "glm"), with_content=with_content)


@pytest.mark.parametrize(("template_file", "family", "max_calls", "with_content"), FAMILIES)
def test_a_rendered_call_parses_back_to_the_same_call(template_file, family, max_calls, with_content):
    template = (TEMPLATES / template_file).read_text()
    parser = parser_for_template(template)
    assert parser.family == family

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(drawn=strategy_for(template_file, max_calls, with_content))
    def roundtrip(drawn):
        message, tools = drawn
        text = generated_text(template, message, tools)
        parsed = parser.parse(text, tools=tools)
        assert parsed.errors == ()
        expected = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
        assert [(call.name, call.arguments) for call in parsed.tool_calls] == expected
        if with_content:
            assert parsed.content.strip() == message["content"].strip()

    roundtrip()
