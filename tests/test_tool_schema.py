"""Tool schemas from Python callables: one test per kind of signature, and the refusals."""

from __future__ import annotations

import dataclasses
import enum
import functools
import pickle
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Optional, TypedDict, Union

import pytest

from tools import Tool, ToolDefinitionError, Toolset, function_schema


def params(fn) -> dict[str, Any]:
    return function_schema(fn)["function"]["parameters"]


# --- signatures -----------------------------------------------------------------------------------------


def scalars(count: int, ratio: float, label: str, flag: bool) -> str:
    """Combine scalars.

    Args:
        count: How many.
        ratio: A ratio.
        label: A label.
        flag: A switch.
    """
    return ""


def test_scalars_map_to_json_types_and_all_are_required():
    schema = function_schema(scalars)
    assert schema["type"] == "function"
    assert schema["function"]["name"] == "scalars"
    assert schema["function"]["description"] == "Combine scalars."
    assert params(scalars) == {
        "type": "object",
        "properties": {
            "count": {"type": "integer", "description": "How many."},
            "ratio": {"type": "number", "description": "A ratio."},
            "label": {"type": "string", "description": "A label."},
            "flag": {"type": "boolean", "description": "A switch."},
        },
        "required": ["count", "ratio", "label", "flag"],
    }


def optional_with_default(query: str, limit: Optional[int] = None) -> list[str]:  # noqa: UP045
    """Search.

    Args:
        query: What to look for.
        limit: At most this many results.
    """
    return []


def test_optional_with_none_default_is_a_nullable_type_not_openapi_nullable():
    # transformers' get_json_schema writes {"type": "integer", "nullable": true}: OpenAPI, not JSON Schema,
    # so a validator rejects the null the default stands for.
    prop = params(optional_with_default)["properties"]["limit"]
    assert prop == {"type": ["integer", "null"], "description": "At most this many results.", "default": None}
    assert params(optional_with_default)["required"] == ["query"]


def optional_without_default(path: str, encoding: str | None) -> str:
    """Read a file.

    Args:
        path: Which file.
        encoding: Its encoding; None to guess.
    """
    return ""


def test_optional_without_default_is_not_required_and_defaults_to_none_at_call_time():
    # get_json_schema keeps such a parameter required.
    tool = Tool.from_callable(optional_without_default)
    assert tool.parameters["required"] == ["path"]
    assert tool.parameters["properties"]["encoding"]["type"] == ["string", "null"]
    assert tool.implicit_none == {"encoding"}


def literal_choice(mode: Literal["fast", "slow"], level: Literal[1, 2, "max"] = 1) -> str:
    """Pick a mode.

    Args:
        mode: Speed.
        level: Effort level.
    """
    return mode


def test_literal_becomes_enum_with_its_json_types():
    props = params(literal_choice)["properties"]
    assert props["mode"] == {"type": "string", "enum": ["fast", "slow"], "description": "Speed."}
    assert props["level"] == {
        "type": ["integer", "string"],
        "enum": [1, 2, "max"],
        "description": "Effort level.",
        "default": 1,
    }


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Priority(enum.IntEnum):
    LOW = 1
    HIGH = 2


def paint(color: Color, priority: Priority = Priority.LOW) -> str:
    """Paint.

    Args:
        color: The colour.
        priority: How urgent.
    """
    return color.value


def test_enum_becomes_enum_of_member_values_with_default_as_value():
    # transformers 5.17's get_json_schema refuses Enum hints altogether.
    props = params(paint)["properties"]
    assert props["color"] == {"type": "string", "enum": ["red", "green"], "description": "The colour."}
    assert props["priority"] == {
        "type": "integer",
        "enum": [1, 2],
        "description": "How urgent.",
        "default": 1,
    }


def nested_lists(matrix: list[list[float]], tags: Sequence[str]) -> float:
    """Sum a matrix.

    Args:
        matrix: Rows of numbers.
        tags: Labels.
    """
    return 0.0


def test_nested_lists_and_sequences():
    props = params(nested_lists)["properties"]
    assert props["matrix"]["type"] == "array"
    assert props["matrix"]["items"] == {"type": "array", "items": {"type": "number"}}
    assert props["tags"] == {"type": "array", "items": {"type": "string"}, "description": "Labels."}


def nested_dicts(scores: dict[str, list[int]], meta: dict) -> None:
    """Store scores.

    Args:
        scores: Scores per name.
        meta: Anything else.
    """


def test_dicts_become_objects_with_typed_values():
    props = params(nested_dicts)["properties"]
    assert props["scores"] == {
        "type": "object",
        "additionalProperties": {"type": "array", "items": {"type": "integer"}},
        "description": "Scores per name.",
    }
    assert props["meta"] == {"type": "object", "description": "Anything else."}


def tuples(point: tuple[int, int], values: tuple[float, ...], seen: set[str]) -> None:
    """Tuples and sets.

    Args:
        point: An (x, y) pair.
        values: Any number of floats.
        seen: Distinct names.
    """


def test_fixed_and_variadic_tuples_and_sets():
    # get_json_schema refuses tuple[float, ...].
    props = params(tuples)["properties"]
    assert props["point"]["prefixItems"] == [{"type": "integer"}, {"type": "integer"}]
    assert (props["point"]["minItems"], props["point"]["maxItems"]) == (2, 2)
    assert props["values"]["items"] == {"type": "number"}
    assert props["seen"]["uniqueItems"] is True


def defaults(retries: int = 3, name: str = "x", tags: list[str] | None = None, scale: float = 0.5) -> None:
    """Defaults.

    Args:
        retries: Attempts.
        name: A name.
        tags: Tags.
        scale: Scale.
    """


def test_defaults_are_in_the_schema_and_not_required():
    # get_json_schema leaves defaults out, so the model cannot know them.
    schema = params(defaults)
    assert "required" not in schema
    assert [schema["properties"][k]["default"] for k in ("retries", "name", "tags", "scale")] == [
        3,
        "x",
        None,
        0.5,
    ]


async def fetch(url: str, timeout_s: float = 10.0) -> str:
    """Fetch a page.

    Args:
        url: The address.
        timeout_s: Give up after this many seconds.
    """
    return url


def test_async_function():
    tool = Tool.from_callable(fetch)
    assert tool.is_async
    assert tool.parameters["required"] == ["url"]


class Counter:
    def __init__(self) -> None:
        self.value = 0

    def increment(self, step: int) -> int:
        """Increment the counter.

        Args:
            step: Value to add.
        """
        self.value += step
        return self.value

    async def read(self) -> int:
        """Read the counter."""
        return self.value

    @staticmethod
    def double(x: int) -> int:
        """Double a number.

        Args:
            x: The number.
        """
        return 2 * x

    @classmethod
    def make(cls, start: int) -> int:
        """Make a value.

        Args:
            start: Where to start.
        """
        return start


def test_methods_bound_unbound_static_and_class_skip_the_receiver():
    counter = Counter()
    bound = Tool.from_callable(counter.increment)
    assert bound.name == "increment"
    assert list(bound.parameters["properties"]) == ["step"]
    assert bound.fn(2) == 2 and counter.value == 2
    assert Tool.from_callable(counter.read).is_async
    assert Tool.from_callable(counter.read).parameters == {"type": "object", "properties": {}}
    assert list(Tool.from_callable(Counter.double).parameters["properties"]) == ["x"]
    assert list(Tool.from_callable(Counter.make).parameters["properties"]) == ["start"]


class Scorer:
    """Score a guess.

    Args:
        guess: The guess.
    """

    def __call__(self, guess: str) -> float:
        """Score a guess.

        Args:
            guess: The guess.
        """
        return 1.0


class AsyncScorer:
    async def __call__(self, guess: str) -> float:
        """Score a guess asynchronously.

        Args:
            guess: The guess.
        """
        return 1.0


def test_callable_instances_and_partials():
    assert Tool.from_callable(Scorer()).name == "Scorer"
    assert Tool.from_callable(AsyncScorer()).is_async
    partial = Tool.from_callable(functools.partial(defaults, retries=5))
    assert partial.name == "defaults"
    assert partial.parameters["properties"]["retries"]["default"] == 5


class Address(TypedDict):
    street: str
    number: int


@dataclasses.dataclass
class Box:
    width: float
    height: float = 1.0


def records(address: Address, box: Box) -> str:
    """Records.

    Args:
        address: Where.
        box: What size.
    """
    return ""


def test_typeddict_and_dataclass_become_closed_objects():
    # get_json_schema refuses both.
    props = params(records)["properties"]
    assert props["address"]["properties"] == {"street": {"type": "string"}, "number": {"type": "integer"}}
    assert props["address"]["required"] == ["street", "number"]
    assert props["address"]["additionalProperties"] is False
    assert props["box"]["required"] == ["width"]


def annotated(n: Annotated[int, "How many items to take."], m: int) -> int:
    """Take items.

    Args:
        m: Offset.
    """
    return n


def test_annotated_text_describes_a_parameter_the_docstring_omits():
    assert params(annotated)["properties"]["n"] == {
        "type": "integer",
        "description": "How many items to take.",
    }


def unions(key: Union[int, str], payload: list[int] | dict[str, int], anything: Any) -> None:  # noqa: UP007
    """Unions.

    Args:
        key: Id or name.
        payload: Items.
        anything: Whatever.
    """


def test_unions_of_plain_types_are_type_lists_others_anyof():
    props = params(unions)["properties"]
    assert props["key"]["type"] == ["integer", "string"]
    assert [option["type"] for option in props["payload"]["anyOf"]] == ["array", "object"]
    assert props["anything"] == {"description": "Whatever."}


def docstring_styles(path: str, mode: str = "r") -> str:
    """Open a file and return its text.

    Longer explanation that spans
    two lines.

    Args:
        path (str): The file to open. Example: /tmp/a.txt
            relative paths start at the working directory.
        mode (str, optional): How to open it.

    Returns:
        The text.
    """
    return ""


def test_docstring_typed_args_and_continuations():
    # transformers 5.17 reads "path (str):" as no argument and "Example:" as a new one.
    schema = function_schema(docstring_styles)["function"]
    assert (
        schema["description"] == "Open a file and return its text. Longer explanation that spans two lines."
    )
    assert schema["parameters"]["properties"]["path"]["description"] == (
        "The file to open. Example: /tmp/a.txt relative paths start at the working directory."
    )
    assert schema["parameters"]["properties"]["mode"]["description"] == "How to open it."


def test_plain_cases_match_transformers_get_json_schema():
    from transformers.utils import get_json_schema

    # (It also refuses Sequence[str], so nested_lists is not among them.)
    for fn in (scalars, nested_dicts, literal_choice, optional_without_default):
        ours = function_schema(fn)
        theirs = get_json_schema(fn)
        theirs["function"].pop("return", None)
        for prop in ours["function"]["parameters"]["properties"].values():
            prop.pop("default", None)  # ours adds defaults; theirs leaves them out
        for prop in theirs["function"]["parameters"]["properties"].values():
            if prop.pop("nullable", False):  # theirs says nullable, ours lists null among the types
                prop["type"] = [prop["type"], "null"]
        theirs["function"]["parameters"]["required"] = [
            name for name in theirs["function"]["parameters"]["required"] if name != "encoding"
        ]  # theirs keeps `encoding: str | None` required
        assert ours == theirs, fn.__name__


def test_tool_and_toolset_pickle():
    toolset = Toolset([scalars, paint, fetch])
    restored = pickle.loads(pickle.dumps(toolset))
    assert restored.schemas() == toolset.schemas()
    assert restored["paint"].hints["color"] is Color


# --- refusals -------------------------------------------------------------------------------------------


def no_docstring(x: int) -> int:
    return x


def missing_hint(x, y: int) -> int:  # type: ignore[no-untyped-def]
    """Add.

    Args:
        x: One.
        y: Two.
    """
    return y


def undescribed(x: int, y: int) -> int:
    """Add.

    Args:
        x: One.
    """
    return x


class Opaque:
    pass


def opaque(thing: Opaque) -> None:
    """Take a thing.

    Args:
        thing: The thing.
    """


def int_keys(table: dict[int, str]) -> None:
    """Take a table.

    Args:
        table: The table.
    """


def star_args(*values: int) -> None:
    """Take values.

    Args:
        values: Values.
    """


class Empty(enum.Enum):
    pass


def empty_enum(e: Empty) -> None:
    """Take nothing.

    Args:
        e: Nothing.
    """


@pytest.mark.parametrize(
    ("fn", "needle"),
    [
        (no_docstring, "tool 'no_docstring' (test_tool_schema.no_docstring) has no docstring"),
        (missing_hint, "parameter 'x' has no type hint"),
        (undescribed, "parameter 'y' is not described in the docstring"),
        (opaque, "parameter 'thing': type Opaque has no JSON form"),
        (int_keys, "dict keys must be str"),
        (star_args, "*values cannot be passed by a model"),
        (empty_enum, "Enum Empty has no values"),
        (lambda x: x, "a lambda cannot be a tool"),
        (42, "a tool must be callable"),
    ],
)
def test_refusals_name_the_function_and_what_is_missing(fn, needle):
    with pytest.raises(ToolDefinitionError, match=None) as info:
        Tool.from_callable(fn)
    assert needle in str(info.value)
    assert isinstance(info.value, TypeError)


def test_duplicate_names_in_a_toolset_are_refused():
    with pytest.raises(ToolDefinitionError, match="two tools are named 'increment'"):
        Toolset([Counter().increment, Counter().increment])
