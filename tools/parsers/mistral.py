"""The Mistral tool-call formats, both introduced by the `[TOOL_CALLS]` control token.

    Some text.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}                 (v11 tokenizers:
    [TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}          Small 3.1+, Devstral, Magistral)
    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]   (v3: Nemo)

Text before the first `[TOOL_CALLS]` is content. After it, a `[` starts the JSON-list form; anything else
is the name-then-`[ARGS]` form, one call per `[TOOL_CALLS]`. The arguments are one JSON object; text
after it that does not start another call is content.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from tools.calls import ToolCall
from tools.parsers.base import ParseError, ParseErrorKind, Scan, ToolCallParser
from tools.parsers.json_calls import call_from_object, raw_decode
from tools.schema import Tool

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


class MistralParser(ToolCallParser):
    """Parser of Mistral's `[TOOL_CALLS]` formats (name + `[ARGS]`, or a JSON list)."""

    family = "mistral"
    stop_markers = ("</s>",)
    call_format = '[TOOL_CALLS]<tool name>[ARGS]{"<parameter>": <JSON value>}'

    def _parse_calls(
        self, text: str, tools: Mapping[str, Tool], truncated: bool
    ) -> tuple[str, list[ToolCall], list[ParseError]]:
        scan = Scan()
        first = text.find(TOOL_CALLS)
        if first < 0:
            return text, [], []
        scan.content.append(text[:first])
        pos = first
        while pos < len(text):
            if not text.startswith(TOOL_CALLS, pos):
                following = text.find(TOOL_CALLS, pos)
                stop = following if following >= 0 else len(text)
                scan.content.append(text[pos:stop])
                pos = stop
                continue
            start = pos
            pos += len(TOOL_CALLS)
            rest = text[pos:].lstrip()
            listed = rest.startswith("[") and not rest.startswith((ARGS, CALL_ID))
            reader = self._read_list if listed else self._read_named
            pos, error = reader(text, pos, scan, truncated)
            if error is not None:
                scan.errors.append(error)
                scan.content.append(text[start:pos])
        return scan.result()

    def _read_list(self, text: str, pos: int, scan: Scan, truncated: bool) -> tuple[int, ParseError | None]:
        """`[{"name": ..., "arguments": {...}, "id": ...}, ...]`; returns where it ends."""
        start = len(text) - len(text[pos:].lstrip())
        try:
            items, end = raw_decode(text, start)
        except json.JSONDecodeError as exc:
            end = _next_call(text, start)
            if truncated and end == len(text):
                return end, self._unfinished("the [TOOL_CALLS] list", text[start:end], truncated)
            why = (
                f"the [TOOL_CALLS] list is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"
            )
            return end, self._error(ParseErrorKind.BAD_JSON, why, text[start:end])
        if not items:
            return end, self._error(
                ParseErrorKind.MISSING_NAME, "the [TOOL_CALLS] list holds no call", text[start:end]
            )
        calls = []
        for item in items:
            outcome = call_from_object(item, text[start:end], self._error, arguments_keys=("arguments",))
            if not isinstance(outcome, ToolCall):
                return end, outcome
            calls.append(outcome)
        scan.calls.extend(calls)
        return end, None

    def _read_named(self, text: str, pos: int, scan: Scan, truncated: bool) -> tuple[int, ParseError | None]:
        """`NAME[CALL_ID]ID[ARGS]{...}` or `NAME[ARGS]{...}`; returns where it ends."""
        limit = _next_call(text, pos)
        args_at = text.find(ARGS, pos, limit)
        if args_at < 0:
            if truncated and limit == len(text):
                return limit, self._unfinished("the tool call", text[pos:limit], truncated)
            return limit, self._error(
                ParseErrorKind.BAD_ARGUMENTS,
                "the tool name is not followed by [ARGS] and its arguments",
                text[pos:limit],
            )
        head = text[pos:args_at]
        call_id = None
        if CALL_ID in head:
            head, call_id = head.split(CALL_ID, 1)
            call_id = call_id.strip() or None
        name = head.strip()
        if not name:
            return limit, self._error(
                ParseErrorKind.MISSING_NAME, "[TOOL_CALLS] is not followed by a tool name", text[pos:limit]
            )
        args_start = args_at + len(ARGS)
        args_start += len(text[args_start:]) - len(text[args_start:].lstrip())
        try:
            arguments, end = raw_decode(text, args_start)
        except json.JSONDecodeError as exc:
            if truncated and limit == len(text):
                return limit, self._unfinished(f"the arguments of call '{name}'", text[pos:limit], truncated)
            why = f"the arguments of call '{name}' are not valid JSON: {exc.msg} at column {exc.colno}"
            return limit, self._error(ParseErrorKind.BAD_JSON, why, text[pos:limit])
        if not isinstance(arguments, dict):
            return end, self._error(
                ParseErrorKind.BAD_ARGUMENTS,
                f"the arguments of call '{name}' must be a JSON object of named values",
                text[pos:end],
            )
        scan.calls.append(ToolCall(name, arguments, call_id))
        return end, None


def _next_call(text: str, pos: int) -> int:
    """Where the next `[TOOL_CALLS]` starts after `pos`, or the end of the text."""
    following = text.find(TOOL_CALLS, pos)
    return following if following >= 0 else len(text)
