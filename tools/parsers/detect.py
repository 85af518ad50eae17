"""Choosing the tool-call parser for a model: from markers in its chat template, or by name.

A chat template shows how the model writes a call, so a few distinctive strings in it tell the family
apart without comparing whole templates (which change between releases and fine-tunes):

    [TOOL_CALLS]                                   mistral    (Mistral Nemo, Small, Devstral, ...)
    <arg_key>                                      glm        (GLM-4.5, 4.6, 4.7)
    <tool_call> and <function=                     qwen_xml   (Qwen3.5, Qwen3-Coder)
    <tool_call>                                    qwen       (Qwen2.5, Qwen3, QwQ, Hermes)
    <|python_tag|>, or <|start_header_id|> with
    a "parameters" key                             llama      (Llama 3.1, 3.2)

The first row that matches wins, so the more specific markers come first. Reasoning (`<think>` blocks) is
split off when the template mentions `</think>`. Any other template (DeepSeek, Kimi, gpt-oss, ...) has no
parser here: `detect_family` raises `UnknownToolCallFormat`, and the configuration must name a family.
"""

from __future__ import annotations

from tools.parsers.base import ToolCallParser, UnknownToolCallFormat
from tools.parsers.glm import GlmParser
from tools.parsers.llama import LlamaParser
from tools.parsers.mistral import MistralParser
from tools.parsers.qwen import QwenParser
from tools.parsers.qwen_xml import QwenXmlParser

PARSERS: dict[str, type[ToolCallParser]] = {
    parser.family: parser for parser in (QwenParser, QwenXmlParser, LlamaParser, MistralParser, GlmParser)
}


def detect_family(chat_template: str) -> str:
    """The tool-call family a chat template writes calls in; raises UnknownToolCallFormat when none fits."""
    if "[TOOL_CALLS]" in chat_template:
        return MistralParser.family
    if "<arg_key>" in chat_template:
        return GlmParser.family
    if "<tool_call>" in chat_template:
        return QwenXmlParser.family if "<function=" in chat_template else QwenParser.family
    if "<|python_tag|>" in chat_template or (
        "<|start_header_id|>" in chat_template and '"parameters"' in chat_template
    ):
        return LlamaParser.family
    raise UnknownToolCallFormat(
        "the chat template shows none of the tool-call formats this harness parses "
        f"({', '.join(PARSERS)}); name the family in the configuration (tool_call_format) if the model "
        "writes one of them"
    )


def get_parser(family: str, *, reasoning: bool = False) -> ToolCallParser:
    """A parser for a family by name (`qwen`, `qwen_xml`, `llama`, `mistral`, `glm`)."""
    parser = PARSERS.get(family)
    if parser is None:
        raise UnknownToolCallFormat(
            f"no tool-call parser named '{family}'; choose one of {', '.join(PARSERS)}"
        )
    return parser(reasoning=reasoning)


def parser_for_template(chat_template: str, *, family: str | None = None) -> ToolCallParser:
    """The parser for a chat template: the family named by `family` when given, else the one detected.

    Reasoning is split off when the template knows `</think>`, whichever way the family was chosen.
    """
    chosen = family if family is not None else detect_family(chat_template)
    return get_parser(chosen, reasoning="</think>" in chat_template)
