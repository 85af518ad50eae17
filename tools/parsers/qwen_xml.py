"""The Qwen3.5 / Qwen3-Coder tool-call format: XML-like tags, every argument written as text.

    <think>reasoning</think>            (Qwen3.5; the prompt usually opens the block)
    Some text.
    <tool_call>
    <function=write_file>
    <parameter=path>
    notes.txt
    </parameter>
    <parameter=lines>
    [1, 2, 3]
    </parameter>
    </function>
    </tool_call>

A value is the text between `<parameter=KEY>` and `</parameter>`, less one newline on each side. The
template writes strings as they are and other values as JSON (or Python's `True`/`None` spelling), so a
value is typed from the tool's schema (`typed_value`): a string parameter keeps its text, an integer
parameter reads `7` as 7, an array parameter reads `[1, 2, 3]` as a list. Without a schema (an unknown
tool or parameter) values stay strings, and the executor reports the unknown name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from tools.calls import ToolCall
from tools.parsers.base import ParseError, ParseErrorKind, ToolCallParser, parameter_schema, typed_value
from tools.schema import Tool

_FUNCTION_RE = re.compile(r"<function=([^>\n]*)>")
_PARAMETER_RE = re.compile(r"<parameter=([^>\n]*)>")


class QwenXmlParser(ToolCallParser):
    """Parser of `<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>`."""

    family = "qwen_xml"
    stop_markers = ("<|im_end|>", "<|endoftext|>")
    call_format = (
        "<tool_call>\n<function=TOOL_NAME>\n<parameter=PARAMETER_NAME>\nvalue\n</parameter>\n</function>\n"
        "</tool_call>"
    )

    def _parse_calls(
        self, text: str, tools: Mapping[str, Tool], truncated: bool
    ) -> tuple[str, list[ToolCall], list[ParseError]]:
        return self._scan_tagged(text, truncated, lambda body, block: self._read_block(body, block, tools))

    def _read_block(self, body: str, block: str, tools: Mapping[str, Tool]) -> list[ToolCall] | ParseError:
        """The calls of one closed <tool_call> block (normally one), or the error that spoils the block."""
        functions = list(_FUNCTION_RE.finditer(body))
        if not functions:
            return self._error(
                ParseErrorKind.MISSING_NAME, "the <tool_call> holds no <function=NAME> tag", block
            )
        calls = []
        for index, match in enumerate(functions):
            name = match.group(1).strip()
            if not name:
                return self._error(ParseErrorKind.MISSING_NAME, "a <function=...> tag names no tool", block)
            limit = functions[index + 1].start() if index + 1 < len(functions) else len(body)
            close = body.find("</function>", match.end(), limit)
            if close < 0:
                return self._unfinished(f"<function={name}>", block, truncated=False)
            arguments, error = self._read_parameters(name, body[match.end() : close], block, tools)
            if error is not None:
                return error
            calls.append(ToolCall(name, arguments))
        return calls

    def _read_parameters(
        self, name: str, body: str, block: str, tools: Mapping[str, Tool]
    ) -> tuple[dict[str, Any], ParseError | None]:
        arguments: dict[str, Any] = {}
        pos = 0
        while (match := _PARAMETER_RE.search(body, pos)) is not None:
            key = match.group(1).strip()
            if not key:
                return {}, self._error(
                    ParseErrorKind.BAD_ARGUMENTS, f"a <parameter=...> tag of call '{name}' has no name", block
                )
            close = body.find("</parameter>", match.end())
            reopened = _PARAMETER_RE.search(body, match.end())
            if close < 0 or (reopened is not None and reopened.start() < close):
                return {}, self._unfinished(f"<parameter={key}> of call '{name}'", block, truncated=False)
            if key in arguments:
                return {}, self._error(
                    ParseErrorKind.BAD_ARGUMENTS, f"parameter '{key}' of call '{name}' is given twice", block
                )
            if body[pos : match.start()].strip():
                return {}, self._stray(name, body[pos : match.start()], block)
            raw = _strip_one_newline(body[match.end() : close])
            arguments[key] = typed_value(raw, parameter_schema(tools, name, key))
            pos = close + len("</parameter>")
        if body[pos:].strip():
            return {}, self._stray(name, body[pos:], block)
        return arguments, None

    def _stray(self, name: str, text: str, block: str) -> ParseError:
        return self._error(
            ParseErrorKind.BAD_ARGUMENTS,
            f"call '{name}' has text outside its <parameter=...> tags: {text.strip()[:60]}",
            block,
        )


def _strip_one_newline(value: str) -> str:
    """Remove the newline the format puts after the opening and before the closing tag, and only that."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value
