"""The Qwen2.5 / Qwen3 tool-call format (also Hermes and QwQ): JSON objects inside `<tool_call>` tags.

    <think>reasoning</think>            (Qwen3 and QwQ; optional)
    Some text.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"zone": "CET"}}
    </tool_call>

Any number of calls, anywhere in the reply; the text between them is content. Each tag must close, and
its body must be one JSON object with a "name" and an "arguments" object (an "arguments" string holding
such an object is accepted too). A block ends at the closing tag after its JSON object, so an argument
that holds the tags themselves (code that prints "</tool_call>") does not end the call early.
"""

from __future__ import annotations

from collections.abc import Mapping

from tools.calls import ToolCall
from tools.parsers.base import ParseError, ParseErrorKind, ToolCallParser
from tools.parsers.json_calls import call_from_object, decode_json, raw_decode
from tools.schema import Tool


class QwenParser(ToolCallParser):
    """Parser of JSON calls in `<tool_call>` tags (Qwen2.5, Qwen3, QwQ, Hermes)."""

    family = "qwen"
    stop_markers = ("<|im_end|>", "<|endoftext|>")
    call_format = (
        '<tool_call>\n{"name": "<tool name>", "arguments": {"<parameter>": <JSON value>}}\n</tool_call>'
    )

    def _parse_calls(
        self, text: str, tools: Mapping[str, Tool], truncated: bool
    ) -> tuple[str, list[ToolCall], list[ParseError]]:
        return self._scan_tagged(text, truncated, self._read_block, closing_at=_after_json_body)

    def _read_block(self, body: str, block: str) -> list[ToolCall] | ParseError:
        obj, why = decode_json(body.strip())
        if why is not None:
            return self._error(
                ParseErrorKind.BAD_JSON, f"the JSON inside <tool_call></tool_call> is not valid: {why}", block
            )
        outcome = call_from_object(obj, block, self._error, arguments_keys=("arguments", "parameters"))
        return [outcome] if isinstance(outcome, ToolCall) else outcome


def _after_json_body(text: str, body_start: int) -> int | None:
    """Where `</tool_call>` is when the block's body is one JSON object followed only by space; else None."""
    start = len(text) - len(text[body_start:].lstrip())
    if not text.startswith("{", start):
        return None
    try:
        _, end = raw_decode(text, start)
    except ValueError:
        return None
    closing = len(text) - len(text[end:].lstrip())
    return closing if text.startswith("</tool_call>", closing) else None
