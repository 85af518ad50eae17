"""The GLM-4.5 / 4.6 / 4.7 tool-call format: the name after `<tool_call>`, then key/value tag pairs.

    <think>reasoning</think>
    Some text.
    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

GLM-4.7 writes the same without the newlines. The template writes string values as they are and other
values as JSON, so each value is typed from the tool's schema (`typed_value`); values are not stripped,
since the format puts nothing around them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from tools.calls import ToolCall
from tools.parsers.base import ParseError, ParseErrorKind, ToolCallParser, parameter_schema, typed_value
from tools.schema import Tool

_PAIR_RE = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class GlmParser(ToolCallParser):
    """Parser of GLM's `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>`."""

    family = "glm"
    stop_markers = ("<|user|>", "<|observation|>", "<|endoftext|>")
    call_format = (
        "<tool_call>TOOL_NAME\n<arg_key>PARAMETER_NAME</arg_key>\n<arg_value>value</arg_value>\n</tool_call>"
    )

    def _parse_calls(
        self, text: str, tools: Mapping[str, Tool], truncated: bool
    ) -> tuple[str, list[ToolCall], list[ParseError]]:
        return self._scan_tagged(text, truncated, lambda body, block: self._read_call(body, block, tools))

    def _read_call(self, body: str, block: str, tools: Mapping[str, Tool]) -> list[ToolCall] | ParseError:
        first_key = body.find("<arg_key>")
        head = (body if first_key < 0 else body[:first_key]).strip()
        name, _, stray = head.partition(next((c for c in head if c.isspace()), " "))
        if not name or "<" in name:
            return self._error(
                ParseErrorKind.MISSING_NAME, "<tool_call> must be followed by a tool name", block
            )
        if stray.strip():
            return self._error(
                ParseErrorKind.BAD_ARGUMENTS,
                f"call '{name}' has text between its name and its arguments: {stray.strip()[:60]}",
                block,
            )
        arguments: dict[str, Any] = {}
        pos = 0 if first_key < 0 else first_key
        rest = body if first_key >= 0 else ""
        while (match := _PAIR_RE.match(rest, pos)) is not None:
            key = match.group(1).strip()
            if not key:
                return self._error(
                    ParseErrorKind.BAD_ARGUMENTS, f"call '{name}' has an empty <arg_key>", block
                )
            if key in arguments:
                return self._error(
                    ParseErrorKind.BAD_ARGUMENTS, f"argument '{key}' of call '{name}' is given twice", block
                )
            arguments[key] = typed_value(match.group(2), parameter_schema(tools, name, key))
            pos = match.end()
        leftover = rest[pos:].strip()
        if leftover:
            return self._error(
                ParseErrorKind.BAD_ARGUMENTS,
                f"the arguments of call '{name}' must be <arg_key>NAME</arg_key><arg_value>VALUE</arg_value> "
                f"pairs; could not read: {leftover[:60]}",
                block,
            )
        return [ToolCall(name, arguments)]
