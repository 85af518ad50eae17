"""Tool-call parsers per model family: a reply's text -> content, reasoning, tool calls and parse errors.

parser = parser_for_template(tokenizer.chat_template)          # or get_parser("qwen_xml")
parsed = parser.parse(text, tools=toolset, truncated=False)
parsed.tool_calls, parsed.errors, parsed.to_message()
parser.error_message(parsed)                                    # the tool message after a parse error
"""

from tools.parsers.base import (
    ParsedMessage,
    ParseError,
    ParseErrorKind,
    ToolCallParser,
    UnknownToolCallFormat,
    default_call_id,
    split_reasoning,
    typed_value,
)
from tools.parsers.detect import PARSERS, detect_family, get_parser, parser_for_template
from tools.parsers.glm import GlmParser
from tools.parsers.llama import LlamaParser
from tools.parsers.mistral import MistralParser
from tools.parsers.qwen import QwenParser
from tools.parsers.qwen_xml import QwenXmlParser

__all__ = [
    "PARSERS",
    "GlmParser",
    "LlamaParser",
    "MistralParser",
    "ParseError",
    "ParseErrorKind",
    "ParsedMessage",
    "QwenParser",
    "QwenXmlParser",
    "ToolCallParser",
    "UnknownToolCallFormat",
    "default_call_id",
    "detect_family",
    "get_parser",
    "parser_for_template",
    "split_reasoning",
    "typed_value",
]
