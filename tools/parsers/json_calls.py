"""Reading one tool call written as a JSON object, shared by the JSON families (Qwen, Llama, Mistral).

The families agree on `{"name": ..., <arguments>: {...}}` and differ in the key of the arguments
(`arguments` for Qwen and Mistral, `parameters` for Llama) and in what surrounds the object. Models also
write the arguments as a JSON string holding the object (OpenAI's wire form); that is accepted.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tools.calls import ToolCall
from tools.parsers.base import ParseError, ParseErrorKind

ErrorMaker = Callable[[ParseErrorKind, str, str], ParseError]


def decode_json(text: str) -> tuple[Any, str | None]:
    """(value, None) when `text` is one JSON value, else (None, why) with the decoder's message."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        return None, f"{exc.msg} at line {exc.lineno}, column {exc.colno}"


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
