"""Argument validation and the safe coercions, on literal arguments as a model would send them."""

from __future__ import annotations

import dataclasses
import enum
import pickle
from typing import Any, Literal

import pytest

from tools import InvalidToolArguments, Tool, bind_arguments


class Unit(enum.Enum):
    CELSIUS = "C"
    FAHRENHEIT = "F"


@dataclasses.dataclass
class Window:
    start: int
    end: int


def convert(
    value: float,
    count: int,
    unit: Unit,
    verbose: bool = False,
    label: str = "",
    points: list[int] | None = None,
    pair: tuple[int, str] | None = None,
    tags: set[str] | None = None,
    window: Window | None = None,
    note: str | None = None,
    mode: Literal["a", "b"] = "a",
) -> str:
    """Convert a value.

    Args:
        value: The value.
        count: How many times.
        unit: Target unit.
        verbose: Say more.
        label: A label.
        points: Some integers.
        pair: An (id, name) pair.
        tags: Distinct tags.
        window: A range.
        note: A note.
        mode: A mode.
    """
    return ""


def kwargs_tool(name: str, **extra: Any) -> str:
    """Take extras.

    Args:
        name: A name.
    """
    return name


TOOL = Tool.from_callable(convert)
BASE = {"value": 1.5, "count": 2, "unit": "C"}


def bind(**overrides: Any) -> dict[str, Any]:
    return bind_arguments(TOOL, {**BASE, **overrides})


def invalid(**overrides: Any) -> InvalidToolArguments:
    with pytest.raises(InvalidToolArguments) as info:
        bind(**overrides)
    return info.value


def test_valid_arguments_pass_through_and_enum_becomes_member():
    assert bind() == {"value": 1.5, "count": 2, "unit": Unit.CELSIUS}


@pytest.mark.parametrize(
    ("key", "sent", "received"),
    [
        ("count", "7", 7),
        ("count", " -3 ", -3),
        ("count", 7.0, 7),
        ("value", "2.5", 2.5),
        ("value", "1e3", 1000.0),
        ("value", 4, 4),
        ("verbose", "true", True),
        ("verbose", "False", False),
        ("label", 42, "42"),
        ("label", 2.5, "2.5"),
        ("points", "[1, 2]", [1, 2]),
        ("points", ["1", 2.0], [1, 2]),
    ],
)
def test_safe_coercions(key, sent, received):
    value = bind(**{key: sent})[key]
    assert value == received
    assert type(value) is type(received)


@pytest.mark.parametrize(
    ("key", "sent", "problem"),
    [
        ("count", "7.5", "is not of type 'integer'"),
        ("count", 7.5, "is not of type 'integer'"),
        ("count", True, "is not of type 'integer'"),
        ("value", "abc", "is not of type 'number'"),
        ("value", "nan", "is not of type 'number'"),
        ("verbose", "yes", "is not of type 'boolean'"),
        ("verbose", 1, "is not of type 'boolean'"),
        ("label", True, "is not of type 'string'"),
        ("unit", "K", "is not one of ['C', 'F']"),
        ("mode", "c", "is not one of ['a', 'b']"),
        ("points", "[1, 2", "is not valid under any of the given schemas"),
        ("pair", [1, "a", 3], "is too long"),
    ],
)
def test_unsafe_values_are_rejected_naming_the_parameter(key, sent, problem):
    error = invalid(**{key: sent})
    assert error.tool == "convert"
    assert error.parameter == key
    assert problem in error.problem


def test_nested_problems_name_the_position():
    error = invalid(points=[1, "x", 3])
    assert error.parameter == "points"
    assert error.problem.startswith("at points[1]: 'x' is not of type 'integer'")


def test_missing_required_and_unknown_parameters():
    with pytest.raises(InvalidToolArguments, match="parameter 'count': missing required parameter"):
        bind_arguments(TOOL, {"value": 1, "unit": "F"})
    error = invalid(cuont=3)
    assert error.parameter == "cuont"
    assert "did you mean 'count'?" in error.problem


def test_arguments_as_json_text_and_bad_json():
    assert bind_arguments(TOOL, '{"value": 1, "count": "2", "unit": "F"}')["count"] == 2
    with pytest.raises(InvalidToolArguments, match="not valid JSON"):
        bind_arguments(TOOL, '{"value": 1,')
    with pytest.raises(InvalidToolArguments, match="must be a JSON object of named arguments, got list"):
        bind_arguments(TOOL, "[1, 2]")


def test_empty_arguments_mean_no_arguments():
    tool = Tool.from_callable(kwargs_tool)
    with pytest.raises(InvalidToolArguments, match="missing required parameter"):
        bind_arguments(tool, "")
    assert bind_arguments(tool, {"name": "a", "other": [1]}) == {"name": "a", "other": [1]}


def test_json_values_are_rebuilt_into_python_types():
    args = bind(pair=[3, "x"], tags=["a", "b", "a"][:2], window={"start": 1, "end": "4"})
    assert args["pair"] == (3, "x")
    assert args["tags"] == {"a", "b"}
    assert args["window"] == Window(1, 4)


def test_invalid_arguments_error_pickles_with_its_fields():
    error = invalid(count="x")
    restored = pickle.loads(pickle.dumps(error))
    assert (restored.tool, restored.parameter, restored.problem) == (
        error.tool,
        error.parameter,
        error.problem,
    )
    assert str(restored) == str(error)
    assert isinstance(restored, ValueError)
