"""Shared builders for the parser case tables: one reply, what it must parse to, and the runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from tools import Toolset
from tools.parsers import ToolCallParser


def get_weather(city: str, days: int = 1, metric: bool = True) -> str:
    """Forecast for a city.

    Args:
        city: The city.
        days: How many days ahead.
        metric: Celsius rather than Fahrenheit.
    """
    return ""


def write_file(path: str, content: str, mode: int = 420, append: bool = False) -> str:
    """Write a file.

    Args:
        path: Where.
        content: What.
        mode: Permission bits.
        append: Append rather than replace.
    """
    return ""


def search(
    query: str,
    limit: int = 10,
    threshold: float = 0.5,
    tags: list[str] | None = None,
    filters: dict[str, int] | None = None,
    note: str | None = None,
) -> str:
    """Search documents.

    Args:
        query: Words to look for.
        limit: Most results.
        threshold: Lowest score.
        tags: Tags to match.
        filters: Field filters.
        note: A remark.
    """
    return ""


TOOLS = Toolset([get_weather, write_file, search])


@dataclass(frozen=True)
class Reply:
    """A reply and what it must parse to: content, calls as (name, arguments), error kinds."""

    text: str
    content: str = ""
    calls: tuple[tuple[str, dict[str, Any]], ...] = ()
    errors: tuple[str, ...] = ()
    reasoning: str | None = None
    truncated: bool = False
    ids: tuple[str | None, ...] = field(default=())


def cases(*replies: Reply) -> list[Any]:
    """pytest params named by index, so a failure says which reply."""
    return [pytest.param(reply, id=f"{index:02d}") for index, reply in enumerate(replies)]


def check(parser: ToolCallParser, reply: Reply) -> None:
    parsed = parser.parse(reply.text, tools=TOOLS, truncated=reply.truncated)
    assert parsed.content == reply.content
    assert [(call.name, call.arguments) for call in parsed.tool_calls] == list(reply.calls)
    assert [str(error.kind) for error in parsed.errors] == list(reply.errors)
    assert parsed.reasoning == reply.reasoning
    assert parsed.truncated == reply.truncated
    if reply.ids:
        assert tuple(call.id for call in parsed.tool_calls) == reply.ids
    for error in parsed.errors:
        assert error.family == parser.family
        assert error.message
        # Never dropped silently: the unreadable call's text stays in the content.
        assert error.text[:30] in parsed.content
    # Every call carries an id and a dict of arguments, ready for the template and the executor.
    assert all(call.id and isinstance(call.arguments, dict) for call in parsed.tool_calls)
