"""Reading one tool call written as a JSON object, shared by the JSON families (Qwen, Llama, Mistral).

The families agree on `{"name": ..., <arguments>: {...}}` and differ in the key of the arguments
(`arguments` for Qwen and Mistral, `parameters` for Llama) and in what surrounds the object. Models also
write the arguments as a JSON string holding the object (OpenAI's wire form); that is accepted.

Every JSON value a model writes is decoded here (`decode_json`, `raw_decode`), nested at most
MAX_JSON_DEPTH levels deep: deeper is a decoding error the model is told about, never a RecursionError.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tools.calls import ToolCall
from tools.parsers.base import ParseError, ParseErrorKind

ErrorMaker = Callable[[ParseErrorKind, str, str], ParseError]
MAX_JSON_DEPTH = 64
_DECODER = json.JSONDecoder()


def decode_json(text: str) -> tuple[Any, str | None]:
    """(value, None) when `text` is one JSON value, else (None, why) with the decoder's message."""
    try:
        start = len(text) - len(text.lstrip())
        value, end = raw_decode(text, start)
        if text[end:].strip():
            raise json.JSONDecodeError("Extra data", text, end + len(text[end:]) - len(text[end:].lstrip()))
        return value, None
    except json.JSONDecodeError as exc:
        return None, f"{exc.msg} at line {exc.lineno}, column {exc.colno}"


def raw_decode(text: str, pos: int = 0) -> tuple[Any, int]:
    """The JSON value starting at `pos` and where it ends (json.JSONDecoder.raw_decode), refused with a
    JSONDecodeError when it is nested more than MAX_JSON_DEPTH levels deep."""
    if nesting_depth(text, pos) > MAX_JSON_DEPTH:
        raise json.JSONDecodeError(f"nested more than {MAX_JSON_DEPTH} levels deep", text, pos)
    try:
        return _DECODER.raw_decode(text, pos)
    except RecursionError:  # belt and braces: the depth check above should make this unreachable
        raise json.JSONDecodeError(f"nested more than {MAX_JSON_DEPTH} levels deep", text, pos) from None


def nesting_depth(text: str, pos: int = 0) -> int:
    """The deepest nesting of arrays and objects in the JSON value at `pos` (strings skipped), scanning no
    further than where that value closes."""
    start = len(text) - len(text[pos:].lstrip())
    if start >= len(text) or text[start] not in "[{":
        return 0  # a string, number or literal holds no nesting
    depth = deepest = 0
    in_string = escaped = False
    for index in range(start, len(text)):
        char = text[index]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
            if depth <= 0:
                break
    return deepest


def call_from_object(
    obj: Any, source: str, error: ErrorMaker, *, arguments_keys: tuple[str, ...] = ("arguments", "parameters")
) -> ToolCall | ParseError:
    """Turn a decoded JSON value into a call, or the error saying why it is not one.

    Args:
        obj: The decoded value.
        source: The text it was decoded from, for the error.
        error: The parser's error constructor (kind, message, text).
        arguments_keys: Keys that may hold the arguments, in order of preference.
    """
    if not isinstance(obj, dict):
        return error(
            ParseErrorKind.BAD_JSON,
            f"a tool call must be a JSON object, got {_json_type(obj)}",
            source,
        )
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return error(ParseErrorKind.MISSING_NAME, 'the tool call has no "name" (a non-empty string)', source)
    key = next((key for key in arguments_keys if key in obj), None)
    arguments = obj.get(key) if key is not None else {}
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        decoded, why = decode_json(arguments) if arguments.strip() else ({}, None)
        if why is not None:
            return error(
                ParseErrorKind.BAD_JSON,
                f'the "{key}" string of call "{name}" is not valid JSON: {why}',
                source,
            )
        arguments = decoded
    if not isinstance(arguments, dict):
        return error(
            ParseErrorKind.BAD_ARGUMENTS,
            f'the "{key}" of call "{name}" must be an object of named values, got {_json_type(arguments)}',
            source,
        )
    call_id = obj.get("id")
    return ToolCall(name.strip(), arguments, call_id if isinstance(call_id, str) and call_id else None)


def _json_type(value: Any) -> str:
    return {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        type(None): "null",
    }.get(type(value), type(value).__name__)
