"""Python callables -> the OpenAI-style function schemas a model sees, and back to Python values.

A tool is a sync or async callable with a type hint on every parameter and a Google-style docstring with a
summary and one line per parameter. `Tool.from_callable` turns it into

    {"type": "function", "function": {"name": ..., "description": ..., "parameters": <JSON Schema>}}

and refuses, naming the function and what is missing, a callable it cannot describe honestly.

Type hints map to JSON Schema (draft 2020-12) as follows:

    int, float, str, bool, None        integer, number, string, boolean, null
    Any / object / no parameters        {} (anything)
    Literal[...], Enum subclasses       enum (an Enum arrives at the tool as its member, not its value)
    X | None, Optional[X]               X or null; not required, None when the model leaves it out
    X | Y                               a type list for plain types, anyOf otherwise
    list[X], Sequence[X]                array of X
    set[X], frozenset[X]                array of unique X (arrives as a set)
    tuple[X, Y], tuple[X, ...]          fixed array (prefixItems) or array of X (arrives as a tuple)
    dict[str, X], Mapping[str, X]       object whose values are X
    TypedDict, dataclass                object with their fields (a dataclass arrives as an instance)
    Annotated[X, "text"]                X, with "text" as the description when the docstring has none

A parameter with a default is not required and carries the default in its schema.

transformers has `get_json_schema` for the same job; for the plain cases our output is the same (a test
checks), and we part from it where it is wrong for tool calling or unstable across the releases we support:
it marks Optional with OpenAPI's `nullable` (not JSON Schema, so validators reject a null), omits defaults,
keeps `X | None` without a default required, refuses `tuple[X, ...]`, TypedDict and dataclasses, and only
recent releases know Enum.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import inspect
import types
import typing
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Union, get_args, get_origin

import jsonschema

from tools.docstring import parse_docstring
from tools.errors import ToolDefinitionError

_SCALARS: dict[Any, str] = {
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    type(None): "null",
}
_SEQUENCES = {list, Sequence, typing.Sequence, tuple, set, frozenset, typing.List, typing.Set}  # noqa: UP006
_MAPPINGS = {dict, Mapping, typing.Mapping, typing.Dict}  # noqa: UP006


@dataclass(frozen=True)
class Tool:
    """A callable the model may call, with its schema.

    Attributes:
        name: The name the model calls it by (the callable's `__name__` unless given).
        fn: The callable itself (a module-level function keeps the tool picklable).
        schema: The OpenAI-style function schema rendered into the prompt.
        is_async: Whether calling `fn` returns an awaitable.
        timeout_s: This tool's per-call timeout, overriding the executor's; None keeps the executor's.
        max_output_chars: This tool's output cap, overriding the executor's; None keeps the executor's.
    """

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]
    is_async: bool
    timeout_s: float | None = None
    max_output_chars: int | None = None
    # parameter -> its type hint, to turn validated JSON back into the Python values the tool expects
    hints: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # parameters typed `X | None` without a default: omitted by the model -> called with None
    implicit_none: frozenset[str] = field(default=frozenset(), repr=False, compare=False)
    accepts_extra_kwargs: bool = field(default=False, repr=False, compare=False)

    @classmethod
    def from_callable(
        cls,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        timeout_s: float | None = None,
        max_output_chars: int | None = None,
    ) -> Tool:
        """Describe `fn` as a tool; raise ToolDefinitionError naming the function and what is missing."""
        if isinstance(fn, Tool):
            return fn
        if not callable(fn):
            raise ToolDefinitionError(f"a tool must be callable, got {type(fn).__name__}: {fn!r}")
        tool_name = name or _callable_name(fn)
        # Environments expose bound methods, one set per instance: describe each function only once.
        key = fn.__func__ if inspect.ismethod(fn) else fn if inspect.isfunction(fn) else None
        described = _DESCRIBED.get(key) if key is not None else None
        if described is None:
            described = _describe(fn, tool_name)
            if key is not None:
                _DESCRIBED[key] = described
        schema = {
            "type": "function",
            "function": {
                "name": tool_name,
                "description": described.summary,
                "parameters": described.parameters,
            },
        }
        return cls(
            name=tool_name,
            fn=fn,
            schema=schema,
            is_async=_is_async(fn),
            timeout_s=timeout_s,
            max_output_chars=max_output_chars,
            hints=described.hints,
            implicit_none=described.implicit_none,
            accepts_extra_kwargs=described.accepts_extra_kwargs,
        )

    @property
    def validator(self) -> jsonschema.Draft202012Validator:
        """A validator of the arguments' schema, shared by every tool made from the same function."""
        return _validator_for(self.parameters)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["hints"] = dict(self.hints)  # a mappingproxy does not pickle
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["hints"] = types.MappingProxyType(state["hints"])
        self.__dict__.update(state)

    @property
    def parameters(self) -> dict[str, Any]:
        """The JSON Schema of the tool's arguments."""
        return self.schema["function"]["parameters"]

    @property
    def description(self) -> str:
        return self.schema["function"]["description"]


@dataclass(frozen=True)
class _Description:
    """What a callable's hints and docstring say, independent of the name it is registered under."""

    summary: str
    parameters: dict[str, Any]
    hints: Mapping[str, Any]
    implicit_none: frozenset[str]
    accepts_extra_kwargs: bool


_DESCRIBED: weakref.WeakKeyDictionary[Callable[..., Any], _Description] = weakref.WeakKeyDictionary()


_VALIDATORS: collections.OrderedDict[int, tuple[dict[str, Any], jsonschema.Draft202012Validator]] = (
    collections.OrderedDict()
)


def _validator_for(parameters: dict[str, Any]) -> jsonschema.Draft202012Validator:
    """A validator per parameters schema, kept in a small LRU (the entry holds the schema, so its id
    cannot be reused by another while cached)."""
    entry = _VALIDATORS.get(id(parameters))
    if entry is None or entry[0] is not parameters:
        entry = (parameters, jsonschema.Draft202012Validator(parameters))
        _VALIDATORS[id(parameters)] = entry
        if len(_VALIDATORS) > 4096:
            _VALIDATORS.popitem(last=False)
    else:
        _VALIDATORS.move_to_end(id(parameters))
    return entry[1]


def _describe(fn: Callable[..., Any], tool_name: str) -> _Description:
    target = _signature_target(fn)
    label = f"tool '{tool_name}' ({_qualname(target)})"
    doc = parse_docstring(inspect.getdoc(target))
    if not doc.summary:
        raise ToolDefinitionError(
            f"{label} has no docstring: write a Google-style docstring with a one-line summary and an "
            "'Args:' section describing each parameter; the model reads them to decide how to call it"
        )
    try:
        hints = typing.get_type_hints(target, include_extras=True)
    except Exception as exc:  # a forward reference that does not resolve, say
        raise ToolDefinitionError(f"{label}: its type hints cannot be resolved: {exc}") from exc

    properties: dict[str, Any] = {}
    required: list[str] = []
    implicit_none: set[str] = set()
    call_hints: dict[str, Any] = {}
    accepts_extra = False
    params = list(inspect.signature(fn).parameters.values())
    if (
        inspect.isfunction(fn)
        and params
        and params[0].name in ("self", "cls")
        and params[0].annotation is params[0].empty
    ):
        params = params[1:]  # a method taken from its class: the receiver is bound later, never sent
    for param in params:
        if param.kind is param.VAR_KEYWORD:
            accepts_extra = True
            continue
        if param.kind is param.VAR_POSITIONAL:
            raise ToolDefinitionError(
                f"{label}: *{param.name} cannot be passed by a model, which sends named arguments only; "
                "take a list parameter instead"
            )
        if param.kind is param.POSITIONAL_ONLY:
            raise ToolDefinitionError(
                f"{label}: parameter '{param.name}' is positional-only; a model sends named arguments"
            )
        if param.name not in hints:
            raise ToolDefinitionError(
                f"{label}: parameter '{param.name}' has no type hint; add one (e.g. `{param.name}: str`)"
            )
        hint = hints[param.name]
        where = f"{label}, parameter '{param.name}'"
        prop = _schema_for_hint(hint, where)
        description = doc.args.get(param.name) or _annotated_description(hint)
        if not description:
            raise ToolDefinitionError(
                f"{label}: parameter '{param.name}' is not described in the docstring; add "
                f"'{param.name}: <what it is>' under 'Args:'"
            )
        prop["description"] = description
        if param.default is not param.empty:
            if _is_json_value(param.default):
                prop["default"] = (
                    param.default.value if isinstance(param.default, enum.Enum) else param.default
                )
        elif _allows_none(hint):
            implicit_none.add(param.name)
        else:
            required.append(param.name)
        properties[param.name] = prop
        call_hints[param.name] = hint

    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    return _Description(
        summary=doc.summary,
        parameters=parameters,
        hints=types.MappingProxyType(call_hints),
        implicit_none=frozenset(implicit_none),
        accepts_extra_kwargs=accepts_extra,
    )


def function_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI-style function schema of a callable (see the module docstring for the type mapping)."""
    return Tool.from_callable(fn).schema


def from_json_value(value: Any, hint: Any) -> Any:
    """Turn a validated JSON value into what a parameter typed `hint` expects.

    JSON has no tuples, sets, enums or dataclasses; the schema admitted their JSON form, this rebuilds them.
    Values of other types pass through unchanged.
    """
    hint = _strip_annotated(hint)
    origin, args = get_origin(hint), get_args(hint)
    if value is None:
        return None
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(value)
    if dataclasses.is_dataclass(hint) and isinstance(hint, type) and isinstance(value, dict):
        field_hints = typing.get_type_hints(hint, include_extras=True)
        return hint(**{k: from_json_value(v, field_hints.get(k, Any)) for k, v in value.items()})
    if _is_union(origin):
        return _convert_union(value, args)
    if origin in (tuple,) and isinstance(value, list):
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(from_json_value(v, args[0]) for v in value)
        return tuple(from_json_value(v, h) for v, h in zip(value, args or [Any] * len(value), strict=False))
    if origin in (set, frozenset) and isinstance(value, list):
        item = args[0] if args else Any
        return origin(from_json_value(v, item) for v in value)
    if origin in _SEQUENCES and isinstance(value, list):
        item = args[0] if args else Any
        return [from_json_value(v, item) for v in value]
    if origin in _MAPPINGS and isinstance(value, dict) and len(args) == 2:
        return {k: from_json_value(v, args[1]) for k, v in value.items()}
    if hint in (tuple, set, frozenset) and isinstance(value, list):
        return hint(value)
    return value


# --- type hints -> JSON Schema ------------------------------------------------------------------------


def _schema_for_hint(hint: Any, where: str) -> dict[str, Any]:
    hint = _strip_annotated(hint)
    origin, args = get_origin(hint), get_args(hint)
    if hint in (Any, object, inspect.Parameter.empty):
        return {}
    if hint in _SCALARS or hint is None:
        return {"type": _SCALARS[type(None) if hint is None else hint]}
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _enum_schema([member.value for member in hint], f"{where}: Enum {hint.__name__}")
    if origin is Literal:
        return _enum_schema(list(args), f"{where}: Literal")
    if _is_union(origin):
        return _union_schema(args, where)
    if origin in (tuple,) or hint is tuple:
        if not args:
            return {"type": "array"}
        if len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": _schema_for_hint(args[0], where)}
        items = [_schema_for_hint(arg, where) for arg in args]
        return {"type": "array", "prefixItems": items, "minItems": len(items), "maxItems": len(items)}
    if origin in _SEQUENCES or hint in _SEQUENCES:
        schema: dict[str, Any] = {"type": "array"}
        if args:
            schema["items"] = _schema_for_hint(args[0], where)
        if origin in (set, frozenset) or hint in (set, frozenset):
            schema["uniqueItems"] = True
        return schema
    if origin in _MAPPINGS or hint in _MAPPINGS:
        schema = {"type": "object"}
        if args:
            if _strip_annotated(args[0]) is not str:
                raise ToolDefinitionError(
                    f"{where}: dict keys must be str (JSON object keys are strings), got {args[0]!r}"
                )
            schema["additionalProperties"] = _schema_for_hint(args[1], where)
        return schema
    if typing.is_typeddict(hint):
        return _record_schema(hint, set(hint.__required_keys__), where)
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        required = {
            f.name
            for f in dataclasses.fields(hint)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
        return _record_schema(hint, required, where)
    raise ToolDefinitionError(
        f"{where}: type {_type_name(hint)} has no JSON form; use str, int, float, bool, a Literal or Enum, "
        "list/tuple/set/dict of those, a TypedDict or a dataclass"
    )


def _enum_schema(values: list[Any], where: str) -> dict[str, Any]:
    if not values:
        raise ToolDefinitionError(f"{where} has no values, so no argument could ever match it")
    bad = [v for v in values if type(v) not in _SCALARS]
    if bad:
        raise ToolDefinitionError(f"{where} has values that are not JSON scalars: {bad!r}")
    kinds = list(dict.fromkeys(_SCALARS[type(v)] for v in values))
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": values}


def _union_schema(args: tuple[Any, ...], where: str) -> dict[str, Any]:
    options = [_schema_for_hint(arg, where) for arg in args if arg is not type(None)]
    nullable = type(None) in args
    if any(option == {} for option in options):
        return {}
    if all(set(option) == {"type"} and isinstance(option["type"], str) for option in options):
        kinds = list(dict.fromkeys(option["type"] for option in options))
        if nullable:
            kinds.append("null")
        return {"type": kinds[0] if len(kinds) == 1 else kinds}
    if nullable:
        options.append({"type": "null"})
    return options[0] if len(options) == 1 else {"anyOf": options}


def _record_schema(cls: type, required: set[str], where: str) -> dict[str, Any]:
    hints = typing.get_type_hints(cls, include_extras=True)
    properties = {}
    for key, hint in hints.items():
        prop = _schema_for_hint(hint, f"{where}, field '{key}'")
        if description := _annotated_description(hint):
            prop["description"] = description
        properties[key] = prop
    schema: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
    ordered = [key for key in hints if key in required]
    if ordered:
        schema["required"] = ordered
    return schema


# --- small helpers ------------------------------------------------------------------------------------


def _convert_union(value: Any, args: tuple[Any, ...]) -> Any:
    for arg in args:
        base = _strip_annotated(arg)
        if isinstance(base, type) and issubclass(base, enum.Enum):
            try:
                return base(value)
            except ValueError:
                continue
        if (dataclasses.is_dataclass(base) and isinstance(value, dict)) or get_origin(
            base
        ) in _SEQUENCES | _MAPPINGS:
            return from_json_value(value, base)
    return value


def _is_union(origin: Any) -> bool:
    return origin is Union or origin is types.UnionType


def _allows_none(hint: Any) -> bool:
    hint = _strip_annotated(hint)
    return (
        hint is None or hint is type(None) or (_is_union(get_origin(hint)) and type(None) in get_args(hint))
    )


def _strip_annotated(hint: Any) -> Any:
    while get_origin(hint) is typing.Annotated:
        hint = get_args(hint)[0]
    return hint


def _annotated_description(hint: Any) -> str | None:
    if get_origin(hint) is typing.Annotated:
        for meta in get_args(hint)[1:]:
            if isinstance(meta, str) and meta.strip():
                return meta.strip()
    return None


def _is_json_value(value: Any) -> bool:
    if isinstance(value, enum.Enum):
        return type(value.value) in _SCALARS
    if type(value) in _SCALARS:
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_json_value(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json_value(v) for k, v in value.items())
    return False


def _signature_target(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The object whose docstring and annotations describe `fn`."""
    if isinstance(fn, functools.partial):
        return _signature_target(fn.func)
    if inspect.isroutine(fn) or inspect.isclass(fn):
        return fn
    return type(fn).__call__  # a callable instance


def _callable_name(fn: Callable[..., Any]) -> str:
    if isinstance(fn, functools.partial):
        return _callable_name(fn.func)
    name = getattr(fn, "__name__", None) or type(fn).__name__
    if name == "<lambda>":
        raise ToolDefinitionError(
            "a lambda cannot be a tool: it has no name, docstring or type hints, and it does not pickle "
            "into the rollout worker; define a module-level function"
        )
    return name


def _qualname(fn: Callable[..., Any]) -> str:
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}.{getattr(fn, '__qualname__', repr(fn))}"


def _type_name(hint: Any) -> str:
    return getattr(hint, "__qualname__", None) or repr(hint)


def _is_async(fn: Callable[..., Any]) -> bool:
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.iscoroutinefunction(fn):
        return True
    return not inspect.isroutine(fn) and inspect.iscoroutinefunction(type(fn).__call__)
