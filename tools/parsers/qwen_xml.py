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

Values are raw text, so a value may itself hold the closing tags (code that writes "</parameter>" or
"</tool_call>"). A tag closes only where the format's structure continues after it: `</parameter>`
before the next `<parameter=` or the function's end, `</function>` before the next `<function=` or the
block's end, `</tool_call>` right after a `</function>`.
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
_FUNCTION_END = re.compile(r"</function>(?=\s*(?:<function=|\Z))")
_PARAMETER_END = re.compile(r"</parameter>(?=\s*(?:<parameter=|\Z))")
_BLOCK_END = re.compile(r"</function>\s*(</tool_call>)")
_BLOCK_START = re.compile(r"<tool_call>\s*<function=")


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
        return self._scan_tagged(
            text, truncated, lambda body, block: self._read_block(body, block, tools), closing_at=_block_end
        )

    def _read_block(self, body: str, block: str, tools: Mapping[str, Tool]) -> list[ToolCall] | ParseError:
        """The calls of one closed <tool_call> block (normally one), or the error that spoils the block."""
        match = _FUNCTION_RE.search(body)
        if match is None:
            return self._error(
                ParseErrorKind.MISSING_NAME, "the <tool_call> holds no <function=NAME> tag", block
            )
        calls = []
        while match is not None:
            name = match.group(1).strip()
            if not name:
                return self._error(ParseErrorKind.MISSING_NAME, "a <function=...> tag names no tool", block)
            end = _FUNCTION_END.search(body, match.end())
            end_at = end.start() if end is not None else body.rfind("</function>", match.end())
            if end_at < 0:
                return self._unfinished(f"<function={name}>", block, truncated=False)
            arguments, error = self._read_parameters(name, body[match.end() : end_at], block, tools)
            if error is not None:
                return error
            calls.append(ToolCall(name, arguments))
            if end is None:
                break  # the last function: what follows its close is not another call
            match = _FUNCTION_RE.match(body, len(body) - len(body[end.end() :].lstrip()))
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
            closing = _PARAMETER_END.search(body, match.end())
            # no close where the structure goes on: the last one, so text after it is reported as stray
            close = closing.start() if closing is not None else body.rfind("</parameter>", match.end())
            # another parameter opening on its own line before this one closed: this one was left open
            reopened = re.compile(r"\n\s*<parameter=").search(body, match.end())
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


def _block_end(text: str, body_start: int) -> int | None:
    """Where a block's `</tool_call>` is: the first one right after a `</function>`; None (the first one,
    whatever precedes it) when there is none, or when a new block opens before it (this one was left open)."""
    match = _BLOCK_END.search(text, body_start)
    if match is None:
        return None
    reopened = _BLOCK_START.search(text, body_start, match.start())
    return match.start(1) if reopened is None else None
