"""Checking the arguments of a tool call against the tool's schema, before the call.

`bind_arguments(tool, arguments)` takes what the model sent (a dict, or the JSON text of one), applies a few
safe coercions, validates the result with `jsonschema` (draft 2020-12), and returns the keyword arguments to
call the tool with, rebuilt into the Python types its hints name (tuples, sets, enums, dataclasses).
Anything wrong raises `InvalidToolArguments` naming the parameter and the problem; the executor turns that
into a tool message for the model, never an exception that ends the rollout.

The coercions, applied only where the value as sent does not match the schema, and only when lossless:

    "7" -> 7, 7.0 -> 7            for an integer
    "2.5" -> 2.5, "1e3" -> 1000.0 for a number
    "true" / "false" -> bool      for a boolean (any letter case)
    7 -> "7", 2.5 -> "2.5"        for a string
    '[1, 2]' -> [1, 2]            for an array or object sent as JSON text (XML tool-call formats carry text)

Missing parameters typed `X | None` without a default are passed as None. Unknown parameter names are an
error unless the tool takes **kwargs.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Mapping
from typing import Any

import jsonschema

from tools.errors import InvalidToolArguments
from tools.schema import Tool, from_json_value

_INT_RE = re.compile(r"^\s*[-+]?\d+\s*$")


def value_depth(value: Any) -> int:
    """How deeply lists and dicts nest in `value` (iterative: any depth is measured without recursion)."""
    deepest = 0
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list | tuple):
            depth += 1
            deepest = max(deepest, depth)
            stack.extend((child, depth) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def json_value(text: str) -> Any:
    """One JSON value, nested at most MAX_JSON_DEPTH deep (json.JSONDecodeError otherwise)."""
    from tools.parsers.json_calls import raw_decode

    start = len(text) - len(text.lstrip())
    value, end = raw_decode(text, start)
    if text[end:].strip():
        raise json.JSONDecodeError("Extra data", text, end)
    return value


def bind_arguments(tool: Tool, arguments: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """Validate and coerce a call's arguments; return the keyword arguments for `tool.fn`."""
    args = _as_object(tool.name, arguments)
    properties: dict[str, Any] = tool.parameters.get("properties", {})
    unknown = [key for key in args if key not in properties]
    if unknown and not tool.accepts_extra_kwargs:
        key = unknown[0]
        close = difflib.get_close_matches(key, properties, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise InvalidToolArguments(
            tool.name, key, f"no such parameter{hint} (parameters: {', '.join(properties) or 'none'})"
        )
    coerced = {
        key: coerce(value, properties[key]) if key in properties else value for key, value in args.items()
    }
    for key in tool.implicit_none:
        coerced.setdefault(key, None)

    error = jsonschema.exceptions.best_match(tool.validator.iter_errors(coerced))
    if error is not None:
        raise _as_invalid(tool.name, error)
    return {key: from_json_value(value, tool.hints.get(key)) for key, value in coerced.items()}


def coerce(value: Any, schema: Mapping[str, Any]) -> Any:
    """Return `value` coerced toward `schema` where one of the safe coercions applies, else unchanged."""
    options = schema.get("anyOf")
    if options:
        # Prefer an option the value already has the type of; coerce toward the others only after.
        for option in options:
            if _matches_type(value, option):
                return coerce(value, option)
        for option in options:
            converted = coerce(value, option)
            if _matches_type(converted, option):
                return converted
        return value
    if _matches_type(value, schema):
        return _coerce_inside(value, schema)
    kinds = schema.get("type")
    for kind in [kinds] if isinstance(kinds, str) else kinds or ():
        converted = _coerce_scalar(value, kind)
        if converted is not _NO:
            return _coerce_inside(converted, schema)
    return value


# --- internals ----------------------------------------------------------------------------------------

_NO = object()


def _as_object(tool: str, arguments: Mapping[str, Any] | str | None) -> dict[str, Any]:
    if arguments is None:
        return {}
    if isinstance(arguments, str):
        if not arguments.strip():
            return {}
        try:
            arguments = json_value(arguments)
        except json.JSONDecodeError as exc:
            raise InvalidToolArguments(
                tool, None, f"not valid JSON ({exc.msg} at position {exc.pos})"
            ) from None
    if not isinstance(arguments, Mapping):
        raise InvalidToolArguments(
            tool, None, f"must be a JSON object of named arguments, got {type(arguments).__name__}"
        )
    return dict(arguments)


def _as_invalid(tool: str, error: jsonschema.ValidationError) -> InvalidToolArguments:
    path = list(error.absolute_path)
    if error.validator == "required":
        missing = error.message.split("'")[1] if "'" in error.message else None
        return InvalidToolArguments(tool, missing, "missing required parameter")
    parameter = str(path[0]) if path else None
    inner = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path[1:])
    where = f"at {parameter}{inner}: " if inner else ""
    instance = json.dumps(error.instance, default=repr)
    if len(instance) > 80:
        instance = instance[:77] + "..."
    problem = (
        error.message.replace(repr(error.instance), instance)
        if len(repr(error.instance)) > 80
        else error.message
    )
    return InvalidToolArguments(tool, parameter, f"{where}{problem}")


def _matches_type(value: Any, schema: Mapping[str, Any]) -> bool:
    kinds = schema.get("type")
    if kinds is None:
        return "anyOf" not in schema or any(_matches_type(value, option) for option in schema["anyOf"])
    return any(_is_kind(value, kind) for kind in ([kinds] if isinstance(kinds, str) else kinds))


def _is_kind(value: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return {
        "string": str,
        "boolean": bool,
        "array": list,
        "object": dict,
        "null": type(None),
    }.get(kind, object) is type(value) or (kind == "object" and isinstance(value, dict))


def _coerce_scalar(value: Any, kind: str) -> Any:
    if kind == "integer":
        if isinstance(value, str) and _INT_RE.match(value):
            return int(value)
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif kind == "number" and isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return _NO
        return number if math.isfinite(number) else _NO
    elif kind == "boolean" and isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    elif kind == "string" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    elif kind in ("array", "object") and isinstance(value, str):
        try:
            parsed = json_value(value)
        except json.JSONDecodeError:
            return _NO
        if _is_kind(parsed, kind):
            return parsed
    return _NO


def _coerce_inside(value: Any, schema: Mapping[str, Any]) -> Any:
    """Coerce the items of an array and the values of an object, following the schema's structure."""
    if isinstance(value, list):
        prefix = schema.get("prefixItems")
        items = schema.get("items")
        out = []
        for i, item in enumerate(value):
            sub = prefix[i] if prefix and i < len(prefix) else items
            out.append(coerce(item, sub) if isinstance(sub, Mapping) else item)
        return out
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        out_dict = {}
        for key, item in value.items():
            sub = props.get(key, extra)
            out_dict[key] = coerce(item, sub) if isinstance(sub, Mapping) else item
        return out_dict
    return value
