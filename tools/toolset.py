"""The tools of one rollout, by name, in the order their schemas are rendered."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from tools.errors import ToolDefinitionError
from tools.schema import Tool


class Toolset(Mapping[str, Tool]):
    """An ordered, read-only mapping of tool names to tools, with unique names.

    Example:
        >>> toolset = Toolset([add, multiply])          # plain functions become Tools
        >>> toolset.schemas()                           # what the chat template renders
        >>> (toolset | Toolset([env.move])).names()     # shared tools plus an environment's
    """

    def __init__(self, tools: Iterable[Tool | Callable[..., Any]] = ()):
        self._tools: dict[str, Tool] = {}
        for item in tools:
            tool = item if isinstance(item, Tool) else Tool.from_callable(item)
            if tool.name in self._tools:
                raise ToolDefinitionError(
                    f"two tools are named '{tool.name}': {self._tools[tool.name].fn!r} and {tool.fn!r}; "
                    "the model calls tools by name, so names must be unique (rename one, or register it with "
                    "Tool.from_callable(fn, name=...))"
                )
            self._tools[tool.name] = tool

    def __getitem__(self, name: str) -> Tool:
        return self._tools[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tools)

    def __len__(self) -> int:
        return len(self._tools)

    def __or__(self, other: Toolset) -> Toolset:
        return Toolset([*self.values(), *other.values()])

    def names(self) -> list[str]:
        return list(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        """The OpenAI-style schemas, for `tokenizer.apply_chat_template(..., tools=...)`."""
        return [tool.schema for tool in self._tools.values()]

    def __repr__(self) -> str:
        return f"Toolset({self.names()})"
