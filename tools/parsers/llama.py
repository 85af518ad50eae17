"""The Llama 3.1 / 3.2 tool-call format: the whole reply is a JSON call.

    {"name": "get_weather", "parameters": {"city": "Paris"}}

optionally after `<|python_tag|>`, and several calls separated by `;` or newlines. The templates render
one call per message, written with "parameters" ("arguments" is accepted as well).

A reply is read as calls only when it starts (after whitespace and `<|python_tag|>`) with a JSON object.
An object without a "name" is an answer written as JSON: it stays content. A reply starting with
`{"name"` or `<|python_tag|>` that does not decode is a call gone wrong, reported as such.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from tools.calls import ToolCall
from tools.parsers.base import ParseError, ParseErrorKind, ToolCallParser
from tools.parsers.json_calls import call_from_object, raw_decode
from tools.schema import Tool

PYTHON_TAG = "<|python_tag|>"
_LOOKS_LIKE_CALL = re.compile(r'^\{\s*("type"\s*:\s*"function"\s*,\s*)?"name"\s*:')
_SEPARATOR = re.compile(r"[\s;]*")


class LlamaParser(ToolCallParser):
    """Parser of Llama 3.1 / 3.2 JSON calls (`{"name": ..., "parameters": {...}}`)."""

    family = "llama"
    stop_markers = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")
    call_format = '{"name": "<tool name>", "parameters": {"<parameter>": <JSON value>}}'

    def _parse_calls(
        self, text: str, tools: Mapping[str, Tool], truncated: bool
    ) -> tuple[str, list[ToolCall], list[ParseError]]:
        body = text.lstrip()
        tagged = body.startswith(PYTHON_TAG)
        if tagged:
            body = body[len(PYTHON_TAG) :].lstrip()
        if not body.startswith("{"):
            if tagged:
                return text, [], [self._error(ParseErrorKind.BAD_JSON, _NOT_JSON, text)]
            return text, [], []

        calls: list[ToolCall] = []
        pos = 0
        while pos < len(body) and body[pos] == "{":
            try:
                obj, end = raw_decode(body, pos)
            except json.JSONDecodeError as exc:
                if not (tagged or calls or _LOOKS_LIKE_CALL.match(body)):
                    return text, [], []  # text that happens to start with "{": an answer, not a call
                if truncated:
                    return body[pos:], calls, [self._unfinished("the JSON tool call", body[pos:], truncated)]
                why = f"the tool call is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"
                return body[pos:], calls, [self._error(ParseErrorKind.BAD_JSON, why, body[pos:])]
            if not (calls or tagged) and not (isinstance(obj, dict) and "name" in obj):
                return text, [], []  # an answer written as JSON
            outcome = call_from_object(
                obj, body[pos:end], self._error, arguments_keys=("parameters", "arguments")
            )
            if not isinstance(outcome, ToolCall):
                return body[pos:], calls, [outcome]
            calls.append(outcome)
            separator = _SEPARATOR.match(body, end)
            assert separator is not None  # the pattern also matches nothing
            pos = separator.end()
        # Text after the calls is content; so is the rest of a reply from the first call that went wrong.
        return body[pos:], calls, []


_NOT_JSON = 'after <|python_tag|> the reply must be a JSON call such as {"name": ..., "parameters": {...}}'
